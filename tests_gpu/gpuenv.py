"""What the GPU tests can use here: how many GPUs, whether the CUDA backend can run (skip reasons)."""

from __future__ import annotations

import pytest


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_missing() -> str:
    """Why the CUDA backend cannot run here ("" when it can)."""
    if gpu_count() == 0:
        return "needs a CUDA GPU (torch sees none)"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "needs cuda-bindings (the gpu extra)"
    return ""


def need_gpus(n: int) -> None:
    """Skip the calling test unless at least n GPUs are visible."""
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPU{'s of one host' if n > 1 else ''} (found {have})")
