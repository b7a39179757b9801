"""The CUDA backend's host side on a simulated GPU (CPU only): what CudaStream enqueues, in what order,
with which addresses and values, for both round paths (the round kernel and the batched memops), and
the whole protocol through AsyncRounds with the real proxy process on top of it.

The simulated driver hands out the fast-path entry points (cuGetProcAddress) as ctypes callbacks, so
the backend's own ctypes calls, parameter structs (_RoundArgs, the cuStreamBatchMemOp array) and event
ring run unchanged; the callbacks queue each op to one "device" thread that executes them in order, as
a stream would. The round kernel is modelled in Python from its CUDA source's steps (stage, stamp,
gathered, park until released >= t, reply -> device buffer and mirror, consumed, counter). What this
cannot show (the kernel's own memory ordering, the real driver) is tests_gpu/cuda_probe.py's job."""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time

import numpy as np
import pytest

from draftrelay import cudabuild
from draftrelay.handoff import cuda_driver, cuda_kernels
from draftrelay.handoff import cuda_stream as cs
from draftrelay.handoff.region import Region, RegionConfig, W, pack_staging
from draftrelay.handoff.rounds import AsyncRounds, open_rounds
from draftrelay.round import RoundRequest
from draftrelay.testing import score_round
from test_cuda_stream_cpu import FakeDriver, cfg

WAIT_FN, ROUND_FN = 0x5151, 0x7171


def u32(addr: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(addr)


def geq(a: int, b: int) -> bool:
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


class SimDevice:
    """One in-order stream run by a thread. Ops are logged as they are enqueued."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.log: list[tuple] = []
        self.issued = self.done = 0
        self.events: dict[int, int] = {}
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, entry: tuple, fn, *args) -> None:
        self.issued += 1
        self.log.append(entry)
        self.q.put((fn, args, self.issued))

    def _run(self) -> None:
        while True:
            fn, args, ticket = self.q.get()
            if fn is None:
                return
            fn(*args)
            self.done = ticket

    def wait_until(self, addr: int, value: int) -> None:
        while not geq(u32(addr).value, value) and not self.stop:
            time.sleep(0)

    def sync(self, timeout_s: float = 5.0) -> None:
        end = time.monotonic() + timeout_s
        while self.done < self.issued and time.monotonic() < end:
            time.sleep(0.0005)

    def close(self) -> None:
        self.stop = True
        self.q.put((None, (), 0))
        self.thread.join(5)


class SimDriver(FakeDriver):
    """FakeDriver plus the fast path, modules and kernel launches, executed by a SimDevice."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        import enum

        self.dev = SimDevice()
        self.rounds: list[cuda_kernels.RoundArgs] = []  # the round kernel's parameter at each launch
        m, ok = self.module, (self.R.CUDA_SUCCESS,)
        m.cuGetProcAddress = self._proc
        m.cuModuleLoadData = lambda p: (self.R.CUDA_SUCCESS, 99)
        m.cuModuleGetFunction = lambda mod, name: (self.R.CUDA_SUCCESS,
                                                   ROUND_FN if name == b"draftrelay_round" else WAIT_FN)
        m.cuModuleUnload = lambda mod: ok
        m.CUstreamBatchMemOpType = enum.IntEnum("CUstreamBatchMemOpType", {
            "CU_STREAM_MEM_OP_WAIT_VALUE_32": 1, "CU_STREAM_MEM_OP_WRITE_VALUE_32": 2})
        d = self.dev

        def write(s, addr, v, f):
            d.submit(("write", addr, v), lambda: setattr(u32(addr), "value", v))
            return 0

        def wait(s, addr, v, f):
            d.submit(("wait", addr, v), d.wait_until, addr, v)
            return 0

        def copy(kind):
            def fn(dst, src, n, s):
                d.submit((kind, dst or 0, src or 0, n), ctypes.memmove, dst, src, n)
                return 0
            return fn

        def record(ev, s):
            d.events[ev] = d.issued
            d.log.append(("record",))
            return 0

        def query(ev):
            return 600 if self.stuck or d.done < d.events.get(ev, 0) else 0

        def launch(fn, gx, gy, gz, bx, by, bz, shmem, s, kp, extra):
            if fn == ROUND_FN:
                ptr = ctypes.c_void_p.from_address(kp).value  # kernelParams[0]: the struct, copied now
                size = ctypes.sizeof(cuda_kernels.RoundArgs)
                a = cuda_kernels.RoundArgs.from_buffer_copy(ctypes.string_at(ptr, size))
                self.rounds.append(a)
                d.submit(("round", a.t), self._round_kernel, a)
                return 0
            return 1  # the PTX wait kernel is not simulated

        def batch(s, count, params, flags):
            ops = []
            for i in range(count):
                base = params + i * cuda_driver.MEMOP_SIZE
                ops.append((u32(base).value, ctypes.c_uint64.from_address(base + cuda_driver.MEMOP_ADDR).value,
                            u32(base + cuda_driver.MEMOP_VALUE).value, u32(base + cuda_driver.MEMOP_FLAGS).value))
            d.submit(("batch", *ops), self._batch, ops)
            return 0

        impl = {"cuStreamWriteValue32": write, "cuStreamWaitValue32": wait, "cuMemcpyDtoHAsync": copy("d2h"),
                "cuMemcpyHtoDAsync": copy("h2d"), "cuEventRecord": record, "cuEventQuery": query,
                "cuLaunchKernel": launch}
        self._cbs = {name: ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(impl[name])
                     for name, argtypes in cuda_driver.FAST.items()}
        self._cbs["cuStreamBatchMemOp"] = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint,
                                                           ctypes.c_void_p, ctypes.c_uint)(batch)

    def _proc(self, name, version, flags):
        cb = self._cbs.get(name.decode())
        return (self.R.CUDA_SUCCESS, ctypes.cast(cb, ctypes.c_void_p).value if cb else 0, None)

    def _batch(self, ops) -> None:
        for op, addr, value, _ in ops:
            if op == 2:
                u32(addr).value = value
            elif op == 1:
                self.dev.wait_until(addr, value)

    def _round_kernel(self, a: cuda_kernels.RoundArgs) -> None:
        """The steps of draftrelay_round (handoff/round_kernel.cu), one after the other."""
        t = a.t or (u32(a.counter).value + 1) & 0xFFFFFFFF
        s = t & 1
        n = a.nbytes
        if a.tok_off and n >= a.tok_off + 16:  # the kernel's own condition
            n = min(n, a.tok_off + 4 * u32(a.src + 8).value)
        ctypes.memmove(a.staging[s], a.src, n)
        if a.stamp:
            u32(a.staging[s]).value = t
        u32(a.gathered).value = t
        self.dev.wait_until(a.released, t)
        reply = ctypes.string_at(a.reply[s], a.reply_bytes)
        ctypes.memmove(a.dev[s], reply, a.reply_bytes)
        ctypes.memmove(a.mirror[s], reply, a.reply_bytes)
        u32(a.consumed).value = t
        u32(a.counter).value = t


@pytest.fixture
def sim_cuda(monkeypatch, install_driver):
    """Install a SimDriver as cuda.bindings.driver; CPU torch plays the device (no pinning, no streams)."""
    import torch

    made: list[SimDriver] = []

    def install(**kw) -> SimDriver:
        sim = SimDriver(**kw)
        made.append(sim)
        install_driver(sim.module, "simulated GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: sim.dev.sync())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        for name in ("empty", "zeros"):
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, pin_memory=False, _real=real, **k: _real(*a, **k))
        monkeypatch.setattr(cudabuild, "nvrtc_cubin", lambda source, arch: np.zeros(16, np.uint8))
        return sim

    yield install
    for sim in made:
        sim.dev.close()


def test_the_round_kernel_path_stages_parks_and_mirrors_exactly(sim_cuda):
    sim = sim_cuda()
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    st = cs.CudaStream(region)
    try:
        assert st.info["round"] == "kernel" and st.info["wait"] == "auto" and st.info["batch_memops"]
        assert st.info["round_kernel"] == "draftrelay_round"
        assert [a.t for a in sim.rounds] == [1, 0, 3]  # the start-up check: given, from the counter, parked
        L = region.layout
        offs = tuple(L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED))
        dst = [st.new_reply_buffer() for _ in (0, 1)]
        req = RoundRequest(5, 1, 0, np.arange(7, dtype=np.int32), 3)
        for t in (1, 2, 3):
            s = t & 1
            region.reply_view(s)[:] = (np.arange(L.reply_size) + 7 * t) % 251  # what the proxy "published"
            ev = st.enqueue_round(s, t, pack_staging(L, t, [req]), dst[s], offs)
            time.sleep(0.01)
            assert not ev.query() and region.view(offs[0], 4).view(np.uint32)[0] == t  # gathered, parked
            a = sim.rounds[-1]
            assert a.t == t and a.src == st._bounce_dptr[s] and a.dev[s] == dst[s].dev_ptr
            assert a.mirror[s] == dst[s].mirror_dptr and a.staging[s] == region.base + L.staging(s)
            assert a.nbytes == L.staging_tok_off + 4 * 7  # only the used part of the slot is staged
            region.view(offs[1], 4).view(np.uint32)[0] = t  # release
            assert ev.wait(5.0)
            assert np.array_equal(st.host_bytes(dst[s]), region.reply_view(s))
            assert np.array_equal(dst[s].dev.numpy(), region.reply_view(s))
            assert region.view(offs[2], 4).view(np.uint32)[0] == t
            assert np.array_equal(region.staging_view(s)[:a.nbytes], pack_staging(L, t, [req])[:a.nbytes])
        assert int(st._counter.item()) == 3
        with pytest.raises(ValueError, match="slot"):
            st.enqueue_round(0, 5, pack_staging(L, 5, [req]), dst[0], offs)
    finally:
        region.view(L.word(W.RELEASED), 4).view(np.uint32)[0] = 1 << 20
        st.close()
        region.close()
    assert sim.registered == {}


def test_the_memop_path_is_one_batched_write_and_wait_between_the_copies(sim_cuda):
    sim = sim_cuda()
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    st = cs.CudaStream(region, wait="memop")
    try:
        assert st.info["round"] == "memops" and st.info["batch_memops"] and st._round_fn is None
        L, base = region.layout, region.base
        g, r, c = offs = tuple(L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED))
        dst = st.new_reply_buffer()
        req = RoundRequest(5, 1, 0, np.arange(3, dtype=np.int32), 3)
        n0 = len(sim.dev.log)
        region.view(r, 4).view(np.uint32)[0] = 1
        ev = st.enqueue_round(1, 1, pack_staging(L, 1, [req]), dst, offs)
        assert ev.wait(5.0)
        ops = [e for e in sim.dev.log[n0:] if e[0] != "record"]
        used = L.staging_tok_off + 4 * 3
        assert [e[0] for e in ops] == ["h2d", "d2h", "batch", "h2d", "d2h", "write"]
        assert ops[0][3] == used and ops[1][1] == base + L.staging(1) and ops[1][3] == used
        assert ops[2][1:] == ((2, base + g, 1, 0), (1, base + r, 1, 0))  # write gathered = 1, wait released >= 1
        assert ops[3][1:] == (dst.dev_ptr, base + L.reply(1), L.reply_size)
        assert ops[4][1:] == (dst.host_ptr, dst.dev_ptr, L.reply_size)
        assert ops[5][1:] == (base + c, 1)
    finally:
        st.close()
        region.close()
    st2 = None
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:  # batch=False: the previous build's separate write and wait
        st2 = cs.CudaStream(region, wait="memop", batch=False)
        assert st2.info["batch_memops"] is False
    finally:
        if st2 is not None:
            st2.close()
        region.close()


def test_auto_falls_back_to_memops_with_the_reason_and_kernel_refuses(sim_cuda, monkeypatch):
    sim = sim_cuda()

    def no_nvrtc(source, arch):
        raise RuntimeError("libnvrtc not found")

    monkeypatch.setattr(cudabuild, "nvrtc_cubin", no_nvrtc)
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        st = cs.CudaStream(region)
        assert st.info["round"] == "memops" and "libnvrtc not found" in st.info["round_kernel"]
        st.close()
        with pytest.raises(cs.CudaStreamRefused, match="wait='kernel'"):
            cs.CudaStream(region, wait="kernel")
        assert sim.registered == {}
        with pytest.raises(ValueError, match="expected one of"):
            cs.CudaStream(region, wait="polling")
    finally:
        region.close()


def test_a_round_kernel_that_fails_its_check_is_never_used(sim_cuda, monkeypatch):
    sim = sim_cuda()
    real = sim._round_kernel

    def skips_the_mirror(a):
        mirror = a.mirror[a.t & 1] if a.t else 0
        real(a)
        if mirror:
            ctypes.memset(mirror, 0, a.reply_bytes)

    monkeypatch.setattr(sim, "_round_kernel", skips_the_mirror)
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        st = cs.CudaStream(region)
        assert st.info["round"] == "memops" and "mirror wrong" in st.info["round_kernel"]
        assert len(sim.rounds) == 3 and st._round_fn is None  # checked once, never used
        st.close()
        assert sim.registered == {}
    finally:
        region.close()


@pytest.mark.parametrize("wait", ["auto", "memop"])
def test_faulted_rounds_through_the_real_proxy_on_the_simulated_stream(sim_cuda, monkeypatch, wait):
    sim_cuda()
    monkeypatch.setenv("DRAFTRELAY_CUDA_WAIT", wait)
    faults = dict(seed=3, p_exception=0.05, p_bad_reply=0.05, p_corrupt=0.05, p_delay=0.02, delay_ms=40)
    r = open_rounds(cfg(backend="cuda", strict=True, round_spec={"kind": "builtin", "faults": faults}))
    assert isinstance(r, AsyncRounds)
    try:
        assert r.stream.info["round"] == ("kernel" if wait == "auto" else "memops")
        rng = np.random.default_rng(9)
        exact = wrong = 0
        for i in range(150):
            reqs = [RoundRequest(j, 1, 3 * i, rng.integers(0, 5000, int(rng.integers(0, 9))).astype(np.int32),
                                 int(rng.integers(0, 6))) for j in range(int(rng.integers(1, 5)))]
            e, w = score_round(reqs, r.result(r.submit(reqs), timeout_s=10), 5000)
            exact, wrong = exact + e, wrong + w
        st = r.stats()
    finally:
        r.close()
    assert wrong == 0 and exact > 100 and st["rounds"] == 150
    assert st["ok"] > 100 and st["failed"] > 0  # the faults happened and were refused, not believed


def test_handoff_config_cuda_wait_reaches_the_stream(sim_cuda):
    """HandoffConfig.cuda_wait picks the parked stream's wait (memop for a worker on the engine's own
    GPU); a bad value is named."""
    from draftrelay.handoff.rounds import HandoffConfig, make_stream

    sim_cuda()
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        st = make_stream(HandoffConfig(backend="cuda", cuda_wait="memop"), region)
        assert st.wait_mode == "memop" and st.info["round"] == "memops" and st._round_fn is None
        st.close()
        with pytest.raises(ValueError, match="'spin'"):
            make_stream(HandoffConfig(backend="cuda", cuda_wait="spin"), region)
    finally:
        region.close()
