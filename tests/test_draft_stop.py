"""The confidence stop: the worker ends a round's drafts after the first one the drafter is less sure of
than the block's min_conf. Wire field, the stop rule, the drafters' early exit and KV lengths, the
session's trimming and rollback, the round function's default, the depth policy's statistics and cost
model, and the engine end to end (greedy output identical to target-only)."""

from __future__ import annotations

import numpy as np
import pytest

from draftrelay import model as M
from draftrelay.engine.depth import Acceptance, DepthConfig, DepthPolicy
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.round import RoundRequest
from draftrelay.wire import protocol as P
from draftrelay.wire.roundfn import to_blocks, worker_round_fn
from draftrelay.worker import drafters
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.draft_stop import stop_counts
from draftrelay.worker.drafters import Job, LlamaDrafter
from draftrelay.worker.server import WorkerServer

# ---- wire ---------------------------------------------------------------------------------------------


def test_step_frame_carries_min_conf_per_block():
    blocks = [P.Block(1, 1, 0, np.arange(3, dtype=np.int32), 8, 0, 0.4), P.Block(2, 1, 0, [7], 8)]
    out = P.decode_step(memoryview(P.encode_step(blocks)), 4)
    assert [b.min_conf for b in out] == [pytest.approx(0.4), 0.0]
    assert out[0].min_conf == float(np.float32(0.4))  # float32 on the wire
    assert [b.tokens.tolist() for b in out] == [[0, 1, 2], [7]]


def test_step_frame_without_a_stop_is_unchanged():
    b = P.Block(5, 2, 3, np.array([1, 2], np.int32), 4, P.FLAG_END)
    expected = P.STEP_HEAD.pack(1, 0, 0) + P.BLOCK_HEAD.pack(5, 2, 3, 2, 4, P.FLAG_END) + np.array(
        [1, 2], "<i4").tobytes()
    assert P.encode_step([b]) == expected
    flags = P.STEP_HEAD.unpack_from(P.encode_step([P.Block(5, 2, 3, [1], 4, 0, 0.5)]), 0)[1]
    assert flags == P.STEP_FLAG_MIN_CONF


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x"])
def test_bad_min_conf_is_refused_by_the_encoder(bad):
    with pytest.raises(ValueError, match="min_conf"):
        P.encode_step([P.Block(1, 1, 0, [1], 4, 0, bad)])


def test_bad_min_conf_frames_are_malformed():
    good = P.encode_step([P.Block(1, 1, 0, [1], 4, 0, 0.5)])
    with pytest.raises(P.FrameError, match="MIN_CONF.*float32 thresholds") as e:
        P.decode_step(memoryview(good[:-4]), 4)  # flag set, thresholds missing
    assert e.value.code == P.MALFORMED
    bad = good[:-4] + np.array([2.0], "<f4").tobytes()
    with pytest.raises(P.FrameError, match="outside"):
        P.decode_step(memoryview(bad), 4)


# ---- the rule -------------------------------------------------------------------------------------------


def test_stop_counts_keep_the_low_draft_and_at_least_one():
    confs = np.array([[0.9, 0.3, 0.9, 0.9], [0.1, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9], [0.9, 0.2, 0.1, 0.9]],
                     np.float32)
    assert stop_counts(confs, [0.5, 0.5, 0.5, 0.0], [4, 4, 4, 4]).tolist() == [2, 1, 4, 4]
    assert stop_counts(confs, [0.5, 0.5, 0.5, 0.5], [1, 3, 3, 0]).tolist() == [1, 1, 3, 0]
    assert stop_counts(confs[:, :2], [0.95] * 4, [4] * 4).tolist() == [1, 1, 1, 1]  # fewer columns


# ---- drafters --------------------------------------------------------------------------------------------


def test_test_drafter_stops_and_keeps_the_fed_drafts_only():
    d = drafters.TestDrafter(vocab_size=500, n_rows=2, max_ctx=256, n_out_max=16)
    full_d, full_c = d.run([Job(0, 0, np.arange(6, dtype=np.int32))], 12)
    thr = float(np.sort(full_c[0, :6])[-2])  # some of the first six drafts fall below it
    m = int(stop_counts(full_c, [thr], [12])[0])
    assert 1 <= m < 12
    out_d, out_c = d.run([Job(1, 0, np.arange(6, dtype=np.int32), thr)], 12)
    assert out_d.shape[1] == m  # it stopped computing
    assert out_d[0].tolist() == full_d[0, :m].tolist()
    assert d.lengths[1] == 6 + m - 1  # the context and the drafts fed back before the stop


@pytest.fixture(scope="module")
def tiny():
    return M.tiny_pair()


@pytest.mark.parametrize("mode", ["eager", "lean"])
def test_llama_drafter_stops_early_with_the_same_drafts(tiny, mode):
    drafter = tiny[1]
    ctx = np.array(list(b"def quicksort(arr):"), np.int32)
    ref = LlamaDrafter(drafter, 2, 256, 16, "t", "", "eager")
    full_d, full_c = ref.run([Job(0, 0, ctx)], 12)
    thr = float(np.float32(np.sort(full_c[0, :5])[0] + 1e-4))  # stops at the least sure of the first five
    m = int(stop_counts(full_c, [thr], [12])[0])
    assert 1 <= m <= 5
    d = LlamaDrafter(drafter, 2, 256, 16, "t", "", mode)
    # a batch: a job without a stop keeps the STEP going to n_steps; alone, the stopping job ends it early
    both_d, _ = d.run([Job(0, 0, ctx, thr), Job(1, 0, ctx)], 12)
    assert both_d.shape[1] == 12 and both_d[1].tolist() == full_d[0].tolist()
    out_d, out_c = d.run([Job(0, 0, ctx, thr)], 12)
    assert out_d.shape[1] == m and out_d[0].tolist() == full_d[0, :m].tolist()
    assert np.allclose(out_c[0], full_c[0, :m], atol=1e-6)
    assert int(d.cache.lengths[0]) == len(ctx) + m - 1
    # the next round continues from the stopped row exactly as from a fresh one
    nxt = np.array([int(full_d[0, 0]), 7], np.int32)
    a, _ = d.run([Job(0, len(ctx), nxt)], 6)
    b, _ = LlamaDrafter(drafter, 2, 256, 16, "t", "", mode).run([Job(0, 0, np.concatenate([ctx, nxt]))], 6)
    assert a.tolist() == b.tolist()


# ---- the session -----------------------------------------------------------------------------------------


def session(core: WorkerCore, n_out: int = 16):
    s, _ = core.open_session(P.Hello(max_requests=2, n_out_max=n_out))
    return s


def test_session_trims_each_block_and_reports_partial():
    ref = WorkerCore(drafters.TestDrafter(500, 4, 256, 16))
    core = WorkerCore(drafters.TestDrafter(500, 4, 256, 16))
    s0, s1 = session(ref), session(core)
    ctx = np.arange(4, dtype=np.int32)
    full = ref.step(s0, [P.Block(1, 1, 0, ctx, 12)])
    thr = float(np.float32(np.sort(full.confidences[0, :5])[0] + 1e-4))
    m = int(stop_counts(full.confidences[:, :12], [thr], [12])[0])
    r = core.step(s1, [P.Block(1, 1, 0, ctx, 12, 0, thr), P.Block(2, 1, 0, ctx, 12)])
    assert r.counts.tolist() == [m, 12] and r.status.tolist() == [P.PARTIAL, P.OK]
    assert r.drafts[0, :m].tolist() == full.drafts[0, :m].tolist()
    assert r.drafts[1].tolist() == full.drafts[0].tolist()
    # next round: everything drafted was accepted plus a bonus token; the row reuses the m - 1 drafts it holds
    acc = np.concatenate([r.drafts[0, :m], [3]]).astype(np.int32)
    a = core.step(s1, [P.Block(1, 1, len(ctx), acc, 6)])
    b = ref.step(s0, [P.Block(1, 2, 0, np.concatenate([ctx, acc]).astype(np.int32), 6)])  # from scratch
    assert a.counts.tolist() == [6] and a.drafts[0].tolist() == b.drafts[0].tolist()


def test_round_fn_sends_the_spec_default_unless_the_request_sets_one():
    reqs = [RoundRequest(1, 1, 0, np.array([1], np.int32), 4), RoundRequest(2, 1, 0, np.array([1], np.int32), 4,
                                                                             min_conf=0.0),
            RoundRequest(3, 1, 5, np.zeros(0, np.int32), 0)]
    blocks = to_blocks(reqs, 0.3)
    assert [b.min_conf for b in blocks] == [0.3, 0.0, 0.0]  # the END block carries none
    with pytest.raises(ValueError, match="draft_stop"):
        worker_round_fn({"kind": "worker", "host": "127.0.0.1", "port": 1, "draft_stop": 3})


# ---- the depth policy ------------------------------------------------------------------------------------


def test_a_stopped_round_is_no_rejection_at_the_later_positions():
    a, b = Acceptance(8, decay=1.0), Acceptance(8, decay=1.0)
    for _ in range(20):
        a.add(8, 3, 3)  # the stop ended it after 3 drafts, all kept
        b.add(3, 3, 3)  # asked 3, all kept
    assert np.allclose(a.cond(), b.cond())  # p at positions 3.. is not pulled down by the stop
    assert a.offer()[3] < 0.15 and np.allclose(a.offer()[:3], 1.0)
    assert a.cont()[2] < 0.15 and np.allclose(a.cont()[:2], 1.0)
    assert a.drafted_dist(8)[2] > 0.85  # a cap of 8 drafts about 3
    assert a.expected_kept(8) < b.success() * 3.3


def test_without_the_stop_the_model_is_the_plain_one():
    a = Acceptance(6, decay=1.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        a.add(6, 6, int(rng.integers(0, 7)))
    assert np.allclose(a.offer(), 1.0) and np.allclose(a.cont(), 1.0)
    assert a.drafted_dist(4).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert a.expected_kept(4) == pytest.approx(a.success() * float(np.cumprod(a.cond()[:4]).sum()))


def policy_with_costs(k_max: int, fixed_rounds: bool = False) -> DepthPolicy:
    """Costs like the reference pair on the 2-core CPU: a draft 90 ms, a verify 230 ms + 12 ms a position."""
    p = DepthPolicy(k_max, DepthConfig(fixed_rounds=fixed_rounds))
    for m in (1, 2, 4, k_max):
        p.observe_round(m, 0.09 * m, 2)
    for w in (1, 2, 3, 5, k_max + 1):
        p.observe_verify(w, 0.23 + 0.012 * (w - 1))
    p.observe_host(0.001)
    p._explore_left = 0
    return p


def test_round_cost_is_booked_at_the_drafts_drafted():
    p = DepthPolicy(12)
    p.observe_round(12, 0.27, 2, drafted=3)
    p.observe_round(12, 1.08, 2, drafted=12)
    assert p.round.known(3) and p.round.known(12)
    assert p.round(3) == pytest.approx(0.27, rel=0.3) and p.round(12) > 3 * p.round(3)
    p.observe_round(4, 0.5, 2, drafted=0)  # a failed round costs its time at the depth it asked
    assert p.round.known(4)


def test_the_stop_keeps_a_deep_cap_cheap():
    """The drafter is unsure (and wrong) after 4..12 sure drafts: with the stop a round ends there, so a
    cap of 12 costs what the drafts up to the rejection cost, while a fixed k = 12 also pays for drafts
    past it. The same acceptance by position, the same costs: only the cost model of a capped round
    (Acceptance.drafted_dist) tells them apart."""
    stop, plain = policy_with_costs(12), policy_with_costs(12)
    rng = np.random.default_rng(1)
    for _ in range(60):
        run = int(rng.integers(4, 13))  # sure drafts before the unsure one, which is drafted and rejected
        stop.observe_accept(12, min(run + 1, 12), min(run, 12))
        plain.observe_accept(12, 12, min(run, 12))
    rs, rp = stop.rates(), plain.rates()
    assert np.allclose(stop.acc.cond(), plain.acc.cond())
    assert rs[12] > 1.2 * rp[12]  # a deep cap keeps its rate with the stop
    assert max(rs) >= max(rp) and int(np.argmax(rs)) >= int(np.argmax(rp))
    assert rs[12] > 0.97 * max(rs)


def test_a_fixed_depth_drafter_books_a_stopped_round_at_the_depth_it_asked():
    """A graph drafter computes all 12 drafts and returns 3: the round cost 12 drafts' time, and booked at 3
    it would make 3-draft rounds look as dear as 12-draft ones."""
    p = DepthPolicy(12, DepthConfig(fixed_rounds=True))
    p.observe_round(12, 1.08, 2, drafted=3)
    assert p.round.known(12) and not p.round.known(3)
    p.observe_round(4, 0.5, 2, drafted=0)  # a failed round: at the depth it asked, as always
    assert p.round.known(4)


def test_a_fixed_depth_drafter_prices_a_cap_at_its_full_round():
    """The same acceptance and costs as the stop test above: where every round of a cap k costs round(k),
    the cap's rate is (1 + kept) / (round(k) + verify(m + 1) averaged over m), below the stopping drafter's,
    and a deep cap no longer keeps its rate."""
    stop, fixed = policy_with_costs(12), policy_with_costs(12, fixed_rounds=True)
    rng = np.random.default_rng(1)
    for _ in range(60):
        run = int(rng.integers(4, 13))
        for pol in (stop, fixed):
            pol.observe_accept(12, min(run + 1, 12), min(run, 12))
    rs, rf = stop.rates(), fixed.rates()
    co = fixed.acc.cond() * fixed.acc.offer()
    for k in (4, 8, 12):
        dist = fixed.acc.drafted_dist(k)
        cost = sum(dist[m - 1] * (fixed.round(k) + fixed.verify(m + 1)) for m in range(1, k + 1))
        assert rf[k] == pytest.approx((1 + fixed.acc.expected_kept(k, co)) / (cost + fixed.host(0)))
        # below the stopping drafter's wherever a round of the cap stops early (runs of 4..12 sure drafts:
        # never at a cap of 4)
        assert rf[k] < rs[k] if k > 4 else rf[k] == pytest.approx(rs[k])
    assert rf[1] == pytest.approx(rs[1]) and rf[0] == pytest.approx(rs[0])  # one draft: nothing to stop
    assert rf[12] < 0.9 * max(rf)


# ---- the engine, end to end ------------------------------------------------------------------------------

PROMPTS = [list(b"Hello, world"), list(b"def quicksort(arr):"), list(b"abc")]


@pytest.fixture(scope="module")
def stop_worker(tiny):
    core = WorkerCore(LlamaDrafter(tiny[1], 8, 512, 16, M.tiny_model_id(), M.TINY_TOKENIZER_ID, "lean"),
                      max_requests=8)
    seen: list[tuple[int, int, float]] = []  # n_out, drafts returned, min_conf of every block
    finish = core._finish_frame

    def spy(s, blocks, frame):
        r = finish(s, blocks, frame)
        seen.extend((b.n_out, int(c), b.min_conf) for b, c in zip(blocks, r.counts, strict=True) if b.n_out)
        return r

    core._finish_frame = spy
    server = WorkerServer(core, "127.0.0.1", 0)
    host, port = server.start()
    yield {"kind": "worker", "host": host, "port": port, "model_id": M.tiny_model_id(), "n_out_max": 16}, seen
    server.stop()


def generate(target, mode="off", spec=None, **cfg):
    h = HandoffConfig(round_spec=spec or {"kind": "builtin"}, deadline_ms=3000, round_budget_ms=2500)
    with Engine(target, EngineConfig(mode=mode, max_batch=2, max_len=256, handoff=h, **cfg)) as eng:
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=24))
        return [r.output for r in reqs], eng.metrics()


@pytest.mark.parametrize("mode,depth", [("sync", "fixed"), ("sync", "auto"), ("async", "fixed")])
def test_engine_output_identical_with_the_stop(tiny, stop_worker, mode, depth):
    spec, seen = stop_worker
    ref, _ = generate(tiny[0])
    seen.clear()
    out, m = generate(tiny[0], mode, spec, n_draft=12, depth=depth, draft_stop=0.6)
    assert out == ref
    t = m["total"]
    assert t["rounds"]["ok"] > 0 and t["rounds"]["failed"] == 0
    assert seen and all(c == pytest.approx(float(np.float32(0.6))) for _, _, c in seen)
    assert any(n < k for k, n, _ in seen)  # some rounds came back short
    tries = t["accept_rate_by_pos"]
    assert len(tries) >= 2
    if depth == "auto":
        d = t["depth"]
        assert len(d["offered_by_pos"]) == 12 and min(d["offered_by_pos"]) < 1.0


@pytest.mark.parametrize("fixed", [False, True])
def test_the_engine_hands_fixed_rounds_to_its_depth_policy(tiny, stop_worker, fixed):
    """EngineConfig.fixed_rounds reaches the depth policy (how the policy books and prices with it: the
    DepthPolicy tests above), also when the engine makes a fresh policy for new rounds."""
    spec, _ = stop_worker
    h = HandoffConfig(round_spec=spec, deadline_ms=3000, round_budget_ms=2500)
    cfg = EngineConfig(mode="sync", max_batch=2, max_len=256, handoff=h, n_draft=12, depth="auto", draft_stop=0.6,
                       fixed_rounds=fixed)
    with Engine(tiny[0], cfg) as eng:
        assert eng.depth.cfg.fixed_rounds is fixed
        eng._new_depth_policy()
        assert eng.depth.cfg.fixed_rounds is fixed


@pytest.mark.parametrize("mode, fixed", [("lean", False), ("eager", False), ("static", True), ("test", False)])
def test_the_worker_says_whether_its_drafter_computes_every_asked_draft(tiny, mode, fixed):
    """HELLO_OK_FIXED_ROUNDS: set by a drafter in static steps (CUDA graphs are the same steps captured),
    not by one that stops computing where the stop ends its drafts; generate's handshake reads it and sets
    EngineConfig.fixed_rounds from it."""
    from draftrelay.engine import loading as L
    from draftrelay.engine.cli_generate import handshake

    d = drafters.TestDrafter() if mode == "test" else \
        LlamaDrafter(tiny[1], 4, 256, 8, M.tiny_model_id(), M.TINY_TOKENIZER_ID, mode)
    assert d.fixed_rounds is fixed
    server = WorkerServer(WorkerCore(d, max_requests=4), "127.0.0.1", 0)
    host, port = server.start()
    try:
        spec = L.worker_spec(host, port, d.model_id, d.tokenizer_hash, 4, 1)
        code, why, flags = handshake(spec)
        assert (code, why) == (0, "")
        assert bool(flags & P.HELLO_OK_FIXED_ROUNDS) is fixed
    finally:
        server.stop()


def test_engine_refuses_a_bad_stop(tiny):
    with pytest.raises(ValueError, match="draft_stop"):
        Engine(tiny[0], EngineConfig(mode="off", draft_stop=1.5))


def test_engine_without_the_stop_sends_none(tiny, stop_worker):
    spec, seen = stop_worker
    seen.clear()
    generate(tiny[0], "sync", spec, n_draft=4)
    assert seen and all(c == 0.0 and n == k for k, n, c in seen)


def test_generate_flag(capsys, tmp_path):
    from draftrelay import cli

    assert cli.main(["generate", "x", "--draft-stop", "1.5"]) == 2
    assert capsys.readouterr().err.strip().startswith("draftrelay generate: --draft-stop 1.5")
    outs = []
    for extra in (["--mode", "off"], ["--mode", "sync", "--k-max", "10", "--draft-stop", "0.6"]):
        path = tmp_path / f"m{len(outs)}.json"
        assert cli.main(["generate", "def quicksort(arr):", "--device", "cpu", "--max-tokens", "20",
                         "--progress", "off", "--json", str(path), *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
