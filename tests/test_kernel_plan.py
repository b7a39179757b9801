"""kernels.plan without a GPU: the row buckets (one measurement and one compiled kernel per bucket),
the plan cache file (round trip, corrupt, mismatched, stale), the planning counters start-up logs."""

from __future__ import annotations

import json
import logging
import math
import sys
import types

import pytest

from draftrelay import kernels
from draftrelay.kernels import plan as P

SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936), (3584, 4608), (18944, 3584)]
META = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.5.0", "kernels": "abc", "pdl": True}


def test_row_buckets_cover_every_planned_row_count_once():
    assert [P.row_bucket(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert [list(P.bucket_rows(m)) for m in (1, 2, 3, 6, 16)] == [[1], [2], [3, 4], [5, 6, 7, 8], list(range(9, 17))]
    for bad in (0, 17):
        with pytest.raises(ValueError, match="rows"):
            P.row_bucket(bad)
    assert P.plan_key(0, P.PRO_NONE, 17, 896, 896, "bfloat16", False, False) is None  # beyond: cuBLAS


def test_a_bucket_measures_what_each_of_its_row_counts_would_and_each_choice_runs_them_all():
    for pro in (P.PRO_NONE, P.PRO_NORM, P.PRO_SILU):
        for K, N in SHAPES:
            for M in range(1, 17):
                key, cands = P.plan_key(3, pro, M, N, K, "bfloat16", True, False)
                assert key == (3, pro, P.row_bucket(M), N, K, "bfloat16", True, False)
                # nothing a row count would have measured on its own is lost to the bucket
                assert cands == P.candidates(pro, M, N, K), (pro, M, N, K)
                assert all(P.supports(c, m) for c in cands for m in P.bucket_rows(M))


def test_every_row_count_of_a_bucket_runs_the_kernel_measured_at_its_top():
    """One compile per bucket (plan.launch_key: what Triton compiles for), where rows as a constexpr
    compiled one per row count. Row count 16 and 1 differ from their neighbours only by Triton's
    integer specialisation (== 1, divisible by 16)."""
    for pro in (P.PRO_NONE, P.PRO_NORM, P.PRO_SILU):
        for K, N in SHAPES:
            for top in (2, 4, 8, 16):
                for c in P.bucket_candidates(pro, top, N, K):
                    rows = [m for m in P.bucket_rows(top) if m % 16]
                    keys = {P.launch_key(pro, c, m, N, K, "bfloat16", False, pro == P.PRO_NORM) for m in rows}
                    assert len(keys) == 1, (pro, K, N, top, c)
                    old = {P.launch_key(pro, c, m, N, K, "bfloat16", False, pro == P.PRO_NORM,
                                        (16 if c.dot else P.next_pow2(m), m)) for m in rows}
                    assert len(old) == len(rows)  # the rows as a constexpr: a kernel per row count
    s = P.SkinnyConfig(4, 1024, False, 4, 2)
    assert P.row_tiles(s, 5) == (8, 8) and P.row_tiles(s, 3) == (4, 4) and P.row_tiles(s, 1) == (1, 1)
    assert P.row_tiles(P.SkinnyConfig(16, 128, True, 4, 4), 5) == (16, 1)


def counting_measure(calls: list, times: dict | None = None):
    def measure(key, cands):
        calls.append(key)
        t = times or {}
        return {None: t.get(None, 10e-6), **{c: t.get(c, 5e-6 + 1e-7 * i) for i, c in enumerate(cands)}}
    return measure


def test_the_cache_file_round_trip_measures_nothing_on_restart(tmp_path, caplog):
    path = str(tmp_path / "sub" / "plan.json")
    key = (0, P.PRO_NORM, 8, 1152, 896, "bfloat16", True, True)
    cands = P.bucket_candidates(P.PRO_NORM, 8, 1152, 896)
    cub = (0, P.PRO_NONE, 4, 896, 896, "bfloat16", False, False)
    cub_cands = P.bucket_candidates(P.PRO_NONE, 4, 896, 896)
    calls: list = []
    first = P.Planner(counting_measure(calls, {None: 1e-6}), lambda dev: P.PlanCache(path, META))
    assert first.choose(cub, cub_cands) is None  # cuBLAS won: stored too
    first.stats = P.PlanStats()
    first.table.clear()
    won = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(path, META)).choose(key, cands)
    assert won == cands[0] and len(calls) == 2
    data = json.loads(open(path).read())
    assert data["meta"] == META and data["format"] == P.PlanCache.FORMAT and len(data["plans"]) == 2
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        again = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(path, META))
        assert again.choose(key, cands) == won and again.choose(cub, cub_cands) is None
    assert len(calls) == 2 and not caplog.records  # nothing measured, nothing to warn about
    assert again.stats.from_cache == 2 and again.stats.measured == 0 and again.stats.caches == {path}
    assert again.report[key][won.label()] == pytest.approx(5e-6) and again.report[key]["cublas"] == pytest.approx(1e-5)
    # the device index is not part of the file's key: another index of the same card finds it
    assert P.Planner(counting_measure(calls), lambda dev: P.PlanCache(path, META)).choose(
        (5, *key[1:]), cands) == won and len(calls) == 2


@pytest.mark.parametrize("content, why", [
    (b"{\"format\": 1, \"meta\": ", "unreadable"),  # cut short
    (b"\xff\xfe garbage", "unreadable"),
    (b"[1, 2]", "not a format-1"),
    (json.dumps({"format": 99, "meta": META, "plans": {}}).encode(), "not a format-1"),
    (json.dumps({"format": 1, "meta": {**META, "triton": "3.4.0"}, "plans": {}}).encode(), "triton '3.4.0'"),
    (json.dumps({"format": 1, "meta": {**META, "device": "NVIDIA A100"}, "plans": {}}).encode(), "another card"),
])
def test_a_corrupt_or_mismatched_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content, why):
    path = tmp_path / "plan.json"
    key = (0, P.PRO_NONE, 1, 896, 896, "bfloat16", False, False)
    cands = P.bucket_candidates(P.PRO_NONE, 1, 896, 896)
    if b"plans" in content:  # a mismatched file with an entry that would pick the slowest candidate
        d = json.loads(content)
        d["plans"] = {P.PlanCache.entry_key(key[1:]): {"choice": cands[-1].label(), "us": {}}}
        content = json.dumps(d).encode()
    path.write_bytes(content)
    calls: list = []
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        pl = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(str(path), META))
        assert pl.choose(key, cands) == cands[0]  # measured, not taken from the file
    assert calls == [key] and pl.stats.from_cache == 0
    assert any(why in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records), caplog.text
    d = json.loads(path.read_text())  # rewritten for this card and build
    assert d["meta"] == META and d["plans"][P.PlanCache.entry_key(key[1:])]["choice"] == cands[0].label()


def test_a_stale_entry_is_measured_again_and_a_failed_measurement_is_not_stored(tmp_path, caplog):
    path = str(tmp_path / "plan.json")
    key = (0, P.PRO_SILU, 8, 896, 4864, "bfloat16", False, False)
    cands = P.bucket_candidates(P.PRO_SILU, 8, 896, 4864)
    with open(path, "w") as f:
        json.dump({"format": 1, "meta": META, "plans": {
            P.PlanCache.entry_key(key[1:]): {"choice": "sum999x7w4s1", "us": {}},  # no such candidate now
            "junk": 5}}, f)
    calls: list = []
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        pl = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(path, META))
        assert pl.choose(key, cands) == cands[0]
    assert calls == [key] and "not a present candidate" in caplog.text
    broken = (0, P.PRO_NONE, 2, 896, 896, "bfloat16", False, False)
    pl.measure = lambda k, c: {None: 1e-5, **dict.fromkeys(c, math.inf)}
    assert pl.choose(broken, P.bucket_candidates(P.PRO_NONE, 2, 896, 896)) is None  # every candidate failed
    stored = json.load(open(path))["plans"]
    assert stored[P.PlanCache.entry_key(key[1:])]["choice"] == cands[0].label()  # the stale one replaced
    assert P.PlanCache.entry_key(broken[1:]) not in stored  # nothing learned: measured again next start
    assert "junk" not in stored  # an entry that is not a record is dropped


def test_two_processes_writing_one_file_keep_each_others_plans(tmp_path):
    path = str(tmp_path / "plan.json")
    a, b = P.PlanCache(path, META), P.PlanCache(path, META)  # both opened before either wrote
    cfg = P.SkinnyConfig(4, 1024, False, 4, 2)
    a.put((P.PRO_NONE, 1, 896, 896, "bfloat16", False, False), cfg, {"cublas": 1e-5, cfg.label(): 5e-6})
    b.put((P.PRO_NONE, 1, 3584, 3584, "bfloat16", False, False), None, {"cublas": 1e-5})
    plans = json.load(open(path))["plans"]
    assert len(plans) == 2 and sorted(p["choice"] for p in plans.values()) == ["cublas", cfg.label()]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kernel-plan-")]  # no temporary left


def test_an_unwritable_cache_only_warns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    calls: list = []
    key = (0, P.PRO_NONE, 1, 896, 896, "bfloat16", False, False)
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        pl = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(str(blocker / "plan.json"), META))
        assert pl.choose(key, P.bucket_candidates(P.PRO_NONE, 1, 896, 896)) is not None
    assert calls == [key] and "not written" in caplog.text

    def refuse(dev):
        raise RuntimeError("no device name")
    pl = P.Planner(counting_measure(calls), refuse)
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        assert pl.choose(key, P.bucket_candidates(P.PRO_NONE, 1, 896, 896)) is not None
    assert "unavailable" in caplog.text and len(calls) == 2


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTRELAY_PLAN_CACHE", raising=False)
    p1 = P.cache_path(META)
    assert p1.startswith(str(tmp_path / "draftrelay" / "kernel-plan-")) and p1.endswith(".json")
    assert P.cache_path({**META, "torch": "2.12.0"}) != p1  # another build: another file
    monkeypatch.setenv("DRAFTRELAY_PLAN_CACHE", "off")
    assert P.cache_path(META) is None
    monkeypatch.setenv("DRAFTRELAY_PLAN_CACHE", str(tmp_path / "mine.json"))
    assert P.cache_path(META) == str(tmp_path / "mine.json")


def test_planning_counters_and_the_start_up_line(monkeypatch):
    calls: list = []
    pl = P.Planner(counting_measure(calls))
    for M in (5, 6, 7, 8, 1, 16, 12):
        planned = P.plan_key(0, P.PRO_NONE, M, 896, 896, "bfloat16", False, False)
        pl.choose(*planned)
    assert [k[2] for k in calls] == [8, 1, 16]  # one measurement per bucket, at its top
    n = sum(len(P.bucket_candidates(P.PRO_NONE, m, 896, 896)) for m in (8, 1, 16))
    assert pl.stats.measured == 3 and pl.stats.candidates == n and pl.stats.seconds >= 0
    assert pl.stats.line().startswith(f"kernel plan: 3 shapes measured ({n} configurations) in ")
    assert pl.stats.summary()["from_cache"] == 0
    monkeypatch.delitem(sys.modules, "draftrelay.kernels.triton_ops", raising=False)
    assert kernels.plan_stats() is None  # the Triton kernels never loaded: nothing planned
    monkeypatch.setitem(sys.modules, "draftrelay.kernels.triton_ops", types.SimpleNamespace(PLANNER=pl))
    assert kernels.plan_stats() is pl.stats


def write_seed(path, plans: dict, device: str = "NVIDIA H200") -> str:
    path.write_text(json.dumps({"format": P.PlanCache.FORMAT, "meta": {**META, "device": device,
                                                                         "kernels": "another build"},
                                "plans": plans}))
    return str(path)


SEED_KEY = (0, P.PRO_NORM, 4, 1152, 896, "bfloat16", True, False)


def seeded_planner(tmp_path, calls, checks, plans, device="NVIDIA H200", check_ok=True, cache=True):
    seed = write_seed(tmp_path / "seed.json", plans, device)
    cache_path = str(tmp_path / "cache.json")

    def check(key, cfg):
        checks.append((key, cfg.label()))
        return check_ok
    return P.Planner(counting_measure(calls), (lambda dev: P.PlanCache(cache_path, META)) if cache else None,
                     seed_for=lambda dev: P.PlanSeed(seed, "NVIDIA H200"), check=check), cache_path


def test_a_seeded_choice_is_checked_not_timed_and_lands_in_the_cache(tmp_path):
    cands = P.bucket_candidates(P.PRO_NORM, 4, 1152, 896)
    want = cands[-1]
    calls, checks = [], []
    us = {c.label(): 5.0 for c in cands} | {want.label(): 4.0, "cublas": 6.0}  # the seed timed every candidate
    pl, cache_path = seeded_planner(tmp_path, calls, checks, {
        P.PlanCache.entry_key(SEED_KEY[1:]): {"choice": want.label(), "us": us}})
    assert pl.choose(SEED_KEY, cands) == want
    assert calls == [] and checks == [(SEED_KEY, want.label())]  # one check on this card, nothing timed
    assert pl.stats.from_seed == 1 and pl.stats.measured == 0 and "1 from the seed" in pl.stats.line()
    assert pl.report[SEED_KEY] == {k: pytest.approx(v * 1e-6) for k, v in us.items()}
    # the cache file now holds it: a restart takes it from there without even the check
    again = P.Planner(counting_measure(calls), lambda dev: P.PlanCache(cache_path, META),
                      seed_for=lambda dev: None, check=lambda k, c: pytest.fail("checked again"))
    assert again.choose(SEED_KEY, cands) == want and again.stats.from_cache == 1 and calls == []


def test_a_seeded_cublas_choice_needs_no_check(tmp_path):
    calls, checks = [], []
    pl, _ = seeded_planner(tmp_path, calls, checks, {P.PlanCache.entry_key(SEED_KEY[1:]): {"choice": "cublas"}})
    assert pl.choose(SEED_KEY, P.bucket_candidates(P.PRO_NORM, 4, 1152, 896)) is None
    assert calls == [] and checks == [] and pl.stats.from_seed == 1


@pytest.mark.parametrize("case", ["check fails", "not a candidate", "another card", "key absent"])
def test_a_seed_that_does_not_hold_here_is_measured(tmp_path, case, caplog):
    cands = P.bucket_candidates(P.PRO_NORM, 4, 1152, 896)
    label = "sum999x1w1s1" if case == "not a candidate" else cands[-1].label()
    key_str = P.PlanCache.entry_key(SEED_KEY[1:] if case != "key absent" else (P.PRO_NONE, *SEED_KEY[2:]))
    calls, checks = [], []
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        pl, _ = seeded_planner(tmp_path, calls, checks, {key_str: {"choice": label}},
                               device="NVIDIA A100" if case == "another card" else "NVIDIA H200",
                               check_ok=case != "check fails")
        got = pl.choose(SEED_KEY, cands)
    assert calls == [SEED_KEY] and pl.stats.measured == 1 and pl.stats.from_seed == 0
    assert got == cands[0]  # the measurement's winner (counting_measure: the first candidate)
    assert len(checks) == (1 if case == "check fails" else 0)
    if case == "check fails":
        assert "differs from cuBLAS" in caplog.text
    if case == "another card":
        assert "made on 'NVIDIA A100'" in caplog.text


def test_a_seed_that_never_timed_a_present_candidate_is_measured(tmp_path):
    """A seed made before a candidate was added names the best of what it timed; the newcomer could
    beat it, so the key is measured (a seed entry without its times is taken as it stands)."""
    cands = P.bucket_candidates(P.PRO_NORM, 4, 1152, 896)
    timed = {c.label(): 5.0 for c in cands} | {"cublas": 6.0}
    for us, seeded in ((timed, True), ({k: v for k, v in timed.items() if k != cands[0].label()}, False),
                       (None, True)):
        calls, checks = [], []
        entry = {"choice": "cublas"} | ({"us": us} if us is not None else {})
        pl, _ = seeded_planner(tmp_path, calls, checks, {P.PlanCache.entry_key(SEED_KEY[1:]): entry}, cache=False)
        got = pl.choose(SEED_KEY, cands)
        assert (got is None and calls == [] and pl.stats.from_seed == 1) if seeded else \
            (got == cands[0] and calls == [SEED_KEY] and pl.stats.from_seed == 0), us


def test_a_check_that_raises_is_a_failed_check(tmp_path, caplog):
    cands = P.bucket_candidates(P.PRO_NORM, 4, 1152, 896)
    seed = write_seed(tmp_path / "seed.json", {P.PlanCache.entry_key(SEED_KEY[1:]): {"choice": cands[-1].label()}})

    def boom(key, cfg):
        raise RuntimeError("no such kernel on this card")
    calls: list = []
    pl = P.Planner(counting_measure(calls), None, seed_for=lambda dev: P.PlanSeed(seed, "NVIDIA H200"), check=boom)
    with caplog.at_level(logging.WARNING, logger="draftrelay.kernels"):
        assert pl.choose(SEED_KEY, cands) == cands[0]
    assert calls == [SEED_KEY] and "no such kernel on this card" in caplog.text


def test_seed_path_follows_the_environment_and_the_card_name(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTRELAY_PLAN_SEED", raising=False)
    assert P.seed_path("No Such Card 9000") is None
    monkeypatch.setattr(P, "SEED_DIR", str(tmp_path))
    (tmp_path / "NVIDIA_H200.json").write_text("{}")
    assert P.seed_path("NVIDIA H200") == str(tmp_path / "NVIDIA_H200.json")
    monkeypatch.setenv("DRAFTRELAY_PLAN_SEED", "off")
    assert P.seed_path("NVIDIA H200") is None
    monkeypatch.setenv("DRAFTRELAY_PLAN_SEED", str(tmp_path / "mine.json"))
    assert P.seed_path("NVIDIA H200") == str(tmp_path / "mine.json")


def test_whole_shape_plans_every_bucket_at_the_first_call_and_none_later():
    calls: list = []
    pl = P.Planner(counting_measure(calls), whole_shape=True)
    key, cands = P.plan_key(0, P.PRO_SILU, 1, 896, 4864, "bfloat16", False, False)
    pl.choose(key, cands)
    assert sorted(k[2] for k in calls) == list(P.ROW_BUCKETS)  # every bucket of the shape, once
    assert all(k[:2] == key[:2] and k[3:] == key[3:] for k in calls)
    n = len(calls)
    for M in range(1, P.MAX_ROWS + 1):  # a verify, a batch, branches: nothing left to measure
        pl.choose(*P.plan_key(0, P.PRO_SILU, M, 896, 4864, "bfloat16", False, False))
    assert len(calls) == n
    other, other_cands = P.plan_key(0, P.PRO_NONE, 3, 896, 896, "bfloat16", False, False)
    pl.choose(other, other_cands)  # another shape: its own five
    assert len(calls) == n + len(P.ROW_BUCKETS)
    # each sibling was measured with its own bucket's candidates
    for k in calls:
        assert k in pl.table


def test_every_shipped_seed_names_present_candidates():
    """A shipped seed (kernels/plans/*.json) whose choices the present candidate rules no longer make
    would silently fall back to measuring at start: regenerate it (benchmarks/plan_seed.py on the card).
    So would one that never timed a present candidate (PlanSeed.get); the one exception allowed: keys whose
    untimed candidates are all swapped dot tiles (plan.candidates), added after the H200's seed was made;
    those keys are measured at start until the seed is made again on that card."""
    import glob
    import os

    files = glob.glob(os.path.join(P.SEED_DIR, "*.json"))
    assert files, "no shipped plan seed"
    for path in files:
        data = json.loads(open(path).read())
        seed = P.PlanSeed(path, data["meta"]["device"])
        assert seed.entries, path
        for key_str, e in seed.entries.items():
            pro, bucket, N, K, dt, bias, delta = key_str.split("|")
            key = (int(pro), int(bucket), int(N), int(K), dt, bias == "True", delta == "True")
            cands = P.bucket_candidates(key[0], key[1], key[2], key[3], key[4])  # an INT8 key's own
            untimed = [c for c in cands if c.label() not in e.get("us", {c.label(): 0 for c in cands})]
            if untimed:
                assert all(c.swap for c in untimed), (path, key_str, untimed)
                assert seed.get(key, cands) is P.MISSING
                continue
            assert seed.get(key, cands) is not P.MISSING, (path, key_str, e["choice"])


def _plan_seed_script():
    """benchmarks/plan_seed.py as a module (it imports its neighbours from benchmarks/)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("plan_seed_under_test", root / "plan_seed.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(root))
    return mod


def test_repick_rewrites_a_files_choices_under_the_present_rule(tmp_path, capsys):
    """benchmarks/plan_seed.py --repick: each entry is chosen again from its recorded times with plan.pick
    (cuBLAS charged CHAIN_S, then MARGIN), so a seed measured under an older rule can follow the present
    one without a GPU; entries without a cuBLAS time keep their choice."""
    mod = _plan_seed_script()
    chained_us = (10e-6 + P.CHAIN_S) * (1 - P.MARGIN) * 1e6
    plans = {
        "1|4|9728|896|bfloat16|False|True": {"choice": "cublas", "us": {"cublas": 10.0, "dot64x128w4s4": 10.3}},
        "1|8|4608|3584|bfloat16|True|False": {"choice": "cublas",
                                              "us": {"cublas": 10.0, "dot64x128w4s4": chained_us * 1.05}},
        "0|1|896|896|bfloat16|False|False": {"choice": "sum16x1024w8s2", "us": {"sum16x1024w8s2": 2.4}},
        "2|1|896|4864|bfloat16|False|False": {"choice": "sum4x1024w4s1uk5",
                                              "us": {"cublas": 8.3, "sum4x1024w4s1uk5": None}},
    }
    f = tmp_path / "seed.json"
    f.write_text(json.dumps({"format": P.PlanCache.FORMAT, "meta": {"device": "X"}, "plans": plans}))
    assert mod.repick(str(f)) == 0
    got = {k: v["choice"] for k, v in json.loads(f.read_text())["plans"].items()}
    assert got["1|4|9728|896|bfloat16|False|True"] == "dot64x128w4s4"  # 3 % slower alone, faster in a chain
    assert got["1|8|4608|3584|bfloat16|True|False"] == "cublas"  # slower than cuBLAS even with the charge
    assert got["0|1|896|896|bfloat16|False|False"] == "sum16x1024w8s2"  # no cuBLAS time: kept
    assert got["2|1|896|4864|bfloat16|False|False"] == "cublas"  # the only candidate failed: cuBLAS
    assert "2 of 4 choices changed" in capsys.readouterr().out


def test_a_seed_from_a_benchmarks_plans_keeps_only_fully_timed_keys_chosen_anew(tmp_path, capsys):
    """benchmarks/plan_seed.py --from-benchmark: each plan a fast_forward.py run measured becomes a seed entry
    chosen again among the present candidates (a label that is no longer one is dropped from its times); a
    key with a present candidate the run never timed is left out; the file loads as that card's seed."""
    mod = _plan_seed_script()
    gate = P.bucket_candidates(P.PRO_NORM, 4, 9728, 896)
    q8 = P.bucket_candidates(P.PRO_NORM, 1, 9728, 896, P.INT8)
    us = {c.label(): 10.0 for c in gate}
    us[gate[-1].label()] = 9.5
    rows = [  # the fastest label is not a present candidate here: the choice is the best present one
        {"product": "norm_linear", "M": 4, "N": 9728, "K": 896, "bias": False, "residual": True, "failed": [],
         "us": {"cublas": 12.0, "dot64x128w4s3sw": 8.0, **us}},
        # one present candidate never timed: left out
        {"product": "linear", "M": 8, "N": 3584, "K": 3584, "bias": False, "residual": False, "failed": [],
         "us": {"cublas": 11.0, "dot64x128w4s4": 9.0}},
        # every candidate failed or lost: cuBLAS
        {"product": "act_linear", "M": 1, "N": 896, "K": 4864, "bias": False, "residual": False,
         "us": {"cublas": 5.0}, "failed": [c.label() for c in P.bucket_candidates(P.PRO_SILU, 1, 896, 4864)]},
        # an int8 head's key (int8_head.py) keeps its dtype: its own entry, its own (multiply-and-sum) candidates
        {"product": "norm_linear", "M": 1, "N": 9728, "K": 896, "dtype": P.INT8, "bias": False, "residual": True,
         "failed": [], "us": {"cublas": 30.0, **{c.label(): 4.0 for c in q8}}}]
    bench = tmp_path / "fast_forward.json"
    bench.write_text(json.dumps({"machine": {"gpus": ["Card X"]}, "weights": "random bf16, real shapes",
                                 "plans": rows}))
    out = tmp_path / "seed.json"
    assert mod.from_benchmark(str(bench), str(out)) == 0
    assert "left out (a present candidate untimed there): 0|8|3584|3584|bfloat16|False|False" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["meta"] == {"device": "Card X"} and len(data["plans"]) == 3
    assert data["plans"]["1|1|9728|896|int8|False|True"]["choice"] == q8[0].label()
    e = data["plans"]["1|4|9728|896|bfloat16|False|True"]
    assert e["choice"] == gate[-1].label() and "dot64x128w4s3sw" not in e["us"]
    assert data["plans"]["2|1|896|4864|bfloat16|False|False"]["choice"] == "cublas"
    seed = P.PlanSeed(str(out), "Card X")
    assert seed.get((P.PRO_NORM, 4, 9728, 896, "bfloat16", False, True), gate) == gate[-1]
    bench.write_text(json.dumps({"machine": {"gpus": ["Card X", "Card Y"]}, "weights": "bf16", "plans": rows}))
    with pytest.raises(SystemExit, match="not one card"):
        mod.from_benchmark(str(bench), str(out))


def test_a_seeds_shapes_take_a_draft_vocabulary_head():
    """benchmarks/plan_seed.py --shapes NAME@N[+int8]: the products of a decode and a verify, and those of a drafter's
    forwards with the head restricted to ids 0..N-1 (the norm's product at one position, the plain one
    where a catch-up picks its row first), so one command makes every key a card's seed ships; a bad item
    is a clear error naming it."""
    import torch

    mod = _plan_seed_script()
    name, dtype, vocab, head_int8 = mod.parse_shape("qwen2.5-0.5b@32768")
    assert (name, dtype, vocab, head_int8) == ("qwen2.5-0.5b", torch.bfloat16, 32768, False)
    whole = mod.shapes_of(name, dtype, 4)
    both = mod.shapes_of(name, dtype, 4, draft_vocab=vocab)
    assert both - whole == {(P.PRO_NONE, 32768, 896, "bfloat16", False, False),
                            (P.PRO_NORM, 32768, 896, "bfloat16", False, True)}
    assert (P.PRO_NORM, 151936, 896, "bfloat16", False, True) in whole <= both
    assert mod.parse_shape("qwen2.5-7b:float32") == ("qwen2.5-7b", torch.float32, 0, False)
    # +int8 (worker --head-int8, --quant int8): each head read as int8 by the greedy forwards, the norm's
    # product at one position and the plain one after a catch-up picks its row; the layers' four products as
    # int8 (q|k|v with its bias, without and with a residual; the down product on stored activations only: no
    # int8 tile takes the SiLU prologue); nothing bf16 changes
    assert mod.parse_shape("qwen2.5-0.5b@32768+int8") == ("qwen2.5-0.5b", torch.bfloat16, 32768, True)
    layers = {(P.PRO_NORM, 1152, 896, P.INT8, True, False), (P.PRO_NORM, 1152, 896, P.INT8, True, True),
              (P.PRO_NONE, 896, 896, P.INT8, False, False), (P.PRO_NORM, 9728, 896, P.INT8, False, True),
              (P.PRO_NONE, 896, 4864, P.INT8, False, False)}
    quant = mod.shapes_of(name, dtype, 4, draft_vocab=vocab, head_int8=True)
    assert quant - both == layers | {(pro, n, 896, P.INT8, False, pro == P.PRO_NORM)
                                     for pro in (P.PRO_NONE, P.PRO_NORM) for n in (32768, 151936)}
    assert mod.shapes_of(name, dtype, 4, head_int8=True) - whole == layers | {
        (pro, 151936, 896, P.INT8, False, pro == P.PRO_NORM) for pro in (P.PRO_NONE, P.PRO_NORM)}
    for bad, says in (("qwen9", "unknown shape 'qwen9'"), ("qwen2.5-0.5b@x", "draft vocabulary 'x'"),
                      ("qwen2.5-0.5b@0", "between 1 and"), ("qwen2.5-0.5b:float99", "'float99'"),
                      ("qwen2.5-0.5b+int4", "'\\+int4'.*the one option is \\+int8")):
        with pytest.raises(SystemExit, match=says):
            mod.parse_shape(bad)


def test_the_h100_seed_holds_every_key_its_command_plans():
    """The shipped H100 seed is what `plan_seed.py --shapes qwen2.5-7b,qwen2.5-0.5b@32768+int8` plans, no key
    more or fewer: every product of the 7B target and of the 0.5B drafter with the restricted head, the int8
    heads and the int8 layers (worker --draft-vocab 32768 --head-int8 --quant int8), at every row bucket with
    candidates. A start on an H100 with those options then checks seeded choices and times none; a key missing
    here would be timed at every such start."""
    import os

    todo = _plan_seed_script().shapes_of_specs("qwen2.5-7b,qwen2.5-0.5b@32768+int8", 4)
    want = {P.PlanCache.entry_key((pro, b, N, K, dt, bias, delta)) for pro, N, K, dt, bias, delta in todo
            for b in P.ROW_BUCKETS if P.bucket_candidates(pro, b, N, K, dt)}
    path = os.path.join(P.SEED_DIR, "NVIDIA_H100_80GB_HBM3.json")
    got = set(json.loads(open(path).read())["plans"])
    assert any("|int8|" in k and "|9728|" in k for k in want)  # the int8 layers' keys are among them
    assert got == want, (sorted(want - got)[:5], sorted(got - want)[:5])


def test_every_shipped_seed_follows_the_present_choice_rule():
    """Each shipped choice is what plan.pick makes of the times the seed recorded: a change of the rule
    (MARGIN, CHAIN_S) without `benchmarks/plan_seed.py --repick` would ship choices the rule no longer
    makes (a seed's choices are checked on the card, never re-timed)."""
    import glob
    import os

    for path in glob.glob(os.path.join(P.SEED_DIR, "*.json")):
        for key_str, e in json.loads(open(path).read())["plans"].items():
            choice = P.pick_recorded(e["us"])
            if choice is not None:
                assert choice == e["choice"], (path, key_str, e)
