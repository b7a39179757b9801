"""Fixtures of the GPU tests (`python3 -m pytest -q tests_gpu [--out DIR]`; CI collects only tests/).

`backend`: the stream backend a hand-off scenario runs on. `emulated` runs anywhere (the CPU tests'
own backend); `cuda` is the CUDA backend on its default round path (the round kernel where it builds
and passes its check); `cuda-memop`, the same backend on the memop path (DRAFTRELAY_CUDA_WAIT=memop),
for the tests that do not narrow the params to emulated | cuda. The CUDA params skip, saying why,
where there is no GPU or no cuda-bindings.

`out_dir`: where probes write their JSON (`--out DIR`, default a temporary directory). With `--out`, the
session also writes DIR/tests_gpu.json: every test's outcome, duration and skip reason.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from gpuenv import cuda_missing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the CPU scenarios the backend tests run again (tests/test_*.py)

_REPORTS: list[dict] = []


def pytest_addoption(parser) -> None:
    parser.addoption("--out", default=os.environ.get("DRAFTRELAY_GPU_OUT", ""),
                     help="directory for the probes' JSON and tests_gpu.json (default: a temporary directory)")


@pytest.fixture(params=["emulated", "cuda", "cuda-memop"])
def backend(request, monkeypatch) -> str:
    if request.param == "emulated":
        return "emulated"
    why = cuda_missing()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("DRAFTRELAY_CUDA_WAIT", "memop" if request.param == "cuda-memop" else "auto")
    _warm_cuda()
    return "cuda"


_WARM: list[bool] = []


def _warm_cuda() -> None:
    """Open and close one CUDA hand-off before the first scenario counts fds: the driver's own device
    fds and the round kernel's NVRTC build happen once per process, not per scenario."""
    if _WARM:
        return
    import torch

    from draftrelay.handoff.cuda_stream import CudaStream
    from draftrelay.handoff.region import Region, RegionConfig

    torch.zeros(1, device="cuda")
    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        CudaStream(region, torch.cuda.Stream()).close()
    finally:
        region.close()
    _WARM.append(True)


@pytest.fixture(scope="session")
def out_dir(request, tmp_path_factory) -> Path:
    given = request.config.getoption("--out")
    path = Path(given) if given else tmp_path_factory.mktemp("gpu-out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome == "skipped" or (report.when == "setup" and report.failed):
        entry = {"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2)}
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        elif report.failed:
            entry["error"] = str(report.longrepr)[-2000:]
        _REPORTS.append(entry)
        _write(_OUT[0] if _OUT else "")


_OUT: list[str] = []
_MACHINE: dict = {}
_ARGS: list[str] = []


def pytest_configure(config) -> None:
    _OUT.append(config.getoption("--out"))
    _ARGS.extend(config.invocation_params.args)


def pytest_sessionfinish(session, exitstatus) -> None:
    _write(session.config.getoption("--out"), final=True)


def _write(given: str, final: bool = False) -> None:
    """DIR/tests_gpu.json, rewritten after every test (a run cut short still leaves what it did)."""
    if not given or not _REPORTS:
        return
    if not _MACHINE:
        from draftrelay.handoff.procinfo import machine_info

        _MACHINE.update(machine_info())
    os.makedirs(given, exist_ok=True)
    counts: dict[str, int] = {}
    for r in _REPORTS:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    with open(os.path.join(given, "tests_gpu.json"), "w") as f:
        json.dump({"command": "python3 -m pytest " + " ".join(_ARGS),
                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": _MACHINE,
                   "complete": final, "counts": counts, "tests": _REPORTS}, f, indent=1, default=str)
