"""The P2P, TP2 and worker-graph GPU probes as tests: each probe script runs as its own process (as the
benchmarks and the docs call it) with `--out`, and the test asserts on the JSON it wrote.

Two-GPU probes skip on one GPU, saying so; `test_p2p_one_device` runs both ranks on one GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuenv import gpu_count, need_gpus

HERE = Path(__file__).resolve().parent


def run_probe(script: str, args: list[str], timeout_s: float) -> tuple[int, str]:
    p = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                       timeout=timeout_s)
    return p.returncode, (p.stdout + p.stderr)[-4000:]


def failed_checks(path: Path) -> dict:
    res = json.loads(path.read_text())
    return {k: c.get("error") for k, c in res["checks"].items() if not c["ok"]}


def test_p2p_one_device(out_dir):
    need_gpus(1)
    rc, log = run_probe("p2p_probe.py", ["--one-device", "--out", str(out_dir)], 300)
    path = out_dir / "p2p_probe_one_device.json"
    assert path.exists(), log
    assert rc == 0 and not failed_checks(path), (failed_checks(path), log)
    assert json.loads(path.read_text())["checks"]["one_device_pair"]["ops"] == 60


def test_p2p_pair(out_dir):
    need_gpus(2)
    rc, log = run_probe("p2p_probe.py", ["--out", str(out_dir)], 480)
    path = out_dir / "p2p_probe_pair.json"
    assert path.exists(), log
    res = json.loads(path.read_text())
    assert rc == 0 and not res["failed"], (failed_checks(path), log)
    assert res["passed"] == 8  # every check of the pair, including the re-run after the faults


def test_tp2_pair(out_dir):
    need_gpus(2)
    rc, log = run_probe("tp2_probe.py", ["--out", str(out_dir)], 540)
    path = out_dir / "tp2_probe.json"
    assert path.exists(), log
    assert rc == 0 and not failed_checks(path), (failed_checks(path), log)


def test_worker_graph_equals_eager(out_dir):
    need_gpus(1)
    rc, log = run_probe("worker_graph_probe.py", ["--rounds", "40", "--out", str(out_dir)], 240)
    path = out_dir / "worker_graph_probe.json"
    assert path.exists(), log
    res = json.loads(path.read_text())["results"]
    assert len(res) == 2 * min(2, gpu_count())  # tiny fp32 and the 0.5B shape, on each GPU probed
    fp32 = [r for r in res if r.get("dtype", "float32") == "float32" and r.get("first_diff_round") is not None]
    assert rc == 0 and not fp32, log


@pytest.mark.parametrize("script", ["p2p_probe.py", "tp2_probe.py"])
def test_two_gpu_probes_refuse_clearly_on_one_gpu(script, out_dir):
    # on a one-GPU machine the scripts themselves say what they need (exit 2), rather than failing later
    if gpu_count() != 1:
        pytest.skip(f"checks the one-GPU refusal (found {gpu_count()} GPUs)")
    rc, log = run_probe(script, ["--out", str(out_dir)], 120)
    assert rc == 2 and "needs 2 GPU" in log, log
