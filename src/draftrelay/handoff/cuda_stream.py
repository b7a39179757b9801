"""The CUDA backend of the engine-side stream ops: a real GPU stream parks on the host flag.

The shared memfd region (region.py) is registered with the driver (cuMemHostRegister, DEVICEMAP |
PORTABLE), so the GPU reads and writes the hand-off words, staging and replies in place. A round
(`enqueue_round`, what AsyncRounds.submit calls) is enqueued on the engine's torch stream in one of two
ways; the protocol (docs/ORDERING.md) is the same and the proxy never calls CUDA in either.

**Round kernel** (`wait="auto"`, the default, where it compiles and passes its start-up check; or
`"kernel"`): ONE launch of a one-block kernel (CUDA C below, compiled at start with NVRTC from the
bindings, launched on a scratch area at start so it is never a first-use kernel while parked):

    copy the rows (device memory, or the pinned bounce for host bytes) -> staging[s]; fence (system)
    gathered = t (release store); thread 0 polls released >= t with acquire loads (GEQ, wrapping)
    reply[s] (claim word included) -> the device reply buffer AND its pinned host mirror, written from
    the same registers, so decode_reply reads exactly the bytes the device got; consumed = t

then an event record: ~2 driver calls per round instead of 7. The round number is a launch parameter,
or 0 = "the device counter's last round + 1" (`enqueue_round_from_counter`): a CUDA graph that captured
such a launch replays round after round with no parameter update. While parked it keeps one block of
one SM spinning on a host-memory load (the price of the faster wake-up: the memop wait below uses no SM).

**Memops** (`wait="memop"`, or where the kernel is unavailable: no NVRTC, no ctypes fast path):
D2H rows -> staging[s]; one cuStreamBatchMemOp [write gathered = t (after a memory barrier), wait
released >= t (GEQ)]; H2D reply[s] -> device buffer, D2H of that buffer -> the pinned host mirror (the
mirror is what decode_reply reads: exactly the bytes the device got, never the live slot a late proxy may
still write); write consumed = t; event record (on a ring of reusable events).

The single ops (copy_in, write32, wait_geq32, copy_out; stream.py) stay available for tests, probes and
graph capture; with `wait="kernel"` wait_geq32 launches a one-thread polling kernel (PTX below) instead
of cuStreamWaitValue32. Per-round driver functions are called through the pointers cuGetProcAddress
returns (legacy-stream variants, CUDA 12.0 ABI) via ctypes, which drops the GIL for each call (`fast`).
The engine thread only enqueues; nothing here waits on the stream except `drain` (bounded, by event
queries) and `preload` (before any round is armed). The driver bindings (`cuda-bindings`, the `gpu`
extra) are imported only in this module, only when this backend is chosen. Figures:
docs/CUDA_BACKEND.md, benchmarks/results/handoff_cuda.json.

Refusal. The constructor raises CudaStreamRefused, leaving nothing registered, when: the bindings or
a CUDA device are missing; the device cannot use host pointers for registered memory
(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM == 0); the device is not on unified
addressing; registering the region fails; a functional probe of stream memory operations on a
registered scratch page fails (e.g. CUDA_ERROR_NOT_SUPPORTED; the deprecated attribute
CAN_USE_STREAM_MEM_OPS_V1 reads 0 on an H200 under CUDA 13 although memops work, so it is only
recorded); or `wait="kernel"` was asked for and the round kernel cannot be built or fails its check
(under "auto" that only falls back to memops, with the reason in `info["round_kernel"]`). open_rounds
turns a refusal into sync rounds with the reason, or AsyncRefused under strict.

Never free what a parked stream may still use: `close` drains first (event queries, bounded) and, if the
stream will not drain, raises StreamStuck and keeps the region registered (the caller must then keep it
mapped too; rounds.AsyncRounds.close does).

Use a non-default stream for the engine: a parked *legacy default* stream also holds up every blocking
stream of the context.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .region import Region, W
from .stream import Event, StreamOps, StreamStuck


class CudaStreamRefused(RuntimeError):
    """The CUDA backend cannot run here; the message says why. Nothing is left registered."""


class CudaError(RuntimeError):
    """A driver call failed after start-up (an enqueue error: the engine should stop using async)."""


_PAGE = mmap.PAGESIZE
_c = ctypes
# The polling wait kernel: one thread spins until (int32)(*addr - value) >= 0, like cuStreamWaitValue32's
# GEQ. ld.acquire.sys orders the copy of the reply (next on the stream) after the observed release.
_WAIT_PTX = b"""
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
# The hot driver functions and their C signatures (cuda.h, CUDA 12.0 ABI): CUresult is an int,
# CUstream/CUevent are pointers, CUdeviceptr is a 64-bit integer.
_FAST = {
    "cuStreamWriteValue32": (_c.c_void_p, _c.c_uint64, _c.c_uint32, _c.c_uint),
    "cuStreamWaitValue32": (_c.c_void_p, _c.c_uint64, _c.c_uint32, _c.c_uint),
    "cuMemcpyDtoHAsync": (_c.c_void_p, _c.c_uint64, _c.c_size_t, _c.c_void_p),
    "cuMemcpyHtoDAsync": (_c.c_uint64, _c.c_void_p, _c.c_size_t, _c.c_void_p),
    "cuEventRecord": (_c.c_void_p, _c.c_void_p),
    "cuEventQuery": (_c.c_void_p,),
    "cuLaunchKernel": (_c.c_void_p, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint,
                       _c.c_void_p, _c.c_void_p, _c.c_void_p),
}
WAIT_MODES = ("auto", "kernel", "memop")
_EVENT_RING = 64  # reusable events; a ring slot is re-recorded only 64 records later (see _CudaEvent)
_ROUND_THREADS = 256  # one block: 4 KB of reply or staging per pass

# The round kernel (see the module docstring). Ordering: every thread fences its staging stores at
# system scope before the block barrier, thread 0 then stores `gathered` with release semantics; thread 0
# polls `released` with acquire loads and the block barrier orders every thread's reply loads after it
# (the same "one thread acquires, bar.sync, all read" pattern as NCCL's); host memory is read with
# .relaxed.sys loads, which are never served from a stale cached line; `consumed` is stored once every
# reply load has returned. The host reads the mirror only after the round's event, i.e. after the kernel
# finished and all its stores are visible.
_ROUND_CU = r"""// One hand-off round as one kernel, one block (draftrelay/handoff/cuda_stream.py; docs/ORDERING.md).
typedef unsigned int u32;
typedef unsigned long long u64;

struct RoundArgs {
    const unsigned char* src;         // rows + descriptor: device memory or mapped pinned host memory
    u64 nbytes;                       // bytes of src to stage (at most a staging slot)
    unsigned char* staging[2];        // staging[slot] in the registered region
    const unsigned char* reply[2];    // reply[slot] in the registered region (claim word first)
    unsigned char* dev[2];            // the engine's device reply buffers
    unsigned char* mirror[2];         // their pinned host mirrors (what decode_reply reads)
    u32* gathered;
    u32* released;
    u32* consumed;
    u32* counter;                     // device memory: the last round this kernel ran
    u32 reply_bytes;                  // a multiple of 16
    u32 tok_off;                      // staging offset of the tokens: stage only the used part; 0 = all
    u32 t;                            // the round; 0 = *counter + 1 (graph replays)
    u32 stamp;                        // 1: write t into the descriptor's round field
};

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed_sys(const void* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld16(const void* p) {  // coherent at system scope: never a stale cached line
    uint4 v;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// dst[0, n) = src[0, n), 16 bytes a thread at a time, four loads in flight before their stores
// (a load from host memory is a bus round trip: one per thread, not one per vector).
__device__ __forceinline__ void copy_block(unsigned char* dst, const unsigned char* src, u64 n) {
    const u64 tid = threadIdx.x, nth = blockDim.x;
    if ((((u64)dst | (u64)src) & 15) == 0) {
        const u64 nv = n >> 4;
        u64 i = tid;
        for (; i + 3 * nth < nv; i += 4 * nth) {
            uint4 a = ld16(src + 16 * i), b = ld16(src + 16 * (i + nth));
            uint4 c = ld16(src + 16 * (i + 2 * nth)), d = ld16(src + 16 * (i + 3 * nth));
            *(uint4*)(dst + 16 * i) = a;
            *(uint4*)(dst + 16 * (i + nth)) = b;
            *(uint4*)(dst + 16 * (i + 2 * nth)) = c;
            *(uint4*)(dst + 16 * (i + 3 * nth)) = d;
        }
        for (; i < nv; i += nth) *(uint4*)(dst + 16 * i) = ld16(src + 16 * i);
        for (i = 16 * nv + tid; i < n; i += nth) dst[i] = src[i];
    } else {
        for (u64 i = tid; i < n; i += nth) dst[i] = src[i];
    }
}

extern "C" __global__ void __launch_bounds__(256) draftrelay_round(const RoundArgs a) {
    const u32 t = a.t ? a.t : *(volatile u32*)a.counter + 1u;
    const u32 s = t & 1u;
    unsigned char* stg = s ? a.staging[1] : a.staging[0];  // (a select, not an index: no local-memory copy of a)
    // 1. stage the rows (only the used part when the descriptor says how many tokens there are)
    u64 n = a.nbytes;
    if (a.tok_off && n >= a.tok_off + 16ull) {
        const u64 used = (u64)a.tok_off + 4ull * ld_relaxed_sys(a.src + 8);  // descriptor: round, n_req, n_tok
        if (used < n) n = used;
    }
    copy_block(stg, a.src, n);
    __threadfence_system();  // every thread's staging stores are visible to the host ...
    __syncthreads();         // ... before thread 0 goes on
    if (threadIdx.x == 0) {
        if (a.stamp) *(volatile u32*)stg = t;  // the descriptor names round t (graphs: t comes from the counter)
        __threadfence_system();
        st_release_sys(a.gathered, t);  // 2. gathered = t
        while ((int)(ld_acquire_sys(a.released) - t) < 0) {  // 3. park until released >= t (GEQ, wrapping)
        }
    }
    __syncthreads();  // the acquire above orders every thread's reply loads after the release
    // 4. reply[s] (claim word included) -> device buffer and host mirror, from the same registers
    const unsigned char* rep = s ? a.reply[1] : a.reply[0];
    unsigned char* dev = s ? a.dev[1] : a.dev[0];
    unsigned char* mir = s ? a.mirror[1] : a.mirror[0];
    for (u32 i = threadIdx.x; i < a.reply_bytes / 16u; i += blockDim.x) {
        const uint4 v = ld16(rep + 16u * i);
        *(uint4*)(dev + 16u * i) = v;
        *(uint4*)(mir + 16u * i) = v;
    }
    __syncthreads();  // every reply load has returned: the slot may be reused
    if (threadIdx.x == 0) {
        st_relaxed_sys(a.consumed, t);  // 5. consumed = t
        *a.counter = t;
    }
}
"""

_CUBINS: dict = {}  # (source, arch) -> cubin: NVRTC runs once per process, not once per stream


def compile_cuda(source: str, arch: tuple[int, int]) -> np.ndarray:
    """Compile CUDA C to a cubin for sm_<arch> with NVRTC (from cuda-bindings; needs libnvrtc, which
    torch's CUDA wheels bring). Raises on any failure, with NVRTC's log."""
    key = (source, tuple(arch))
    if key in _CUBINS:
        return _CUBINS[key]
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"draftrelay.cu", 0, [], [])
    if err:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    try:
        opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), b"-std=c++17"]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC {err}: {log.decode(errors='replace').strip()}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    _CUBINS[key] = np.frombuffer(cubin, dtype=np.uint8).copy()
    return _CUBINS[key]


class _RoundArgs(ctypes.Structure):
    """The round kernel's parameter, passed by value (its C twin is RoundArgs in _ROUND_CU)."""

    _fields_ = [("src", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("staging", ctypes.c_uint64 * 2),
                ("reply", ctypes.c_uint64 * 2), ("dev", ctypes.c_uint64 * 2), ("mirror", ctypes.c_uint64 * 2),
                ("gathered", ctypes.c_uint64), ("released", ctypes.c_uint64), ("consumed", ctypes.c_uint64),
                ("counter", ctypes.c_uint64), ("reply_bytes", ctypes.c_uint32), ("tok_off", ctypes.c_uint32),
                ("t", ctypes.c_uint32), ("stamp", ctypes.c_uint32)]


# cuStreamBatchMemOp's parameter: a 48-byte union per op; for WRITE_VALUE_32 / WAIT_VALUE_32 the
# operation is at offset 0, the address at 8, the 32-bit value at 16, the flags at 24 (cuda.h).
_MEMOP_SIZE, _MEMOP_ADDR, _MEMOP_VALUE, _MEMOP_FLAGS = 48, 8, 16, 24


def _import_driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaStreamRefused(
            f"cuda-bindings is not installed ({exc}); install the gpu extra: pip install 'draftrelay[gpu]'"
        ) from None
    return driver


def _err_name(drv, err) -> str:
    try:
        r = drv.cuGetErrorName(drv.CUresult(int(err)))
        return r[1].decode() if not r[0] and r[1] else str(err)
    except Exception:
        return str(err)


class _CudaEvent(Event):
    """One recorded point of the stream. Events come from a ring and are re-recorded later; since a
    re-record is always later on the same stream, a stale wrapper can only answer "not yet" for
    longer, never "done" too early."""

    __slots__ = ("_done", "_ev", "_owner")

    def __init__(self, ev, owner: CudaStream) -> None:
        self._ev = ev
        self._owner = owner
        self._done = False

    def query(self) -> bool:
        # once done, always done: this record's point was passed (a later re-record has its own wrapper),
        # so asking again (the bounce buffer's reuse check after the round was collected) costs no call
        if not self._done:
            self._done = self._owner._query(self._ev)
        return self._done

    def wait(self, timeout_s: float | None = None) -> bool:
        # Poll, never cuEventSynchronize: a parked stream must not be able to hang the caller for ever.
        if self.query():
            return True
        start = time.perf_counter()
        end = None if timeout_s is None else start + timeout_s
        spin_end = start + 200e-6
        while True:
            if self.query():
                return True
            now = time.perf_counter()
            if end is not None and now >= end:
                return False
            if now >= spin_end:
                time.sleep(50e-6)


class CudaReplyBuffer:
    """The engine's reply buffer: `dev` (uint8 on the GPU; what the engine's kernels read) and its
    pinned host mirror `host` (filled on the stream with the same bytes as `dev`; what decode_reply
    reads). `mirror_dptr`: the mirror's device address (the round kernel writes it directly)."""

    def __init__(self, torch, nbytes: int, device, host_dptr=None) -> None:
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.nbytes = nbytes
        self.dev_ptr = self.dev.data_ptr()
        self.host_ptr = self.host.data_ptr()
        self.mirror_dptr = host_dptr(self.host_ptr) if host_dptr is not None else self.host_ptr


class CudaStream(StreamOps):
    """Stream ops on a torch CUDA stream through the driver API (see module docstring).

    `stream`: a torch.cuda.Stream (default: torch.cuda.current_stream() at construction).
    `drain_timeout_s`: the bound `close` waits for the stream before declaring it stuck.
    """

    name = "cuda"

    def __init__(self, region: Region, stream: Any = None, *, drain_timeout_s: float = 5.0,
                 fast: bool = True, wait: str | None = None, batch: bool = True) -> None:
        super().__init__(region)
        self.drain_timeout_s = drain_timeout_s
        self.fast = fast
        self.wait_mode = wait or os.environ.get("DRAFTRELAY_CUDA_WAIT", "auto")
        if self.wait_mode not in WAIT_MODES:
            raise ValueError(f"CudaStream wait={self.wait_mode!r}: expected one of {', '.join(WAIT_MODES)}")
        self.batch = batch
        self._registered: list[int] = []  # host addresses currently registered by us
        self._scratch: mmap.mmap | None = None
        self._events: list = []
        self._round_fn = None  # the round kernel, once loaded and checked
        self._round_mod = self._wait_mod = None
        self._bm = None  # the batched [write gathered, wait released] memop parameters (fast path)
        self._closed = False
        self.stuck = False
        self.info: dict = {}
        try:
            self._start(stream)
        except BaseException as exc:
            try:
                self._teardown()
            except StreamStuck:
                raise
            except Exception as cleanup_exc:  # keep the first reason, say the cleanup failed too
                raise CudaStreamRefused(f"{exc} (cleanup failed: {cleanup_exc})") from exc
            if isinstance(exc, (CudaStreamRefused, StreamStuck)) or not isinstance(exc, Exception):
                raise
            raise CudaStreamRefused(f"{type(exc).__name__}: {exc}") from exc

    # -- start-up -----------------------------------------------------------------------------------
    def _call(self, what: str, res):
        """Unpack a driver result tuple; raise CudaError naming the call on failure."""
        err = res[0]
        if err:
            raise CudaError(f"{what} failed: {_err_name(self._drv, err)}")
        return res[1] if len(res) == 2 else res[1:]

    def _start(self, stream: Any) -> None:
        drv = self._drv = _import_driver()
        try:
            import torch
        except ImportError as exc:
            raise CudaStreamRefused(f"torch is not importable: {exc}") from None
        if not torch.cuda.is_available():
            raise CudaStreamRefused("torch sees no CUDA device (torch.cuda.is_available() is False)")
        self._torch = torch
        ts = stream if stream is not None else torch.cuda.current_stream()
        self.torch_stream = ts
        self.device = ts.device
        torch.zeros(1, device=self.device)  # make torch create the primary context, current on this thread
        try:
            err = drv.cuInit(0)[0]
        except Exception as exc:  # the bindings could not load libcuda
            raise CudaStreamRefused(f"the CUDA driver library could not be loaded: {exc}") from None
        if err:
            raise CudaStreamRefused(f"cuInit failed: {_err_name(drv, err)}")
        self._ctx = self._call("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        if not int(self._ctx):
            raise CudaStreamRefused("no CUDA context is current on the engine thread")
        dev = self._call("cuCtxGetDevice", drv.cuCtxGetDevice())
        A = drv.CUdevice_attribute

        def attr(name: str) -> int | None:
            a = getattr(A, name, None)
            if a is None:
                return None
            r = drv.cuDeviceGetAttribute(a, dev)
            return None if r[0] else int(r[1])

        host_ptr = attr("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM")
        uva = attr("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING")
        self.info = {
            "device": torch.cuda.get_device_name(self.device),
            "driver_version": self._call("cuDriverGetVersion", drv.cuDriverGetVersion()),
            "can_use_host_pointer_for_registered_mem": host_ptr,
            "unified_addressing": uva,
            "can_use_stream_mem_ops_v1": attr("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1"),
            "can_use_64_bit_stream_mem_ops": attr("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"),
            "stream": int(ts.cuda_stream),
        }
        if host_ptr != 1:
            raise CudaStreamRefused(
                f"device cannot use host pointers for registered memory "
                f"(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM={host_ptr}); stream memops on the region are unsafe")
        if uva != 1:
            raise CudaStreamRefused(f"device is not on unified addressing (UNIFIED_ADDRESSING={uva})")

        self.cu_stream = drv.CUstream(int(ts.cuda_stream))
        self._s = int(ts.cuda_stream)
        self._SUCCESS = int(drv.CUresult.CUDA_SUCCESS)
        self._NOT_READY = int(drv.CUresult.CUDA_ERROR_NOT_READY)
        self._bind_calls(fast=self.fast)
        self._GEQ = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self._WDEFAULT = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        flags = int(drv.CU_MEMHOSTREGISTER_DEVICEMAP) | int(drv.CU_MEMHOSTREGISTER_PORTABLE)
        self._reg_flags = flags

        for _ in range(_EVENT_RING):
            ev = self._call("cuEventCreate", drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
            self._events.append(ev)
        self._ev_h = [int(ev) for ev in self._events]
        self._ev_i = 0

        self._probe_memops()

        # Register the region. The mapping is page-aligned and whole pages are mapped, so round up.
        size = (self.region.size + _PAGE - 1) // _PAGE * _PAGE
        err = drv.cuMemHostRegister(self.region.base, size, flags)[0]
        if err:
            raise CudaStreamRefused(f"cuMemHostRegister of the region ({size} bytes) failed: {_err_name(drv, err)}")
        self._registered.append(self.region.base)
        dbase = int(self._call("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(self.region.base, 0)))
        if dbase != self.region.base:
            raise CudaStreamRefused(f"registered region's device pointer {dbase:#x} differs from its host "
                                    f"address {self.region.base:#x} although host pointers are usable")
        self._dbase = dbase
        L = self.region.layout
        self._staging_h = [self.region.base + L.staging(s) for s in (0, 1)]
        self._reply_h = [self.region.base + L.reply(s) for s in (0, 1)]
        self._staging_size = L.staging_size
        self._reply_size = L.reply_size
        # Host-side sources (self-test, tests) go pinned bounce -> device -> staging: a host-to-host
        # async copy would be synchronous with the host, i.e. block the engine until the release.
        self._bounce = [torch.empty(L.staging_size, dtype=torch.uint8, pin_memory=True) for _ in (0, 1)]
        self._bounce_np = [b.numpy() for b in self._bounce]
        self._bounce_dev = [torch.empty(L.staging_size, dtype=torch.uint8, device=self.device) for _ in (0, 1)]
        self._bounce_ev: list[_CudaEvent | None] = [None, None]
        self._tok_off = L.staging_tok_off
        self.info["wait"] = self.wait_mode
        if self.wait_mode == "kernel":
            self._load_wait_kernel()
        self.info["round"] = "memops"
        if self.wait_mode in ("auto", "kernel"):
            try:
                self._load_round_kernel()
                self.info["round"] = "kernel"
            except StreamStuck:
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                if self.wait_mode == "kernel":
                    raise CudaStreamRefused(f"wait='kernel': the round kernel is unavailable ({why})") from exc
                self.info["round_kernel"] = f"unavailable, rounds use memops ({why})"
        self.info["batch_memops"] = self._bm is not None

    def _bind_calls(self, fast: bool) -> None:
        """The per-round driver calls, each taking plain ints and returning the CUresult as an int."""
        drv = self._drv
        self.info["fast_calls"] = False
        self._batch_fn = None
        if fast:
            flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
            fns = {}
            for name, argtypes in _FAST.items():
                r = drv.cuGetProcAddress(name.encode(), 12000, flags)
                if r[0] or not r[1]:
                    fns = {}
                    break
                fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(r[1]))
            if fns:
                r = drv.cuGetProcAddress(b"cuStreamBatchMemOp", 12000, flags)
                if not r[0] and r[1]:
                    self._batch_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p,
                                                      ctypes.c_uint)(int(r[1]))
                self._launch = fns["cuLaunchKernel"]
                self._write, self._wait = fns["cuStreamWriteValue32"], fns["cuStreamWaitValue32"]
                self._d2h, self._h2d = fns["cuMemcpyDtoHAsync"], fns["cuMemcpyHtoDAsync"]
                self._rec, self._qry = fns["cuEventRecord"], fns["cuEventQuery"]
                self.info["fast_calls"] = True
                return

        def wrap(fn):
            return lambda *a: int(fn(*a)[0])

        self._write, self._wait = wrap(drv.cuStreamWriteValue32), wrap(drv.cuStreamWaitValue32)
        self._launch = wrap(drv.cuLaunchKernel)
        self._d2h, self._h2d = wrap(drv.cuMemcpyDtoHAsync), wrap(drv.cuMemcpyHtoDAsync)
        self._rec, self._qry = wrap(drv.cuEventRecord), wrap(drv.cuEventQuery)

    def _load_wait_kernel(self) -> None:
        """JIT the polling kernel and launch it once on a satisfied word (no first use while parked)."""
        drv = self._drv
        self._ptx = np.frombuffer(_WAIT_PTX + b"\0", dtype=np.uint8).copy()
        err, mod = drv.cuModuleLoadData(self._ptx.ctypes.data)[:2]
        if err:
            raise CudaStreamRefused(f"wait='kernel': cuModuleLoadData of the wait kernel failed: {_err_name(drv, err)}")
        self._wait_mod = mod
        self._wait_fn = int(self._call("cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"draftrelay_wait_geq32")))
        # Launch arguments live in fixed buffers: cuLaunchKernel copies them at the call.
        self._kp_addr, self._kp_val = ctypes.c_uint64(0), ctypes.c_uint32(0)
        self._kp = (ctypes.c_void_p * 2)(ctypes.addressof(self._kp_addr), ctypes.addressof(self._kp_val))
        self._kp_ptr = ctypes.addressof(self._kp)
        if self.info.get("fast_calls"):
            self._kp_arg = self._kp_ptr
        else:  # the bindings take kernelParams as ((values), (ctypes types))
            self._kp_arg = None
        released = self._dbase + self.region.layout.word(W.RELEASED)  # 0 >= 0: returns at once
        ok = self._launch_wait(released, 0) == 0 and self.record().wait(5.0)
        if not ok:
            raise CudaStreamRefused("wait='kernel': the wait kernel did not complete on a satisfied word")

    def _launch_wait(self, addr: int, value: int) -> int:
        if self._kp_arg is None:
            return int(self._drv.cuLaunchKernel(self._wait_fn, 1, 1, 1, 1, 1, 1, 0, self._s,
                                                ((addr, value), (ctypes.c_uint64, ctypes.c_uint32)), 0)[0])
        self._kp_addr.value = addr
        self._kp_val.value = value
        return self._launch(self._wait_fn, 1, 1, 1, 1, 1, 1, 0, self._s, self._kp_arg, None)

    def _fail(self, what: str, err: int):
        try:
            name = _err_name(self._drv, self._drv.CUresult(err))
        except ValueError:
            name = f"CUresult {err}"
        raise CudaError(f"{what} failed: {name}")

    def _probe_memops(self) -> None:
        """Write then wait on a registered scratch page: proves host-memory stream memops work here."""
        drv = self._drv
        self._scratch = mmap.mmap(-1, _PAGE)
        words = np.frombuffer(self._scratch, dtype=np.uint32)
        addr = int(words.ctypes.data)
        del words
        err = drv.cuMemHostRegister(addr, _PAGE, self._reg_flags)[0]
        if err:
            raise CudaStreamRefused(f"cuMemHostRegister of a scratch page failed: {_err_name(drv, err)}")
        self._registered.append(addr)
        dptr = int(self._call("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(addr, 0)))
        err = self._write(self._s, dptr, 7, self._WDEFAULT)
        if err:
            raise CudaStreamRefused(f"stream memory operations unsupported: cuStreamWriteValue32 -> "
                                    f"{_err_name(drv, err)}")
        err = self._wait(self._s, dptr, 7, self._GEQ)
        if err:
            raise CudaStreamRefused(f"stream memory operations unsupported: cuStreamWaitValue32(GEQ) -> "
                                    f"{_err_name(drv, err)}")
        if not self.record().wait(2.0):
            raise StreamStuck("the memop probe (write 7, wait >= 7 on a scratch page) did not complete in 2 s")
        seen = int(np.frombuffer(self._scratch, dtype=np.uint32, count=1)[0])
        if seen != 7:
            raise CudaStreamRefused(f"stream write to registered host memory not visible (read {seen}, wrote 7)")
        if self.batch and self._batch_fn is not None:  # the batched write + wait: used only if it works here
            self._setup_batch()
            words = np.frombuffer(self._scratch, dtype=np.uint32, count=2)
            words[1] = 10
            err = self._write_then_wait(dptr, dptr + 4, 11)  # write word 0 = 11, then park until word 1 >= 11
            ev = None if err else self.record()
            time.sleep(0.002)
            parked = ev is not None and not ev.query() and int(words[0]) == 11
            words[1] = 11
            done = ev is not None and ev.wait(2.0)
            if not (parked and done):
                self._bm = None
                self.info["batch_memops_error"] = f"cuStreamBatchMemOp -> {err}, parked={parked}, done={done}"
                if ev is not None and not done and not self.drain(2.0):
                    raise StreamStuck("the batched memop probe (write, then wait on a released word) did not finish")
            del words
        self._unregister(addr)
        self._scratch.close()
        self._scratch = None

    def _setup_batch(self) -> None:
        """Two CUstreamBatchMemOpParams: [write32 (with the default memory barrier), wait32 GEQ]."""
        OP = self._drv.CUstreamBatchMemOpType
        bm = (ctypes.c_uint8 * (2 * _MEMOP_SIZE))()
        for i, (op, flags) in enumerate(((OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, self._WDEFAULT),
                                         (OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, self._GEQ))):
            ctypes.c_uint32.from_buffer(bm, i * _MEMOP_SIZE).value = int(op)
            ctypes.c_uint32.from_buffer(bm, i * _MEMOP_SIZE + _MEMOP_FLAGS).value = flags
        self._bm, self._bm_ptr = bm, ctypes.addressof(bm)
        self._bm_addr = [ctypes.c_uint64.from_buffer(bm, i * _MEMOP_SIZE + _MEMOP_ADDR) for i in (0, 1)]
        self._bm_val = [ctypes.c_uint32.from_buffer(bm, i * _MEMOP_SIZE + _MEMOP_VALUE) for i in (0, 1)]

    def _write_then_wait(self, write_addr: int, wait_addr: int, value: int) -> int:
        """Enqueue write32(write_addr, value) then wait32(wait_addr >= value) in one driver call."""
        self._bm_addr[0].value, self._bm_addr[1].value = write_addr, wait_addr
        self._bm_val[0].value = self._bm_val[1].value = value & 0xFFFFFFFF
        return self._batch_fn(self._s, 2, self._bm_ptr, 0)

    def _host_dptr(self, host_ptr: int) -> int:
        """The device address of pinned host memory (equal to the host address under unified addressing)."""
        return int(self._call("cuMemHostGetDevicePointer", self._drv.cuMemHostGetDevicePointer(host_ptr, 0)))

    def _load_round_kernel(self) -> None:
        """Compile and load the round kernel, then run it on a scratch area (three rounds, one of them
        parked until the host releases it) and check every word and byte it must move: a kernel that
        fails here is never used, and its module is loaded and launched before any round is armed."""
        if not self.info.get("fast_calls"):
            raise RuntimeError("the round kernel is launched through the ctypes fast path, which is off")
        torch, drv = self._torch, self._drv
        self._round_cubin = compile_cuda(_ROUND_CU, torch.cuda.get_device_capability(self.device))
        err, mod = drv.cuModuleLoadData(self._round_cubin.ctypes.data)[:2]
        if err:
            raise RuntimeError(f"cuModuleLoadData of the round kernel failed: {_err_name(drv, err)}")
        self._round_mod = mod
        self._counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._bounce_dptr = [self._host_dptr(b.data_ptr()) for b in self._bounce]
        L, base = self.region.layout, self._dbase
        a = self._args = _RoundArgs()
        a.staging[0], a.staging[1] = (base + L.staging(s) for s in (0, 1))
        a.reply[0], a.reply[1] = (base + L.reply(s) for s in (0, 1))
        a.gathered, a.released, a.consumed = (base + L.word(w) for w in (W.GATHERED, W.RELEASED, W.CONSUMED))
        a.counter = self._counter.data_ptr()
        a.reply_bytes, a.tok_off, a.stamp = self._reply_size, self._tok_off, 0
        self._args_kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))
        self._args_kp_ptr = ctypes.addressof(self._args_kp)
        self._round_words = (L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED))
        fn = int(self._call("cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"draftrelay_round")))
        self._check_round_kernel(fn)
        self._round_fn = fn
        self.info["round_kernel"] = "draftrelay_round"

    def _check_round_kernel(self, fn: int) -> None:
        torch, drv = self._torch, self._drv
        scratch = mmap.mmap(-1, 2 * _PAGE)
        u8 = np.frombuffer(scratch, dtype=np.uint8)
        w32 = u8[:256].view(np.uint32)  # gathered @0, released @64, consumed @128 (bytes)
        base = int(u8.ctypes.data)
        err = drv.cuMemHostRegister(base, 2 * _PAGE, self._reg_flags)[0]
        if err:
            raise RuntimeError(f"cuMemHostRegister of the round kernel's scratch failed: {_err_name(drv, err)}")
        self._registered.append(base)
        try:
            rng = np.random.default_rng(11)
            stg, rep, nrep = (1024, 2048), (4096, 5120), 1024
            src_np = rng.integers(0, 256, (3, 1008), dtype=np.uint8)  # 1000 bytes a round: 16-byte loop + tail
            src = torch.from_numpy(src_np).to(self.device)
            bufs = [CudaReplyBuffer(torch, nrep, self.device, self._host_dptr) for _ in (0, 1)]
            torch.cuda.synchronize(self.device)
            a = _RoundArgs()
            a.nbytes = 1000
            a.staging[0], a.staging[1] = base + stg[0], base + stg[1]
            a.reply[0], a.reply[1] = base + rep[0], base + rep[1]
            a.dev[0], a.dev[1] = bufs[0].dev_ptr, bufs[1].dev_ptr
            a.mirror[0], a.mirror[1] = bufs[0].mirror_dptr, bufs[1].mirror_dptr
            a.gathered, a.released, a.consumed, a.counter = base, base + 64, base + 128, self._counter.data_ptr()
            a.reply_bytes, a.tok_off, a.stamp = nrep, 0, 1
            kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))

            def launch(t: int, given: bool) -> Event:
                a.t = t if given else 0
                a.src = src[t - 1].data_ptr()
                e = self._launch(fn, 1, 1, 1, _ROUND_THREADS, 1, 1, 0, self._s, ctypes.addressof(kp), None)
                if e:
                    self._fail("cuLaunchKernel(draftrelay_round)", e)
                return self.record()

            problems = []
            # t = 1 given (slot 1), released already; then t from the counter (2, slot 0); then t = 3 parked
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
                torch.cuda.synchronize(self.device)
                got = u8[stg[s]:stg[s] + 1000]
                want_rep = u8[rep[s]:rep[s] + nrep]
                checks = {"gathered": w32[0] == t, "consumed": w32[32] == t, "stamp": got[:4].view(np.uint32)[0] == t,
                          "staging": np.array_equal(got[4:], src_np[t - 1, 4:1000]),
                          "mirror": np.array_equal(bufs[s].host_np, want_rep),
                          "device buffer": np.array_equal(bufs[s].dev.cpu().numpy(), want_rep),
                          "counter": int(self._counter.item()) == t}
                problems += [f"t={t}: {k} wrong" for k, ok in checks.items() if not ok]
            with torch.cuda.stream(self.torch_stream):
                self._counter.zero_()  # graph replays after start begin at round 1
            if not self.drain(5.0):
                raise StreamStuck("the round kernel's check did not drain")
            if problems:
                raise RuntimeError("the round kernel failed its start-up check: " + "; ".join(problems))
        finally:
            if self.drain(5.0):  # never unregister what the device may still touch
                self._unregister(base)
                got = want_rep = w32 = u8 = None  # noqa: F841  (drop the views before closing the mapping)
                scratch.close()

    # -- the ops (engine thread; enqueue only) --------------------------------------------------------
    def copy_in(self, slot: int, src: Any) -> None:
        """Stage slot `slot` from `src`: a CUDA tensor (the engine's gather: one D2H copy) or host bytes
        (numpy / CPU tensor: via a pinned bounce buffer and the device, so the host never blocks)."""
        torch = self._torch
        if isinstance(src, torch.Tensor) and src.is_cuda:
            n = min(src.nbytes, self._staging_size)
            err = self._d2h(self._staging_h[slot], src.data_ptr(), n, self._s)
        else:
            arr = src.numpy() if isinstance(src, torch.Tensor) else np.asarray(src)
            arr = arr.reshape(-1).view(np.uint8)
            n = min(arr.nbytes, self._staging_size)
            prev = self._bounce_ev[slot]
            if prev is not None and not prev.wait(self.drain_timeout_s):
                raise StreamStuck(f"bounce buffer {slot} still in use by the stream after {self.drain_timeout_s} s")
            self._bounce_np[slot][:n] = arr[:n]
            dev = self._bounce_dev[slot].data_ptr()
            err = self._h2d(dev, self._bounce[slot].data_ptr(), n, self._s)
            if not err:
                self._bounce_ev[slot] = self.record()
                err = self._d2h(self._staging_h[slot], dev, n, self._s)
        if err:
            self._fail(f"copy_in(slot {slot})", err)

    def _host_src(self, src: Any) -> np.ndarray:
        torch = self._torch
        arr = src.numpy() if isinstance(src, torch.Tensor) else np.asarray(src)
        return arr.reshape(-1).view(np.uint8)

    def _used_bytes(self, arr: np.ndarray) -> int:
        """Bytes of a packed round worth staging: the descriptor, the request table and n_tok tokens
        (the proxy parses nothing else; pack_staging hands over a whole slot, mostly zeros)."""
        n = min(arr.nbytes, self._staging_size)
        if n >= 16:
            n = min(n, self._tok_off + 4 * int.from_bytes(arr[8:12].tobytes(), "little"))
        return n

    def enqueue_round(self, slot: int, t: int, src: Any, dst: CudaReplyBuffer, offs: tuple[int, int, int],
                      on_resume: Callable[[], None] | None = None) -> Event:
        """One whole round (see the module docstring): the round kernel, or the memop sequence."""
        if on_resume is not None:  # a host callback mid-stream: only the single ops can place it
            return super().enqueue_round(slot, t, src, dst, offs, on_resume)
        if (t & 1) != slot:
            raise ValueError(f"round {t} belongs to slot {t & 1}, not {slot}")
        if self._round_fn is not None:
            return self._enqueue_round_kernel(slot, t, src, dst, offs)
        g, r, c = offs
        torch = self._torch
        if isinstance(src, torch.Tensor) and src.is_cuda:
            self.copy_in(slot, src)
        else:
            arr = self._host_src(src)
            self.copy_in(slot, arr[:self._used_bytes(arr)])
        if self._bm is not None:
            err = self._write_then_wait(self._dbase + g, self._dbase + r, t)
            if err:
                self._fail(f"cuStreamBatchMemOp(write +{g} = {t}, wait +{r} >= {t})", err)
        else:
            self.write32(g, t)
            self.wait_geq32(r, t)
        self.copy_out(slot, dst)
        self.write32(c, t)
        return self.record()

    def _enqueue_round_kernel(self, slot: int, t: int, src: Any, dst: CudaReplyBuffer,
                              offs: tuple[int, int, int]) -> Event:
        if offs != self._round_words:
            raise ValueError(f"round words at {offs}, the round kernel was set up for {self._round_words}")
        a = self._args
        torch = self._torch
        host = not (isinstance(src, torch.Tensor) and src.is_cuda)
        if host:  # host bytes: into the pinned bounce, which the kernel reads over the bus
            arr = self._host_src(src)
            n = self._used_bytes(arr)
            prev = self._bounce_ev[slot]
            if prev is not None and not prev.wait(self.drain_timeout_s):
                raise StreamStuck(f"bounce buffer {slot} still in use by the stream after {self.drain_timeout_s} s")
            self._bounce_np[slot][:n] = arr[:n]
            a.src, a.nbytes = self._bounce_dptr[slot], n
        else:
            a.src, a.nbytes = src.data_ptr(), min(src.nbytes, self._staging_size)
        a.t = t & 0xFFFFFFFF  # 0 only after 2**32 rounds: the kernel's counter + 1 is the same number then
        a.dev[slot], a.mirror[slot] = dst.dev_ptr, dst.mirror_dptr
        err = self._launch(self._round_fn, 1, 1, 1, _ROUND_THREADS, 1, 1, 0, self._s, self._args_kp_ptr, None)
        if err:
            self._fail(f"cuLaunchKernel(draftrelay_round, t={t})", err)
        ev = self.record()
        if host:
            self._bounce_ev[slot] = ev
        return ev

    def enqueue_round_from_counter(self, src: Any, dsts: tuple[CudaReplyBuffer, CudaReplyBuffer]) -> None:
        """Enqueue (or, inside a stream capture, record) one round whose number the DEVICE picks: the
        round counter's last round + 1, slot t & 1, and t is stamped into the staged descriptor. A CUDA
        graph holding this launch replays round after round with no parameter update. `src`: a device
        tensor at a fixed address (the engine's gather output); `dsts`: both slots' reply buffers.
        The caller keeps the host-side count (`set_round_counter` to resynchronise, e.g. after a reset)."""
        if self._round_fn is None:
            raise RuntimeError(f"the round kernel is not in use here (wait={self.wait_mode!r}; "
                               f"{self.info.get('round_kernel', '')})")
        if not (isinstance(src, self._torch.Tensor) and src.is_cuda):
            raise ValueError("enqueue_round_from_counter needs a device tensor as the source")
        a = _RoundArgs()
        ctypes.memmove(ctypes.addressof(a), ctypes.addressof(self._args), ctypes.sizeof(a))
        a.src, a.nbytes, a.t, a.stamp = src.data_ptr(), min(src.nbytes, self._staging_size), 0, 1
        for s in (0, 1):
            a.dev[s], a.mirror[s] = dsts[s].dev_ptr, dsts[s].mirror_dptr
        kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))  # the driver copies the parameter at the call
        err = self._launch(self._round_fn, 1, 1, 1, _ROUND_THREADS, 1, 1, 0, self._s, ctypes.addressof(kp), None)
        if err:
            self._fail("cuLaunchKernel(draftrelay_round, t from the counter)", err)

    def set_round_counter(self, value: int) -> None:
        """Enqueue: the device round counter := value (the next counter round is value + 1)."""
        v = value & 0xFFFFFFFF
        with self._torch.cuda.stream(self.torch_stream):
            self._counter.fill_(v - 2**32 if v >= 2**31 else v)  # an int32 tensor holding the u32 word

    def write32(self, off: int, value: int) -> None:
        err = self._write(self._s, self._dbase + off, value & 0xFFFFFFFF, self._WDEFAULT)
        if err:
            self._fail(f"cuStreamWriteValue32(+{off}, {value})", err)

    def wait_geq32(self, off: int, value: int) -> None:
        if self.wait_mode == "kernel":
            err = self._launch_wait(self._dbase + off, value & 0xFFFFFFFF)
        else:
            err = self._wait(self._s, self._dbase + off, value & 0xFFFFFFFF, self._GEQ)
        if err:
            self._fail(f"cuStreamWaitValue32(+{off} >= {value})", err)

    def copy_out(self, slot: int, dst: CudaReplyBuffer) -> None:
        err = self._h2d(dst.dev_ptr, self._reply_h[slot], dst.nbytes, self._s)
        if not err:
            err = self._d2h(dst.host_ptr, dst.dev_ptr, dst.nbytes, self._s)
        if err:
            self._fail(f"copy_out(slot {slot})", err)

    def record(self) -> Event:
        i = self._ev_i
        self._ev_i = (i + 1) % _EVENT_RING
        err = self._rec(self._ev_h[i], self._s)
        if err:
            self._fail("cuEventRecord", err)
        return _CudaEvent(self._ev_h[i], self)

    def bind_thread(self) -> None:
        self._drv.cuCtxSetCurrent(self._ctx)  # a driver context is current per thread

    def _query(self, ev: int) -> bool:
        err = self._qry(ev)
        if err == self._NOT_READY:
            return False
        if err == self._SUCCESS:
            return True
        if err == int(self._drv.CUresult.CUDA_ERROR_INVALID_CONTEXT):  # queried from a thread with no context
            self._drv.cuCtxSetCurrent(self._ctx)
            err = self._qry(ev)
            if err in (self._SUCCESS, self._NOT_READY):
                return err == self._SUCCESS
        self._fail("cuEventQuery", err)

    def new_reply_buffer(self) -> CudaReplyBuffer:
        buf = CudaReplyBuffer(self._torch, self._reply_size, self.device, self._host_dptr)
        if buf.nbytes > self._reply_size:
            raise ValueError("reply buffer larger than a reply slot")
        return buf

    def host_bytes(self, buf: CudaReplyBuffer) -> np.ndarray:
        return buf.host_np

    # -- kernel preload --------------------------------------------------------------------------------
    def preload(self, fns: Iterable[Callable[[], Any]]) -> None:
        """Launch every kernel the engine will launch while a stream is parked, once, before the first
        round is armed; then wait (bounded) until they ran.

        Why: under CUDA's default lazy module loading, the first launch of a kernel loads its module,
        and a module load waits for the device to go idle. While the stream is parked on `released`
        the device is not idle, so that first launch blocks the engine thread until the round is
        released (on an H200: 30 of 30 fresh module loads returned only after the release). With the
        CUDA-free proxy and the native watchdog that costs only the overlap; if anything the release
        depends on makes a CUDA call meanwhile (a proxy thread copying the reply with
        cuMemcpyHtoDAsync, a helper thread in the engine), it is a deadlock (3 of 3 on the H200, ended
        only by a CUDA-free timer; 0 of 3 once the kernel had been launched before). The classic trap is a
        first-use Triton or other JIT kernel (Triton's loader calls cuModuleLoadData explicitly, so
        CUDA_MODULE_LOADING=EAGER does not cover it), and a torch op used for the first time in the
        decode loop. Pass callables that launch each such kernel with representative shapes (each
        Triton specialisation is its own module).
        """
        if not self.drain(self.drain_timeout_s):
            raise StreamStuck("preload: the stream did not drain; kernels must be preloaded before rounds are armed")
        with self._torch.cuda.stream(self.torch_stream):
            for fn in fns:
                fn()
        if not self.drain(self.drain_timeout_s):
            raise StreamStuck(f"preload: the preloaded kernels did not finish within {self.drain_timeout_s} s")

    # -- drain and close --------------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> bool:
        if self._closed or not self._events:
            return True
        self._drv.cuCtxSetCurrent(self._ctx)  # drains may come from another thread (a supervisor)
        return self.record().wait(timeout_s)

    def _unregister(self, addr: int) -> None:
        err = self._drv.cuMemHostUnregister(addr)[0]
        self._registered.remove(addr)
        if err:
            raise CudaError(f"cuMemHostUnregister({addr:#x}) failed: {_err_name(self._drv, err)}")

    def _teardown(self) -> None:
        """Unregister and free everything, but only once the stream is drained (bounded)."""
        if self._registered or self._events:
            if self._events and not self.drain(self.drain_timeout_s):
                self.stuck = True
                raise StreamStuck(f"the CUDA stream did not drain within {self.drain_timeout_s} s: "
                                  "host memory stays registered (the GPU may still use it)")
        errors = []
        for addr in list(self._registered):
            try:
                self._unregister(addr)
            except CudaError as exc:
                errors.append(str(exc))
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        for name in ("_wait_mod", "_round_mod"):
            if getattr(self, name, None) is not None:
                self._drv.cuModuleUnload(getattr(self, name))
                setattr(self, name, None)
        self._round_fn = None
        for ev in self._events:
            self._drv.cuEventDestroy(ev)
        self._events = []
        self._bounce = self._bounce_np = self._bounce_dev = []
        self._bounce_ev = [None, None]
        if errors:
            raise CudaError("; ".join(errors))

    def close(self) -> None:
        if self._closed:
            return
        self._teardown()
        self._closed = True

    @property
    def registered(self) -> bool:
        return bool(self._registered)
