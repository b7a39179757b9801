"""Building the package's CUDA C at run time: one place for both ways it is built.

* `nvrtc_cubin(source, capability)`: NVRTC (from cuda-bindings; libnvrtc comes with torch's CUDA
  wheels) to a cubin that the driver API loads (cuModuleLoadData). The hand-off's round kernel
  (handoff/round_kernel.cu) is built this way: no compiler on the box, a few hundred ms, once per
  process and source.
* `nvcc_library(source, arch)`: nvcc to a shared library that ctypes loads. The P2P kernels
  (p2p/kernels.cu) are built this way: they expose a C ABI and include no torch header, so plain
  `nvcc -shared` takes seconds (a torch extension takes about a minute), the library never depends on
  torch's C++ ABI, and a box without a CUDA torch can still compile-check it. The library is cached
  on disk by (source bytes, included files' bytes, arch, defines), so `pip install` never needs nvcc.

Nothing here is imported at package import time by code that must stay CUDA-free (the proxy, the
watchdog); the bindings are imported only inside `nvrtc_cubin`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_CUBINS: dict[tuple[str, tuple[int, int]], np.ndarray] = {}  # NVRTC runs once per process and source


def arch_name(capability: tuple[int, int]) -> str:
    """(9, 0) -> "sm_90"."""
    return f"sm_{capability[0]}{capability[1]}"


def nvrtc_cubin(source: str, capability: tuple[int, int], name: str = "draftrelay.cu") -> np.ndarray:
    """Compile CUDA C to a cubin for `capability` with NVRTC. Raises RuntimeError with NVRTC's log."""
    key = (source, (int(capability[0]), int(capability[1])))
    if key in _CUBINS:
        return _CUBINS[key]
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    try:
        opts = [f"--gpu-architecture={arch_name(key[1])}".encode(), b"-std=c++17"]
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


def nvcc_path() -> str:
    return os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def nvcc_command(source: Path, arch: str, out: Path, include_dirs: Sequence[Path] = (),
                 defines: Sequence[str] = ()) -> list[str]:
    return [nvcc_path(), "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
            *(f"-I{d}" for d in include_dirs), *(f"-D{d}" for d in defines), "-o", str(out), str(source)]


def nvcc_library(source: Path, arch: str, build_dir: Path, stem: str, *, include_dirs: Sequence[Path] = (),
                 depends: Sequence[Path] = (), defines: Sequence[str] = ()) -> Path:
    """Compile `source` to build_dir/<stem>_<arch>_<hash>.so unless that exact build exists.

    `depends`: files the source includes (their bytes are part of the cache key)."""
    h = hashlib.sha256(source.read_bytes())
    for dep in depends:
        h.update(dep.read_bytes())
    h.update(arch.encode())
    for d in defines:
        h.update(b"\0" + d.encode())
    out = build_dir / f"{stem}_{arch}_{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = nvcc_command(source, arch, tmp_out, include_dirs, defines)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except FileNotFoundError as exc:
            raise RuntimeError(f"building {source.name} needs nvcc: {cmd[0]} not found") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed building {source}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a half-written library
    return out
