"""The driver API as the CUDA backend calls it: the bindings import, error names, and the per-round calls.

Per-round driver functions are called through the pointers cuGetProcAddress returns (legacy-stream
variants, CUDA 12.0 ABI) via ctypes, which drops the GIL for each call (`fast`); without them, through
the bindings (each call then returns a tuple). Either way every call here takes plain ints and returns
the CUresult as an int. The bindings (`cuda-bindings`, the `gpu` extra) are imported only when the CUDA
backend is chosen: nothing on the proxy's or the watchdog's path imports this module.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

_c = ctypes


class CudaStreamRefused(RuntimeError):
    """The CUDA backend cannot run here; the message says why. Nothing is left registered."""


class CudaError(RuntimeError):
    """A driver call failed after start-up (an enqueue error: the engine should stop using async)."""


# The hot driver functions and their C signatures (cuda.h, CUDA 12.0 ABI): CUresult is an int,
# CUstream/CUevent are pointers, CUdeviceptr is a 64-bit integer.
FAST = {
    "cuStreamWriteValue32": (_c.c_void_p, _c.c_uint64, _c.c_uint32, _c.c_uint),
    "cuStreamWaitValue32": (_c.c_void_p, _c.c_uint64, _c.c_uint32, _c.c_uint),
    "cuMemcpyDtoHAsync": (_c.c_void_p, _c.c_uint64, _c.c_size_t, _c.c_void_p),
    "cuMemcpyHtoDAsync": (_c.c_uint64, _c.c_void_p, _c.c_size_t, _c.c_void_p),
    "cuEventRecord": (_c.c_void_p, _c.c_void_p),
    "cuEventQuery": (_c.c_void_p,),
    "cuLaunchKernel": (_c.c_void_p, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint,
                       _c.c_void_p, _c.c_void_p, _c.c_void_p),
}
_ABI = 12000  # the CUDA version whose signatures FAST describes

# cuStreamBatchMemOp's parameter: a 48-byte union per op; for WRITE_VALUE_32 / WAIT_VALUE_32 the
# operation is at offset 0, the address at 8, the 32-bit value at 16, the flags at 24 (cuda.h).
MEMOP_SIZE, MEMOP_ADDR, MEMOP_VALUE, MEMOP_FLAGS = 48, 8, 16, 24


def import_driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaStreamRefused(
            f"cuda-bindings is not installed ({exc}); install the gpu extra: pip install 'draftrelay[gpu]'"
        ) from None
    return driver


def err_name(drv, err) -> str:
    try:
        r = drv.cuGetErrorName(drv.CUresult(int(err)))
        return r[1].decode() if not r[0] and r[1] else str(err)
    except Exception:
        return str(err)


@dataclass
class Calls:
    """The per-round calls; `fast` says whether they are the ctypes entry points. `batch` is
    cuStreamBatchMemOp (ctypes only; None where the driver does not hand it out)."""

    write: Any
    wait: Any
    launch: Any
    d2h: Any
    h2d: Any
    record: Any
    query: Any
    batch: Any = None
    fast: bool = False


def bind_calls(drv, fast: bool) -> Calls:
    if fast:
        flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        fns = {}
        for name, argtypes in FAST.items():
            r = drv.cuGetProcAddress(name.encode(), _ABI, flags)
            if r[0] or not r[1]:
                fns = {}
                break
            fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(r[1]))
        if fns:
            batch = None
            r = drv.cuGetProcAddress(b"cuStreamBatchMemOp", _ABI, flags)
            if not r[0] and r[1]:
                batch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p,
                                         ctypes.c_uint)(int(r[1]))
            return Calls(fns["cuStreamWriteValue32"], fns["cuStreamWaitValue32"], fns["cuLaunchKernel"],
                         fns["cuMemcpyDtoHAsync"], fns["cuMemcpyHtoDAsync"], fns["cuEventRecord"],
                         fns["cuEventQuery"], batch, True)

    def wrap(fn):
        return lambda *a: int(fn(*a)[0])

    return Calls(wrap(drv.cuStreamWriteValue32), wrap(drv.cuStreamWaitValue32), wrap(drv.cuLaunchKernel),
                 wrap(drv.cuMemcpyDtoHAsync), wrap(drv.cuMemcpyHtoDAsync), wrap(drv.cuEventRecord),
                 wrap(drv.cuEventQuery))


class WriteThenWait:
    """[write32 (with the default memory barrier), wait32 GEQ] as one cuStreamBatchMemOp call. The
    parameter array lives here; each call rewrites its two addresses and value (the driver copies it)."""

    def __init__(self, drv, batch_fn, write_flags: int, geq_flags: int) -> None:
        OP = drv.CUstreamBatchMemOpType
        bm = (ctypes.c_uint8 * (2 * MEMOP_SIZE))()
        for i, (op, flags) in enumerate(((OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, write_flags),
                                         (OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, geq_flags))):
            ctypes.c_uint32.from_buffer(bm, i * MEMOP_SIZE).value = int(op)
            ctypes.c_uint32.from_buffer(bm, i * MEMOP_SIZE + MEMOP_FLAGS).value = flags
        self._bm, self._ptr, self._fn = bm, ctypes.addressof(bm), batch_fn
        self._addr = [ctypes.c_uint64.from_buffer(bm, i * MEMOP_SIZE + MEMOP_ADDR) for i in (0, 1)]
        self._val = [ctypes.c_uint32.from_buffer(bm, i * MEMOP_SIZE + MEMOP_VALUE) for i in (0, 1)]

    def __call__(self, stream: int, write_addr: int, wait_addr: int, value: int) -> int:
        """Enqueue write32(write_addr, value) then wait32(wait_addr >= value); returns the CUresult."""
        self._addr[0].value, self._addr[1].value = write_addr, wait_addr
        self._val[0].value = self._val[1].value = value & 0xFFFFFFFF
        return self._fn(stream, 2, self._ptr, 0)
