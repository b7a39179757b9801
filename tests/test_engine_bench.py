"""The workload benchmark runs end to end on the CPU at tiny shapes (its figures are for a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_workloads_benchmark_tiny(tmp_path):
    out = tmp_path / "ew.json"
    cmd = [sys.executable, "benchmarks/engine_workloads.py", "--device", "cpu", "--target", "tiny", "--drafter",
           "tiny", "--workloads", "short,32k-conc3", "--ctx-scale", "1024", "--warmup", "2", "--steps", "3",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "async vs sync" in proc.stdout
    res = json.loads(out.read_text())
    for name, n_req in (("short", 3), ("32k-conc3", 3)):
        w = res["workloads"][name]
        runs = w["runs"]
        assert sum(len(r["ttft_s"]) for r in runs) == n_req
        for r in runs:
            for mode in ("off", "sync", "async"):
                m = r["modes"][mode]
                assert m["round_mode"] == mode
                assert len(m["step_p50_ms"]) == len(r["ttft_s"]) and min(m["step_p50_ms"]) > 0
            # the same prefill decoded in every mode: greedy tokens agree (as far as each got)
            toks = [r["modes"][m]["first_tokens"] for m in ("off", "sync", "async")]
            for i in range(len(r["ttft_s"])):
                n = min(len(t[i]) for t in toks)
                assert n >= 4 and toks[0][i][:n] == toks[1][i][:n] == toks[2][i][:n]
    assert res["handoff"]["async"]["ok"] > 0 and res["handoff"]["async"]["failed"] == 0
