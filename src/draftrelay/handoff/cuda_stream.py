"""The CUDA backend of the engine-side stream ops: a real GPU stream parks on the host flag.

The shared memfd region (region.py) is registered with the driver (cuMemHostRegister, DEVICEMAP |
PORTABLE), so the GPU reads and writes the hand-off words, staging and replies in place. A round is
enqueued on the engine's torch stream as plain driver calls (stream.py has the op list):

    copy_in    cuMemcpyDtoHAsync  gathered rows (a device tensor) -> staging[s]
    write32    cuStreamWriteValue32(gathered, t)       the write is preceded by a memory barrier
    wait_geq32 cuStreamWaitValue32(released >= t, GEQ) the stream parks here, polling host memory
    copy_out   cuMemcpyHtoDAsync  reply[s] (claim word included) -> the device reply buffer,
               then cuMemcpyDtoHAsync of that buffer -> a pinned host mirror (what decode_reply reads:
               exactly the bytes the device got, never the live slot a late proxy might still touch)
    write32    cuStreamWriteValue32(consumed, t)
    record     cuEventRecord on a ring of reusable events

The engine thread only enqueues; nothing here waits on the stream except `drain` (bounded, by event
queries) and `preload` (before any round is armed). The driver bindings (`cuda-bindings`, the `gpu`
extra) are imported only in this module, only when this backend is chosen. Unless `fast=False`, the
per-round driver functions are called through the pointers cuGetProcAddress returns (legacy-stream
variants, CUDA 12.0 ABI) via ctypes, which drops the GIL for each call: the bindings' own entry points
added ~1.6 µs a call in one H200 run (three memops 12.4 vs 7.6 µs), within noise in another. Most of a
round's ~20 µs enqueue is the driver itself (per call p50 on an H200: D2H 4.8, memop 2.4-2.8, H2D 3.0,
event record 1.7 µs; benchmarks/results/handoff_cuda.json).

Waiting. `wait="memop"` (the default) parks the stream with cuStreamWaitValue32(GEQ): no SM is used,
but the GPU notices a host-memory store only ~8-9 µs p50 / 13-17 µs p99 later (H200; 8.0 µs even when
the engine thread stores the flag itself, against 2.6 µs between two stream writes that do not wait).
`wait="kernel"` (or DRAFTRELAY_CUDA_WAIT=kernel) launches instead a one-thread
kernel that polls the word with acquire loads at system scope (PTX below, JIT-compiled by the driver at
start and launched once there, so it is never a first-use kernel) and exits once it is >= t: 5.4 µs p50
/ 7.5 µs p99 release -> resume with a napping proxy on an H200, at the price of one SM busy while the
stream is parked and a launch (~5 µs) instead of a memop in the enqueue. Same protocol, same CUDA-free
release; qualified on the H200 by the same 10,000-round soak and late-proxy probes.

Refusal. The constructor raises CudaStreamRefused, leaving nothing registered, when: the bindings or
a CUDA device are missing; the device cannot use host pointers for registered memory
(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM == 0); the device is not on unified
addressing; registering the region fails; or a functional probe of stream memory operations on a
registered scratch page fails (e.g. CUDA_ERROR_NOT_SUPPORTED; the deprecated attribute
CAN_USE_STREAM_MEM_OPS_V1 reads 0 on an H200 under CUDA 13 although memops work, so it is only
recorded). open_rounds turns that into sync rounds with the reason, or AsyncRefused under strict.

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
_EVENT_RING = 64  # reusable events; a ring slot is re-recorded only 64 records later (see _CudaEvent)


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

    __slots__ = ("_ev", "_owner")

    def __init__(self, ev, owner: CudaStream) -> None:
        self._ev = ev
        self._owner = owner

    def query(self) -> bool:
        return self._owner._query(self._ev)

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
    pinned host mirror `host` (filled on the stream right after `dev`; what decode_reply reads)."""

    def __init__(self, torch, nbytes: int, device) -> None:
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.nbytes = nbytes
        self.dev_ptr = self.dev.data_ptr()
        self.host_ptr = self.host.data_ptr()


class CudaStream(StreamOps):
    """Stream ops on a torch CUDA stream through the driver API (see module docstring).

    `stream`: a torch.cuda.Stream (default: torch.cuda.current_stream() at construction).
    `drain_timeout_s`: the bound `close` waits for the stream before declaring it stuck.
    """

    name = "cuda"

    def __init__(self, region: Region, stream: Any = None, *, drain_timeout_s: float = 5.0,
                 fast: bool = True, wait: str | None = None) -> None:
        super().__init__(region)
        self.drain_timeout_s = drain_timeout_s
        self.fast = fast
        self.wait_mode = wait or os.environ.get("DRAFTRELAY_CUDA_WAIT", "memop")
        if self.wait_mode not in ("memop", "kernel"):
            raise ValueError(f"CudaStream wait={self.wait_mode!r}: expected 'memop' or 'kernel'")
        self._registered: list[int] = []  # host addresses currently registered by us
        self._scratch: mmap.mmap | None = None
        self._events: list = []
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
        self.info["wait"] = self.wait_mode
        if self.wait_mode == "kernel":
            self._load_wait_kernel()

    def _bind_calls(self, fast: bool) -> None:
        """The per-round driver calls, each taking plain ints and returning the CUresult as an int."""
        drv = self._drv
        self.info["fast_calls"] = False
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
        self._unregister(addr)
        self._scratch.close()
        self._scratch = None

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
        buf = CudaReplyBuffer(self._torch, self._reply_size, self.device)
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
        if getattr(self, "_wait_mod", None) is not None:
            self._drv.cuModuleUnload(self._wait_mod)
            self._wait_mod = None
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
