"""The CUDA backend's GPU probes (cuda_probe.py) as tests: each step in a fresh process under its
timeout, its result merged into OUT/handoff_cuda_probe.json, the test failing with the step's own
details when the step did not pass."""

from __future__ import annotations

import json

import pytest

import cuda_probe
from gpuenv import cuda_missing


@pytest.fixture(scope="module")
def probe_results(out_dir):
    results: dict = {}
    yield results
    if results:
        cuda_probe.write_results(str(out_dir), results)


@pytest.mark.parametrize("step", cuda_probe.STEPS)
def test_cuda_probe_step(step, probe_results, out_dir):
    why = cuda_missing()
    if why:
        pytest.skip(why)
    res = probe_results[step] = cuda_probe.run_step(step, str(out_dir))
    summary = json.dumps({k: v for k, v in res.items() if k not in ("rows", "rounds", "trace")}, default=str)
    assert res.get("pass"), f"{step}: {cuda_probe.summary_line(step, res)} | {summary[-3000:]}"
