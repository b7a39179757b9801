"""The CUDA backend's two kernels, loaded and checked at start-up (never first used while parked).

* The round kernel (round_kernel.cu; compiled once per process with NVRTC by draftrelay.cudabuild):
  one launch runs a whole round (stage, gathered, park until released, reply to the device buffer and
  its mirror, consumed). `load_round_kernel` builds and loads it, then `check_round_kernel` runs it on a
  scratch area (three rounds, one parked until the host releases it) and checks every word and byte it
  must move: a kernel that fails here is never used.
* The polling wait kernel (PTX below, `wait="kernel"`): one thread spins until (int32)(*addr - value)
  >= 0, like cuStreamWaitValue32's GEQ; ld.acquire.sys orders the copy of the reply (next on the
  stream) after the observed release. Launched once on a satisfied word at start.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from draftrelay import cudabuild

from .cuda_driver import CudaStreamRefused, err_name
from .region import W
from .stream import Event, StreamStuck

if TYPE_CHECKING:
    from .cuda_stream import CudaStream

ROUND_SOURCE = Path(__file__).resolve().parent / "round_kernel.cu"
ROUND_THREADS = 256  # one block: 4 KB of reply or staging per pass
_PAGE = mmap.PAGESIZE

WAIT_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry draftrelay_wait_geq32(.param .u64 p_addr, .param .u32 p_value)
{
    .reg .pred %p;
    .reg .b32 %v, %x, %d;
    .reg .b64 %a;
    ld.param.u64 %a, [p_addr];
    ld.param.u32 %v, [p_value];
POLL:
    ld.acquire.sys.u32 %x, [%a];
    sub.s32 %d, %x, %v;
    setp.lt.s32 %p, %d, 0;
    @%p bra POLL;
    ret;
}
"""


class RoundArgs(ctypes.Structure):
    """The round kernel's parameter, passed by value (its C twin is RoundArgs in round_kernel.cu, whose
    static_assert pins the same 128 bytes)."""

    _fields_ = [("src", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("staging", ctypes.c_uint64 * 2),
                ("reply", ctypes.c_uint64 * 2), ("dev", ctypes.c_uint64 * 2), ("mirror", ctypes.c_uint64 * 2),
                ("gathered", ctypes.c_uint64), ("released", ctypes.c_uint64), ("consumed", ctypes.c_uint64),
                ("counter", ctypes.c_uint64), ("reply_bytes", ctypes.c_uint32), ("tok_off", ctypes.c_uint32),
                ("t", ctypes.c_uint32), ("stamp", ctypes.c_uint32)]


assert ctypes.sizeof(RoundArgs) == 128


def round_source() -> str:
    return ROUND_SOURCE.read_text()


# -- the polling wait kernel ----------------------------------------------------------------------------
def load_wait_kernel(st: CudaStream) -> None:
    """JIT the polling kernel and launch it once on a satisfied word (no first use while parked)."""
    drv = st._drv
    st._ptx = np.frombuffer(WAIT_PTX + b"\0", dtype=np.uint8).copy()
    err, mod = drv.cuModuleLoadData(st._ptx.ctypes.data)[:2]
    if err:
        raise CudaStreamRefused(f"wait='kernel': cuModuleLoadData of the wait kernel failed: {err_name(drv, err)}")
    st._wait_mod = mod
    st._wait_fn = int(st._call("cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"draftrelay_wait_geq32")))
    # Launch arguments live in fixed buffers: cuLaunchKernel copies them at the call.
    st._kp_addr, st._kp_val = ctypes.c_uint64(0), ctypes.c_uint32(0)
    st._kp = (ctypes.c_void_p * 2)(ctypes.addressof(st._kp_addr), ctypes.addressof(st._kp_val))
    # the bindings (no fast path) take kernelParams as ((values), (ctypes types)) instead
    st._kp_arg = ctypes.addressof(st._kp) if st.info.get("fast_calls") else None
    released = st._dbase + st.region.layout.word(W.RELEASED)  # 0 >= 0: returns at once
    ok = launch_wait(st, released, 0) == 0 and st.record().wait(5.0)
    if not ok:
        raise CudaStreamRefused("wait='kernel': the wait kernel did not complete on a satisfied word")


def launch_wait(st: CudaStream, addr: int, value: int) -> int:
    if st._kp_arg is None:
        return int(st._drv.cuLaunchKernel(st._wait_fn, 1, 1, 1, 1, 1, 1, 0, st._s,
                                          ((addr, value), (ctypes.c_uint64, ctypes.c_uint32)), 0)[0])
    st._kp_addr.value = addr
    st._kp_val.value = value
    return st._launch(st._wait_fn, 1, 1, 1, 1, 1, 1, 0, st._s, st._kp_arg, None)


# -- the round kernel -------------------------------------------------------------------------------
def load_round_kernel(st: CudaStream) -> None:
    """Compile and load the round kernel, fill the stream's launch parameter, then check it."""
    if not st.info.get("fast_calls"):
        raise RuntimeError("the round kernel is launched through the ctypes fast path, which is off")
    torch, drv = st._torch, st._drv
    st._round_cubin = cudabuild.nvrtc_cubin(round_source(), torch.cuda.get_device_capability(st.device))
    err, mod = drv.cuModuleLoadData(st._round_cubin.ctypes.data)[:2]
    if err:
        raise RuntimeError(f"cuModuleLoadData of the round kernel failed: {err_name(drv, err)}")
    st._round_mod = mod
    st._counter = torch.zeros(1, dtype=torch.int32, device=st.device)
    st._bounce_dptr = [st._host_dptr(b.data_ptr()) for b in st._bounce]
    L, base = st.region.layout, st._dbase
    a = st._args = RoundArgs()
    a.staging[0], a.staging[1] = (base + L.staging(s) for s in (0, 1))
    a.reply[0], a.reply[1] = (base + L.reply(s) for s in (0, 1))
    a.gathered, a.released, a.consumed = (base + L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED))
    a.counter = st._counter.data_ptr()
    a.reply_bytes, a.tok_off, a.stamp = st._reply_size, st._tok_off, 0
    st._args_kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))
    st._args_kp_ptr = ctypes.addressof(st._args_kp)
    st._round_words = (L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED))
    fn = int(st._call("cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"draftrelay_round")))
    check_round_kernel(st, fn)
    st._round_fn = fn
    st.info["round_kernel"] = "draftrelay_round"


def check_round_kernel(st: CudaStream, fn: int) -> None:
    """Three rounds on a registered scratch area: t = 1 given (slot 1, released beforehand), t = 2 from
    the device counter (slot 0), t = 3 given and parked until the host releases it. Every hand-off word,
    the stamp, the staged bytes, the mirror, the device buffer and the counter must be right."""
    torch, drv = st._torch, st._drv
    scratch = mmap.mmap(-1, 2 * _PAGE)
    u8 = np.frombuffer(scratch, dtype=np.uint8)
    w32 = u8[:256].view(np.uint32)  # gathered @0, released @64, consumed @128 (bytes)
    base = int(u8.ctypes.data)
    err = drv.cuMemHostRegister(base, 2 * _PAGE, st._reg_flags)[0]
    if err:
        raise RuntimeError(f"cuMemHostRegister of the round kernel's scratch failed: {err_name(drv, err)}")
    st._registered.append(base)
    try:
        rng = np.random.default_rng(11)
        stg, rep, nrep = (1024, 2048), (4096, 5120), 1024
        src_np = rng.integers(0, 256, (3, 1008), dtype=np.uint8)  # 1000 bytes a round: 16-byte loop + tail
        src = torch.from_numpy(src_np).to(st.device)
        bufs = [st.new_reply_buffer(nrep) for _ in (0, 1)]
        torch.cuda.synchronize(st.device)
        a = RoundArgs()
        a.nbytes = 1000
        a.staging[0], a.staging[1] = base + stg[0], base + stg[1]
        a.reply[0], a.reply[1] = base + rep[0], base + rep[1]
        a.dev[0], a.dev[1] = bufs[0].dev_ptr, bufs[1].dev_ptr
        a.mirror[0], a.mirror[1] = bufs[0].mirror_dptr, bufs[1].mirror_dptr
        a.gathered, a.released, a.consumed, a.counter = base, base + 64, base + 128, st._counter.data_ptr()
        a.reply_bytes, a.tok_off, a.stamp = nrep, 0, 1
        kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))

        def launch(t: int, given: bool) -> Event:
            a.t = t if given else 0
            a.src = src[t - 1].data_ptr()
            e = st._launch(fn, 1, 1, 1, ROUND_THREADS, 1, 1, 0, st._s, ctypes.addressof(kp), None)
            if e:
                st._fail("cuLaunchKernel(draftrelay_round)", e)
            return st.record()

        problems = []
        for t, given in ((1, True), (2, False), (3, True)):
            s = t & 1
            parked = t == 3
            u8[rep[s]:rep[s] + nrep] = rng.integers(0, 256, nrep, dtype=np.uint8)  # a fresh reply
            if not parked:
                w32[16] = t  # released
            ev = launch(t, given)
            if parked:
                time.sleep(0.005)
                if ev.query() or w32[32] == t or w32[0] != t:
                    problems.append(f"t={t}: not parked (done={ev.query()}, gathered={w32[0]}, "
                                    f"consumed={w32[32]})")
                w32[16] = t
            if not ev.wait(5.0):
                raise StreamStuck(f"the round kernel's check (round {t}) did not finish in 5 s")
            torch.cuda.synchronize(st.device)
            got = u8[stg[s]:stg[s] + 1000]
            want_rep = u8[rep[s]:rep[s] + nrep]
            checks = {"gathered": w32[0] == t, "consumed": w32[32] == t, "stamp": got[:4].view(np.uint32)[0] == t,
                      "staging": np.array_equal(got[4:], src_np[t - 1, 4:1000]),
                      "mirror": np.array_equal(bufs[s].host_np, want_rep),
                      "device buffer": np.array_equal(bufs[s].dev.cpu().numpy(), want_rep),
                      "counter": int(st._counter.item()) == t}
            problems += [f"t={t}: {k} wrong" for k, ok in checks.items() if not ok]
        with torch.cuda.stream(st.torch_stream):
            st._counter.zero_()  # graph replays after start begin at round 1
        if not st.drain(5.0):
            raise StreamStuck("the round kernel's check did not drain")
        if problems:
            raise RuntimeError("the round kernel failed its start-up check: " + "; ".join(problems))
    finally:
        if st.drain(5.0):  # never unregister what the device may still touch
            st._unregister(base)
            got = want_rep = w32 = u8 = None  # noqa: F841  (drop the views before closing the mapping)
            scratch.close()
