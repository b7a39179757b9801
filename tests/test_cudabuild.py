"""The one CUDA build helper (draftrelay.cudabuild) on a CPU: the nvcc library cache and its failures.

nvcc itself is replaced by a stand-in that writes the output file, so these run without a CUDA toolkit;
the real builds run in test_p2p_emulation.py (where nvcc exists) and on the GPU (tests_gpu/)."""

from __future__ import annotations

import subprocess
import types

import pytest

from draftrelay import cudabuild


@pytest.fixture
def fake_nvcc(monkeypatch):
    calls: list[list[str]] = []

    def run(cmd, **kw):
        calls.append(cmd)
        out = cmd[cmd.index("-o") + 1]
        with open(out, "wb") as f:
            f.write(b"\x7fELF fake")
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("NVCC", "/opt/fake/nvcc")
    return calls


def test_library_is_built_once_per_source_dependency_arch_and_defines(tmp_path, fake_nvcc):
    src, dep = tmp_path / "k.cu", tmp_path / "inc.cu"
    src.write_text('#include "inc.cu"\n')
    dep.write_text("// v1\n")
    build = tmp_path / "build"

    def lib(arch="sm_90", defines=()):
        return cudabuild.nvcc_library(src, arch, build, "libk", include_dirs=(tmp_path,), depends=(dep,),
                                      defines=defines)

    first = lib()
    assert first.exists() and first.parent == build and first.name.startswith("libk_sm_90_")
    assert lib() == first and len(fake_nvcc) == 1  # cached: nvcc not run again
    assert fake_nvcc[0][0] == "/opt/fake/nvcc" and f"-I{tmp_path}" in fake_nvcc[0]
    dep.write_text("// v2\n")  # an included file changed: a new build
    second = lib()
    assert second != first and len(fake_nvcc) == 2
    assert lib(arch="sm_80") not in (first, second) and len(fake_nvcc) == 3
    assert lib(defines=("X=1",)) not in (first, second) and "-DX=1" in fake_nvcc[-1]
    assert not [p for p in build.iterdir() if p.is_dir()]  # no temporary directory left behind


def test_nvcc_failure_and_absence_are_clear_errors(tmp_path, monkeypatch):
    src = tmp_path / "bad.cu"
    src.write_text("this is not CUDA\n")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(returncode=1, stderr="error: x"))
    with pytest.raises(RuntimeError, match=r"nvcc failed building .*bad\.cu:\nerror: x"):
        cudabuild.nvcc_library(src, "sm_90", tmp_path / "b", "libbad")

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", missing)
    monkeypatch.setenv("NVCC", "/nowhere/nvcc")
    with pytest.raises(RuntimeError, match="needs nvcc: /nowhere/nvcc not found"):
        cudabuild.nvcc_library(src, "sm_90", tmp_path / "b", "libbad")
    assert not list((tmp_path / "b").glob("*.so"))


def test_arch_name():
    assert cudabuild.arch_name((9, 0)) == "sm_90" and cudabuild.arch_name((12, 1)) == "sm_121"
