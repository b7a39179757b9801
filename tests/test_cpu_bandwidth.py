"""The roofline benchmark's byte count and a smoke run at the tiny target's shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_bandwidth  # noqa: E402
from draftrelay.model import tiny_pair  # noqa: E402


def test_decode_read_bytes_counts_each_weight_once_and_one_embedding_row():
    target = tiny_pair()[0]
    c = target.cfg  # 4 layers, hidden 64, 4 heads / 2 kv heads of 16, intermediate 176, vocab 256, untied
    per_layer = 64 * (4 + 2 + 2) * 16 + 4 * 16 * 64 + 3 * 64 * 176 + 2 * 64  # qkv, o, gate|up + down, norms
    got = cpu_bandwidth.decode_read_bytes(target, context=10)
    assert got["layers"] == 4 * c.n_layers * per_layer
    assert got["lm_head"] == 4 * 256 * 64 and got["embedding_row"] == 4 * 64 and got["final_norm"] == 4 * 64
    assert got["kv_cache"] == 4 * 2 * c.n_layers * 2 * 16 * 11  # K and V of the context and the new token


def test_cpu_bandwidth_smoke(tmp_path):
    out = tmp_path / "cb.json"
    proc = subprocess.run([sys.executable, "benchmarks/cpu_bandwidth.py", "--target", "tiny", "--no-hf", "--steps", "3",
                           "--buffer-mb", "16", "--repeats", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["bytes_per_step_total"] == sum(res["bytes_per_step"].values())
    for n, bw in res["bandwidth_gb_s"].items():
        assert bw["gemv"] > 0 and bw["sum"] > 0
        assert res["ideal_step_ms"][n] > 0
    assert {"ours, 1 thread", "ours argmax only, 1 thread", "LM head alone, 1 thread"} <= set(res["variants"])


def test_cpu_draft_smoke(tmp_path):
    """benchmarks/cpu_draft.py at the tiny drafter: every variant timed, the screened and full-head STEPs'
    drafts equal, the worker process's STEPs interleaved with the in-process ones."""
    out = tmp_path / "cd.json"
    proc = subprocess.run([sys.executable, "benchmarks/cpu_draft.py", "--drafter", "tiny", "--steps", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"STEP 1 draft (extension forward)", "STEP 5 drafts, full head", "layers only", "head screened",
            "worker STEP 5 drafts"} <= set(res["variants"])
    assert all(v["min_ms"] > 0 for v in res["variants"].values())
    assert res["drafts_equal_full_head"] is True
    assert set(res["per_draft_worker_ms"]) == {"p50_ms", "min_ms"}
