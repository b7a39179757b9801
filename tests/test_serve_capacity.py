"""What keeps a server no slower with speculation than without at any batch size, and its start-up
coverage: the per-batch-size depth policy, the round budget that follows the round's size, the
warm-up's prefill sweep and start-up requests, the worker's capture limit."""

from __future__ import annotations

import numpy as np
import pytest

from draftrelay.engine.depth import BatchDepthPolicy, batch_bucket
from draftrelay.round import RoundRequest
from draftrelay.serve.cli import startup_requests
from draftrelay.serve.scheduler import SWEEP_ALL, sweep_lengths
from draftrelay.wire.roundfn import CATCH_UP_TOKENS, RoundBudget, WorkerRoundFn
from draftrelay.worker.drafters import steady_state_keys


def run(pol: BatchDepthPolicy, batch: int, steps: int, plain_s: float, spec_s: float, spec_tokens: float,
        catch_up_s: float | None = None) -> list[int]:
    """Steps at `batch` rows as a server reports them: a plain step takes plain_s for one token per
    row, a speculative one spec_s for spec_tokens, one right after a plain step catch_up_s."""
    pol.batch = batch
    out = []
    for _ in range(steps):
        after_plain = not pol.last_k
        k = pol.choose()
        out.append(k)
        if k:
            pol.observe_step(catch_up_s if after_plain and catch_up_s else spec_s, spec_tokens)
        else:
            pol.observe_step(plain_s, 1.0)
    return out


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_speculation_steps_aside_at_the_batch_size_where_it_does_not_pay():
    pol = BatchDepthPolicy(4, probe_every=16)
    # batch 1: a speculative step gives 3 tokens in 1.5 plain steps' time: it pays
    at1 = run(pol, 1, 100, plain_s=0.005, spec_s=0.0075, spec_tokens=3.0)
    # batch 16: its verify is compute-bound and its rounds slow: 1.5 tokens in 2 plain steps' time
    at16 = run(pol, 16, 100, plain_s=0.010, spec_s=0.020, spec_tokens=1.5)
    assert set(at1) | set(at16) == {0, 4}  # k or nothing: the depths whose graphs the worker captured
    assert at16[20:].count(0) >= 65 and any(at16[20:])  # off, but for a probe now and then
    assert at1[20:].count(4) >= 70  # on, but for a plain step now and then
    s = pol.summary()["by_batch"]
    assert s[16]["measured_tok_per_s"]["plain"] > s[16]["measured_tok_per_s"]["spec"]
    assert s[1]["measured_tok_per_s"]["spec"] > s[1]["measured_tok_per_s"]["plain"]
    pol.batch = 1  # each class kept its own rates: batch 1 speculates again at once
    assert pol.choose() == 4


def test_catch_up_steps_are_not_counted():
    # the step after plain ones carries what the drafter missed (slow); steady ones pay
    pol = BatchDepthPolicy(4, probe_every=8)
    picks = run(pol, 4, 120, plain_s=0.005, spec_s=0.006, spec_tokens=3.0, catch_up_s=0.5)
    assert picks[40:].count(4) >= 70
    r = pol.rates[4]
    assert r.rate(True) == pytest.approx(3.0 / 0.006)
    # a step with a request the drafter has not seen yet (its prompt) is not counted either
    pol.catch_up = True
    pol.choose()
    pol.observe_step(1.0, 1.0)
    assert r.rate(True) == pytest.approx(3.0 / 0.006)


def test_a_probe_brings_speculation_back_when_it_pays_again():
    pol = BatchDepthPolicy(4, probe_every=8, probe_len=3)
    run(pol, 8, 60, plain_s=0.005, spec_s=0.050, spec_tokens=2.0)  # rounds timing out: off
    assert pol.choose() == 0
    later = run(pol, 8, 200, plain_s=0.005, spec_s=0.004, spec_tokens=3.0)  # the drafter is fast again
    assert later[-50:].count(4) >= 45
    assert pol.probes[8] >= 1


def test_batch_policy_refuses_no_depth():
    with pytest.raises(ValueError, match="k_max"):
        BatchDepthPolicy(0)
    with pytest.raises(ValueError, match="probe_len"):
        BatchDepthPolicy(4, probe_len=1)


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
    # from below: a prompt of 3,000 tokens never uses a bucket under 4,096; one longer than the rows the last
    low = steady_state_keys([4], 1, 32869, min_kv=3000)
    assert {k[3] for k in low} == {4096, 8192, 16384, 32768, 32869}
    assert {k[3] for k in steady_state_keys([4], 1, 32869, min_kv=1000, max_kv=5000)} == {1024, 2048, 4096, 8192}
    assert {k[3] for k in steady_state_keys([4], 1, 300, min_kv=9000)} == {300}


def test_the_scheduler_drives_the_batch_policy_and_greedy_output_is_unchanged():
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.handoff.rounds import HandoffConfig
    from draftrelay.model import tiny_pair
    from draftrelay.serve.cli import use_batch_depth
    from draftrelay.serve.metrics import ServeMetrics
    from draftrelay.serve.scheduler import Scheduler

    target, _ = tiny_pair()
    prompts = [[5 + i, 9, 13, 2 * i + 1] for i in range(3)]
    params = SamplingParams(max_tokens=40)

    def outputs(auto: bool) -> tuple[list[list[int]], Engine]:
        cfg = EngineConfig(mode="sync", n_draft=3, max_batch=4, max_len=128,
                           handoff=HandoffConfig(round_spec={"kind": "builtin"}))
        eng = Engine(target, cfg)
        use_batch_depth(eng, auto)
        sched = Scheduler(eng, ServeMetrics("t", lambda: {}), max_queue=4)  # its thread is not started
        reqs = [eng.add_request(p, params) for p in prompts]
        eng.prefill_waiting()
        while eng.running:
            sched._step()
        eng.close()
        return [r.output for r in reqs], eng

    plain, _ = outputs(False)
    auto, eng = outputs(True)
    assert auto == plain  # greedy: the policy changes speed only
    pol = eng.depth
    assert isinstance(pol, BatchDepthPolicy)
    assert set(pol.rates) <= {1, 2, 4} and 4 in pol.rates  # told the batch of 3 before its steps
    r = pol.rates[4]
    assert r.n[True] + r.n[False] >= 3  # the scheduler reported the steps it ran
    assert set(pol.chosen[4]) <= {0, 3}


def test_local_worker_gets_the_capture_limit(monkeypatch):
    import torch

    from draftrelay.engine import loading
    from draftrelay.worker import process

    seen = []
    monkeypatch.setattr(process, "start_worker_process", lambda args, env=None: seen.append(args))
    loading.start_local_worker("tiny", torch.device("cuda"), 4, 4096, 8, warm_batch=8, warm_max_kv=1024)
    loading.start_local_worker("tiny", torch.device("cuda"), 4, 4096, 8, warm_batch=8)
    a, b = seen
    assert a[a.index("--warm-max-kv") + 1] == "1024" and a[a.index("--warm-graphs") + 1] == "4"
    assert "--warm-max-kv" not in b and "--warm-graphs" in b
