"""benchmarks/variant_pairs.py: two fast_forward.py variants' p50s paired within each result file (CPU, JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import variant_pairs  # noqa: E402


def result(card: str, drafter: dict[int, tuple[float, float]], target: dict[int, tuple[float, float]]) -> dict:
    """A fast_forward.py result of one process: drafter rows by requests and target rows by tokens, each
    with the p50s of variants "a" and "b" (the target's also an "x" that the drafter's lack)."""
    def times(a, b, **more):
        return {"a": {"p50_ms": a}, "b": {"p50_ms": b}, **{k: {"p50_ms": v} for k, v in more.items()}}
    drafter_rows = [{"context": 128, "requests": r, "step": times(*ab)} for r, ab in drafter.items()]
    target_rows = [{"context": 128, "tokens": t, "step": times(*ab, x=1.0)} for t, ab in target.items()]
    return {"machine": {"gpus": [card]}, "drafter_0p5b": {"rows": drafter_rows}, "target_7b": {"rows": target_rows}}


def test_differences_pair_within_a_process_and_group_by_card_forward_and_width(tmp_path, capsys):
    """Each row gives a - b of its own process; the summary's median, extremes and counts of who was faster
    are those of the rows of one card, forward and width, never mixed with another card's."""
    files = [result("H100", {1: (3.0, 2.9), 4: (4.0, 4.1)}, {1: (5.0, 5.0), 5: (6.0, 5.5)}),
             result("H100", {1: (2.8, 2.75)}, {}),
             result("H100", {1: (2.9, 2.95)}, {}),
             result("H200", {1: (2.6, 2.7)}, {})]
    for i, r in enumerate(files):
        (tmp_path / f"fast_forward_{i}.json").write_text(json.dumps(r))
    out = tmp_path / "pairs.json"
    assert variant_pairs.main(["--a", "a", "--b", "b", "--files", str(tmp_path / "fast_forward_*.json"),
                               "--out", str(out)]) == 0
    summary = {(s["card"], s["forward"], s["width"]): s for s in json.loads(out.read_text())["summary"]}
    step1 = summary["H100", "drafter STEP", "requests 1"]
    assert step1["n"] == 3 and step1["median_ms"] == pytest.approx(0.05)
    assert (step1["min_ms"], step1["max_ms"]) == (pytest.approx(-0.05), pytest.approx(0.1))
    assert (step1["b_faster"], step1["a_faster"]) == (2, 1)
    assert summary["H200", "drafter STEP", "requests 1"]["a_faster"] == 1
    assert summary["H100", "drafter STEP", "requests 4"]["median_ms"] == pytest.approx(-0.1)
    verify = summary["H100", "target forward", "tokens 5"]
    assert verify["median_ms"] == pytest.approx(0.5) and verify["b_faster"] == 1
    tie = summary["H100", "target forward", "tokens 1"]
    assert (tie["b_faster"], tie["a_faster"]) == (0, 0)  # equal p50s favour neither
    assert "requests 1: n   3 median +0.050" in capsys.readouterr().out


def test_rows_lacking_either_variant_are_left_out_and_none_at_all_is_an_error_naming_it(tmp_path, capsys):
    (tmp_path / "fast_forward_0.json").write_text(json.dumps(result("H100", {1: (1.0, 1.0)}, {1: (1.0, 3.0)})))
    glob = str(tmp_path / "fast_forward_*.json")
    out = tmp_path / "pairs.json"
    assert variant_pairs.main(["--a", "a", "--b", "x", "--files", glob, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]  # "x" is timed on the target's rows only
    assert [(s["forward"], s["median_ms"]) for s in summary] == [("target forward", 0.0)]
    with pytest.raises(SystemExit):
        variant_pairs.main(["--a", "a", "--b", "nope", "--files", glob])
    assert "'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        variant_pairs.main(["--a", "a", "--b", "b", "--files", str(tmp_path / "none_*.json")])
    assert "matches no file" in capsys.readouterr().err
