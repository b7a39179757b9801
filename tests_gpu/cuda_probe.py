"""GPU probes of the CUDA stream backend, JSON out. Needs a CUDA GPU, torch and cuda-bindings.

    python tests_gpu/cuda_probe.py --out DIR [--steps env,refusal,lazy,lazy_round,soak,graph,soak_memop]
    python3 -m pytest -q tests_gpu/test_cuda_probe.py [--out DIR]         # the same steps as tests

Each step runs in its own Python process under a timeout (a fresh process is also a fresh CUDA module
state, which the lazy-loading step needs); the results land in DIR/handoff_cuda_probe.json and the
command prints a table. Steps:

  env      device, driver, package versions, device attributes the backend checks
  refusal  refusal paths on the real driver: region already registered, no host-pointer use
           (attribute forced to 0), stream memops unsupported (forced), proxy won't start, self-test
           fails, strict start: each leaves 0 fds / 0 memfd mappings / nothing registered
  lazy     a fresh module load (a new NVRTC cubin, or a new Triton specialisation) on the engine thread
           while its stream is parked: with a CUDA-calling in-process proxy (hangs; a CUDA-free timer
           process releases the flag after a bound so the probe ends) vs the CUDA-free proxy process
           (30 of 30 rounds exact); plus controls
  lazy_round  lazy's main case (30 parked rounds, a fresh module each) on the default round path
  soak     10,000 faulted rounds through the real proxy process on the CUDA stream, two of three rounds
           staged from a device tensor (the engine's gather): 0 wrong drafts
  graph    CUDA graphs: (a) D2H, write and wait nodes, host reset between replays; (b) the same with the
           memop node values updated in the executable graph per replay; (c) the round kernel taking t
           from the device counter: one graph replayed as 20 consecutive rounds, no update, no reset
  soak_memop  soak on the memop path (DRAFTRELAY_CUDA_WAIT=memop); soak runs the default (the round
           kernel where it is available)

The late-proxy, host-staged soak, refusal and drill scenarios of the CPU tests run on this backend too:
tests_gpu/test_handoff_scenarios.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

from draftrelay.handoff.procinfo import children, fd_count, machine_info, memfd_maps

STEPS = ("env", "refusal", "lazy", "lazy_round", "soak", "graph", "soak_memop")
STEP_TIMEOUT_S = {"env": 30, "refusal": 50, "lazy": 90, "lazy_round": 40, "soak": 70, "graph": 40, "soak_memop": 70}
RESULT = "handoff_cuda_probe.json"
_CHECKPOINT = ""  # the step's JSON path: long steps write partial results there as they go


def checkpoint(out: dict) -> None:
    if _CHECKPOINT:
        with open(_CHECKPOINT, "w") as f:
            json.dump({**out, "partial": True}, f, indent=1, default=str)
VOCAB = 5000


# ---------------------------------------------------------------------------------------------
# shared helpers (the same checks as tests/test_handoff.py)


def make_requests(rng, t: int):
    from draftrelay.testing import random_requests

    return random_requests(rng, t, VOCAB)


def check_round(reqs, res) -> tuple[int, int]:
    """(exact drafts, wrong drafts); a failed round must carry zero drafts (else it counts as wrong)."""
    from draftrelay.testing import score_round

    return score_round(reqs, res, VOCAB)


def cfg(**kw):
    import torch

    from draftrelay.handoff.rounds import HandoffConfig

    # loss_fires raised as in tests/test_handoff.py: the soak and the late-proxy probe stall the proxy on
    # purpose to test the hand-off; the loss rule (3 fires, no round finished) would replace the proxy
    base = dict(vocab_size=VOCAB, max_requests=4, max_tokens=256, max_drafts=8, deadline_ms=20.0,
                selftest_rounds=4, backend="cuda", cuda_stream=torch.cuda.Stream(), loss_fires=10**6)
    base.update(kw)
    return HandoffConfig(**base)








def pct(a, q):
    return float(np.percentile(np.asarray(a, dtype=np.float64), q)) if len(a) else None


# ---------------------------------------------------------------------------------------------


def step_env() -> dict:
    from importlib import metadata

    import torch

    from draftrelay.handoff.cuda_stream import CudaStream
    from draftrelay.handoff.region import Region, RegionConfig

    out = machine_info()
    for dist in ("triton", "cupy-cuda13x"):  # present on the GPU image; the probe does not need them
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    eng = torch.cuda.Stream()
    torch.zeros(1, device="cuda")  # CUDA's own fds are opened here, before the baseline
    fds, maps = fd_count(), memfd_maps()
    region = Region.create(RegionConfig(4, 256, 8, VOCAB))
    st = CudaStream(region, eng)
    out["backend_info"] = st.info
    st.close()
    out["unregistered_after_close"] = not st.registered
    region.close()
    out["fds_back"], out["maps_back"] = fd_count() == fds, memfd_maps() == maps
    out["pass"] = bool(out["unregistered_after_close"] and out["fds_back"] and out["maps_back"])
    return out


def step_refusal() -> dict:
    import torch
    from cuda.bindings import driver

    from draftrelay.handoff import cuda_stream as cs
    from draftrelay.handoff import rounds as rounds_mod
    from draftrelay.handoff.region import Region, RegionConfig, RoundRequest, Status
    from draftrelay.handoff.rounds import AsyncRefused, SyncRounds, open_rounds

    torch.zeros(1, device="cuda")
    cases: dict = {}
    seen_registered: list = []

    class Recording(cs.CudaStream):
        def _teardown(self) -> None:
            try:
                super()._teardown()
            finally:
                seen_registered.append(list(self._registered))

    def baseline():
        return fd_count(), memfd_maps(), children()

    def clean(b) -> bool:
        return fd_count() == b[0] and memfd_maps() == b[1] and children() <= b[2]

    # 1. the region is already registered (someone else pinned it): cuMemHostRegister fails
    b = baseline()
    region = Region.create(RegionConfig(4, 256, 8, VOCAB))
    size = (region.size + 4095) // 4096 * 4096
    flags = int(driver.CU_MEMHOSTREGISTER_DEVICEMAP) | int(driver.CU_MEMHOSTREGISTER_PORTABLE)
    assert not driver.cuMemHostRegister(region.base, size, flags)[0]
    seen_registered.clear()
    try:
        Recording(region, torch.cuda.Stream())
        reason = None
    except cs.CudaStreamRefused as exc:
        reason = str(exc)
    driver.cuMemHostUnregister(region.base)
    region.close()
    cases["register_fails"] = {"reason": reason, "registered_left": seen_registered[-1] if seen_registered else None,
                               "clean": clean(b)}

    # 2./3. forced capability refusals on the real driver (H200 has both capabilities)
    real_attr, real_write, real_proc = driver.cuDeviceGetAttribute, driver.cuStreamWriteValue32, driver.cuGetProcAddress

    def no_fast_write(name, *a):  # the backend's ctypes fast path looks the function up here
        return (driver.CUresult.CUDA_SUCCESS, 0, None) if name == b"cuStreamWriteValue32" else real_proc(name, *a)

    def no_host_ptr(a, dev):
        if a == driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
            return (driver.CUresult.CUDA_SUCCESS, 0)
        return real_attr(a, dev)

    def no_memops(*a):
        return (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED,)

    for name, attr, fn in (("no_host_pointer", "cuDeviceGetAttribute", no_host_ptr),
                           ("memops_unsupported", "cuStreamWriteValue32", no_memops)):
        b = baseline()
        seen_registered.clear()
        setattr(driver, attr, fn)
        if name == "memops_unsupported":
            driver.cuGetProcAddress = no_fast_write
        saved = cs.CudaStream
        cs.CudaStream = Recording
        try:
            r = open_rounds(cfg())
            strict_raised = False
            try:
                open_rounds(cfg(strict=True))
            except AsyncRefused:
                strict_raised = True
        finally:
            setattr(driver, attr, real_attr if attr == "cuDeviceGetAttribute" else real_write)
            driver.cuGetProcAddress = real_proc
            cs.CudaStream = saved
        cases[name] = {"mode": r.mode, "reason": r.refusal, "strict_raised": strict_raised,
                       "registered_left": [x for s in seen_registered for x in s], "clean": clean(b)}

    # 4./5. proxy won't start; self-test fails (the stream was registered and must be unregistered)
    for name, kw, patch_exe in (("proxy_exits", {}, True),
                                ("selftest_fails", {"round_spec": {"kind": "builtin", "faults": {
                                    "p_corrupt": 1.0, "in_selftest": True}}}, False)):
        b = baseline()
        seen_registered.clear()
        saved_exe, saved_cls = rounds_mod.sys.executable, cs.CudaStream
        cs.CudaStream = Recording
        if patch_exe:
            rounds_mod.sys.executable = "/bin/false"
        try:
            r = open_rounds(cfg(**kw))
            fallback_ok = isinstance(r, SyncRounds) and r.result(
                r.submit([RoundRequest(1, 1, 0, np.array([3], np.int32), 2)])).status == Status.OK
            strict_raised = False
            try:
                open_rounds(cfg(strict=True, **kw))
            except AsyncRefused:
                strict_raised = True
        finally:
            rounds_mod.sys.executable, cs.CudaStream = saved_exe, saved_cls
        cases[name] = {"mode": r.mode, "reason": r.refusal, "sync_fallback_serves": fallback_ok,
                       "strict_raised": strict_raised, "teardowns": len(seen_registered),
                       "registered_left": [x for s in seen_registered for x in s], "clean": clean(b)}
    ok = all(c.get("reason") and c["clean"] and not c["registered_left"] for c in cases.values())
    ok = ok and all(c.get("strict_raised", True) for c in cases.values())
    return {"cases": cases, "pass": bool(ok)}


# ---------------------------------------------------------------------------------------------
# lazy loading


def nvrtc_cubins(n: int, tag: str) -> list[tuple[str, np.ndarray]]:
    """n tiny kernels, each its own module (distinct name and constant), compiled ahead of time."""
    import torch

    from draftrelay.cudabuild import nvrtc_cubin

    arch = torch.cuda.get_device_capability()
    out = []
    for i in range(n):
        name = f"probe_{tag}_{i}"
        src = f'extern "C" __global__ void {name}(int* p) {{ atomicAdd(p, {i + 1}); }}\n'
        out.append((name, nvrtc_cubin(src, arch)))
    return out


def load_and_launch(driver, name: str, cubin: np.ndarray, cu_stream, counter_ptr: int) -> None:
    """A fresh module: cuModuleLoadData + cuModuleGetFunction + first launch (on the parked stream)."""
    err, mod = driver.cuModuleLoadData(cubin.ctypes.data)
    assert not err, f"cuModuleLoadData: {err}"
    err, fn = driver.cuModuleGetFunction(mod, name.encode())
    assert not err, f"cuModuleGetFunction: {err}"
    err, = driver.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, cu_stream, ((counter_ptr,), (ctypes.c_void_p,)), 0)
    assert not err, f"cuLaunchKernel: {err}"
    return fn


TIMER_CODE = r"""
import json, sys, time
from draftrelay.handoff import native
from draftrelay.handoff.region import Region, W
region = Region.open(int(sys.argv[1])); n = int(sys.argv[2]); bound_us = int(float(sys.argv[3]) * 1e6)
g, r = region.word_addr(W.GATHERED), region.word_addr(W.RELEASED)
for t in range(1, n + 1):
    if native.wait_geq32(g, t, 0, 200, 60_000_000) != 0:
        print(json.dumps({"t": t, "error": "never gathered"}), flush=True); break
    fired = native.wait_geq32(r, t, 0, 200, bound_us) != 0
    ns = native.now_ns()
    if fired:
        native.store_max32(r, t)
    print(json.dumps({"t": t, "fired": fired, "ns": ns}), flush=True)
"""


def lazy_inprocess(loader: str, proxy_kind: str, n_rounds: int, bound_s: float) -> dict:
    """Engine: write gathered=t, wait released>=t, then (while parked) a module load + first launch.
    Proxy: an in-process thread that, once the engine is inside the load, makes (or not) one CUDA call
    (cuMemcpyHtoDAsync of the reply, as the seed's thread proxy did) and then releases. A CUDA-free timer
    *process* releases the flag after `bound_s` if nobody did, so the probe always ends."""
    import torch
    from cuda.bindings import driver

    from draftrelay.handoff import native
    from draftrelay.handoff.cuda_stream import CudaStream
    from draftrelay.handoff.region import Region, RegionConfig, W

    region = Region.create(RegionConfig(4, 256, 8, VOCAB))
    eng = torch.cuda.Stream()
    st = CudaStream(region, eng)
    L = region.layout
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    err, pstream = driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
    assert not err
    dev_reply = torch.zeros(L.reply_size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    if loader == "nvrtc":
        kernels = nvrtc_cubins(n_rounds, f"{proxy_kind}_{os.getpid()}")
    elif loader == "preloaded":  # control: the same kind of kernel, its module loaded and launched before
        kernels = nvrtc_cubins(1, f"pre_{os.getpid()}") * n_rounds
        pre_fn = load_and_launch(driver, kernels[0][0], kernels[0][1], st.cu_stream, counter.data_ptr())
        torch.cuda.synchronize()
    elif loader == "triton":
        import triton
        import triton.language as tl

        @triton.jit
        def _bump(p, C: tl.constexpr):
            tl.atomic_add(p, C)

        _bump[(1,)](counter, C=999)  # warm Triton itself (its launcher build) outside the window
        torch.cuda.synchronize()
    timer = subprocess.Popen([sys.executable, "-c", TIMER_CODE, str(region.fd), str(n_rounds), str(bound_s)],
                             pass_fds=(region.fd,), stdout=subprocess.PIPE, text=True)
    a_g, a_r = region.word_addr(W.GATHERED), region.word_addr(W.RELEASED)
    loading = threading.Event()
    proxy_log: list[dict] = []

    def proxy() -> None:
        native.set_timer_slack_ns(1000)
        for t in range(1, n_rounds + 1):
            if native.wait_geq32(a_g, t, 50, 20, 60_000_000) != 0:
                return
            loading.wait(5.0)
            time.sleep(0.02)  # let the engine get inside the module load
            c0 = native.now_ns()
            if proxy_kind == "cudacall":
                e, = driver.cuMemcpyHtoDAsync(dev_reply.data_ptr(), region.base + L.reply(t & 1), 64, pstream)
            c1 = native.now_ns()
            loading.clear()
            released_by_proxy = bool(native.store_max32(a_r, t))
            proxy_log.append({"t": t, "call_ns": c1 - c0, "call_start_ns": c0, "call_end_ns": c1,
                              "released_by_proxy": released_by_proxy})

    th = threading.Thread(target=proxy, daemon=True)
    th.start()
    rounds = []
    for t in range(1, n_rounds + 1):
        st.write32(L.word(W.GATHERED), t)
        st.wait_geq32(L.word(W.RELEASED), t)
        st.write32(L.word(W.CONSUMED), t)
        ev = st.record()
        native.wait_geq32(a_g, t, 1000, 50, 10_000_000)
        parked = not native.geq32(native.load32(a_r), t)
        loading.set()
        l0 = native.now_ns()
        with torch.cuda.stream(eng):
            if loader in ("nvrtc",):
                load_and_launch(driver, kernels[t - 1][0], kernels[t - 1][1], st.cu_stream, counter.data_ptr())
            elif loader == "preloaded":
                e, = driver.cuLaunchKernel(pre_fn, 1, 1, 1, 1, 1, 1, 0, st.cu_stream,
                                           ((counter.data_ptr(),), (ctypes.c_void_p,)), 0)
            else:
                _bump[(1,)](counter, C=1000 + t)
        l1 = native.now_ns()
        done = ev.wait(bound_s + 30)
        rounds.append({"t": t, "parked_at_load": parked, "load_ms": (l1 - l0) / 1e6, "load_end_ns": l1,
                       "stream_done": done})
    th.join(bound_s + 30)
    timer_out, _ = timer.communicate(timeout=bound_s + 30)
    fires = {d["t"]: d for d in map(json.loads, timer_out.splitlines()) if "t" in d}
    torch.cuda.synchronize()
    for rd in rounds:
        tf = fires.get(rd["t"], {})
        pl = next((p for p in proxy_log if p["t"] == rd["t"]), {})
        rd["timer_fired"] = bool(tf.get("fired"))
        rd["proxy_call_ms"] = pl.get("call_ns", 0) / 1e6 if pl else None
        # the deadlock signature: the proxy's CUDA call started while the stream was parked and the engine
        # was inside the load, and both returned only after the CUDA-free timer released the stream (a call
        # that could not even start, e.g. for the GIL, is not counted)
        rel_ns = tf.get("ns", 1 << 62)
        rd["proxy_call_started_before_release"] = bool(pl) and pl["call_start_ns"] < rel_ns
        rd["hung_until_timer"] = bool(tf.get("fired")) and rd["proxy_call_started_before_release"] \
            and pl.get("call_end_ns", 0) >= rel_ns and rd["load_end_ns"] >= rel_ns
        del rd["load_end_ns"]
    st.close()
    driver.cuStreamDestroy(pstream)
    region.close()
    return {"loader": loader, "proxy": proxy_kind, "bound_s": bound_s, "rounds": rounds,
            "timer_fires": sum(r["timer_fired"] for r in rounds),
            "hung_until_timer": sum(r["hung_until_timer"] for r in rounds),
            "all_done": all(r["stream_done"] for r in rounds)}


def lazy_free_process(n_rounds: int = 30) -> dict:
    """The real thing: the CUDA-free proxy process holds each round ~100 ms (an injected delay, below the
    1 s deadline); while the stream is parked the engine loads a fresh module and launches it."""
    import torch
    from cuda.bindings import driver

    from draftrelay.handoff import native
    from draftrelay.handoff.region import W
    from draftrelay.handoff.rounds import open_rounds

    kernels = nvrtc_cubins(n_rounds, f"free_{os.getpid()}")
    eng = torch.cuda.Stream()
    r = open_rounds(cfg(cuda_stream=eng, deadline_ms=1000.0, strict=True,
                        round_spec={"kind": "builtin", "faults": {"p_delay": 1.0, "delay_ms": 100}}))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    a_g, a_r = r.region.word_addr(W.GATHERED), r.region.word_addr(W.RELEASED)
    a_last = r.region.word_addr(W.LAST_RELEASE_NS)
    rng = np.random.default_rng(5)
    rows, exact_rounds, wrong = [], 0, 0
    try:
        for i in range(n_rounds):
            reqs = make_requests(rng, i + 1)
            t = r.submit(reqs)
            native.wait_geq32(a_g, t, 1000, 50, 10_000_000)
            parked = not native.geq32(native.load32(a_r), t)
            l0 = native.now_ns()
            with torch.cuda.stream(eng):
                load_and_launch(driver, kernels[i][0], kernels[i][1], r.stream.cu_stream, counter.data_ptr())
            l1 = native.now_ns()
            res = r.result(t, timeout_s=10)
            e, w = check_round(reqs, res)
            wrong += w
            exact_rounds += int(res.ok and w == 0)
            rel = native.load64(a_last)
            rows.append({"t": t, "parked_at_load": parked, "load_ms": (l1 - l0) / 1e6,
                         "load_returned_after_release": l1 >= rel, "status": res.status.name})
        torch.cuda.synchronize()
        stats = r.stats()
    finally:
        r.close()
    want = n_rounds * (n_rounds + 1) // 2
    return {"rounds": n_rounds, "exact_rounds": exact_rounds, "wrong_drafts": wrong,
            "parked_at_every_load": all(x["parked_at_load"] for x in rows),
            "loads_returning_after_release": sum(x["load_returned_after_release"] for x in rows),
            "load_ms_p50": pct([x["load_ms"] for x in rows], 50), "load_ms_max": max(x["load_ms"] for x in rows),
            "kernels_all_ran": int(counter.item()) == want, "watchdog": stats["watchdog"], "rows": rows}


def step_lazy() -> dict:
    import torch

    torch.zeros(1, device="cuda")
    out: dict = {"CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset)")}
    for key, fn in (("free_process_30", lambda: lazy_free_process(30)),
                    ("cudacall_nvrtc", lambda: lazy_inprocess("nvrtc", "cudacall", 3, 3.0)),
                    ("free_thread_nvrtc", lambda: lazy_inprocess("nvrtc", "free", 3, 3.0)),
                    ("cudacall_preloaded", lambda: lazy_inprocess("preloaded", "cudacall", 3, 3.0)),
                    ("cudacall_triton", lambda: lazy_inprocess("triton", "cudacall", 2, 5.0)),
                    ("free_thread_triton", lambda: lazy_inprocess("triton", "free", 2, 5.0))):
        t0 = time.monotonic()
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        out[key]["wall_s"] = round(time.monotonic() - t0, 2)
        print(f"lazy {key}: {json.dumps({k: v for k, v in out[key].items() if k not in ('rows', 'rounds')})}",
              flush=True)
        checkpoint(out)
    free = out["free_process_30"]
    out["pass"] = bool(free.get("exact_rounds") == 30 and free.get("wrong_drafts") == 0
                       and free.get("kernels_all_ran"))
    out["deadlock_reproduced"] = bool(out["cudacall_nvrtc"].get("hung_until_timer", 0) > 0)
    return out


# ---------------------------------------------------------------------------------------------


def step_soak() -> dict:
    import torch

    from draftrelay.handoff.region import pack_staging
    from draftrelay.handoff.rounds import open_rounds
    from draftrelay.testing import score_in_flight

    faults = dict(seed=7, p_delay=0.004, delay_ms=35, p_exception=0.02, p_disconnect=0.02, p_timeout=0.01,
                  p_bad_reply=0.01, p_corrupt=0.01, p_stall=0.006, stall_ms=35)
    eng = torch.cuda.Stream()
    r = open_rounds(cfg(cuda_stream=eng, strict=True, round_spec={"kind": "builtin", "faults": faults}))
    L = r.region.layout
    path = {k: v for k, v in r.stream.info.items() if k in ("wait", "round", "round_kernel", "batch_memops")}
    # Device-side sources for 2 of 3 rounds (the engine's gather: one D2H), host numpy for the rest.
    pinned = [torch.zeros(L.staging_size, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    dev = [torch.zeros(L.staging_size, dtype=torch.uint8, device="cuda") for _ in range(4)]
    rng = np.random.default_rng(1)

    def submitted():
        for _ in range(10_000):
            t = r._t + 1  # the stream round (after the self-test's)
            reqs = make_requests(rng, t)
            if t % 3:
                k = t % 4
                pack_staging(L, t, reqs, out=pinned[k].numpy())
                with torch.cuda.stream(eng):
                    dev[k].copy_(pinned[k], non_blocking=True)
                tt = r.submit(src=dev[k], n_out=np.array([q.n_out for q in reqs], np.int32))
            else:
                tt = r.submit(reqs)
            assert tt == t
            yield tt, reqs

    t0 = time.monotonic()
    try:
        exact, wrong = score_in_flight(r, submitted(), VOCAB)
        st = r.stats()
    finally:
        r.close()
    elapsed = time.monotonic() - t0
    ok = wrong == 0 and st["rounds"] == 10_000 and st["ok"] + st["failed"] + st["watchdog"] == st["rounds"]
    return {"wait": os.environ.get("DRAFTRELAY_CUDA_WAIT", "auto"), "round_path": path,
            "rounds": st["rounds"], "exact_drafts": exact, "wrong_drafts": wrong, "elapsed_s": round(elapsed, 2),
            "stats": st, "pass": bool(ok and exact > 10_000)}


def step_soak_memop() -> dict:
    """The soak on the memop path (batched write + wait, copies) instead of the default round kernel."""
    os.environ["DRAFTRELAY_CUDA_WAIT"] = "memop"
    return step_soak()


def step_lazy_round() -> dict:
    """The lazy-loading probe's main case on the default path (the stream parked in the round kernel):
    a fresh module loaded and launched on the engine thread in every one of 30 parked rounds."""
    import torch

    torch.zeros(1, device="cuda")
    out = lazy_free_process(30)
    out["pass"] = bool(out.get("exact_rounds") == 30 and out.get("wrong_drafts") == 0 and out.get("kernels_all_ran"))
    return out


# ---------------------------------------------------------------------------------------------


def step_graph() -> dict:
    import torch
    from cuda.bindings import driver

    from draftrelay.handoff import native
    from draftrelay.handoff.cuda_stream import CudaStream
    from draftrelay.handoff.region import (
        Region,
        RegionConfig,
        RoundRequest,
        Status,
        W,
        decode_reply,
        pack_staging,
        unpack_staging,
        write_reply,
    )
    from draftrelay.testing import deterministic_draft

    region = Region.create(RegionConfig(4, 256, 8, VOCAB))
    L = region.layout
    eng = torch.cuda.Stream()
    st = CudaStream(region, eng)
    buf = st.new_reply_buffer()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    req = RoundRequest(3, 1, 0, np.array([5, 6, 7], np.int32), 4)
    dev_src = torch.zeros(L.staging_size, dtype=torch.uint8, device="cuda")
    words = [L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED), L.claim(0), L.claim(1)]

    def capture(t: int):
        err, = driver.cuStreamBeginCapture(st.cu_stream,
                                           driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        assert not err, err
        with torch.cuda.stream(eng):
            counter.add_(1)  # a kernel node before the hand-off, as the engine's gather would be
        s = t & 1
        st.copy_in(s, dev_src)
        st.write32(L.word(W.GATHERED), t)
        st.wait_geq32(L.word(W.RELEASED), t)
        st.copy_out(s, buf)
        st.write32(L.word(W.CONSUMED), t)
        err, graph = driver.cuStreamEndCapture(st.cu_stream)
        assert not err, err
        err, gexec = driver.cuGraphInstantiate(graph, 0)
        assert not err, err
        return graph, gexec

    def proxy_round(t: int, replay: int, delay_s: float, log: list) -> None:
        """CUDA-free: wait gathered >= t, check the staged bytes, publish drafts that name the replay."""
        if native.wait_geq32(region.word_addr(W.GATHERED), t, 100, 20, 5_000_000) != 0:
            log.append("never gathered")
            return
        s = t & 1
        try:
            private = region.staging_view(s).copy()
            _, reqs = unpack_staging(L, private, t)
            d, c = deterministic_draft(reqs[0], VOCAB)
            drafts, conf = pad((d + replay) % VOCAB, L), pad(c, L)
            time.sleep(delay_s)
            log.append(native.load32(region.word_addr(W.CONSUMED)))  # must still be < t: the stream is parked
            write_reply(L, region.reply_view(s), t, Status.OK, np.array([4], np.int32), drafts, conf)
            native.claim32(region.addr(L.claim(s)), 2 * t, 2 * t)
        finally:
            native.store_max32(region.word_addr(W.RELEASED), t)  # never leave the stream parked

    def expect(t: int, replay: int):
        d, _ = deterministic_draft(req, VOCAB)
        return (d + replay) % VOCAB

    out: dict = {}
    # (a) one graph for round 1, replayed 20 times with a host reset of the words between replays
    dev_src.copy_(torch.from_numpy(pack_staging(L, 1, [req])).cuda())
    torch.cuda.synchronize()
    graph, gexec = capture(1)
    err, nodes, n_nodes = driver.cuGraphGetNodes(graph, 0)
    err, nodes, n_nodes = driver.cuGraphGetNodes(graph, n_nodes)
    types = [driver.cuGraphNodeGetType(nd)[1].name for nd in nodes]
    good = 0
    parked_ok = 0
    for replay in range(20):
        log: list = []
        th = threading.Thread(target=proxy_round, args=(1, replay, 0.002, log))
        th.start()
        err, = driver.cuGraphLaunch(gexec, st.cu_stream)
        assert not err, err
        done = st.record().wait(5.0)
        th.join(5.0)
        res = decode_reply(L, st.host_bytes(buf), 1, np.array([4], np.int32))
        ok = done and res.ok and np.array_equal(res.drafts[0, :4], expect(1, replay))
        good += int(ok)
        parked_ok += int(bool(log) and log[0] == 0)
        for w in words:  # drained: reset for the next replay
            native.store32(region.addr(w), 0)
    torch.cuda.synchronize()
    out["reset_replays"] = {"replays": 20, "exact": good, "parked_until_release": parked_ok,
                            "kernel_node_ran": int(counter.item()), "node_types": types}

    # (b) the same graph, memop node values updated in the executable graph: rounds t = 1, 2, 3, ...
    diag: dict = {}
    try:
        memop_nodes = [nd for nd, ty in zip(nodes, types, strict=True) if "BATCH_MEM_OP" in ty]
        # what capture() enqueued, in order (cuGraphGetNodes listed the nodes in capture order on the H200)
        known = [("write", st._dbase + L.word(W.GATHERED)), ("wait", st._dbase + L.word(W.RELEASED)),
                 ("write", st._dbase + L.word(W.CONSUMED))]
        good_b = 0
        t_us = []
        for t in range(1, 21):
            if t > 1:
                dev_src.copy_(torch.from_numpy(pack_staging(L, t, [req])).cuda())
                torch.cuda.synchronize()
                u0 = time.perf_counter()
                for nd, known_op in zip(memop_nodes, known, strict=False):
                    update_memop_node(driver, gexec, nd, t, diag, known_op)
                t_us.append((time.perf_counter() - u0) * 1e6)
            else:
                dev_src.copy_(torch.from_numpy(pack_staging(L, 1, [req])).cuda())
                torch.cuda.synchronize()
            # note: the copy nodes use slot 1 & 1 = 1 as captured; the proxy reads the slot of the
            # captured round, so keep a single slot here (slot of round 1) by passing t's parity check
            log = []
            th = threading.Thread(target=proxy_round_fixed_slot, args=(region, L, t, t, 0.001, log, VOCAB))
            th.start()
            err, = driver.cuGraphLaunch(gexec, st.cu_stream)
            assert not err, err
            done = st.record().wait(5.0)
            th.join(5.0)
            res = decode_reply_fixed_slot(L, st.host_bytes(buf), t)
            good_b += int(done and res is not None and np.array_equal(res, expect(1, t)))
        out["updated_replays"] = {"replays": 20, "exact": good_b, "memop_nodes": len(memop_nodes),
                                  "update_us_p50": pct(t_us, 50), "diag": diag}
    except Exception as exc:  # noqa: BLE001
        out["updated_replays"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:],
                                  "diag": diag}
    finally:
        if not st.drain(5.0):
            out["stuck"] = True

    # (c) the round kernel taking t from the device counter: ONE graph, replayed 20 times as rounds
    #     101..120 (t and the slot t & 1 come from the counter; the kernel stamps t into the staged
    #     descriptor), with no host reset between replays and no parameter update
    try:
        if st.info.get("round") != "kernel":
            raise RuntimeError(f"round kernel not in use: {st.info.get('round_kernel')}")
        for w in words:
            native.store32(region.addr(w), 0)
        bufs = (st.new_reply_buffer(), st.new_reply_buffer())
        dev_src.copy_(torch.from_numpy(pack_staging(L, 0, [req])).cuda())  # round field 0: the kernel stamps t
        counter.zero_()
        st.set_round_counter(100)
        torch.cuda.synchronize()
        err, = driver.cuStreamBeginCapture(st.cu_stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        assert not err, err
        with torch.cuda.stream(eng):
            counter.add_(1)  # the engine's gather would be here
        st.enqueue_round_from_counter(dev_src, bufs)
        with torch.cuda.stream(eng):
            counter.add_(1)  # and its verify here
        err, graph_c = driver.cuStreamEndCapture(st.cu_stream)
        assert not err, err
        err, gexec_c = driver.cuGraphInstantiate(graph_c, 0)
        assert not err, err
        err, nodes_c, n_c = driver.cuGraphGetNodes(graph_c, 0)
        err, nodes_c, n_c = driver.cuGraphGetNodes(graph_c, n_c)
        types_c = [driver.cuGraphNodeGetType(nd)[1].name for nd in nodes_c]
        good_c = parked_c = same_c = 0
        rows = []
        for k in range(20):
            t = 101 + k
            log = []
            th = threading.Thread(target=proxy_round, args=(t, k, 0.002, log))
            th.start()
            err, = driver.cuGraphLaunch(gexec_c, st.cu_stream)
            assert not err, err
            done = st.record().wait(5.0)
            th.join(5.0)
            torch.cuda.synchronize()
            s = t & 1
            res = decode_reply(L, st.host_bytes(bufs[s]), t, np.array([4], np.int32))
            same = bool(torch.equal(bufs[s].dev.cpu(), bufs[s].host))  # the device got the mirror's bytes
            ok = done and res.ok and same and np.array_equal(res.drafts[0, :4], expect(t, k))
            good_c += int(ok)
            parked_c += int(bool(log) and isinstance(log[0], int) and log[0] < t)
            same_c += int(same)
            rows.append({"t": t, "status": res.status.name, "ok": bool(ok), "consumed_while_proxy_held": log[:1]})
        out["counter_replays"] = {
            "replays": 20, "exact": good_c, "parked_until_release": parked_c, "device_equals_mirror": same_c,
            "rounds": [101, 120], "kernel_nodes_ran": int(counter.item()),
            "consumed_after": native.load32(region.word_addr(W.CONSUMED)), "node_types": types_c, "rows": rows,
            "parameter_updates": 0}
        driver.cuGraphExecDestroy(gexec_c)
        driver.cuGraphDestroy(graph_c)
    except Exception as exc:  # noqa: BLE001
        out["counter_replays"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    finally:
        if not st.drain(5.0):
            out["stuck"] = True
    st.close()
    region.close()
    c = out["counter_replays"]
    out["pass"] = out["reset_replays"]["exact"] == 20 and out["reset_replays"]["parked_until_release"] == 20 \
        and c.get("exact") == 20 and c.get("parked_until_release") == 20 and c.get("consumed_after") == 120
    return out


def update_memop_node(driver, gexec, nd, t: int, diag: dict, known_op: tuple[str, int] | None = None) -> None:
    """Set every 32-bit write/wait value of a captured batch-memop node to t in the executable graph.
    Tries the node's own parameters first, then freshly built ones; records what it saw in `diag`.
    On the H200 run (cuda-bindings 13.3.1) GetParams gave count 1 but an empty paramArray, so both
    failed with INVALID_VALUE; the fresh parameters are now built from what capture() enqueued
    (`known_op`) when the node's own are empty (this fallback has not run on a GPU yet)."""
    err, old = driver.cuGraphBatchMemOpNodeGetParams(nd)
    assert not err, f"cuGraphBatchMemOpNodeGetParams: {err}"
    OP = driver.CUstreamBatchMemOpType
    ops = list(old.paramArray)[:old.count]
    if not ops and known_op is not None:
        o = driver.CUstreamBatchMemOpParams()
        kind, addr = known_op
        if kind == "write":
            o.operation = o.writeValue.operation = OP.CU_STREAM_MEM_OP_WRITE_VALUE_32
            o.writeValue.address = driver.CUdeviceptr(addr)
            o.writeValue.flags = 0
        else:
            o.operation = o.waitValue.operation = OP.CU_STREAM_MEM_OP_WAIT_VALUE_32
            o.waitValue.address = driver.CUdeviceptr(addr)
            o.waitValue.flags = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        ops = [o]
    diag.setdefault("ops", [[str(op.operation) for op in ops], int(old.count), int(old.flags)])
    for op in ops:
        if op.operation == OP.CU_STREAM_MEM_OP_WRITE_VALUE_32:
            set_value(driver, op.writeValue, t)
        elif op.operation == OP.CU_STREAM_MEM_OP_WAIT_VALUE_32:
            set_value(driver, op.waitValue, t)
    old.paramArray = ops
    old.count = len(ops)
    err, = driver.cuGraphExecBatchMemOpNodeSetParams(gexec, nd, old)
    if not err:
        diag["path"] = "own params"
        return
    diag["own_params_error"] = str(err)
    fresh = []
    for op in ops:
        o = driver.CUstreamBatchMemOpParams()
        o.operation = op.operation
        if op.operation == OP.CU_STREAM_MEM_OP_WRITE_VALUE_32:
            o.writeValue.operation = op.operation
            o.writeValue.address = op.writeValue.address
            o.writeValue.flags = op.writeValue.flags
            set_value(driver, o.writeValue, t)
        elif op.operation == OP.CU_STREAM_MEM_OP_WAIT_VALUE_32:
            o.waitValue.operation = op.operation
            o.waitValue.address = op.waitValue.address
            o.waitValue.flags = op.waitValue.flags
            set_value(driver, o.waitValue, t)
        else:
            o.memoryBarrier.operation = op.operation
            o.memoryBarrier.flags = op.memoryBarrier.flags
        fresh.append(o)
    p = driver.CUDA_BATCH_MEM_OP_NODE_PARAMS()
    p.ctx = old.ctx
    p.count = len(fresh)
    p.paramArray = fresh
    p.flags = old.flags
    err, = driver.cuGraphExecBatchMemOpNodeSetParams(gexec, nd, p)
    if err:
        diag["fresh_params_error"] = str(err)
        raise RuntimeError(f"cuGraphExecBatchMemOpNodeSetParams: own params {diag['own_params_error']}, "
                           f"fresh params {err}; ops {diag['ops']}")
    diag["path"] = "fresh params"


def pad(a: np.ndarray, L) -> np.ndarray:
    out = np.zeros((1, L.cfg.max_drafts), a.dtype)
    out[0, :len(a)] = a
    return out


def set_value(driver, params, t: int) -> None:
    try:
        params.value = t
    except TypeError:
        params.value = driver.cuuint32_t(t)


def proxy_round_fixed_slot(region, L, t: int, replay: int, delay_s: float, log: list, vocab: int) -> None:
    """For graph (b): the captured copies always use slot 1 (round 1's), while the words count t."""
    from draftrelay.handoff import native
    from draftrelay.handoff.region import Status, W, unpack_staging, write_reply
    from draftrelay.testing import deterministic_draft

    if native.wait_geq32(region.word_addr(W.GATHERED), t, 100, 20, 5_000_000) != 0:
        log.append("never gathered")
        native.store_max32(region.word_addr(W.RELEASED), t)
        return
    try:
        _, reqs = unpack_staging(L, region.staging_view(1).copy(), t)
        d, c = deterministic_draft(reqs[0], vocab)
        time.sleep(delay_s)
        write_reply(L, region.reply_view(1), t, Status.OK, np.array([4], np.int32), pad((d + replay) % vocab, L),
                    pad(c, L))
        native.store32(region.addr(L.claim(1)), 2 * t)  # sole publisher here; the claim word names round t
    finally:
        native.store_max32(region.word_addr(W.RELEASED), t)


def decode_reply_fixed_slot(L, buf: np.ndarray, t: int):
    from draftrelay.handoff.region import decode_reply

    res = decode_reply(L, buf, t, np.array([4], np.int32))
    return res.drafts[0, :4] if res.ok else None


# ---------------------------------------------------------------------------------------------


def run_one(step: str, out_dir: str) -> int:
    global _CHECKPOINT
    _CHECKPOINT = os.path.join(out_dir, f"probe_{step}.json")
    fn = globals()[f"step_{step}"]
    t0 = time.monotonic()
    try:
        res = fn()
    except Exception as exc:  # noqa: BLE001
        res = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:], "pass": False}
    res["step"] = step
    res["wall_s"] = round(time.monotonic() - t0, 2)
    with open(os.path.join(out_dir, f"probe_{step}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


def summary_line(step: str, r: dict) -> str:
    if r.get("timed_out"):
        return f"TIMED OUT after {r['timeout_s']} s"
    if "error" in r and step != "lazy":
        return f"ERROR {r['error']}"
    if step == "env":
        return f"{r.get('nvidia_smi')} torch {r.get('torch')} cuda-bindings {r.get('cuda_bindings')}"
    if step == "refusal":
        return "; ".join(f"{k}: {'clean' if v['clean'] and not v['registered_left'] else 'LEAK'}"
                         for k, v in r["cases"].items())
    if step == "lazy":
        def g(k, f):
            return r.get(k, {}).get(f)
        return (f"cudacall+fresh nvrtc: hung {g('cudacall_nvrtc', 'hung_until_timer')}/3; "
                f"free thread: {g('free_thread_nvrtc', 'timer_fires')} fires; "
                f"cudacall+preloaded: {g('cudacall_preloaded', 'timer_fires')} fires; "
                f"free proxy process: {g('free_process_30', 'exact_rounds')}/30 exact; "
                f"triton cudacall hung {g('cudacall_triton', 'hung_until_timer')}/2, "
                f"free fires {g('free_thread_triton', 'timer_fires')}")
    if step in ("soak", "soak_memop"):
        return (f"{r['rounds']} rounds, {r['exact_drafts']} drafts exact, {r['wrong_drafts']} wrong, "
                f"{r['elapsed_s']} s ({r.get('round_path')})")
    if step == "lazy_round":
        return (f"{r.get('exact_rounds')}/30 exact, loads after release {r.get('loads_returning_after_release')}, "
                f"kernels ran {r.get('kernels_all_ran')}")
    if step == "graph":
        a, b = r.get("reset_replays", {}), r.get("updated_replays", {})
        c = r.get("counter_replays", {})
        return (f"reset replays {a.get('exact')}/20 exact ({a.get('parked_until_release')} parked); "
                f"updated memop replays {b.get('exact', b.get('error'))}/20; round-kernel counter replays "
                f"{c.get('exact', c.get('error'))}/20 ({c.get('parked_until_release')} parked)")
    return ""


def run_step(step: str, out_dir: str) -> dict:
    """Run one step in a fresh process under its timeout; its result dict (pass=False on a timeout or
    a crash, with the log's tail)."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")
    path = os.path.join(out_dir, f"probe_{step}.json")
    try:
        p = subprocess.run([sys.executable, __file__, "--one", step, "--out", out_dir],
                           timeout=STEP_TIMEOUT_S[step], capture_output=True, text=True)
        res = json.load(open(path)) if os.path.exists(path) else {"error": f"no result (exit {p.returncode})",
                                                                   "pass": False}
        res["log_tail"] = (p.stdout + p.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"") + (exc.stderr or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        partial = json.load(open(path)) if os.path.exists(path) else {}
        res = {**partial, "timed_out": True, "timeout_s": STEP_TIMEOUT_S[step], "pass": False,
               "log_tail": tail[-1500:]}
    if os.path.exists(path):
        os.remove(path)  # merged into RESULT (few files come back from the device)
    return res


def write_results(out_dir: str, results: dict) -> str:
    path = os.path.join(out_dir, RESULT)
    with open(path, "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}, f,
                  indent=1, default=str)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=f"directory for {RESULT}")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        return run_one(args.one, args.out)
    results = {}
    for step in args.steps.split(","):
        t0 = time.monotonic()
        results[step] = run_step(step, args.out)
        print(f"[{step}] {time.monotonic() - t0:.1f} s pass={results[step].get('pass')}", flush=True)
    write_results(args.out, results)
    print(f"\n{'step':8} {'pass':5} summary")
    for step, r in results.items():
        try:
            line = summary_line(step, r)
        except Exception as exc:  # noqa: BLE001
            line = f"(summary failed: {exc}) {str(r)[:300]}"
        print(f"{step:8} {str(r.get('pass')):5} {line}")
    return 0 if all(r.get("pass") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
