"""The engine is lossless: greedy outputs are the target's own in every round mode, at every batch
size, with drafts that are right, wrong, corrupt, late or missing; sampling keeps the target's
distribution. Real proxy processes on the emulated stream, a real worker process on loopback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import exact_law
from draftrelay.engine.engine import Engine, EngineConfig, LocalRounds, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.model import ModelConfig, Transformer, tiny_model_id, tiny_pair
from draftrelay.testing import chi2_pvalue
from draftrelay.worker.process import start_worker_process

PROMPTS = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"abc"), list(b"speculative decoding")]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def drafter_fn(drafter: Transformer):
    """An in-process drafter with the worker's semantics (greedy drafts, rollback by position)."""
    ctx: dict[int, list[int]] = {}

    @torch.inference_mode()
    def fn(t, requests, budget_s):
        out = []
        for r in requests:
            c = ctx.setdefault(r.req_id, [])
            del c[r.position:]
            c.extend(int(x) for x in r.tokens)
            d, conf = [], []
            if r.n_out and c:
                cache = drafter.new_cache(1, len(c) + r.n_out + 1)
                lg = drafter(torch.tensor([c]), torch.tensor([0]), cache, torch.tensor([0]), last_only=True)
                for j in range(r.n_out):
                    p = torch.softmax(lg[0, -1], -1)
                    x = int(p.argmax())
                    d.append(x)
                    conf.append(float(p[x]))
                    lg = drafter(torch.tensor([[x]]), torch.tensor([len(c) + j]), cache, torch.tensor([0]))
            out.append((np.array(d, np.int32), np.array(conf, np.float32)))
        return out

    return fn


def run(target, mode="off", prompts=PROMPTS, max_batch=4, rounds=None, spec=None, k=4, on_step=None,
        max_round_tokens=4096, max_tokens=MAX_TOKENS, **hkw):
    h = HandoffConfig(round_spec=spec or {"kind": "builtin"}, **hkw)
    cfg = EngineConfig(mode=mode, n_draft=k, max_batch=max_batch, max_len=256, handoff=h,
                       max_round_tokens=max_round_tokens)
    with Engine(target, cfg, rounds=rounds) as eng:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens), on_step=on_step)
        return [r.output for r in reqs], eng.metrics()


@pytest.fixture(scope="module")
def reference(pair):
    out, m = run(pair[0], "off", max_batch=1)
    assert all(len(o) == MAX_TOKENS for o in out)
    assert m["total"]["rounds"] == {"ok": 0, "failed": 0, "watchdog": 0, "target_only": 0}
    return out


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_identical_across_modes_and_batch_sizes(pair, reference, max_batch):
    target, drafter = pair
    out, _ = run(target, "off", max_batch=max_batch)
    assert out == reference
    out, m = run(target, "sync", max_batch=max_batch, rounds=LocalRounds(drafter_fn(drafter)))
    assert out == reference
    t = m["total"]
    assert t["mean_accepted"] > 1.0  # the tiny drafter agrees with the target often
    assert t["tokens_per_step"] > 1.5
    assert len(t["accept_rate_by_pos"]) == 4 and t["accept_rate_by_pos"][0] >= t["accept_rate_by_pos"][3]
    for mode in ("sync", "async"):  # the builtin hash drafter: wrong drafts through the real hand-off
        out, m = run(target, mode, max_batch=max_batch)
        assert out == reference, mode
        assert m["total"]["round_mode"] == mode and m["total"]["rounds"]["ok"] > 0


def test_faults_cost_speed_never_tokens(pair):
    faults = dict(seed=3, p_delay=0.15, delay_ms=80, p_exception=0.1, p_disconnect=0.1, p_timeout=0.05,
                  p_bad_reply=0.1, p_corrupt=0.1)
    ref, _ = run(pair[0], "off", max_tokens=40)
    out, m = run(pair[0], "async", spec={"kind": "builtin", "faults": faults}, deadline_ms=40, max_tokens=40)
    assert out == ref
    r = m["total"]["rounds"]
    assert r["watchdog"] > 0 and r["failed"] > 0 and r["target_only"] >= r["watchdog"] + r["failed"]
    assert m["total"]["handoff"]["watchdog_fires"] > 0
    out, m = run(pair[0], "sync", spec={"kind": "builtin", "faults": faults}, max_tokens=40)
    assert out == ref and m["total"]["rounds"]["failed"] > 0


def test_kv_rolled_back_to_the_accepted_length(pair, reference):
    target, drafter = pair
    seen = []

    def check(eng):
        for r in eng.running:
            if not r.done:  # the pending token is the only one not in the target's KV
                assert int(eng.cache.lengths[r.row]) == r.seq_len - 1
                seen.append(r.id)

    out, _ = run(target, "sync", rounds=LocalRounds(drafter_fn(drafter)), on_step=check)
    assert out == reference and len(seen) > 10


def test_long_prompts_reach_the_drafter_in_bounded_rounds(pair, reference):
    target, drafter = pair
    inner = drafter_fn(drafter)
    blocks = []

    def fn(t, requests, budget_s):
        blocks.extend((r.req_id, r.position, len(r.tokens), r.n_out) for r in requests)
        return inner(t, requests, budget_s)

    out, m = run(target, "sync", rounds=LocalRounds(fn), max_round_tokens=5)
    assert out == reference
    assert max(b[2] for b in blocks) <= 5
    first = [b for b in blocks if b[0] == 1]  # PROMPTS[1] has 19 tokens: 4 catch-up blocks, no drafts
    assert [b[3] for b in first[:4]] == [0, 0, 0, 0] and first[4][3] > 0
    assert [b[1] for b in first[:5]] == [0, 5, 10, 15, 20]
    assert m["total"]["mean_accepted"] > 1.0


@pytest.fixture(scope="module")
def worker():
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env={"OMP_NUM_THREADS": "1"})
    yield w
    w.stop()


def worker_spec(w, **kw):
    return {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id(), **kw}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_real_worker(pair, reference, worker, mode):
    # generous deadlines: a loaded CI machine must not turn this into a fault test
    out, m = run(pair[0], mode, spec=worker_spec(worker), deadline_ms=3000, round_budget_ms=2500)
    assert out == reference
    t = m["total"]
    assert t["round_mode"] == mode and t["refusal"] == ""
    assert t["rounds"]["ok"] > 0 and t["rounds"]["failed"] == 0
    assert t["mean_accepted"] > 1.0  # the worker's drafter is the tiny pair's drafter
    assert all(r["generation"] == 1 for r in m["requests"])


@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_draft_path_logic_on_the_emulated_stream(pair, reference, worker, graphs):
    """The CUDA async path (verify fed from the reply buffer's bytes, drafts cross-checked against
    the host's verdict) run on the CPU: the 'device' buffer is the emulated stream's reply copy;
    graphs=True: through the decode-graph slots (ring on), eager forwards standing in for replays."""
    from draftrelay.engine.graphs import DecodeGraphs

    target = pair[0]
    h = HandoffConfig(round_spec=worker_spec(worker), deadline_ms=3000, round_budget_ms=2500)
    with Engine(target, EngineConfig(mode="async", n_draft=4, max_len=256, handoff=h)) as eng:
        assert eng.round_mode == "async" and not eng.device_drafts  # no CUDA here
        if graphs:
            eng.graphs = {T: DecodeGraphs(target, eng.cache, 4, T, ring=True, capture=False) for T in (1, 5)}
        used = []
        rounds, host_buffer = eng.rounds, eng.rounds.reply_device_buffer

        def reply_bytes(rid):  # the emulated stream's reply copy stands in for the device buffer
            p = rounds.pending(rid)
            if p is None:
                return None
            p.event.wait(10.0)  # a GPU would order this on the stream instead
            used.append(rid)
            return torch.from_numpy(host_buffer(rid))

        rounds.device_replies = True
        rounds.reply_device_buffer = reply_bytes
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        m = eng.metrics(reqs)["total"]
        verify_graph = eng.graphs.get(5)  # (a closed engine has given its graphs back)
    assert [r.output for r in reqs] == reference
    assert len(used) >= 4 and m["mean_accepted"] > 1.0
    if graphs:
        assert verify_graph.replays >= len(used)


def test_worker_identity_mismatch_is_target_only(pair, reference, worker):
    out, m = run(pair[0], "sync", spec=worker_spec(worker, model_id="some-other-model"))
    assert out == reference
    assert m["total"]["rounds"]["ok"] == 0 and m["total"]["rounds"]["failed"] > 0


def test_worker_killed_mid_run_and_replaced(pair, reference):
    """Kill the worker after a few steps, bring a fresh one up on the same port a few steps later:
    the outputs do not change; rounds fail meanwhile; the engine restarts its requests on the new
    worker (UNKNOWN_REQUEST -> higher generation, resent from position 0) and drafting resumes."""
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env={"OMP_NUM_THREADS": "1"})
    state = {"steps": 0, "w": w, "ok_after": 0}
    port = w.port

    def on_step(eng):
        state["steps"] += 1
        if state["steps"] == 3:
            state["w"].proc.kill()
            state["w"].stop()
        if state["steps"] == 6:
            state["w"] = start_worker_process(["--model", "tiny", "--device", "cpu", "--port", str(port)],
                                              env={"OMP_NUM_THREADS": "1"})
        if state["steps"] > 6:
            state["ok_after"] = sum(r.rounds["ok"] for r in eng.running + eng.finished)

    try:
        prompts = PROMPTS[:2]
        out, m = run(pair[0], "async", prompts=prompts, spec=worker_spec(w, breaker_cooldown_s=0.05),
                     max_batch=2, on_step=on_step, max_tokens=40, deadline_ms=3000, round_budget_ms=2500)
        ref, _ = run(pair[0], "off", prompts=prompts, max_tokens=40)
    finally:
        state["w"].stop()
    assert out == ref
    r = m["total"]["rounds"]
    assert r["failed"] > 0 and r["ok"] > 0 and state["steps"] > 6
    assert max(q["generation"] for q in m["requests"]) > 1  # restarted on the new worker's session
    assert m["total"]["mean_accepted"] > 0


# ---- sampling through the engine -------------------------------------------------------------------

V = 8


def small_target() -> Transformer:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      intermediate_size=48, max_position_embeddings=64)
    return Transformer.random(cfg, seed=5, std=0.25)


def test_sampled_outputs_follow_the_target_distribution():
    """Temperature 1, k = 2 point-mass drafts that are right some of the time: the joint law of the
    two tokens produced by the first speculative step equals the target's (chi-square, 64 cells,
    1,024 samples)."""
    target = small_target()
    prompt = [1, 2, 3]

    def fn(t, requests, budget_s):  # drafts: next two tokens "last+1, last+2" (mod V)
        out = []
        for r in requests:
            n = min(2, r.n_out) if len(r.tokens) else 0  # (no tokens: a finished request's END)
            last = int(r.tokens[-1]) if n else 0
            out.append((np.array([(last + j) % V for j in (1, 2)][:n], np.int32),
                        np.full(n, 0.5, np.float32)))
        return out

    n_batches, B = 64, 16
    counts = np.zeros((V, V))
    for b in range(n_batches):
        cfg = EngineConfig(mode="sync", n_draft=2, max_batch=B, max_len=32)
        with Engine(target, cfg, rounds=LocalRounds(fn)) as eng:
            ps = [SamplingParams(max_tokens=4, temperature=1.0, seed=b * B + i) for i in range(B)]
            for r in eng.generate([prompt] * B, ps):
                counts[r.output[1], r.output[2]] += 1
    # exact law of (token 2, token 3), summed over token 1
    exact = exact_law(target, prompt, V, n_tokens=3, keep=2)
    n = n_batches * B
    expected = exact * n
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > 1e-3, (pvalue, counts, expected)
    # and the test has power: the distribution greedy acceptance would produce is far from it
    assert counts.max() < 0.5 * n


# ---- metrics and bad input ----------------------------------------------------------------------------


def test_metrics_per_request_and_total(pair):
    target, drafter = pair
    out, m = run(target, "sync", rounds=LocalRounds(drafter_fn(drafter)))
    t = m["total"]
    assert t["requests"] == len(PROMPTS) and t["output_tokens"] == len(PROMPTS) * MAX_TOKENS
    assert t["tokens_per_s"] > 0 and t["step_p50_ms"] > 0 and t["ttft_s_mean"] > 0
    for r in m["requests"]:
        assert r["ttft_s"] > 0 and r["step_p50_ms"] > 0 and r["finish_reason"] == "length"
        # every step asked for drafts except possibly the last (whose token must be the target's own)
        assert r["steps"] - 1 <= r["rounds"]["ok"] <= r["steps"] and r["rounds"]["failed"] == 0
        assert 0 < r["tokens_per_step"] <= 5
        assert all(0 <= a <= 1 for a in r["accept_rate_by_pos"])


def test_stop_tokens_and_max_tokens(pair, reference):
    target, drafter = pair
    stop = reference[0][5]
    cfg = EngineConfig(mode="sync", n_draft=4, max_len=256)
    with Engine(target, cfg, rounds=LocalRounds(drafter_fn(drafter))) as eng:
        (r,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))
    first = reference[0].index(stop)
    assert r.output == reference[0][:first + 1] and r.finish_reason == "stop"


def test_bad_input_is_refused_clearly(pair):
    target = pair[0]
    with pytest.raises(ValueError, match="mode"):
        Engine(target, EngineConfig(mode="fast"))
    with Engine(target, EngineConfig(max_len=64)) as eng:
        with pytest.raises(ValueError, match="empty"):
            eng.add_request([])
        with pytest.raises(ValueError, match="vocabulary"):
            eng.add_request([1, 999])
        with pytest.raises(ValueError, match="max_len"):
            eng.add_request([1] * 40, SamplingParams(max_tokens=30))
        with pytest.raises(ValueError, match="temperature"):
            eng.add_request([1], SamplingParams(temperature=-1))
