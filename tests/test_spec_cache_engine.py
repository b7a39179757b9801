"""The speculation cache end to end: a real worker process drafting branches, the real proxy process
writing branch tables, the engine selecting on the emulated stream. Greedy output equals target-only
across batch sizes and k, with every push-path fault, a watchdog-claimed round whose table comes late,
a worker killed mid-prefetch and a proxy killed; sampling keeps the target's law; the hit rate is what
a direct count from the drafter's and the target's tokens says it must be."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from conftest import exact_law
from draftrelay.checkpoint.hf import save_hf_dir
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig
from draftrelay.model import ModelConfig, Transformer, tiny_model_id, tiny_pair
from draftrelay.speculation import table as TB
from draftrelay.testing import chi2_pvalue
from draftrelay.worker.prefetch import TOP_M
from draftrelay.worker.process import start_worker_process

PROMPTS = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"abc"), list(b"speculative decoding")]
MAX_TOKENS = 24
# The workers of these tests always finish their tables (DRAFTRELAY_BRANCH_CUT=off): the tests are about hit
# steps, which cutting branch work behind a waiting STEP would make depend on this machine's speed. The cut
# has its own tests (test_branch_work_behind_a_waiting_step_is_cut_not_waited_for, test_spec_cache_units.py)
ENV = {"OMP_NUM_THREADS": "1", "DRAFTRELAY_BRANCH_CUT": "off"}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def worker():
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env=ENV)
    yield w
    w.stop()


def spec_of(w, **kw):
    return {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id(), **kw}


def run(target, spec=None, F=0, mode="async", max_batch=4, k=4, prompts=PROMPTS, max_tokens=MAX_TOKENS,
        on_step=None, deadline_ms=3000, round_budget_ms=2500, params=None, guard=False, **opts):
    # generous deadlines unless a test says otherwise: a loaded CI machine must not make this a fault test.
    # The guard (engine/cache_guard.py, on by default) is off unless a test asks for it: these tests are
    # about the cache's steps, which the guard would replace by plain ones wherever they measure slower
    opts["guard"] = guard
    h = HandoffConfig(round_spec=spec or {"kind": "builtin"}, deadline_ms=deadline_ms, round_budget_ms=round_budget_ms)
    cfg = EngineConfig(mode=mode, n_draft=k, max_batch=max_batch, max_len=256, handoff=h, spec_fanout=F,
                       spec_options=opts)
    with Engine(target, cfg) as eng:
        reqs = eng.generate(prompts, params or SamplingParams(max_tokens=max_tokens), on_step=on_step)
        m = eng.metrics()
        log = eng.spec_cache.log if eng.spec_cache is not None else None
        if isinstance(eng.rounds, AsyncRounds):
            eng.rounds.wait_settled()
    return [r.output for r in reqs], m, log


@pytest.fixture(scope="module")
def reference(pair):
    out, _, _ = run(pair[0], mode="off", max_batch=1)
    return out


@pytest.mark.parametrize("max_batch, k", [(1, 4), (3, 4), (4, 2), (2, 6)])
def test_greedy_identical_with_the_cache(pair, reference, worker, max_batch, k):
    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=max_batch, k=k)
    assert out == reference
    t = m["total"]
    sc = t["spec_cache"]
    assert sc["active"] and sc["refusal"] == ""
    assert sc["hits"] > 0 and sc["fast_steps"] > 0  # verifies that did not wait for their round
    # one request gets its F = 8; a batch's 8 a request are shared between them (Prefetcher._share)
    bpr = sc["branches_per_round"]
    assert bpr == pytest.approx(8.0) if max_batch == 1 else 1.0 <= bpr <= 16.0, bpr
    assert t["rounds"]["failed"] == 0 and t["rounds"]["watchdog"] == 0
    assert t["mean_accepted"] > 1.0
    # every round is accounted for once, waited for or settled after a fast step
    assert sc["request_rounds"] == sum(r["rounds"]["ok"] for r in m["requests"])


def test_guard_switching_fanout_and_depth_is_greedy_identical(pair, worker):
    """The guard with short windows and probes moves between plain rounds, F = 8 at the engine's k = 4 and
    F = 8 at k = 2 (CacheGuard depths): the tables drafted at one depth are looked up by steps that ask
    another, and the output is still target-only's; every hit verified the settled round's own drafts."""
    opts = {"arms": [8], "depths": [None, 2], "window": 2, "probe_every": 2, "max_interval": 4, "settle": 0,
            "min_probe": 1, "abort_ratio": 100.0}
    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=1, k=4, max_tokens=48, guard=True,
                    guard_options=opts)
    ref48, _, _ = run(pair[0], mode="off", max_batch=1, max_tokens=48)
    assert out == ref48
    sc = m["total"]["spec_cache"]
    chosen = sc["guard"]["by_batch"][1]["chosen"]
    assert {"0", "8", "8@2"} <= set(chosen) and sc["guard"]["arms"] == ["0", "8", "8@2"], sc["guard"]
    assert sc["hits"] > 0 and sc["hit_drafts_differ"] == 0 and m["total"]["rounds"]["failed"] == 0, sc


@pytest.mark.parametrize("max_batch, rule", [(1, "all"), (4, "all"), (4, "early")])
def test_confidence_stop_with_the_cache_is_greedy_identical(pair, reference, worker, max_batch, rule):
    """The worker's confidence stop (round spec draft_stop: a round's drafts end after the first unsure
    one) with the cache: rounds come back shorter than k, their tables still hold branches k deep that
    offer what a stopped round would return, the hits verify exactly those (every settled hit round
    returned the branch's drafts), and the output is target-only's."""
    out, m, log = run(pair[0], spec_of(worker, draft_stop=0.9), F=8, max_batch=max_batch, log=True,
                      wait_rule=rule, **({"table_wait_ms": 2000} if rule == "early" else {}))
    assert out == reference
    sc = m["total"]["spec_cache"]
    assert sc["hits"] > 0 and sc["fast_steps"] > 0 and sc["hit_drafts_differ"] == 0, sc
    assert m["total"]["rounds"]["failed"] == 0
    assert any(e["drafts"] is not None and 0 < len(e["drafts"]) < 4 for e in log)  # the stop cut rounds short
    assert sc["request_rounds"] == sum(r["rounds"]["ok"] for r in m["requests"]) + sc["bare_rows"]


def test_a_miss_does_not_hold_back_the_rows_that_hit(pair, reference, worker):
    """Batch 4, F = 2 (many misses): under the per-row rule a step verifies the rows that hit on their
    branches and the others without drafts or on their round tail, not waiting for the round; output
    stays target-only's and every round is booked once. The all-rows rule (the default) waits on any miss."""
    out, m, _ = run(pair[0], spec_of(worker), F=2, max_batch=4, wait_rule="rows")
    out_all, m_all, _ = run(pair[0], spec_of(worker), F=2, max_batch=4)
    assert out == reference and out_all == reference
    sc, sa = m["total"]["spec_cache"], m_all["total"]["spec_cache"]
    assert sc["wait_rule"] == "rows" and sa["wait_rule"] == "all"
    assert sc["bare_rows"] > 0 and sc["tail_rows"] > 0, sc
    assert sa["bare_rows"] == 0 and sa["tail_rows"] == 0, sa
    frac = sc["fast_steps"] / (sc["fast_steps"] + sc["waited_steps"])
    frac_all = sa["fast_steps"] / (sa["fast_steps"] + sa["waited_steps"])
    assert frac > frac_all, (sc, sa)
    for mm in (m, m_all):
        assert mm["total"]["rounds"]["failed"] == 0
        assert mm["total"]["spec_cache"]["request_rounds"] == sum(r["rounds"]["ok"] for r in mm["requests"])
    with pytest.raises(ValueError, match="wait_rule"):
        run(pair[0], spec_of(worker), F=2, wait_rule="some")


# k = 2 at F = 4: at F = 8 the confidence-calibrated branches hit nearly every lookup of the built-in models
# at k = 2 (35 of 39), which leaves no partial misses for the rule to act on
@pytest.mark.parametrize("F, k", [(2, 4), (8, 4), (4, 2)])
def test_early_lookup_lets_hit_rows_go_and_misses_ask_no_drafts(pair, reference, worker, F, k):
    """Wait rule "early", batch 4, each step waiting for its table (table_wait_ms): the table is looked up
    before the round is sent, so a step whose rows hit only in part does not wait: its missed rows verify
    no drafts and their round asks none; the next table's k = 0 entry (branches over the target's one
    token) gives them drafts again. Output stays target-only's; more steps go without waiting than under
    the all-rows rule; every request-round is booked once: the rounds that asked drafts, plus the missed
    rows' rounds that asked none."""
    out, m, log = run(pair[0], spec_of(worker), F=F, max_batch=4, k=k, wait_rule="early", table_wait_ms=2000,
                      log=True)
    out_all, m_all, _ = run(pair[0], spec_of(worker), F=F, max_batch=4, k=k)
    assert out == reference and out_all == reference
    sc, sa = m["total"]["spec_cache"], m_all["total"]["spec_cache"]
    assert sc["wait_rule"] == "early" and sc["tail_rows"] == 0
    assert sc["bare_rows"] > 0 and sc["k0_lookups"] > 0 and sc["k0_hits"] > 0, sc
    assert sc["k0_hits"] <= sc["k0_lookups"] <= sc["bare_rows"]
    frac = sc["fast_steps"] / (sc["fast_steps"] + sc["waited_steps"])
    frac_all = sa["fast_steps"] / (sa["fast_steps"] + sa["waited_steps"])
    assert frac > frac_all, (sc, sa)
    assert m["total"]["rounds"]["failed"] == 0
    ok = sum(r["rounds"]["ok"] for r in m["requests"])
    assert sc["request_rounds"] == sc["lookups"] == ok + sc["bare_rows"], (sc, ok)
    assert sc["lookups"] == sc["hits"] + sum(sc["misses"].values())
    assert sum(e["hit"] for e in log) == sc["hits"] and len(log) == sc["lookups"]
    assert set(sc["misses"]) <= {"no_match", "no_entry", "no_table"}, sc["misses"]


def test_early_lookup_with_push_faults_and_a_fixed_table_wait(pair, reference, worker):
    """Rule "early" with dropped and corrupted tables: a dropped table is waited for up to table_wait_ms,
    then the step goes on as under "all" (its lookup a miss, "late"); output stays target-only's."""
    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=2, wait_rule="early", table_wait_ms=20,
                    push_faults={"seed": 3, "p_drop": 0.3, "p_corrupt": 0.2})
    assert out == reference
    sc = m["total"]["spec_cache"]
    assert sc["hits"] > 0 and sc["misses"].get("late", 0) > 0 and sc["misses"].get("corrupt", 0) > 0, sc
    with pytest.raises(ValueError, match="table_wait_ms"):
        run(pair[0], spec_of(worker), F=2, wait_rule="early", table_wait_ms=-1)


def test_early_rule_sends_the_round_first_while_the_table_is_not_there(pair, reference):
    """Rule "early" with its default wait (a look): a worker whose every table comes 150 ms after its STEP
    (the worker the longer chain) never has the table there when a step starts, so every step is an
    "all" step (round out at once, lookups after): no row verifies without drafts, no k = 0 entry is
    looked up, lookups still hit, output stays target-only's."""
    w = start_worker_process(["--model", "tiny", "--device", "cpu"],
                             env={**ENV, "DRAFTRELAY_PREFETCH_DELAY_MS": "150"})
    try:
        out, m, _ = run(pair[0], spec_of(w), F=8, max_batch=2, prompts=PROMPTS[:2], wait_rule="early")
        ref, _, _ = run(pair[0], mode="off", prompts=PROMPTS[:2])
    finally:
        w.stop()
    assert out == ref
    sc = m["total"]["spec_cache"]
    assert sc["bare_rows"] == 0 and sc["k0_lookups"] == 0 and sc["hits"] > 0, sc


def test_adapt_turns_tables_off_when_they_do_not_pay(pair, reference, worker):
    """adapt=True with a margin no cache can beat: after one probe the tables are paused and the steps are
    ordinary ones; with a margin any cache beats, they stay on. Output is target-only's either way."""
    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=1, adapt=True, probe_steps=3, adapt_margin=1e6)
    assert out == reference
    sc = m["total"]["spec_cache"]
    assert sc["adapt"]["decisions"][0] == "plain" and sc["plain_steps"] > 0, sc
    assert "tables off" in sc["adapt"]["off_reason"] or sc["adapt"]["phase"] == "cache"
    assert m["total"]["rounds"]["failed"] == 0
    out2, m2, _ = run(pair[0], spec_of(worker), F=8, max_batch=1, adapt=True, probe_steps=3, adapt_margin=-1)
    assert out2 == reference
    sc2 = m2["total"]["spec_cache"]
    assert sc2["adapt"]["decisions"][0] == "tables" and sc2["hits"] > 0, sc2


@pytest.mark.parametrize("fault, reason", [
    ("drop", "late"), ("late", "late"), ("duplicate", "stale_entry"), ("reorder", "stale_entry"),
    ("corrupt", "corrupt"), ("forge", None),
])
def test_push_path_faults_cost_speed_never_tokens(pair, reference, worker, fault, reason):
    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=2, push_faults={"seed": 3, f"p_{fault}": 0.5})
    assert out == reference
    sc = m["total"]["spec_cache"]
    assert sc["active"] and sc["hits"] > 0  # the rounds without a fault still hit
    if reason is not None:
        assert sc["misses"].get(reason, 0) > 0, sc["misses"]
    else:  # forged tables: branches selected, their drafts wrong, the verify rejects them
        _, clean, _ = run(pair[0], spec_of(worker), F=8, max_batch=2)
        assert m["total"]["accept_rate_by_pos"][0] < clean["total"]["accept_rate_by_pos"][0] - 0.1


def test_late_table_after_a_watchdog_claim_is_never_used(pair, reference, worker):
    """Rounds held past the deadline: the watchdog releases them empty; the proxy's late reply is
    discarded and the table it pushes afterwards carries the stamp of a round the engine saw fail."""
    faults = {"seed": 1, "p_delay": 0.25, "delay_ms": 400}
    out, m, _ = run(pair[0], spec_of(worker, faults=faults), F=8, max_batch=2, deadline_ms=250)
    assert out == reference
    t = m["total"]
    assert t["handoff"]["watchdog_fires"] > 0 and t["handoff"]["late_discarded"] > 0
    assert t["spec_cache"]["misses"].get("no_table", 0) > 0 and t["spec_cache"]["hits"] > 0


def test_worker_killed_mid_prefetch_and_replaced(pair, reference):
    env = {**ENV, "DRAFTRELAY_PREFETCH_DELAY_MS": "150"}  # the worker spends most of its time prefetching
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env=env)
    state = {"steps": 0, "w": w}
    port = w.port

    def on_step(eng):
        state["steps"] += 1
        if state["steps"] == 4:
            state["w"].proc.kill()
            state["w"].stop()
        if state["steps"] == 7:
            state["w"] = start_worker_process(["--model", "tiny", "--device", "cpu", "--port", str(port)], env=ENV)

    try:
        out, m, _ = run(pair[0], spec_of(w, breaker_cooldown_s=0.05), F=8, prompts=PROMPTS[:2], max_batch=2,
                        max_tokens=40, on_step=on_step)
        ref, _, _ = run(pair[0], mode="off", prompts=PROMPTS[:2], max_tokens=40)
    finally:
        state["w"].stop()
    assert out == ref
    t = m["total"]
    assert t["rounds"]["failed"] > 0 and state["steps"] > 7
    assert max(q["generation"] for q in m["requests"]) > 1  # restarted on the new worker's session
    assert t["spec_cache"]["hits"] > 0


def test_branch_work_behind_a_waiting_step_is_cut_not_waited_for(pair):
    """A drafter whose branch work outlasts the round budget (every table 600 ms, rounds of 400 ms): with
    the cut (the default) the proxy sends the next STEP as soon as the engine posts it, the worker cuts the
    table it would come behind, and no round fails; with the cut off the same worker holds each next STEP
    behind its table and rounds time out. Output is target-only's either way."""
    ref, _, _ = run(pair[0], mode="off", prompts=PROMPTS[:2], max_tokens=12)
    got = {}
    for cut in ("on", "off"):
        w = start_worker_process(["--model", "tiny", "--device", "cpu"],
                                 env={**ENV, "DRAFTRELAY_BRANCH_CUT": cut, "DRAFTRELAY_PREFETCH_DELAY_MS": "600"})
        try:
            got[cut] = run(pair[0], spec_of(w), F=4, prompts=PROMPTS[:2], max_batch=2, max_tokens=12,
                           deadline_ms=500, round_budget_ms=400)
        finally:
            w.stop()
    for cut, (out, _m, _) in got.items():
        assert out == ref, cut
    on, off = got["on"][1]["total"], got["off"][1]["total"]
    assert on["rounds"]["failed"] == 0 and on["rounds"]["watchdog"] == 0 and on["rounds"]["ok"] > 0, on["rounds"]
    assert on["spec_cache"]["hits"] == 0  # every table was cut (empty): lookups miss, rounds answer
    assert off["rounds"]["failed"] + off["rounds"]["watchdog"] > 0, off["rounds"]


def test_proxy_killed_twice_cache_recovers(pair, reference, worker):
    steps = {"n": 0, "kills": 0}

    def on_step(eng):
        steps["n"] += 1
        if steps["n"] in (3, 8):
            eng.rounds.wait_settled()
            os.kill(eng.rounds.proxy.pid, signal.SIGKILL)
            steps["kills"] += 1

    out, m, _ = run(pair[0], spec_of(worker), F=8, max_batch=3, prompts=PROMPTS[:3], max_tokens=40,
                    on_step=on_step)
    ref, _, _ = run(pair[0], mode="off", prompts=PROMPTS[:3], max_tokens=40)
    assert out == ref and steps["kills"] == 2
    t = m["total"]
    assert t["handoff"]["respawns_used"] == 2
    # each cache step that sees a new proxy generation starts a new table epoch; on a loaded machine both
    # respawns can land between two cache steps (steps that run target-only do not look), which is
    # one new generation as the cache sees it
    assert 1 <= t["spec_cache"]["epochs"] <= t["handoff"]["respawns_used"]
    assert t["spec_cache"]["hits"] > 0


def test_cache_needs_async_rounds(pair, worker):
    out, m, _ = run(pair[0], spec_of(worker), F=8, mode="sync", max_tokens=6)
    sc = m["total"]["spec_cache"]
    assert not sc["active"] and "needs async rounds" in sc["refusal"] and sc["request_rounds"] == 0
    with pytest.raises(ValueError, match="fan-out"):
        run(pair[0], spec_of(worker), F=TB.MAX_BRANCHES + 1)


# ---- the hit rate is what the drafter's and target's tokens say -------------------------------------


def expected_hits(drafter: Transformer, seqs: dict[int, list[int]], log: list[dict], F: int) -> tuple[int, int]:
    """(sure, ambiguous) hit counts recomputed from scratch: for each table lookup, the drafter's
    distributions at the k+1 stopping places after the context, the worker's running acceptance replayed
    from the earlier lookups, choose_branches, and whether the outcome is among the F chosen. Outcomes
    within 1e-4 of the F-th candidate's probability are ambiguous (float order in a batched forward)."""
    acc = TB.Acceptance()
    sure = amb = 0
    for e in log:
        if e["drafts"] is None:
            continue
        f = np.array(e["drafts"], np.int32)
        k = len(f)
        ctx = seqs[e["request"]][:e["base"]]
        new = e["new"]
        with torch.inference_mode():
            cache = drafter.new_cache(1, len(ctx) + k + 1)
            lg = drafter(torch.tensor([ctx + f.tolist()]), torch.tensor([0]), cache, torch.tensor([0]))[0]
            probs = torch.softmax(lg[len(ctx) - 1:len(ctx) + k].float(), -1)
            tp, tt = probs.topk(TOP_M, dim=-1)
        confs = TB.draft_confs(tt.numpy(), tp.numpy(), f)
        cands = TB.choose_branches(tt.numpy(), tp.numpy(), f, acc.rates(confs), 10 ** 6)
        a = len(new) - 1
        idx = None
        if new[:a] == f[:a].tolist():
            idx = next((i for i, (ca, cy, _) in enumerate(cands) if ca == a and cy == new[a]), None)
        if idx is not None:
            p = cands[idx][2]
            near = (idx < F and len(cands) > F and p - cands[F][2] <= 1e-4) or \
                   (idx >= F and cands[F - 1][2] - p <= 1e-4)
            if near:
                amb += 1
            elif idx < F:
                sure += 1
        m = min(k, len(new) - 1)
        eq = np.asarray(new[:m]) == f[:m]
        acc.update(confs, m if eq.all() else int(np.argmin(eq)))  # what the worker observes next round
        assert e["hit"] == (e["why"] == "")
    return sure, amb


@pytest.mark.parametrize("F", [2, 8])
def test_hit_rate_equals_a_direct_count(pair, worker, F):
    target, drafter = pair
    out, m, log = run(target, spec_of(worker), F=F, max_batch=1, max_tokens=40, log=True)
    seqs = {i: PROMPTS[i] + out[i] for i in range(len(PROMPTS))}
    sure, amb = expected_hits(drafter, seqs, log, F)
    sc = m["total"]["spec_cache"]
    hits = sum(e["hit"] for e in log)
    assert hits == sc["hits"] and sc["request_rounds"] == len(log)
    assert sure <= hits <= sure + amb, (hits, sure, amb, sc)
    assert amb <= 2 and sure > 0
    # nothing missed for transport reasons: the only misses are outcomes outside the table and first rounds
    assert set(sc["misses"]) <= {"no_match", "no_entry", "no_table"}, sc["misses"]


# ---- sampling keeps the target's law ----------------------------------------------------------------

V = 8


def small_target() -> Transformer:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      intermediate_size=48, max_position_embeddings=64)
    return Transformer.random(cfg, seed=5, std=0.25)


@pytest.mark.parametrize("rule, guard", [("all", False), ("rows", False), ("early", False), ("all", True)])
def test_sampled_outputs_follow_the_target_distribution_with_the_cache(tmp_path, rule, guard):
    """Temperature 1, k = 2, the worker's drafter is the target itself (greedy drafts), F = 12 branches:
    later steps verify branch drafts without waiting. The joint law of the third and fourth output tokens
    (produced by hit steps in most samples) equals the target's exact law (chi-square, 64 cells, 1,024
    samples), under each wait rule (rows: miss rows verify their round tails or no drafts; early, each step
    waiting for its table: miss rows verify no drafts, then branches of their k = 0 entries)."""
    target = small_target()
    save_hf_dir(target, tmp_path / "m")
    # one session of B = 16 requests: the whole worker (its default share is half of its rows)
    w = start_worker_process(["--model", str(tmp_path / "m"), "--device", "cpu", "--max-ctx", "64",
                              "--max-requests", "16"], env=ENV)
    prompt = [1, 2, 3]
    n_batches, B = 64, 16
    counts = np.zeros((V, V))
    hits = rounds = 0
    try:
        spec = {"kind": "worker", "host": w.host, "port": w.port, "max_requests": B}
        h = HandoffConfig(round_spec=spec, deadline_ms=3000, round_budget_ms=2500)
        # guard: the cache guard on, probing plain rounds every 8 steps (its choices then mix plain and cache
        # steps within the samples, and the law must hold across its switches too)
        every = {"arms": [12], "max_rows": 1 << 10, "window": 3, "probe_every": 8, "max_interval": 8}
        opts = {"guard": guard, **({"guard_options": every} if guard else {})}
        cfg = EngineConfig(mode="async", n_draft=2, max_batch=B, max_len=32, handoff=h, spec_fanout=12,
                           spec_options={"wait_rule": rule, **opts,
                                         **({"table_wait_ms": 2000} if rule == "early" else {})})
        with Engine(target, cfg) as eng:
            for b in range(n_batches):
                ps = [SamplingParams(max_tokens=6, temperature=1.0, seed=b * B + i) for i in range(B)]
                for r in eng.generate([prompt] * B, ps):
                    counts[r.output[2], r.output[3]] += 1
            t = eng.metrics()["total"]
            sc = t["spec_cache"]
            hits, rounds = sc["hits"], sc["request_rounds"]
    finally:
        w.stop()
    if guard:  # both kinds of step ran, and the guard switched between them
        g = sc["guard"]
        assert g["switches"] >= 2 and sc["plain_steps"] > 0, g
        assert all(sum(c["chosen"].values()) for c in g["by_batch"].values())
    assert t["rounds"]["failed"] == 0 and t["rounds"]["watchdog"] == 0
    assert sc["active"] and hits > 0.3 * rounds and sc["fast_steps"] > 0
    assert sc["wait_rule"] == rule and (sc["tail_rows"] + sc["bare_rows"] > 0) == (rule in ("rows", "early")), sc
    exact = exact_law(target, prompt, V, n_tokens=4, keep=2)  # law of (output[2], output[3])
    n = n_batches * B
    expected = exact * n
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > 1e-3, (pvalue, counts, expected)
    assert counts.max() < 0.5 * n  # and the test has power: greedy acceptance would put most mass on one cell


# ---- the commands and the metrics ---------------------------------------------------------------


def test_generate_and_demo_with_the_cache(capsys, tmp_path, monkeypatch):
    from draftrelay import cli

    for name, value in ENV.items():  # the commands' workers inherit it: tables finished, hits not up to load
        monkeypatch.setenv(name, value)
    js = tmp_path / "m.json"
    assert cli.main(["generate", "hello", "--mode", "off", "--max-tokens", "24", "--device", "cpu"]) == 0
    ref = capsys.readouterr().out
    assert cli.main(["generate", "hello", "--mode", "async", "--spec-cache", "8", "--max-tokens", "24",
                     "--device", "cpu", "--deadline-ms", "2000", "--json", str(js)]) == 0
    cap = capsys.readouterr()
    assert cap.out == ref
    assert "[spec-cache F=8] hits" in cap.err
    sc = json.loads(js.read_text())["total"]["spec_cache"]
    assert sc["active"] and sc["hits"] > 0
    assert cli.main(["demo", "--device", "cpu", "--modes", "off,cache", "--spec-cache", "4", "--max-tokens", "16",
                     "--deadline-ms", "2000"]) == 0
    out = capsys.readouterr().out
    assert "identical in off, cache: yes" in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    assert "cache hits" in header and "no-wait verifies" in header
    cache_row = next(line for line in out.splitlines() if line.startswith("cache"))
    assert " %" in cache_row


def test_cache_arguments_are_checked(capsys):
    from draftrelay import cli

    assert cli.main(["generate", "x", "--mode", "off", "--spec-cache", "8"]) == 2
    assert "--spec-cache" in capsys.readouterr().err
    assert cli.main(["demo", "--spec-cache", "99"]) == 2
    assert "--spec-cache" in capsys.readouterr().err


def test_prometheus_metrics_of_the_cache():
    from draftrelay.handoff import metrics

    sc = {"request_rounds": 10, "hits": 7, "misses": {"no_match": 2, "late": 1}, "fast_steps": 5,
          "waited_steps": 3, "hit_rate": 0.7, "branches_per_round": 8.0, "wait_ms_mean": 1.5, "active": True}
    text = metrics.render({"mode": "async", "spec_cache": sc})
    assert "draftrelay_spec_cache_hits_total 7.0" in text
    assert 'draftrelay_spec_cache_misses_total{reason="late"} 1.0' in text
    assert "draftrelay_spec_cache_hit_rate 0.7" in text
    assert "draftrelay_spec_cache" not in metrics.render({"mode": "async"})


def test_cache_steps_at_the_policy_depth_are_greedy_identical(pair, worker, monkeypatch):
    """SpecCache(depth="policy"): each cache step asks the depth the depth policy rates best with the round
    hidden (made to cycle 4, 1, 3, 2 here, so tables drafted at one depth are looked up by steps asking
    another), the output stays target-only's, hits still verify their round's own drafts, and the policy
    learns from the cache steps: their acceptance and their verify widths."""
    from draftrelay.engine.depth import DepthPolicy

    asked = []

    def cycling(self, k_cap):
        d = (4, 1, 3, 2)[len(asked) % 4]
        asked.append(d)
        return min(d, k_cap)

    monkeypatch.setattr(DepthPolicy, "best_hidden", cycling)
    h = HandoffConfig(round_spec=spec_of(worker), deadline_ms=3000, round_budget_ms=2500)
    cfg = EngineConfig(mode="async", n_draft=4, max_batch=1, max_len=256, handoff=h, spec_fanout=8, depth="auto",
                       spec_options={"guard": False, "depth": "policy"})
    with Engine(pair[0], cfg) as eng:
        reqs = eng.generate(PROMPTS[:2], SamplingParams(max_tokens=40))
        m = eng.metrics()
        widths = set(eng.depth.verify.mean)
        tries = float(eng.depth.acc.tries.sum())  # drafts offered, booked by the cache steps alone (no guard)
        if isinstance(eng.rounds, AsyncRounds):
            eng.rounds.wait_settled()
    ref, _, _ = run(pair[0], mode="off", max_batch=1, prompts=PROMPTS[:2], max_tokens=40)
    assert [r.output for r in reqs] == ref
    sc = m["total"]["spec_cache"]
    assert sc["hits"] > 0 and sc["hit_drafts_differ"] == 0 and m["total"]["rounds"]["failed"] == 0, sc
    # verifies of several widths timed for the policy (a hit verifies its branch, as deep as the round before
    # asked: after a step of 1 draft, a step asking 3 verifies 1)
    assert len(asked) >= 8 and len(widths - {1}) >= 3, widths
    assert tries > 0
    with pytest.raises(ValueError, match="'deep'"):
        run(pair[0], spec_of(worker), F=8, max_batch=1, depth="deep")
