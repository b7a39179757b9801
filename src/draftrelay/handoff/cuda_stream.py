"""The CUDA backend of the engine-side stream ops: a real GPU stream parks on the host flag.

The shared memfd region (region.py) is registered with the driver (cuMemHostRegister, DEVICEMAP |
PORTABLE), so the GPU reads and writes the hand-off words, staging and replies in place. A round
(`enqueue_round`, what AsyncRounds.submit calls) is enqueued on the engine's torch stream in one of two
ways; the protocol (docs/ORDERING.md) is the same and the proxy never calls CUDA in either.

**Round kernel** (`wait="auto"`, the default, where it compiles and passes its start-up check; or
`"kernel"`): ONE launch of a one-block kernel (round_kernel.cu, built, loaded and checked on a scratch
area at start by cuda_kernels.py, so it is never a first-use kernel while parked):

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
graph capture; with `wait="kernel"` wait_geq32 launches a one-thread polling kernel (cuda_kernels.py)
instead of cuStreamWaitValue32. Per-round driver calls go through ctypes entry points where the driver
hands them out (cuda_driver.py). The engine thread only enqueues; nothing here waits on the stream except
`drain` (bounded, by event queries) and `preload` (before any round is armed). The driver bindings
(`cuda-bindings`, the `gpu` extra) are imported only by this backend's modules, only when it is chosen.
Figures: docs/CUDA_BACKEND.md, benchmarks/results/handoff_cuda.json.

This module is the enqueue and drain side; what the device must support is checked in cuda_caps.py,
the kernels are built and checked in cuda_kernels.py (with draftrelay.cudabuild).

Refusal. The constructor raises CudaStreamRefused, leaving nothing registered, when: the bindings or
a CUDA device are missing; the device cannot use host pointers for registered memory
(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM == 0); the device is not on unified
addressing; registering the region fails; a functional probe of stream memory operations on a
registered scratch page fails (cuda_caps.py); or `wait="kernel"` was asked for and the round kernel
cannot be built or fails its check (under "auto" that only falls back to memops, with the reason in
`info["round_kernel"]`). open_rounds turns a refusal into sync rounds with the reason, or AsyncRefused
under strict.

Never free what a parked stream may still use: `close` drains first (event queries, bounded) and, if the
stream will not drain, raises StreamStuck and keeps the region registered (the caller must then keep it
mapped too; rounds.AsyncRounds.close does).

Use a non-default stream for the engine: a parked *legacy default* stream also holds up every blocking
stream of the context.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from draftrelay import env_choice

from . import cuda_caps, cuda_kernels
from .cuda_driver import CudaError, CudaStreamRefused, bind_calls, err_name, import_driver
from .cuda_kernels import ROUND_THREADS, RoundArgs
from .region import Region
from .stream import Event, StreamOps, StreamStuck

__all__ = ["WAIT_MODES", "CudaError", "CudaReplyBuffer", "CudaStream", "CudaStreamRefused"]

_PAGE = mmap.PAGESIZE
WAIT_MODES = ("auto", "kernel", "memop")
_EVENT_RING = 64  # reusable events; a ring slot is re-recorded only 64 records later (see _CudaEvent)


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
        if wait and wait not in WAIT_MODES:
            raise ValueError(f"CudaStream wait={wait!r}: expected one of {', '.join(WAIT_MODES)}")
        self.wait_mode = wait or env_choice("DRAFTRELAY_CUDA_WAIT", "auto", WAIT_MODES)
        self.batch = batch
        self._registered: list[int] = []  # host addresses currently registered by us
        self._scratch: mmap.mmap | None = None
        self._events: list = []
        self._round_fn = None  # the round kernel, once loaded and checked
        self._round_mod = self._wait_mod = None
        self._bm = None  # the batched [write gathered, wait released] call (cuda_driver.WriteThenWait)
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
            raise CudaError(f"{what} failed: {err_name(self._drv, err)}")
        return res[1] if len(res) == 2 else res[1:]

    def _start(self, stream: Any) -> None:
        """Start-up, in order: the driver and the context, the device's capabilities (cuda_caps), the
        per-round calls, the event ring, the memop probe, the region's registration, the bounce buffers,
        then the kernels (cuda_kernels: built, loaded and checked here, never first used while parked)."""
        drv = self._drv = import_driver()
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
            raise CudaStreamRefused(f"cuInit failed: {err_name(drv, err)}")
        self._ctx = self._call("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        if not int(self._ctx):
            raise CudaStreamRefused("no CUDA context is current on the engine thread")
        dev = self._call("cuCtxGetDevice", drv.cuCtxGetDevice())
        self.info = cuda_caps.device_info(drv, dev, torch, ts)

        self.cu_stream = drv.CUstream(int(ts.cuda_stream))
        self._s = int(ts.cuda_stream)
        self._SUCCESS = int(drv.CUresult.CUDA_SUCCESS)
        self._NOT_READY = int(drv.CUresult.CUDA_ERROR_NOT_READY)
        calls = bind_calls(drv, self.fast)
        self.info["fast_calls"] = calls.fast
        self._write, self._wait, self._launch = calls.write, calls.wait, calls.launch
        self._d2h, self._h2d, self._rec, self._qry = calls.d2h, calls.h2d, calls.record, calls.query
        self._batch_fn = calls.batch
        self._GEQ = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self._WDEFAULT = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        flags = int(drv.CU_MEMHOSTREGISTER_DEVICEMAP) | int(drv.CU_MEMHOSTREGISTER_PORTABLE)
        self._reg_flags = flags

        for _ in range(_EVENT_RING):
            ev = self._call("cuEventCreate", drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
            self._events.append(ev)
        self._ev_h = [int(ev) for ev in self._events]
        self._ev_i = 0

        cuda_caps.probe_memops(self)

        # Register the region. The mapping is page-aligned and whole pages are mapped, so round up.
        size = (self.region.size + _PAGE - 1) // _PAGE * _PAGE
        err = drv.cuMemHostRegister(self.region.base, size, flags)[0]
        if err:
            raise CudaStreamRefused(f"cuMemHostRegister of the region ({size} bytes) failed: {err_name(drv, err)}")
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
            cuda_kernels.load_wait_kernel(self)
        self.info["round"] = "memops"
        if self.wait_mode in ("auto", "kernel"):
            try:
                cuda_kernels.load_round_kernel(self)
                self.info["round"] = "kernel"
            except StreamStuck:
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                if self.wait_mode == "kernel":
                    raise CudaStreamRefused(f"wait='kernel': the round kernel is unavailable ({why})") from exc
                self.info["round_kernel"] = f"unavailable, rounds use memops ({why})"
        self.info["batch_memops"] = self._bm is not None

    def _fail(self, what: str, err: int):
        try:
            name = err_name(self._drv, self._drv.CUresult(err))
        except ValueError:
            name = f"CUresult {err}"
        raise CudaError(f"{what} failed: {name}")

    def _host_dptr(self, host_ptr: int) -> int:
        """The device address of pinned host memory (equal to the host address under unified addressing)."""
        return int(self._call("cuMemHostGetDevicePointer", self._drv.cuMemHostGetDevicePointer(host_ptr, 0)))

    def _write_then_wait(self, write_addr: int, wait_addr: int, value: int) -> int:
        """Enqueue write32(write_addr, value) then wait32(wait_addr >= value) in one driver call."""
        return self._bm(self._s, write_addr, wait_addr, value)

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

    def enqueue_reply(self, slot: int, t: int, dst: CudaReplyBuffer, offs: tuple[int, int, int],
                      wait: bool = True) -> Event:
        """The stream's part of a round the engine thread staged and announced (stream.py): with the
        round kernel, one launch staging nothing (its store of `gathered` = t repeats the host's), else
        [wait released >= t,] the reply copies and `consumed` = t."""
        if (t & 1) != slot:
            raise ValueError(f"round {t} belongs to slot {t & 1}, not {slot}")
        if self._round_fn is None:
            return super().enqueue_reply(slot, t, dst, offs, wait)
        if offs != self._round_words:
            raise ValueError(f"round words at {offs}, the round kernel was set up for {self._round_words}")
        a = self._args
        a.src, a.nbytes, a.t = self._bounce_dptr[slot], 0, t & 0xFFFFFFFF
        a.dev[slot], a.mirror[slot] = dst.dev_ptr, dst.mirror_dptr
        err = self._launch(self._round_fn, 1, 1, 1, ROUND_THREADS, 1, 1, 0, self._s, self._args_kp_ptr, None)
        if err:
            self._fail(f"cuLaunchKernel(draftrelay_round, reply only, t={t})", err)
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
        err = self._launch(self._round_fn, 1, 1, 1, ROUND_THREADS, 1, 1, 0, self._s, self._args_kp_ptr, None)
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
        a = RoundArgs()
        ctypes.memmove(ctypes.addressof(a), ctypes.addressof(self._args), ctypes.sizeof(a))
        a.src, a.nbytes, a.t, a.stamp = src.data_ptr(), min(src.nbytes, self._staging_size), 0, 1
        for s in (0, 1):
            a.dev[s], a.mirror[s] = dsts[s].dev_ptr, dsts[s].mirror_dptr
        kp = (ctypes.c_void_p * 1)(ctypes.addressof(a))  # the driver copies the parameter at the call
        err = self._launch(self._round_fn, 1, 1, 1, ROUND_THREADS, 1, 1, 0, self._s, ctypes.addressof(kp), None)
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
            err = cuda_kernels.launch_wait(self, self._dbase + off, value & 0xFFFFFFFF)
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

    def new_reply_buffer(self, nbytes: int | None = None) -> CudaReplyBuffer:
        """A reply slot's size; `nbytes` only for a scratch buffer (the round kernel's check)."""
        n = self._reply_size if nbytes is None else nbytes
        return CudaReplyBuffer(self._torch, n, self.device, self._host_dptr)

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
            raise CudaError(f"cuMemHostUnregister({addr:#x}) failed: {err_name(self._drv, err)}")

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
