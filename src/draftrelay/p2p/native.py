"""Builds kernels.cu with nvcc at first use and loads it with ctypes.

Why not torch.utils.cpp_extension: kernels.cu includes no torch header and exposes a C ABI, so plain
`nvcc -shared` builds it in a few seconds (a torch extension takes about a minute: torch's headers are
heavy), the .so never depends on torch's C++ ABI, and a box without a CUDA torch can still
compile-check it. `pip install` never needs nvcc: the build happens here, once per (source, arch),
cached under $DRAFTRELAY_P2P_BUILD (default ~/.cache/draftrelay/p2p).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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

_lib: ctypes.CDLL | None = None


def build_dir() -> Path:
    return Path(os.environ.get("DRAFTRELAY_P2P_BUILD", Path.home() / ".cache" / "draftrelay" / "p2p"))


def nvcc_command(arch: str, out: Path) -> list[str]:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-o", str(out), str(SOURCE)]


def build(arch: str) -> Path:
    """Compile kernels.cu for `arch` (e.g. sm_90) unless a cached build of this exact source exists."""
    digest = hashlib.sha256(SOURCE.read_bytes() + arch.encode()).hexdigest()[:16]
    out_dir = build_dir()
    out = out_dir / f"libdraftrelay_p2p_{arch}_{digest}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = nvcc_command(arch, tmp_out)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except FileNotFoundError as exc:
            raise RuntimeError(f"draftrelay.p2p needs nvcc to build {SOURCE.name}: {cmd[0]} not found") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed building {SOURCE}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a half-written .so
    return out


def load(arch: str) -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build(arch)))
        for name, (restype, *argtypes) in _SIGS.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
        _lib = lib
    return _lib


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc == 0:
        return
    own = {-1: "bad argument (size over capacity or unknown dtype)", -2: "no peer access between the devices",
           -3: "peer write/read probe read back wrong data", -4: "timed out waiting for the device to drain"}
    msg = own.get(rc) or lib.p2p_cuda_error_string(rc).decode()
    raise RuntimeError(f"{what}: {msg} (code {rc})")
