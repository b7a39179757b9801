"""Hand-off micro-benchmark on a real CUDA stream (needs a GPU, torch and cuda-bindings).

Rows, each over --rounds rounds after a warm-up, with a spinning or a napping (spin 50 µs, nap 20 µs)
proxy process answering every round; `path` says how the round was enqueued: `kernel` (the round
kernel, the default), `batched` (memops, write + wait in one cuStreamBatchMemOp), `memops` (the previous
build: separate calls):
  - enqueue: the engine thread's cost of one round. `round`: AsyncRounds.submit with the rows already on
    the device; `round-host`: submit(requests), the engine's own path (packed on the host, staged from a
    pinned bounce); `bare`: write, wait, write on the single ops (`three memops`); `ops`: the memop
    round one call at a time, even rounds batched and odd rounds not (per-call p50s side by side).
  - release -> ack: the proxy's CLOCK_MONOTONIC just before it stores `released` (two ctypes calls before
    the store itself) to the engine thread seeing `consumed`, spinning natively on it. The round kernel
    stores `consumed` once it has read the reply, so this includes one bus round trip for the reply and
    the ack leg (GPU store -> host sees it); memop rounds store it after the H2D + mirror copies; `bare`
    rows right after the wait.
  - release -> done: to the round's event completing (cuEventQuery polled): reply in the device buffer
    and in the host mirror, the next kernel on the stream may start.
  - pickup: engine thread sees `gathered` -> proxy's release (the proxy's wait + the built-in round)
  - the proxy process's CPU use over the run
Then, with no proxy process at all: `gpu-self` (the engine thread stores `released` itself ~20 µs after
the stream parked: the GPU's own wake-up; memop wait, polling wait kernel, round kernel) and
`gpu-unparked` (the same ops with `released` set beforehand: the floor between two stream writes), and
`pingpong`: a resident one-warp kernel answering each host store with its own store (the bus round
trip; half of it estimates one leg, e.g. the ack leg inside release -> ack).

    python benchmarks/handoff_cuda.py [--rounds 20000] [--out benchmarks/results]   # -> DIR/handoff_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from draftrelay.handoff import native
from draftrelay.handoff.procinfo import cpu_seconds, machine_info
from draftrelay.handoff.region import Region, RegionConfig, RoundRequest, W, pack_staging
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig, open_rounds

PROXY = {"spin": (10_000_000, 0), "nap": (50, 20)}



def pct(a, q: float) -> float | None:
    return round(float(np.percentile(np.asarray(a, dtype=np.float64), q)), 2) if len(a) else None


def run(backend: str, mode: str, proxy: str, n_rounds: int, warmup: int, fast: bool = True,
        wait: str = "memop", batch: bool = True) -> dict:
    import torch

    spin_us, nap_us = PROXY[proxy]
    kw = {}
    if backend == "cuda":
        eng = torch.cuda.Stream()
        kw["cuda_stream"] = eng
    else:  # the emulated stream spins like a GPU would poll (it has a core of its own on this machine)
        kw.update(stream_spin_us=10_000_000, stream_nap_us=0)
    cfg = HandoffConfig(vocab_size=32000, max_requests=4, max_tokens=512, max_drafts=8, spin_us=spin_us,
                        nap_us=nap_us, deadline_ms=200, backend=backend, strict=True, cuda_wait=wait or "",
                        cuda_fast_calls=fast, cuda_batch_memops=batch, **kw)
    r = open_rounds(cfg)
    assert isinstance(r, AsyncRounds)
    info = getattr(r.stream, "info", {})
    calls = "ctypes" if info.get("fast_calls") else ("bindings" if backend == "cuda" else "-")
    path = ("kernel" if info.get("round") == "kernel" else "batched" if info.get("batch_memops") else "memops") \
        if backend == "cuda" else "-"
    L = r.region.layout
    a_g, a_c = r.region.word_addr(W.GATHERED), r.region.word_addr(W.CONSUMED)
    a_last = r.region.word_addr(W.LAST_RELEASE_NS)
    off_g, off_r, off_c = L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED)
    rng = np.random.default_rng(0)
    reqs = [RoundRequest(i, 1, 0, rng.integers(0, 32000, 4).astype(np.int32), 4) for i in range(2)]
    n_out = np.array([4, 4], np.int32)
    if backend == "cuda":
        pinned = [torch.zeros(L.staging_size, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
        dev = [torch.zeros(L.staging_size, dtype=torch.uint8, device="cuda") for _ in range(4)]
    else:
        pinned = [torch.zeros(L.staging_size, dtype=torch.uint8) for _ in range(4)]
    enq, memops, resume, pickup, done = [], [], [], [], []
    ops_ns: list[list[int]] = []
    ops_b: list[list[int]] = []
    st = r.stream
    cpu0 = wall0 = 0.0
    bad = 0
    try:
        for i in range(warmup + n_rounds):
            if i == warmup:
                cpu0, wall0 = cpu_seconds(r.proxy.pid), time.monotonic()
            t = r._t + 1
            k = t % 4
            pack_staging(L, t, reqs, out=pinned[k].numpy())
            if backend == "cuda":
                with torch.cuda.stream(eng):
                    dev[k].copy_(pinned[k], non_blocking=True)
                src = dev[k]
            else:
                src = pinned[k].numpy()
            ev = None
            if mode == "round":
                p0 = time.perf_counter_ns()
                rid = r.submit(src=src, n_out=n_out)
                p1 = time.perf_counter_ns()
                m = 0
                ev = r.pending(rid).event
            elif mode == "round-host":  # the engine's own path: requests packed on the host, staged from there
                p0 = time.perf_counter_ns()
                rid = r.submit(reqs)
                p1 = time.perf_counter_ns()
                m = 0
                ev = r.pending(rid).event
            elif mode == "ops":  # the round's ops one by one, each timed (reaches into the backend: bench only)
                r._t = t
                s, dst = t & 1, r._dst[t & 1]
                c = [time.perf_counter_ns()]
                st.copy_in(s, src)
                c.append(time.perf_counter_ns())
                batched = st._bm is not None and t % 2 == 0  # odd rounds: separate calls, side by side
                if batched:  # write gathered + wait released in one driver call
                    st._write_then_wait(st._dbase + off_g, st._dbase + off_r, t)
                else:
                    st.write32(off_g, t)
                    c.append(time.perf_counter_ns())
                    st.wait_geq32(off_r, t)
                c.append(time.perf_counter_ns())
                st._h2d(dst.dev_ptr, st._reply_h[s], dst.nbytes, st._s)
                c.append(time.perf_counter_ns())
                st._d2h(dst.host_ptr, dst.dev_ptr, dst.nbytes, st._s)
                c.append(time.perf_counter_ns())
                st.write32(off_c, t)
                c.append(time.perf_counter_ns())
                ev = st.record()
                c.append(time.perf_counter_ns())
                p0, p1, m = c[0], c[-1], 0
                if i >= warmup:
                    (ops_b if batched else ops_ns).append([b - a for a, b in zip(c, c[1:], strict=False)])
            else:  # bare: drive the stream ops directly (the proxy still answers every round)
                r._t = t
                p0 = time.perf_counter_ns()
                st.copy_in(t & 1, src)
                m0 = time.perf_counter_ns()
                st.write32(off_g, t)
                st.wait_geq32(off_r, t)
                st.write32(off_c, t)
                m1 = time.perf_counter_ns()
                ev = st.record()
                p1 = time.perf_counter_ns()
                m = m1 - m0
            native.wait_geq32(a_g, t, 10_000_000, 0, 2_000_000)
            g_ns = native.now_ns()
            native.wait_geq32(a_c, t, 10_000_000, 0, 2_000_000)
            c_ns = native.now_ns()
            if ev is not None:  # the round's end on the stream: reply in the device buffer and the mirror
                while not ev.query():
                    pass
                done.append(native.now_ns())
            rel = native.load64(a_last)
            if mode.startswith("round"):
                bad += int(not r.result(t, timeout_s=5).ok)
            elif not ev.wait(5):
                raise RuntimeError(f"round {t} did not finish")
            if i >= warmup:
                enq.append(p1 - p0)
                memops.append(m)
                resume.append(c_ns - rel)
                pickup.append(rel - g_ns)
                if ev is not None:
                    done[-1] -= rel
            elif ev is not None:
                done.pop()
        cpu = cpu_seconds(r.proxy.pid) - cpu0
        wall = time.monotonic() - wall0
        stats = r.stats()
    finally:
        r.close()
    us = 1e-3
    row = {"backend": backend, "mode": mode, "proxy": proxy, "calls": calls, "wait": wait if backend == "cuda" else "-",
           "path": path, "round_kernel": info.get("round_kernel"),
           "spin_us": spin_us, "nap_us": nap_us,
           "rounds": n_rounds, "not_ok": bad, "watchdog": stats["watchdog"],
           "enqueue_us_p50": pct(np.array(enq) * us, 50), "enqueue_us_p99": pct(np.array(enq) * us, 99),
           "release_to_resume_us_p50": pct(np.array(resume) * us, 50),
           "release_to_resume_us_p99": pct(np.array(resume) * us, 99),
           "release_to_resume_us_max": round(float(np.max(resume)) * us, 1),
           "pickup_us_p50": pct(np.array(pickup) * us, 50), "pickup_us_p99": pct(np.array(pickup) * us, 99),
           "round_us_mean": round(wall / n_rounds * 1e6, 1), "proxy_cpu_percent": round(100 * cpu / wall, 1)}
    if done:  # release -> the round's event done (polled with cuEventQuery, ~1 µs a query)
        row["release_to_done_us_p50"] = pct(np.array(done) * us, 50)
        row["release_to_done_us_p99"] = pct(np.array(done) * us, 99)
    if mode == "bare":
        row["three_memops_us_p50"] = pct(np.array(memops) * us, 50)
        row["three_memops_us_p99"] = pct(np.array(memops) * us, 99)
    if mode == "ops":  # with batched memops available, even rounds batched and odd ones not, in one run
        a = np.array(ops_ns) * us
        names = ("copy_in_d2h", "write_gathered", "wait_released", "reply_h2d", "mirror_d2h", "write_consumed",
                 "event_record")
        row["op_us_p50"] = {n: pct(a[:, k], 50) for k, n in enumerate(names)}
        row["op_us_p50"]["write_and_wait"] = pct(a[:, 1] + a[:, 2], 50)
        row["op_us_p50"]["round_total"] = pct(a.sum(1), 50)
        if ops_b:
            b = np.array(ops_b) * us
            names = ("copy_in_d2h", "batch_write_wait", "reply_h2d", "mirror_d2h", "write_consumed", "event_record")
            row["op_us_p50_batched"] = {n: pct(b[:, k], 50) for k, n in enumerate(names)}
            row["op_us_p50_batched"]["round_total"] = pct(b.sum(1), 50)
    return row


def run_gpu_self(n_rounds: int, warmup: int, wait: str = "memop") -> list[dict]:
    """No proxy: the engine thread itself stores `released` ~20 µs after it saw `gathered` (the stream is
    parked by then) and times until it sees `consumed`; alternate rounds have `released` set beforehand."""
    import torch

    from draftrelay.handoff.cuda_stream import CudaStream

    region = Region.create(RegionConfig(4, 512, 8, 32000))
    st = CudaStream(region, torch.cuda.Stream(), wait=wait)
    L = region.layout
    off = [L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED)]
    a_g, a_r, a_c = (region.addr(o) for o in off)
    parked_ns, unparked_ns = [], []
    try:
        for t in range(1, 2 * (n_rounds + warmup) + 1):
            parked = t % 2 == 0
            if not parked:
                native.store32(a_r, t)
            st.write32(off[0], t)
            st.wait_geq32(off[1], t)
            st.write32(off[2], t)
            g, r0, c = release_and_time(a_g, a_r if parked else 0, a_c, t)
            if t > 2 * warmup:
                (parked_ns if parked else unparked_ns).append(c - r0 if parked else c - g)
        if not st.drain(5.0):
            raise RuntimeError("stream did not drain")
    finally:
        st.close()
        region.close()
    us = 1e-3
    return [{"backend": "cuda", "mode": name, "proxy": "none", "calls": "ctypes", "wait": wait, "rounds": len(v),
             "release_to_resume_us_p50": pct(np.array(v) * us, 50),
             "release_to_resume_us_p99": pct(np.array(v) * us, 99),
             "release_to_resume_us_max": round(float(np.max(v)) * us, 1)}
            for name, v in (("gpu-self", parked_ns), ("gpu-unparked", unparked_ns))]


def release_and_time(a_g: int, a_r: int, a_c: int, t: int) -> tuple[int, int, int]:
    """The engine thread as its own proxy: wait for `gathered` = t, ~20 µs later store `released` = t
    (a_r = 0: no release, the stream was not parked), wait for `consumed` = t. Returns the three times (ns)."""
    native.wait_geq32(a_g, t, 10_000_000, 0, 2_000_000)
    g = r0 = native.now_ns()
    if a_r:
        while native.now_ns() - g < 20_000:
            pass
        r0 = native.now_ns()
        native.store32(a_r, t)
    native.wait_geq32(a_c, t, 10_000_000, 0, 2_000_000)
    return g, r0, native.now_ns()


def run_gpu_self_round(n_rounds: int, warmup: int) -> dict:
    """gpu-self for the round kernel: no proxy; the engine thread stores `released` itself ~20 µs after it
    saw `gathered`, and times until it sees `consumed` (the kernel stores it once it has read the reply)."""
    import torch

    from draftrelay.handoff.cuda_stream import CudaStream

    region = Region.create(RegionConfig(4, 512, 8, 32000))
    st = CudaStream(region, torch.cuda.Stream(), wait="kernel")
    kernel = st.info.get("round_kernel")
    L = region.layout
    offs = tuple(L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED))
    a_g, a_r, a_c = (region.addr(o) for o in offs)
    src = torch.zeros(L.staging_size, dtype=torch.uint8, device="cuda")
    dst = [st.new_reply_buffer() for _ in (0, 1)]
    torch.cuda.synchronize()
    lat = []
    try:
        for t in range(1, n_rounds + warmup + 1):
            ev = st.enqueue_round(t & 1, t, src, dst[t & 1], offs)
            _, r0, c = release_and_time(a_g, a_r, a_c, t)
            if not ev.wait(5.0):
                raise RuntimeError(f"round {t} did not finish")
            if t > warmup:
                lat.append(c - r0)
    finally:
        st.close()
        region.close()
    us = 1e-3
    return {"backend": "cuda", "mode": "gpu-self", "proxy": "none", "calls": "ctypes", "wait": "kernel",
            "path": "kernel", "round_kernel": kernel, "rounds": len(lat),
            "release_to_resume_us_p50": pct(np.array(lat) * us, 50),
            "release_to_resume_us_p99": pct(np.array(lat) * us, 99),
            "release_to_resume_us_max": round(float(np.max(lat)) * us, 1)}


PINGPONG_CU = r"""
extern "C" __global__ void draftrelay_pingpong(const unsigned* ping, unsigned* pong, unsigned n) {
    for (unsigned i = 1; i <= n; ++i) {
        unsigned long long spins = 0;
        unsigned v;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ping) : "memory");
            if (++spins > (1ull << 22)) {  // ~seconds: the host is gone, do not spin for ever
                asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(pong), "r"(0xFFFFFFFFu) : "memory");
                return;
            }
        } while ((int)(v - i) < 0);
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(pong), "r"(i) : "memory");
    }
}
"""


def run_pingpong(n: int, warmup: int) -> dict:
    """The bus itself: a resident one-warp kernel polls `ping` (acquire loads, as the round kernel polls
    `released`) and answers each value on `pong`; the host stores ping = i and spins until pong = i. Half
    the round trip estimates one leg, e.g. the ack leg (GPU store -> host sees it) inside release -> resume."""
    import ctypes

    import torch
    from cuda.bindings import driver

    from draftrelay.cudabuild import nvrtc_cubin

    torch.zeros(1, device="cuda")
    cubin = nvrtc_cubin(PINGPONG_CU, torch.cuda.get_device_capability())
    err, mod = driver.cuModuleLoadData(cubin.ctypes.data)
    assert not err, err
    err, fn = driver.cuModuleGetFunction(mod, b"draftrelay_pingpong")
    assert not err, err
    words = torch.zeros(64, dtype=torch.int32, pin_memory=True)  # ping at +0, pong at +128 (own lines)
    ping, pong = words.data_ptr(), words.data_ptr() + 128
    stream = torch.cuda.Stream()
    total = n + warmup
    err, = driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, driver.CUstream(stream.cuda_stream),
                                 ((ping, pong, total), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)), 0)
    assert not err, err
    rtt = []
    for i in range(1, total + 1):
        t0 = native.now_ns()
        native.store32(ping, i)
        if native.wait_geq32(pong, i, 10_000_000, 0, 2_000_000) != 0:
            raise RuntimeError(f"pingpong: no answer to {i}")
        t1 = native.now_ns()
        if i > warmup:
            rtt.append(t1 - t0)
    stream.synchronize()
    driver.cuModuleUnload(mod)
    us = 1e-3
    return {"backend": "cuda", "mode": "pingpong", "proxy": "none", "calls": "-", "wait": "-", "path": "-",
            "rounds": len(rtt), "round_trip_us_p50": pct(np.array(rtt) * us, 50),
            "round_trip_us_p99": pct(np.array(rtt) * us, 99),
            "one_leg_us_p50_estimate": pct(np.array(rtt) * us / 2, 50)}

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20_000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--out", default="benchmarks/results", help="directory for handoff_cuda.json")
    ap.add_argument("--no-emulated", action="store_true", help="skip the emulated-stream rows")
    args = ap.parse_args()
    # (backend, mode, proxy, fast calls, wait, batched memops): "auto" is the default (the round kernel);
    # the memop row with batch=False is the previous build's round, side by side
    plan = [("cuda", "round", "nap", True, "auto", True), ("cuda", "round", "spin", True, "auto", True),
            ("cuda", "round-host", "nap", True, "auto", True),
            ("cuda", "round", "nap", True, "memop", True), ("cuda", "round", "nap", True, "memop", False),
            ("cuda", "round-host", "nap", True, "memop", True),
            ("cuda", "bare", "nap", True, "memop", True), ("cuda", "bare", "spin", True, "memop", True),
            ("cuda", "bare", "nap", True, "kernel", True),
            ("cuda", "ops", "nap", True, "memop", True), ("cuda", "round", "nap", False, "memop", False)]
    if not args.no_emulated:
        plan += [("emulated", "round", "spin", True, "-", True), ("emulated", "round", "nap", True, "-", True)]
    rows: list[dict] = []
    errors: list[dict] = []
    for backend, mode, proxy, fast, wait, batch in plan:
        print(f"[{backend} {mode} {proxy} fast={fast} wait={wait} batch={batch}] {args.rounds} rounds ...",
              file=sys.stderr, flush=True)
        try:
            rows.append(run(backend, mode, proxy, args.rounds, args.warmup, fast, wait, batch))
        except Exception as exc:  # noqa: BLE001  one failed configuration must not lose the others
            print(f"  failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            errors.append({"backend": backend, "mode": mode, "proxy": proxy, "wait": wait, "batch": batch,
                           "error": str(exc)})
    extra = [("gpu-self memop", lambda: run_gpu_self(args.rounds, args.warmup, "memop")),
             ("gpu-self wait kernel", lambda: run_gpu_self(args.rounds, args.warmup, "kernel")),
             ("gpu-self round kernel", lambda: [run_gpu_self_round(args.rounds, args.warmup)]),
             ("pingpong", lambda: [run_pingpong(args.rounds, args.warmup)])]
    for name, fn in extra:
        print(f"[{name}] {args.rounds} rounds ...", file=sys.stderr, flush=True)
        try:
            rows += fn()
        except Exception as exc:  # noqa: BLE001
            print(f"  failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            errors.append({"mode": name, "error": f"{type(exc).__name__}: {exc}"})
    nan = float("nan")
    print(f"{'backend':9}{'mode':11}{'proxy':6}{'calls':9}{'path':9}{'enqueue p50/p99 µs':>20}{'3 memops':>9}"
          f"{'release->ack p50/p99 µs':>25}{'->done p50':>11}{'pickup p50':>11}{'round µs':>9}{'proxy CPU':>10}")
    for x in rows:
        if x["mode"] == "pingpong":
            print(f"pingpong (host store -> resident kernel -> host sees its store): round trip p50 "
                  f"{x['round_trip_us_p50']:.2f} µs, p99 {x['round_trip_us_p99']:.2f} µs")
            continue
        print(f"{x['backend']:9}{x['mode'][:10]:11}{x['proxy']:6}{x['calls']:9}{x.get('path', '-'):9}"
              f"{x.get('enqueue_us_p50') or nan:10.1f} / {x.get('enqueue_us_p99') or nan:<7.1f}"
              f"{x.get('three_memops_us_p50') or nan:9.1f}"
              f"{x['release_to_resume_us_p50']:11.1f} / {x['release_to_resume_us_p99']:<11.1f}"
              f"{x.get('release_to_done_us_p50') or nan:11.1f}"
              f"{x.get('pickup_us_p50') or nan:11.1f}{x.get('round_us_mean') or nan:9.0f}"
              f"{x.get('proxy_cpu_percent') or nan:9.0f}%")
    out = {"benchmark": "handoff_cuda", "command": "python benchmarks/handoff_cuda.py " + " ".join(sys.argv[1:]),
           "environment": machine_info(),
           "targets": {"enqueue_us_p50": 15, "release_to_resume_us_p50": 5, "release_to_resume_us_p99": 10},
           "references": {"seed_engine_submit_us": [140, 362], "raw_three_memop_enqueue_us_p50_h200": 9.6,
                          "numpy_spin_release_to_resume_us_h200": [6.2, 12.7]},
           "results": rows, "errors": errors, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "handoff_cuda.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    for x in rows:
        for k in ("op_us_p50", "op_us_p50_batched"):
            if k in x:
                print(f"per-op enqueue p50 µs ({k}):", json.dumps(x[k]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
