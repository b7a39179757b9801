"""The CUDA stream backend, as far as it can be tested without a GPU: it refuses cleanly and visibly
(sync fallback with the reason, or AsyncRefused under strict; no fd, mapping or process left), its
driver bindings are imported only when it is chosen, the preload hook runs before any round is armed,
and `draftrelay selftest` works on the emulated stream. The GPU side is tests_gpu/cuda_probe.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from draftrelay.handoff import cli as selftest_cli
from draftrelay.handoff import rounds as rounds_mod
from draftrelay.handoff.procinfo import children, fd_count, memfd_maps
from draftrelay.handoff.region import Region, RegionConfig
from draftrelay.handoff.rounds import AsyncRefused, AsyncRounds, HandoffConfig, SyncRounds, open_rounds
from draftrelay.handoff.stream import StreamStuck
from draftrelay.round import RoundRequest, Status


def cuda_usable() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_no_cuda = pytest.mark.skipif(
    cuda_usable(), reason="CUDA is usable here: refusal on a real driver is tests_gpu/cuda_probe.py --steps refusal")








def cfg(**kw) -> HandoffConfig:
    base = dict(vocab_size=5000, max_requests=4, max_tokens=256, max_drafts=8, deadline_ms=20.0, selftest_rounds=4)
    base.update(kw)
    return HandoffConfig(**base)


@needs_no_cuda
def test_cuda_backend_refuses_visibly_and_leaves_nothing_behind():
    fds, maps, kids = fd_count(), memfd_maps(), children()
    r = open_rounds(cfg(backend="cuda"))
    assert isinstance(r, SyncRounds) and r.mode == "sync"
    assert r.refusal.startswith("CudaStreamRefused:"), r.refusal
    assert "cuda-bindings is not installed" in r.refusal or "no CUDA device" in r.refusal \
        or "driver library" in r.refusal, r.refusal
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids
    res = r.result(r.submit([RoundRequest(1, 1, 0, np.array([3, 4], np.int32), 3)]))
    assert res.status == Status.OK and res.counts[0] == 3  # the sync fallback still drafts
    with pytest.raises(AsyncRefused, match="CudaStreamRefused"):
        open_rounds(cfg(backend="cuda", strict=True))
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


@needs_no_cuda
def test_cuda_stream_constructor_refuses_and_leaves_the_region_usable():
    from draftrelay.handoff.cuda_stream import CudaStream, CudaStreamRefused

    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        with pytest.raises(CudaStreamRefused) as info:
            CudaStream(region)
        assert str(info.value)  # a reason, not an empty error
        region.view(0, 4)[:] = 1  # still mapped and ours to free
    finally:
        region.close()
    assert region.closed


def test_the_driver_bindings_are_imported_only_when_the_backend_is_chosen():
    code = ("import sys; import draftrelay.handoff.rounds, draftrelay.handoff.cuda_stream, draftrelay.handoff.cli\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_preload_runs_once_before_any_round_is_armed(monkeypatch):
    order: list[str] = []
    real_submit = AsyncRounds.submit

    def spy_submit(self, *a, **k):
        order.append("submit")
        return real_submit(self, *a, **k)

    monkeypatch.setattr(AsyncRounds, "submit", spy_submit)
    r = open_rounds(cfg(preload=(lambda: order.append("kernel A"), lambda: order.append("kernel B"))))
    try:
        assert r.mode == "async", r.refusal
        assert order[:2] == ["kernel A", "kernel B"] and order.count("kernel A") == 1
        assert order[2:] and set(order[2:]) == {"submit"}  # the self-test's rounds came after
    finally:
        r.close()


def test_a_failing_preload_refuses_async_without_leaks():
    fds, maps, kids = fd_count(), memfd_maps(), children()

    def broken() -> None:
        raise RuntimeError("kernel failed to build")

    r = open_rounds(cfg(preload=(broken,)))
    assert r.mode == "sync" and "kernel failed to build" in r.refusal
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


def test_a_stuck_stream_at_start_frees_nothing(monkeypatch):
    """A stream that cannot be drained at start-up fails loudly and keeps the region mapped."""
    started: list[AsyncRounds] = []
    real_start = AsyncRounds._start

    def spy_start(self):
        started.append(self)
        return real_start(self)

    def stuck_stream(cfg_, region):
        raise StreamStuck("test: stream parked for good")

    monkeypatch.setattr(AsyncRounds, "_start", spy_start)
    monkeypatch.setattr(rounds_mod, "make_stream", stuck_stream)
    maps = memfd_maps()
    with pytest.raises(StreamStuck):
        open_rounds(cfg())
    r = started[0]
    try:
        assert memfd_maps() == maps + 1 and not r.region.closed  # nothing the GPU may use was freed
        assert r.watchdog is not None  # and the watchdog still releases whatever is parked
    finally:
        r.watchdog.stop()
        r.region.close()


# -- the selftest subcommand ----------------------------------------------------------------------


def selftest(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    selftest_cli.add_arguments(ap)
    return ap.parse_args(argv)


def test_selftest_on_the_emulated_stream_is_exact(capsys):
    rc = selftest_cli.run(selftest(["--rounds", "150"]))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mode async" in out and "150 rounds: 150 exact, 0 failed, 0 wrong" in out


def test_selftest_json_and_refusal_reason(capsys):
    assert selftest_cli.run(selftest(["--rounds", "20", "--json"])) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == "async" and res["wrong"] == 0 and res["stats"]["ok"] == 20
    if not cuda_usable():
        rc = selftest_cli.run(selftest(["--backend", "cuda", "--rounds", "3"]))
        out = capsys.readouterr().out
        assert rc == 2 and "async refused: CudaStreamRefused" in out and "3 exact" in out
        rc = selftest_cli.run(selftest(["--backend", "cuda", "--strict", "--json"]))
        res = json.loads(capsys.readouterr().out)
        assert rc == 2 and res["mode"] == "refused" and "CudaStreamRefused" in res["refusal"]


def test_selftest_bad_arguments_are_clear_errors(capsys):
    assert selftest_cli.run(selftest(["--rounds", "-5"])) == 3
    assert "--rounds -5" in capsys.readouterr().err
    assert selftest_cli.run(selftest(["--deadline-ms", "0"])) == 3
    with pytest.raises(SystemExit):
        selftest(["--backend", "opencl"])


def test_selftest_through_the_draftrelay_command():
    p = subprocess.run([sys.executable, "-m", "draftrelay.cli", "selftest", "--rounds", "30", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout)
    assert res["backend"] == "emulated" and res["mode"] == "async" and res["wrong"] == 0


# -- the backend's own refusal and cleanup paths, against a simulated driver ------------------------
# A stand-in for cuda.bindings.driver: same call shapes (tuples of CUresult and values), host memory
# "registration" tracked in a dict, stream writes performed at once, events that complete unless the
# test says the stream is stuck. What it checks is CudaStream's own bookkeeping: every refusal path
# leaves nothing registered, and a stream that will not drain keeps its registration.


class FakeDriver:
    def __init__(self, **kw) -> None:
        import enum
        import types

        class CUresult(enum.IntEnum):
            CUDA_SUCCESS = 0
            CUDA_ERROR_INVALID_VALUE = 1
            CUDA_ERROR_INVALID_CONTEXT = 201
            CUDA_ERROR_NOT_READY = 600
            CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
            CUDA_ERROR_NOT_SUPPORTED = 801

        A = enum.IntEnum("CUdevice_attribute", {"CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING": 41,
                                                "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM": 91})
        self.R, self.A = CUresult, A
        self.attrs = {A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: 1,
                      A.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: kw.get("host_ptr", 1)}
        self.memops = kw.get("memops", True)
        self.fail_register_at = kw.get("fail_register_at", 0)  # the n-th registration fails (1-based)
        self.registered: dict[int, int] = {}
        self.n_register = 0
        self.events_live: set[int] = set()
        self.stuck = False
        m = types.ModuleType("cuda.bindings.driver")
        ok = (CUresult.CUDA_SUCCESS,)
        for name, fn in {
            "cuInit": lambda f: ok, "cuCtxGetCurrent": lambda: (CUresult.CUDA_SUCCESS, 77),
            "cuCtxGetDevice": lambda: (CUresult.CUDA_SUCCESS, 0), "cuCtxSetCurrent": lambda c: ok,
            "cuDeviceGetAttribute": lambda a, d: (CUresult.CUDA_SUCCESS, self.attrs.get(a, 0)),
            "cuDriverGetVersion": lambda: (CUresult.CUDA_SUCCESS, 13000),
            "cuGetProcAddress": lambda name, v, f: (CUresult.CUDA_SUCCESS, 0, None),  # no fast path here
            "cuGetErrorName": lambda e: (CUresult.CUDA_SUCCESS, CUresult(e).name.encode()),
            "cuEventCreate": self._event_create, "cuEventDestroy": lambda e: self.events_live.discard(e) or ok,
            "cuEventRecord": lambda e, s: ok,
            "cuEventQuery": lambda e: (CUresult.CUDA_ERROR_NOT_READY,) if self.stuck else ok,
            "cuMemHostRegister": self._register, "cuMemHostUnregister": self._unregister,
            "cuMemHostGetDevicePointer": lambda p, f: (CUresult.CUDA_SUCCESS, p),
            "cuStreamWriteValue32": self._write, "cuStreamWaitValue32": lambda s, a, v, f: ok,
            "cuMemcpyDtoHAsync": lambda *a: ok, "cuMemcpyHtoDAsync": lambda *a: ok,
            "cuLaunchKernel": lambda *a: ok, "cuModuleUnload": lambda m: ok,
            "CUstream": lambda s: s, "CUresult": CUresult, "CUdevice_attribute": A,
            "CU_MEMHOSTREGISTER_DEVICEMAP": 2, "CU_MEMHOSTREGISTER_PORTABLE": 1,
        }.items():
            setattr(m, name, fn)
        m.CUstreamWaitValue_flags = enum.IntEnum("CUstreamWaitValue_flags", {"CU_STREAM_WAIT_VALUE_GEQ": 0})
        m.CUstreamWriteValue_flags = enum.IntEnum("CUstreamWriteValue_flags", {"CU_STREAM_WRITE_VALUE_DEFAULT": 0})
        m.CUevent_flags = enum.IntEnum("CUevent_flags", {"CU_EVENT_DISABLE_TIMING": 2})
        m.CUdriverProcAddress_flags = enum.IntEnum("CUdriverProcAddress_flags",
                                                   {"CU_GET_PROC_ADDRESS_LEGACY_STREAM": 1})
        self.module = m
        self._ev = 1000

    def _event_create(self, flags):
        self._ev += 1
        self.events_live.add(self._ev)
        return self.R.CUDA_SUCCESS, self._ev

    def _register(self, p, size, flags):
        self.n_register += 1
        if self.n_register == self.fail_register_at or p in self.registered:
            return (self.R.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
        self.registered[p] = size
        return (self.R.CUDA_SUCCESS,)

    def _unregister(self, p):
        return (self.R.CUDA_SUCCESS,) if self.registered.pop(p, None) else (self.R.CUDA_ERROR_INVALID_VALUE,)

    def _write(self, s, addr, v, f):
        if not self.memops:
            return (self.R.CUDA_ERROR_NOT_SUPPORTED,)
        import ctypes

        ctypes.c_uint32.from_address(int(addr)).value = v  # a stream write that lands at once
        return (self.R.CUDA_SUCCESS,)


@pytest.fixture
def fake_cuda(install_driver):
    """Install a FakeDriver as cuda.bindings.driver and make CPU torch look like a CUDA device."""

    def install(**kw) -> FakeDriver:
        fake = FakeDriver(**kw)
        install_driver(fake.module, "fake GPU")
        return fake

    return install


@pytest.mark.parametrize("case,kw,reason", [
    ("no host-pointer use", {"host_ptr": 0}, "cannot use host pointers for registered memory"),
    ("memops unsupported", {"memops": False}, "stream memory operations unsupported"),
    ("region registration fails", {"fail_register_at": 2}, "cuMemHostRegister of the region"),
    ("fails after registering (no pinned memory on CPU torch)", {}, "pin_memory"),
])
def test_every_refusal_path_unregisters_everything(fake_cuda, case, kw, reason):
    from draftrelay.handoff.cuda_stream import CudaStream, CudaStreamRefused

    fake = fake_cuda(**kw)
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        with pytest.raises(CudaStreamRefused, match=reason):
            CudaStream(region)
        assert fake.registered == {}, f"{case}: left registered {fake.registered}"
        assert not fake.events_live, f"{case}: events not destroyed"
        if case.startswith("fails after"):
            assert fake.n_register == 2  # the scratch page and the region were registered, then both undone
    finally:
        region.close()


def test_refusal_through_open_rounds_leaves_no_fd_mapping_or_registration(fake_cuda):
    fake = fake_cuda()  # registration succeeds, then CPU torch cannot pin memory: refused after registering
    fds, maps, kids = fd_count(), memfd_maps(), children()
    r = open_rounds(cfg(backend="cuda"))
    assert r.mode == "sync" and "CudaStreamRefused" in r.refusal and "pin_memory" in r.refusal
    assert fake.registered == {} and fake.n_register == 2
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids
    with pytest.raises(AsyncRefused):
        open_rounds(cfg(backend="cuda", strict=True))
    assert fake.registered == {} and fd_count() == fds and memfd_maps() == maps


def test_a_stream_that_will_not_drain_keeps_its_registration(fake_cuda, monkeypatch):
    import torch

    from draftrelay.handoff.cuda_stream import CudaStream

    fake = fake_cuda()
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    st = CudaStream(region, drain_timeout_s=0.2)
    assert st.registered and region.base in fake.registered and st.info["fast_calls"] is False
    fake.stuck = True  # the stream is parked for good
    assert st.drain(0.05) is False
    with pytest.raises(StreamStuck, match="stays registered"):
        st.close()
    assert st.stuck and region.base in fake.registered  # the GPU may still use it: nothing freed
    fake.stuck = False  # released at last (the watchdog's job): now it closes and unregisters
    st.close()
    assert fake.registered == {} and not fake.events_live
    region.close()
