"""What keeps a server no slower with speculation than without at any batch size, and its start-up
coverage: the per-batch-size depth policy, the round budget that follows the round's size, the
warm-up's prefill sweep and start-up requests, the worker's capture limit."""

from __future__ import annotations

import numpy as np
import pytest

from draftrelay.engine.depth import BatchDepthPolicy, DepthConfig, batch_bucket
from draftrelay.round import RoundRequest
from draftrelay.serve.cli import startup_requests
from draftrelay.serve.scheduler import SWEEP_ALL, sweep_lengths
from draftrelay.wire.roundfn import CATCH_UP_TOKENS, RoundBudget, WorkerRoundFn
from draftrelay.worker.drafters import steady_state_keys


def feed(pol: BatchDepthPolicy, batch: int, round_ms: float, verify_ms, p: float, steps: int = 200) -> None:
    """Steps at `batch` rows: every depth's round and verify costs measured, acceptance p per position."""
    pol.batch = batch
    k_max = pol.k_max
    rng = np.random.default_rng(batch)
    for _ in range(steps):
        k = pol.choose()
        if k:
            pol.observe_round(k, round_ms * (1 + 0.1 * k) / 1e3, k + 1)
        pol.observe_verify(k + 1, verify_ms(k + 1) / 1e3)
        pol.observe_host(0.0)
        if k:
            kept = 0
            while kept < k and rng.random() < p:
                kept += 1
            pol.observe_accept(k, k, kept)
    assert pol.k_max == k_max


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_speculation_steps_aside_at_the_batch_size_where_it_does_not_pay():
    pol = BatchDepthPolicy(4, DepthConfig(probe_every=10))
    # batch 1: verify flat in width (memory-bound), cheap rounds, good acceptance: speculation pays
    feed(pol, 1, round_ms=2.0, verify_ms=lambda t: 10.0, p=0.8)
    # batch 16: a verify's cost grows with its width (compute-bound) and the rounds are slow
    feed(pol, 16, round_ms=40.0, verify_ms=lambda t: 10.0 * t, p=0.8)
    pol.batch = 16
    at16 = [pol.choose() for _ in range(30)]
    assert at16.count(0) >= 25  # depth 0, but for the probe rounds
    pol.batch = 1
    at1 = [pol.choose() for _ in range(30)]
    assert at1.count(0) <= 2 and max(at1) >= 2  # batch 1 kept its own view: it still speculates
    s = pol.summary()["by_batch"]
    assert set(s) == {1, 16}
    assert s[16]["expected_tok_per_s_by_k"][0] > max(s[16]["expected_tok_per_s_by_k"][1:])
    assert s[1]["expected_tok_per_s_by_k"][0] < max(s[1]["expected_tok_per_s_by_k"][1:])


def test_failing_rounds_turn_one_batch_size_off():
    pol = BatchDepthPolicy(4, DepthConfig(probe_every=10))
    feed(pol, 2, round_ms=2.0, verify_ms=lambda t: 10.0, p=0.8)
    pol.batch = 8
    for _ in range(100):  # every round at batch 8 fails: its time is spent, no drafts come back
        k = pol.choose()
        if k:
            pol.observe_round(k, 0.15, k + 1)
            pol.observe_accept(k, 0, 0)
        pol.observe_verify(1, 0.010)
        pol.observe_host(0.0)
    assert [pol.choose() for _ in range(20)].count(0) >= 18  # depth 0, but for the probe rounds
    pol.batch = 2
    assert pol.choose() > 0


def test_batch_policy_refuses_no_depth():
    with pytest.raises(ValueError, match="k_max"):
        BatchDepthPolicy(0)


def rr(n_tokens: int) -> RoundRequest:
    return RoundRequest(req_id=1, generation=0, position=0, tokens=np.zeros(n_tokens, np.int32), n_out=4)


def test_round_budget_follows_the_rounds_size():
    b = RoundBudget(per_catch_up_s=0.01, per_token_s=1e-4)
    steady = [rr(5)] * 16
    assert b(0.15, steady) == 0.15  # k + 1 tokens each: the steady budget
    assert b(0.15, [rr(CATCH_UP_TOKENS)]) == 0.15
    one = b(0.15, [rr(CATCH_UP_TOKENS + 10)] + steady)
    assert one == pytest.approx(0.15 + 0.01 + 10 * 1e-4)
    many = b(0.15, [rr(30)] * 16)  # sixteen new requests' prompts in one round
    assert many == pytest.approx(0.15 + 16 * (0.01 + 14 * 1e-4))
    with pytest.raises(ValueError, match="per_catch_up_s"):
        RoundBudget(per_catch_up_s=-1)
    spec = RoundBudget.from_spec({"budget_per_catch_up_ms": 3, "budget_per_token_us": 7})
    assert (spec.per_catch_up_s, spec.per_token_s) == (0.003, 7e-6)


def test_worker_round_fn_passes_the_size_following_budget():
    class Client:
        def __init__(self):
            self.timeouts = []

        def step(self, blocks, timeout):
            self.timeouts.append(timeout)
            raise __import__("draftrelay.wire.client", fromlist=["WireTimeout"]).WireTimeout("late")

    c = Client()
    fn = WorkerRoundFn(c, RoundBudget(0.02, 0.0))
    for reqs in ([rr(5)], [rr(40), rr(40), rr(5)]):
        with pytest.raises(Exception, match="late"):
            fn(1, reqs, 0.1)
    assert c.timeouts == [pytest.approx(0.1), pytest.approx(0.14)]


def test_prefill_sweep_lengths_cover_every_short_prompt():
    lens = sweep_lengths(512, 4096)
    assert lens[:SWEEP_ALL] == list(range(1, SWEEP_ALL + 1))
    assert lens[-1] == 512 and lens == sorted(set(lens))
    assert sweep_lengths(512, 40) == list(range(1, 40))  # one output token must fit the row
    assert sweep_lengths(100, 4096)[-1] == 100


def test_startup_requests_take_every_path():
    reqs = startup_requests()
    gets = {p for p, b in reqs if b is None}
    assert gets == {"health", "v1/models", "metrics"}
    posts = [(p, b) for p, b in reqs if b is not None]
    for path in ("v1/completions", "v1/chat/completions"):
        mine = [b for p, b in posts if p == path]
        assert {b["stream"] for b in mine} == {True, False}
        assert {b["max_tokens"] for b in mine} >= {1, 3}
        assert any(b["temperature"] > 0 and "seed" in b for b in mine)
        assert any(b.get("stream_options", {}).get("include_usage") for b in mine)


def test_worker_capture_limit_keeps_the_buckets_a_context_needs():
    full = steady_state_keys([4], 16, 32869)
    cut = steady_state_keys([4], 16, 32869, max_kv=1000)
    assert {k[3] for k in cut} == {256, 512, 1024}
    assert set(cut) < set(full) and len(cut) == len(full) * 3 // 9
    assert steady_state_keys([4], 2, 300, max_kv=5000) == steady_state_keys([4], 2, 300)


def test_measured_rates_veto_a_depth_the_model_thinks_pays():
    # the model's view: cheap rounds, flat verify, good acceptance: it asks for drafts
    pol = BatchDepthPolicy(4, DepthConfig(probe_every=10), plain_every=8, probe_every=6)
    feed(pol, 4, round_ms=1.0, verify_ms=lambda t: 10.0, p=0.8)
    pol.batch = 4
    assert pol.current.choose() > 0
    # what the server measures: a speculative step gives 2.5 tokens per row in 50 ms, a plain one
    # 1 token in 10 ms (its own work and waits, which the cost model does not see)
    picks = []
    for _ in range(60):
        k = pol.choose()
        picks.append(k)
        pol.observe_step(0.050 if k else 0.010, 2.5 if k else 1.0)
    tail = picks[20:]
    assert tail.count(0) >= 30 and any(tail)  # vetoed, but for a probe every probe_every steps
    assert pol.vetoes[4] >= 25
    s = pol.summary()["by_batch"][4]
    assert s["measured_tok_per_s"]["plain"] > s["measured_tok_per_s"]["spec"]


def test_measured_rates_keep_speculation_where_it_measures_faster():
    pol = BatchDepthPolicy(4, DepthConfig(probe_every=10), plain_every=8)
    feed(pol, 1, round_ms=1.0, verify_ms=lambda t: 10.0, p=0.8)
    pol.batch = 1
    picks = []
    for _ in range(64):
        k = pol.choose()
        picks.append(k)
        pol.observe_step(0.012 if k else 0.010, 3.0 if k else 1.0)
    assert pol.vetoes[1] == 0
    assert 4 <= picks.count(0) <= 12  # one plain step in plain_every keeps the plain rate measured
