"""benchmarks/hit_curve.py: the hit rate against F counted on a trace (CPU, no models)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from draftrelay.replay import synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hit_curve  # noqa: E402


def saved_trace(tmp_path, *args, **kw) -> Path:
    """A synthetic trace (draftrelay.replay.synthetic_trace: top_f 4) saved as tmp_path/trace.json."""
    path = tmp_path / "trace.json"
    synthetic_trace(*args, **kw).save(str(path))
    return path


def test_hit_rate_grows_with_the_fanout_and_the_json_says_so(tmp_path, capsys):
    """The F branches of a table are the F most likely of one sorted list, and greedy outcomes do not
    depend on F, so a larger F hits every lookup a smaller one does: the curve cannot fall."""
    path = saved_trace(tmp_path, 512, n=3, length=48, hit=0.6, seed=4)
    out = tmp_path / "curve.json"
    assert hit_curve.main(["--trace", str(path), "--fanout", "1,2,4,8", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    rates = [got["by_fanout"][f]["hit_rate"] for f in ("1", "2", "4", "8")]
    assert all(0.0 <= r <= 1.0 for r in rates) and rates == sorted(rates), rates
    assert rates[-1] > rates[0]  # more branches do hit more on a trace with rejections
    assert got["by_fanout"]["8"]["lookups"] > 10 and got["k"] == 4
    assert "F =  8" in capsys.readouterr().out


@pytest.mark.parametrize("args, msg", [(["--fanout", "0"], "--fanout"), (["--fanout", "x"], "--fanout"),
                                       (["--k", "0"], "--k"), (["--batch", "0"], "--batch"),
                                       (["--share", "maybe"], "--share")])
def test_bad_arguments_name_what_is_wrong(tmp_path, capsys, args, msg):
    path = saved_trace(tmp_path, 512, n=1, length=24, seed=1)
    with pytest.raises(SystemExit):
        hit_curve.main(["--trace", str(path), *args, "--out", str(tmp_path / "c.json")])
    assert msg in capsys.readouterr().err


def test_a_batch_counts_the_steps_where_every_row_hits(tmp_path, capsys):
    """--batch 2: the entries two at a time, one STEP each round; a step counts as all-hit only when both
    rows hit, so its rate is at most the per-lookup rate. One request gets its F whether the batch's
    branches are shared or not, so at --batch 1 the two curves are the same."""
    path = saved_trace(tmp_path, 512, n=4, length=48, hit=0.6, seed=5)
    out = tmp_path / "curve.json"
    assert hit_curve.main(["--trace", str(path), "--fanout", "2,4", "--batch", "2", "--share", "on,off",
                           "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["batch"] == 2 and set(got["by_share"]) == {"on", "off"}
    for curve in got["by_share"].values():
        for v in curve.values():
            assert v["steps"] > 5 and 0.0 <= v["all_hit_rate"] <= v["hit_rate"] <= 1.0, v
            assert v["lookups"] == 2 * v["steps"]
    assert "all 2 rows hit in" in capsys.readouterr().out
    one = tmp_path / "one.json"
    assert hit_curve.main(["--trace", str(path), "--fanout", "2,4", "--share", "on,off", "--out", str(one)]) == 0
    by = json.loads(one.read_text())["by_share"]
    assert by["on"] == by["off"]


def test_stop_ranks_count_where_the_target_token_lies_among_the_candidates():
    """A hand-made entry: k = 2, the drafter right at positions 1 and 2, wrong at 3 (the target's token is its
    second choice), right at 4, wrong at 5 (the target's token not among its candidates): the rounds stop
    at 3 (after two kept drafts: the bonus place), at 5 ... each place's rank counted once."""
    from draftrelay.replay import Trace, TraceEntry

    target = [10, 11, 12, 13, 14, 15, 16]
    top = [[10, 1], [11, 1], [12, 1], [1, 13], [14, 1], [2, 3], [16, 1]]
    tr = Trace(pair="hand", top_f=2, vocab_size=32,
               entries=[TraceEntry(prompt=[5], target=target, draft_top=top, draft_prob=[[0.6, 0.4]] * 7,
                                   name="code:x")])
    got = hit_curve.stop_ranks(tr, 2, 7)["code"]
    # rounds from position 1: drafts at 1, 2 kept -> stop at 3 (rank 1); from 4: 4 kept, 5 wrong -> stop at 5
    # (not among the candidates); from 6: 6 kept, then the end
    assert got["stops"] == 2
    assert got["within_top"] == {1: 0.0, 2: 0.5}


def test_wider_candidates_and_more_branches_never_hit_less(tmp_path):
    """--top-m and --max-fanout reach the worker's prefetcher (and are put back after): with more
    candidates per place and a higher cap, a large F hits at least what the default does, and the JSON
    holds a curve per --top-m and the stop counts."""
    from draftrelay.worker import prefetch

    path = saved_trace(tmp_path, 512, n=3, length=48, hit=0.5, seed=7)  # top_f 4
    out = tmp_path / "curve.json"
    assert hit_curve.main(["--trace", str(path), "--fanout", "4,16,32", "--top-m", "2,4", "--max-fanout", "32",
                           "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (prefetch.TOP_M, prefetch.MAX_FANOUT) == (8, 16)
    assert set(got["by_top_m"]) == {"2", "4"} and got["max_fanout"] == 32
    narrow, wide = got["by_top_m"]["2"], got["by_top_m"]["4"]
    assert wide["32"]["hit_rate"] >= narrow["32"]["hit_rate"]
    assert wide["32"]["hit_rate"] >= wide["16"]["hit_rate"] >= wide["4"]["hit_rate"]
    assert got["stop_ranks"] and all(v["stops"] > 0 for v in got["stop_ranks"].values())


def test_a_top_m_beyond_the_trace_is_refused(tmp_path, capsys):
    path = saved_trace(tmp_path, 512, n=1, length=24, seed=1)  # top_f 4
    for bad in ("5", "0", "x"):
        with pytest.raises(SystemExit):
            hit_curve.main(["--trace", str(path), "--top-m", bad, "--out", str(tmp_path / "c.json")])
        assert "--top-m" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hit_curve.main(["--trace", str(path), "--max-fanout", "0", "--out", str(tmp_path / "c.json")])
    assert "--max-fanout" in capsys.readouterr().err
