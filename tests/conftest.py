"""Shared fixtures of the CPU tests."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def install_driver(monkeypatch):
    """install(module, gpu_name): `module` stands in for cuda.bindings.driver, and CPU torch answers as
    one CUDA device whose current stream is handle 0 (the CUDA stream backend's tests on a CPU)."""
    import torch

    def install(module, gpu_name: str) -> None:
        pkg, sub = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        pkg.bindings, sub.driver = sub, module
        monkeypatch.setitem(sys.modules, "cuda", pkg)
        monkeypatch.setitem(sys.modules, "cuda.bindings", sub)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)
        stream = types.SimpleNamespace(device=torch.device("cpu"), cuda_stream=0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu_name)

    return install
