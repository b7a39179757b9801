"""The speculation cache's guard (engine/cache_guard.py): per batch class, the fan-out or plain rounds,
whichever its own measurements say is faster, with bounded probes. Unit tests drive CacheGuard with
step costs of their own; the engine tests put it behind a worker whose branch work is slow (the guard
must go sequential) or cheap beside a slow verify (it must keep the cache), greedy output identical
either way."""

from __future__ import annotations

import time

import pytest

from draftrelay.engine.cache_guard import PLAIN, Arm, CacheGuard


def drive(g: CacheGuard, cost, steps: int, batch: int = 1, tokens: float = 3.0) -> list[int]:
    """`steps` steps of `batch` requests, each choice costing cost(its fan-out, batch) seconds; the fan-outs
    chosen (these guards have one depth: the engine's)."""
    out = []
    for _ in range(steps):
        f = g.choose(batch).fanout
        out.append(f)
        g.observe(tokens, cost(f, batch))
    return out


def test_guard_goes_sequential_where_tables_are_slower_and_probes_rarely():
    """Tables at 2x a plain step's cost: after its first window and one of plain rounds the class runs
    plain; afterwards it probes one choice per interval, and the interval doubles while the probes
    confirm plain, so over 600 steps at most a few percent of them are not plain."""
    g = CacheGuard(8, window=4, probe_every=16, max_interval=256, settle=1)
    seen = drive(g, lambda f, b: 0.010 if f == 0 else 0.020, 600)
    assert seen[:4] == [8] * 4  # the start choice: F = 8 (1 x 8 rows within the budget), one window
    assert seen[4:9] == [0] * 5  # plain rounds: the settling step after the switch, then one window
    st = g.stats()["by_batch"][1]
    assert st["best"] == "0" and st["decisions"][0] == "0"
    assert sum(f != 0 for f in seen[10:]) <= 0.05 * 590, st
    assert st["interval"] == 256 and st["probes"] >= 3
    assert set(st["chosen"]) <= {"0", "4", "8"}


def test_guard_keeps_tables_where_they_pay_and_comes_back_when_they_pay_again():
    """Tables at 0.6x a plain step: the class keeps them (plain is probed, loses). Then the costs turn (the
    worker became slow at branching): the next probe of plain rounds switches to them; when tables pay
    again, a probe of the fan-out brings them back."""
    g = CacheGuard(8, arms=[8], window=4, probe_every=8, max_interval=32, settle=1)
    fast = {0: 0.010, 8: 0.006}
    seen = drive(g, lambda f, b: fast[f], 120)
    assert g.classes[1].best == Arm(8) and sum(f == 8 for f in seen[-60:]) >= 50
    slow = {0: 0.010, 8: 0.030}
    drive(g, lambda f, b: slow[f], 120)
    assert g.classes[1].best == PLAIN
    drive(g, lambda f, b: fast[f], 200)
    assert g.classes[1].best == Arm(8)
    assert g.switches >= 4 and PLAIN in g.classes[1].decisions and Arm(8) in g.classes[1].decisions


def test_guard_decides_per_batch_class():
    """Batch 1: tables pay; batch 4 (its branch step 4 x F rows): they do not. Each class keeps its own
    choice, and batches of 3 and 4 share a class."""
    g = CacheGuard(8, arms=[8], window=3, probe_every=8, settle=0)

    def cost(f, b):
        return {1: {0: 0.010, 8: 0.006}, 4: {0: 0.012, 8: 0.030}}[4 if b > 2 else 1][f]

    for _ in range(60):
        for b in (1, 4, 3):
            f = g.choose(b).fanout
            g.observe(3.0, cost(f, b))
    by = g.stats()["by_batch"]
    assert set(by) == {1, 4}
    assert by[1]["best"] == "8" and by[4]["best"] == "0", by


def test_guard_takes_a_lower_fanout_where_it_is_faster():
    """F = 16 and F = 8 both beat plain rounds, F = 8 more so (a cheaper branch step at the same hit rate):
    the neighbour probe finds F = 8 and keeps it."""
    g = CacheGuard(16, arms=[8, 16], window=4, probe_every=8, max_interval=64, settle=1, max_rows=64)
    cost = {0: 0.010, 8: 0.005, 16: 0.007}
    drive(g, lambda f, b: cost[f], 200)
    c = g.classes[1]
    assert c.best == Arm(8) and Arm(16) in c.chosen and PLAIN in c.chosen, g.stats()


def test_guard_takes_a_shallower_depth_where_it_is_faster_per_batch_class():
    """Depths (the engine's k, 3): at one request the engine's k is the fastest (4 tokens a step in 10 ms
    against 3.4 in 9 ms at k = 3); at four requests the branch work of 32 rows makes k = 3 the faster
    (11 tokens in 22 ms against 12 in 30). Each class finds its own; pooled rates pool the tokens of
    steps of the same depth only, so k = 3 is not credited with k = 4's longer steps."""
    g = CacheGuard(8, arms=[8], depths=[None, 3], window=4, probe_every=8, max_interval=64, settle=0)
    assert g.arms == [PLAIN, Arm(8), Arm(8, 3)] and [a.label for a in g.arms] == ["0", "8", "8@3"]
    cost = {1: {PLAIN: (4.0, 0.014), Arm(8): (4.0, 0.010), Arm(8, 3): (3.4, 0.009)},
            4: {PLAIN: (12.0, 0.028), Arm(8): (12.0, 0.030), Arm(8, 3): (11.0, 0.022)}}
    for _ in range(150):
        for b in (1, 4):
            arm = g.choose(b)
            g.observe(*cost[b][arm])
    one, four = g.classes[1], g.classes[4]
    assert one.best == Arm(8) and four.best == Arm(8, 3), g.stats()
    assert Arm(8, 3) in one.chosen and PLAIN in four.chosen  # each was measured where it lost
    assert g.rate(four, Arm(8, 3)) == pytest.approx(500.0) and g.rate(four, Arm(8)) == pytest.approx(400.0)
    assert g.stats()["by_batch"][4]["best"] == "8@3"


def test_a_depth_is_rated_on_every_steps_tokens_at_that_depth():
    """Pooled rates at a shallower depth use what every recent step would have yielded there (by_depth), so
    a probe of k = 3 that falls on a hard stretch of text is not judged on its own few steps; SpecCache
    derives by_depth from each row's tokens: min(g, d + 1) at every depth d up to the step's own."""
    import types

    from draftrelay.engine.spec_cache import SpecCache

    g = CacheGuard(8, arms=[8], depths=[None, 3], window=4, settle=0, abort_ratio=10.0)
    seen = []
    while (arm := g.choose(1)) != Arm(8, 3):  # easy text at k = 4: 5 tokens a step, 4 of them at k = 3
        seen.append(arm)
        g.observe(5, 0.010 if arm == Arm(8) else 0.014, by_depth={None: 5, 3: 4})
    # the start F, plain rounds, one more step at the best, then F = 8 at k = 3
    assert seen == [Arm(8)] * 4 + [PLAIN] * 4 + [Arm(8)]
    g.observe(1, 0.009, by_depth={3: 1})  # its own step: hard text, 1 token
    c = g.classes[1]
    tokens3 = (8 * 4 + 1) / 9  # the steps' tokens at k = 3 in the windows (four a choice, one of its own)
    assert g.rate(c, Arm(8, 3)) == pytest.approx(tokens3 / 0.009)
    assert g.rate(c, Arm(8)) == pytest.approx(5 / 0.010) and g.rate(c, PLAIN) == pytest.approx(5 / 0.014)
    h = CacheGuard(8, arms=[8], window=2, settle=0)
    h.choose(1)
    h.observe(3, 0.01, by_depth={})  # a step that told no depth's tokens (a plain step at depth 0): its own
    assert h.rate(h.classes[1], Arm(8)) == pytest.approx(300.0)
    sc = SpecCache(8, guard_options={"depths": [None, 3]})
    try:
        eng = types.SimpleNamespace(cfg=types.SimpleNamespace(n_draft=4))
        assert sc._tokens_by_depth(eng, [5, 2, 4], 4) == {None: 11, 3: 10}
        assert sc._tokens_by_depth(eng, [4, 1], 3) == {3: 5}  # a step at k = 3 cannot tell k = 4's tokens
    finally:
        sc.shm.close()


def test_guard_starts_within_the_row_budget_and_plain_on_a_shared_device():
    g = CacheGuard(16, max_rows=32)  # arms 8 and 16
    assert g.arms == [PLAIN, Arm(8), Arm(16)]
    assert [g.choose(b).fanout for b in (1, 2, 4, 8)] == [16, 16, 8, 8]
    s = CacheGuard(8, start_plain=True)
    assert s.choose(1) == PLAIN and s.classes[1].todo == [Arm(8)]
    d = CacheGuard(8, arms=[8], depths=[None, 3], start_plain=True)
    assert d.choose(1) == PLAIN and d.classes[1].todo == [Arm(8), Arm(8, 3)]  # the start F, then each depth
    for bad in ({"arms": [0]}, {"window": 0}, {"max_interval": 4, "probe_every": 8}, {"margin": float("nan")},
                {"depths": [None, 0]}, {"depths": ["3"]}):
        with pytest.raises(ValueError, match="cache guard"):
            CacheGuard(8, **bad)


def test_guard_books_neither_settling_nor_unsteady_steps():
    """The step after a change of fan-out (the STEP already out was asked with the old one) and steps the
    caller calls unsteady (catch-up rounds) are not measured."""
    g = CacheGuard(8, arms=[8], window=2, settle=1)
    g.choose(1)
    g.observe(3, 0.01)
    g.choose(1)
    g.observe(3, 9.0, steady=False)  # a catch-up: not booked
    g.choose(1)
    g.observe(3, 0.01)  # the window of F = 8 is full: plain rounds next
    assert g.choose(1) == PLAIN
    g.observe(3, 9.0)  # the settling step after the switch: not booked
    assert g.classes[1].measured == {Arm(8): 2}
    g.choose(1)
    g.observe(3, 0.02)
    g.choose(1)
    g.observe(3, 0.02)
    assert g.classes[1].best == Arm(8) and g.classes[1].measured == {Arm(8): 2, PLAIN: 2}


def test_unsteady_steps_of_the_best_still_bring_the_next_probe():
    """Plain rounds won; then every step is one the caller does not measure (the depth policy asks no
    drafts on this text): the interval still runs out and the tables are probed again."""
    g = CacheGuard(8, arms=[8], window=2, probe_every=4, settle=0)
    drive(g, lambda f, b: 0.010 if f == 0 else 0.020, 6)
    c = g.classes[1]
    assert c.best == PLAIN and c.probe is None
    seen = []
    for _ in range(8):
        seen.append(g.choose(1).fanout)
        g.observe(1, 0.010, steady=False)
    assert 8 in seen, seen


def test_pooled_rates_use_the_class_tokens_own_rates_their_own():
    """Pooled: a choice measured on easy text (more tokens per step) is not credited with the text; each
    choice's rate is the class's tokens per step over its own seconds per step."""
    g = CacheGuard(8, arms=[8], window=2, settle=0)
    for tok, f_want in ((5, 8), (5, 8), (1, 0), (1, 0)):
        assert g.choose(1).fanout == f_want
        g.observe(tok, 0.01)
    c = g.classes[1]
    assert g.rate(c, PLAIN) == pytest.approx(g.rate(c, Arm(8))) == pytest.approx(300.0)
    own = CacheGuard(8, arms=[8], window=2, settle=0, pooled=False)
    for tok in (5, 5, 1, 1):
        own.choose(1)
        own.observe(tok, 0.01)
    assert own.rate(own.classes[1], Arm(8)) == pytest.approx(500.0)
    assert own.rate(own.classes[1], PLAIN) == pytest.approx(100.0)


# ---- the engine: an emulated drafter whose costs the test sets ------------------------------------------

VOCAB = 256


def trace(seed: int = 4, n: int = 3, length: int = 60, hit: float = 0.8):
    """Random target sequences; the drafter's top-1 is the target's token with probability `hit`, its
    second choice the target's token otherwise (so branches over the corrections hit)."""
    from draftrelay.replay import synthetic_trace

    tr = synthetic_trace(VOCAB, n, length, hit, seed=seed, second=True, pair="synthetic guard pair")
    for ent in tr.entries:  # probabilities, so the branch choice has something to rank
        ent.draft_prob = [[0.6, 0.3, 0.07, 0.03] for _ in ent.target]
    return tr


def run_emulated(tmp_path, step_s: float, branch_s: float, verify_s: float, F: int = 8, k: int = 4,
                 guard_options: dict | None = None):
    """Decode the trace at batch 1 through a worker process on an emulated device whose STEP costs step_s
    and whose branch work costs branch_s (each F of the guard's), with every verify made verify_s slower.
    Returns (outputs, the trace's targets, metrics)."""
    import json

    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.handoff.rounds import HandoffConfig
    from draftrelay.model import tiny_pair
    from draftrelay.replay import install_replay_target
    from draftrelay.worker.process import start_worker_process

    tr = trace()
    path = str(tmp_path / "trace.json")
    tr.save(path)
    entries = [{"jobs": 1, "n_steps": n, "kv": 256, "s": step_s} for n in range(1, k + 1)]
    entries += [{"kind": "prefetch", "jobs": 1, "fanout": f, "k": k, "kv": 256, "s": branch_s} for f in (F, F // 2)]
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"entries": entries}))
    w = start_worker_process(["--model", f"replay:{path}:emulated={cost}", "--device", "cpu", "--dtype", "float32"],
                             env={"OMP_NUM_THREADS": "1"})
    target, _ = tiny_pair()
    spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": "replay-emulated"}
    opts = {"window": 4, "probe_every": 16, "settle": 1, **(guard_options or {})}
    cfg = EngineConfig(mode="async", n_draft=k, max_batch=1, max_len=256, spec_fanout=F,
                       spec_options={"guard": True, "guard_options": opts},
                       handoff=HandoffConfig(round_spec=spec, deadline_ms=5000, round_budget_ms=4000))
    hook = install_replay_target(target, tr, n_rows=2, max_len=cfg.max_len)
    try:
        with Engine(target, cfg) as eng:
            verify = eng.verifier.verify

            def slow_verify(*a, **kw):  # a target whose verify takes verify_s more (the drafter can work beside it)
                out = verify(*a, **kw)
                time.sleep(verify_s)
                return out

            eng.verifier.verify = slow_verify
            reqs = eng.generate([e.prompt for e in tr.entries], SamplingParams(max_tokens=len(tr.entries[0].target)))
            m = eng.metrics()
    finally:
        hook.remove()
        w.stop()
    return [r.output for r in reqs], [e.target for e in tr.entries], m


def test_slow_branch_work_makes_the_guard_go_sequential(tmp_path):
    """Branch work of 100 ms after every STEP (a drafter that shares what it runs on), a 2 ms STEP, a 5 ms
    verify: a cache step waits for its table, a sequential one does not (costs ten times apart, so a
    loaded machine cannot turn them around). The guard measures both, runs plain rounds for most steps,
    and the output is the trace's."""
    out, want, m = run_emulated(tmp_path, step_s=0.002, branch_s=0.100, verify_s=0.005)
    assert out == want
    sc = m["total"]["spec_cache"]
    g = sc["guard"]["by_batch"][1]
    assert g["best"] == "0" and g["decisions"] and all(d == "0" for d in g["decisions"]), sc["guard"]
    assert g["chosen"].get("0", 0) > 2 * sum(v for a, v in g["chosen"].items() if a != "0"), g
    assert sc["plain_steps"] > 0 and sc["guard"]["switches"] >= 1
    assert m["total"]["rounds"]["failed"] == 0


def test_cheap_branch_work_beside_a_slow_verify_keeps_the_cache(tmp_path):
    """An 80 ms STEP, 1 ms of branch work and a verify made 20 ms slower: sequential steps cost the round
    plus the verify, cache steps on a hit the verify alone (the worker answers a hit's STEP from its
    branch). The guard probes plain rounds, finds them slower and keeps the cache; the output is the
    trace's."""
    out, want, m = run_emulated(tmp_path, step_s=0.080, branch_s=0.001, verify_s=0.020)
    assert out == want
    sc = m["total"]["spec_cache"]
    g = sc["guard"]["by_batch"][1]
    # (on a loaded machine the first decision can go to plain rounds; the next probe brings the cache back)
    assert g["best"] != "0" and g["decisions"] and g["decisions"][-1] != "0", sc["guard"]
    assert g["chosen"].get("0", 0) > 0  # plain rounds were measured
    assert sum(v for a, v in g["chosen"].items() if a != "0") > g["chosen"]["0"], g
    assert sc["hits"] > 0 and sc["fast_steps"] > 0


def test_a_cache_run_on_a_shared_gpu_starts_with_plain_rounds():
    """shared_gpu=True runs the cache with a worker on the engine's GPU (declined by default): there the
    guard starts every batch class with plain rounds and only probes tables. No GPU needed."""
    import torch

    from draftrelay.engine.loading import handoff_config
    from draftrelay.engine.spec_cache import SpecCache
    from draftrelay.handoff.rounds import AsyncRounds

    spec = {"kind": "worker", "host": "127.0.0.1", "port": 1}
    for shares, first in ((True, 0), (False, 8)):
        h = handoff_config(spec, torch.device("cuda"), 200, shares, host_rounds=True)
        sc = SpecCache(8, shared_gpu=True)
        try:
            h.round_spec = sc.round_spec(h.round_spec, h.round_budget_ms)
            sc.bind(AsyncRounds(h), 256, device_drafts=False)
            assert sc.active and sc.guard.start_plain is shares
            assert sc.guard.choose(1).fanout == first
        finally:
            sc.shm.close()
    with pytest.raises(ValueError, match="cache guard"):
        SpecCache(8, guard_options={"window": 0})
    # the depth of cache steps is the engine's k unless guard_options give depths
    for kw, depths in (({}, [None]), ({"guard_options": {"depths": [None, 3]}}, [None, 3])):
        c = SpecCache(8, **kw)
        try:
            assert c.guard.depths == depths, kw
        finally:
            c.shm.close()
    off = SpecCache(8, guard=False)
    adapt = SpecCache(8, adapt=True)  # the older single probe replaces the guard
    try:
        assert off.guard is None and adapt.guard is None and off.stats()["guard"] is None
    finally:
        off.shm.close()
        adapt.shm.close()


def test_proxy_sends_the_fanout_the_engine_writes():
    """The table memory's fan-out word: the round spec's F by default, the engine's F while it writes one,
    none while it writes 0 (the paused case), the spec's again once cleared."""
    from draftrelay.handoff.branch_push import BranchRounds
    from draftrelay.handoff.branch_shm import ShmError, TableShm
    from test_spec_cache_units import fanout_recorder

    inner, calls = fanout_recorder()

    shm = TableShm.create(4096)
    try:
        br = BranchRounds(inner, {"fd": shm.fd, "fanout": 8}, 256)
        for t, f in enumerate((None, 4, 0, 16, None)):
            shm.set_fanout(f)
            br(t, [], 0.1)
        assert calls == [8, 4, 0, 16, 8]
        assert br.stats["paused_steps"] == 1 and not shm.paused
        shm.set_fanout(0)
        assert shm.paused and shm.fanout(8) == 0
        with pytest.raises(ShmError, match="fan-out"):
            shm.set_fanout(-1)
        br.shm.close()
    finally:
        shm.close()


def test_a_clearly_slower_challenger_loses_without_a_full_window():
    """Plain rounds at 1.6x a cache step: the probe of them ends after min_probe booked steps (plus the
    settling step), not after a window, and the cache is back; a challenger only a little slower (1.1x)
    gets its full window."""
    g = CacheGuard(8, arms=[8], window=6, min_probe=2, abort_ratio=1.3, settle=1)
    seen = drive(g, lambda f, b: 0.016 if f == 0 else 0.010, 12)
    assert seen[:6] == [8] * 6 and seen[6:9] == [0] * 3 and seen[9:] == [8] * 3, seen
    h = CacheGuard(8, arms=[8], window=6, min_probe=2, abort_ratio=1.3, settle=1)
    seen = drive(h, lambda f, b: 0.011 if f == 0 else 0.010, 14)
    assert seen[6:13] == [0] * 7 and seen[13] == 8, seen
    assert g.classes[1].best == Arm(8) and h.classes[1].best == Arm(8)
