"""Loads the P2P kernels (kernels.cu, built with nvcc by draftrelay.cudabuild) with ctypes.

The library is built at first use, once per (source, arch), cached under $DRAFTRELAY_P2P_BUILD
(default ~/.cache/draftrelay/p2p); `pip install` never needs nvcc.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from draftrelay import cudabuild

SOURCE = Path(__file__).resolve().parent / "kernels.cu"

_p, _u32, _u64, _i64, _int = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int

_SIGS: dict[str, tuple] = {
    "p2p_cuda_error_string": (ctypes.c_char_p, _int),
    "p2p_device_count": (_int, ctypes.POINTER(_int)),
    "p2p_enable_peer": (_int, _int, _int),
    "p2p_probe": (_int, _int, _int),
    "p2p_malloc": (_int, _int, _u64, ctypes.POINTER(_p)),
    "p2p_free": (_int, _int, _p),
    "p2p_host_word": (_int, ctypes.POINTER(_p), ctypes.POINTER(_p)),
    "p2p_free_host": (_int, _p),
    "p2p_stream_create": (_int, _int, ctypes.POINTER(_p)),
    "p2p_stream_destroy": (_int, _int, _p),
    "p2p_stream_wait": (_int, _int, _p, _u64),
    "p2p_state_bytes": (_u64, _int, _int, _u64),
    "p2p_ctx_new": (_p, _int, _int, _int, _int, _int, _u64, _u64, ctypes.POINTER(_p), _p, _u32),
    "p2p_ctx_free": (None, _p),
    "p2p_ctx_set_timeout": (None, _p, _u64),
    "p2p_reset_state": (_int, _p, _u32, _p),
    "p2p_read_header": (_int, _p, ctypes.POINTER(_u32), _p, _u64),
    "p2p_allreduce": (_int, _p, _int, _p, _p, _i64, _u32, _int, _p),
    "p2p_argmax_xchg": (_int, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _u32, _int, _p),
    "p2p_shard_argmax": (_int, _int, _int, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _int, _p),
    "p2p_sleep": (_int, _int, _u64, _p),
    "p2p_preload": (_int, _p),
}

_libs: dict[Path, ctypes.CDLL] = {}  # one loaded library per source (production, or a measurement build)


def build_dir() -> Path:
    return Path(os.environ.get("DRAFTRELAY_P2P_BUILD", Path.home() / ".cache" / "draftrelay" / "p2p"))


def build(arch: str, source: Path = SOURCE) -> Path:
    """Compile `source` (kernels.cu, or a file that includes it) for `arch` (e.g. sm_90) unless a cached
    build of these exact bytes exists."""
    stem = "libdraftrelay_p2p" if source == SOURCE else f"libdraftrelay_p2p_{source.stem}"
    depends = () if source == SOURCE else (SOURCE,)
    return cudabuild.nvcc_library(source, arch, build_dir(), stem, include_dirs=(SOURCE.parent,), depends=depends)


def load(arch: str, source: Path = SOURCE) -> ctypes.CDLL:
    lib = _libs.get(source)
    if lib is None:
        lib = ctypes.CDLL(str(build(arch, source)))
        for name, (restype, *argtypes) in _SIGS.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
        _libs[source] = lib
    return lib


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc == 0:
        return
    own = {-1: "bad argument (size over capacity or unknown dtype)", -2: "no peer access between the devices",
           -3: "peer write/read probe read back wrong data", -4: "timed out waiting for the device to drain"}
    msg = own.get(rc) or lib.p2p_cuda_error_string(rc).decode()
    raise RuntimeError(f"{what}: {msg} (code {rc})")
