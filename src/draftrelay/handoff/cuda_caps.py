"""What the CUDA backend needs from the device, checked before anything is registered for rounds.

`device_info` reads the attributes and refuses (CudaStreamRefused) a device that cannot use host
pointers for registered memory or is not on unified addressing. `probe_memops` then proves stream
memory operations on host memory work here by doing them: write then wait on a registered scratch page
(e.g. CUDA_ERROR_NOT_SUPPORTED refuses; the deprecated attribute CAN_USE_STREAM_MEM_OPS_V1 reads 0 on
an H200 under CUDA 13 although memops work, so it is only recorded), and the batched [write, wait]
call, used only if it parks and resumes as it should. Every probe leaves nothing registered.
"""

from __future__ import annotations

import mmap
import time
from typing import TYPE_CHECKING

import numpy as np

from .cuda_driver import CudaError, CudaStreamRefused, WriteThenWait, err_name
from .stream import StreamStuck

if TYPE_CHECKING:
    from .cuda_stream import CudaStream

PAGE = mmap.PAGESIZE


def device_info(drv, dev, torch, torch_stream) -> dict:
    """The attributes the backend checks (and a few it records), refusing a device it cannot use."""
    A = drv.CUdevice_attribute

    def attr(name: str) -> int | None:
        a = getattr(A, name, None)
        if a is None:
            return None
        r = drv.cuDeviceGetAttribute(a, dev)
        return None if r[0] else int(r[1])

    r = drv.cuDriverGetVersion()
    if r[0]:
        raise CudaError(f"cuDriverGetVersion failed: {err_name(drv, r[0])}")
    host_ptr = attr("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM")
    uva = attr("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING")
    info = {
        "device": torch.cuda.get_device_name(torch_stream.device),
        "driver_version": r[1],
        "can_use_host_pointer_for_registered_mem": host_ptr,
        "unified_addressing": uva,
        "can_use_stream_mem_ops_v1": attr("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1"),
        "can_use_64_bit_stream_mem_ops": attr("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"),
        "stream": int(torch_stream.cuda_stream),
    }
    if host_ptr != 1:
        raise CudaStreamRefused(
            f"device cannot use host pointers for registered memory "
            f"(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM={host_ptr}); stream memops on the region are unsafe")
    if uva != 1:
        raise CudaStreamRefused(f"device is not on unified addressing (UNIFIED_ADDRESSING={uva})")
    return info


def probe_memops(st: CudaStream) -> None:
    """Write then wait on a registered scratch page: proves host-memory stream memops work here. Then
    set up the batched write + wait (st._write_then_wait) if the driver has it and it behaves."""
    drv = st._drv
    st._scratch = mmap.mmap(-1, PAGE)
    words = np.frombuffer(st._scratch, dtype=np.uint32)
    addr = int(words.ctypes.data)
    del words
    err = drv.cuMemHostRegister(addr, PAGE, st._reg_flags)[0]
    if err:
        raise CudaStreamRefused(f"cuMemHostRegister of a scratch page failed: {err_name(drv, err)}")
    st._registered.append(addr)
    dptr = int(st._call("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(addr, 0)))
    err = st._write(st._s, dptr, 7, st._WDEFAULT)
    if err:
        raise CudaStreamRefused(f"stream memory operations unsupported: cuStreamWriteValue32 -> {err_name(drv, err)}")
    err = st._wait(st._s, dptr, 7, st._GEQ)
    if err:
        raise CudaStreamRefused(f"stream memory operations unsupported: cuStreamWaitValue32(GEQ) -> "
                                f"{err_name(drv, err)}")
    if not st.record().wait(2.0):
        raise StreamStuck("the memop probe (write 7, wait >= 7 on a scratch page) did not complete in 2 s")
    seen = int(np.frombuffer(st._scratch, dtype=np.uint32, count=1)[0])
    if seen != 7:
        raise CudaStreamRefused(f"stream write to registered host memory not visible (read {seen}, wrote 7)")
    if st.batch and st._batch_fn is not None:
        _probe_batch(st, dptr)
    st._unregister(addr)
    st._scratch.close()
    st._scratch = None


def _probe_batch(st: CudaStream, dptr: int) -> None:
    """The batched write + wait on the scratch page: word 0 := 11, then park until word 1 >= 11. Kept
    only if the stream really parked (and wrote first) and resumed on the release."""
    bm = WriteThenWait(st._drv, st._batch_fn, st._WDEFAULT, st._GEQ)
    words = np.frombuffer(st._scratch, dtype=np.uint32, count=2)
    words[1] = 10
    err = bm(st._s, dptr, dptr + 4, 11)
    ev = None if err else st.record()
    time.sleep(0.002)
    parked = ev is not None and not ev.query() and int(words[0]) == 11
    words[1] = 11
    done = ev is not None and ev.wait(2.0)
    del words
    if parked and done:
        st._bm = bm
        return
    st.info["batch_memops_error"] = f"cuStreamBatchMemOp -> {err}, parked={parked}, done={done}"
    if ev is not None and not done and not st.drain(2.0):
        raise StreamStuck("the batched memop probe (write, then wait on a released word) did not finish")
