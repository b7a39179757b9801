"""Host staging (the engine thread stages and announces a host-packed round) and the host park (nothing
of a round is on the stream until the engine thread saw its release), on the emulated stream with the
proxy as a real separate process: same words, same verdicts, zero wrong drafts."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff import native
from draftrelay.handoff.region import W
from draftrelay.handoff.rounds import HandoffConfig, open_rounds
from draftrelay.model import tiny_pair
from draftrelay.round import RoundRequest, Status
from draftrelay.testing import STALL_POINTS, random_requests, score_in_flight, score_round

VOCAB = 5000


def cfg(**kw) -> HandoffConfig:
    base = dict(vocab_size=VOCAB, max_requests=4, max_tokens=256, max_drafts=8, deadline_ms=20.0,
                selftest_rounds=4, loss_fires=10**6)
    base.update(kw)
    return HandoffConfig(**base)


def word(r, w: W) -> int:
    return native.load32(r.region.word_addr(w))


@pytest.mark.parametrize("park,host_staging", [("stream", True), ("host", True), ("stream", False)])
def test_faulted_soak_zero_wrong_drafts(park, host_staging):
    """Two rounds in flight (the second one of each pair goes through the stream: a round is host-staged
    only when none is in flight) under every fault kind: nothing wrong is ever accepted."""
    faults = dict(seed=11, p_delay=0.004, delay_ms=35, p_exception=0.02, p_disconnect=0.02, p_timeout=0.01,
                  p_bad_reply=0.01, p_corrupt=0.01, p_stall=0.006, stall_ms=35)
    r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": faults}, park=park, host_staging=host_staging))
    assert r.mode == "async", r.refusal
    rng = np.random.default_rng(5)
    try:
        reqs_of = (random_requests(rng, t, VOCAB) for t in range(1, 3001))
        exact, wrong = score_in_flight(r, ((r.submit(q), q) for q in reqs_of), VOCAB)
        st = r.stats()
    finally:
        r.close()
    assert wrong == 0 and exact > 3000
    assert st["rounds"] == 3000 and st["ok"] + st["failed"] + st["watchdog"] == 3000
    assert st["watchdog"] > 0 and st["failed"] > 0


def test_a_host_staged_round_is_announced_before_the_stream_runs_anything():
    """Park "host": submit writes staging and `gathered` itself and queues nothing; the proxy answers the
    round; the reply copy is enqueued only once the engine thread has seen the release."""
    r = open_rounds(cfg(park="host", selftest_rounds=0, round_spec={"kind": "builtin",
                                                                      "faults": dict(p_delay=1.0, delay_ms=30)},
                        deadline_ms=500))
    try:
        req = RoundRequest(1, 1, 0, np.array([7, 8, 9], np.int32), 3)
        rid = r.submit([req])
        assert word(r, W.GATHERED) == 1 and word(r, W.CONSUMED) == 0
        assert r.pending(rid).event is None  # not armed: nothing of it on the stream
        time.sleep(0.06)  # the proxy released it meanwhile; the stream still has not copied the reply
        assert word(r, W.RELEASED) == 1 and word(r, W.CONSUMED) == 0
        res = r.result(rid, timeout_s=5)
        assert res.status == Status.OK and score_round([req], res, VOCAB) == (3, 0)
        assert word(r, W.CONSUMED) == 1
    finally:
        r.close()


def test_a_round_in_flight_keeps_the_next_one_on_the_stream():
    """Announcing round t + 1 while t is unreleased would make the proxy skip t: the second submit must
    leave `gathered` to the stream, which writes it only after t's release."""
    r = open_rounds(cfg(selftest_rounds=0, deadline_ms=2000, round_budget_ms=1500,
                        round_spec={"kind": "builtin", "faults": dict(p_delay=1.0, delay_ms=80)}))
    try:
        a = [RoundRequest(1, 1, 0, np.array([3], np.int32), 2)]
        b = [RoundRequest(1, 1, 1, np.array([4], np.int32), 2)]
        ra = r.submit(a)
        rb = r.submit(b)
        time.sleep(0.02)
        assert word(r, W.GATHERED) == 1  # round 2 waits behind round 1 on the stream
        res_a, res_b = r.result(ra, timeout_s=5), r.result(rb, timeout_s=5)
        assert res_a.status == res_b.status == Status.OK
        assert score_round(a, res_a, VOCAB)[1] == score_round(b, res_b, VOCAB)[1] == 0
        st = r.stats()
        assert st["proxy_skipped"] == 0 and st["watchdog"] == 0
    finally:
        r.close()


@pytest.mark.parametrize("point", STALL_POINTS)
def test_host_parked_round_of_a_late_proxy_is_released_by_the_watchdog(point):
    """The proxy stalls past the deadline at one point: the host park sees the watchdog's release and the
    round decodes as the watchdog's (or, stalled after its claim, as the proxy's complete reply)."""
    faults = dict(seed=0, p_stall=1.0, stall_ms=45, stall_points=[point], every=3)
    r = open_rounds(cfg(park="host", round_spec={"kind": "builtin", "faults": faults}, selftest_rounds=0))
    rng = np.random.default_rng(3)
    try:
        results = []
        for t in range(1, 10):
            reqs = random_requests(rng, t, VOCAB)
            results.append((reqs, r.result(r.submit(reqs), timeout_s=10)))
        st = r.stats()
    finally:
        r.close()
    assert sum(score_round(q, res, VOCAB)[1] for q, res in results) == 0
    stalled = [res for _, res in results if res.round % 3 == 0]
    assert len(stalled) == 3
    assert all(res.status in ((Status.OK, Status.WATCHDOG) if point == "release" else (Status.WATCHDOG,))
               for res in stalled)
    assert st["watchdog"] + st["watchdog_assists"] >= 1


def test_host_park_times_out_without_arming():
    """A bounded result() on a host-parked round that is not released yet raises and leaves it pending;
    a later result() collects it."""
    r = open_rounds(cfg(park="host", selftest_rounds=0, deadline_ms=1000, round_budget_ms=800,
                        round_spec={"kind": "builtin", "faults": dict(p_delay=1.0, delay_ms=150)}))
    try:
        req = RoundRequest(1, 1, 0, np.array([5], np.int32), 2)
        rid = r.submit([req])
        with pytest.raises(TimeoutError):
            r.result(rid, timeout_s=0.02)
        assert r.pending(rid) is not None and r.pending(rid).event is None
        res = r.result(rid, timeout_s=5)
        assert res.status == Status.OK and score_round([req], res, VOCAB)[1] == 0
    finally:
        r.close()


def test_bad_park_names_are_refused():
    with pytest.raises(ValueError, match="park"):
        _ = HandoffConfig(park="gpu").park_mode


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _generate(target, mode: str, **hkw) -> tuple[list[list[int]], dict]:
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 1, 2]]
    h = HandoffConfig(round_spec={"kind": "builtin"}, **hkw)
    with Engine(target, EngineConfig(mode=mode, n_draft=4, max_len=128, handoff=h)) as eng:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=24))
        return [r.output for r in reqs], eng.metrics()


def test_engine_greedy_output_is_the_targets_with_host_park_and_device_reply_path(pair):
    """The engine with park "host" (through result(), and through the device-reply path that waits in
    reply_device_buffer) emits exactly what target-only decoding emits."""
    target = pair[0]
    ref, _ = _generate(target, "off")
    out, m = _generate(target, "async", park="host")
    assert out == ref and m["total"]["round_mode"] == "async" and m["total"]["rounds"]["ok"] > 0

    h = HandoffConfig(round_spec={"kind": "builtin"}, park="host")
    with Engine(target, EngineConfig(mode="async", n_draft=4, max_len=128, handoff=h)) as eng:
        rounds, host_buffer = eng.rounds, eng.rounds.reply_device_buffer
        armed = []

        def reply_bytes(rid):  # the emulated stream's reply copy stands in for the device buffer
            buf = host_buffer(rid)  # blocks until the release, then enqueues the copy
            p = rounds.pending(rid)
            armed.append(p.event is not None)
            p.event.wait(10.0)  # a GPU would order this on the stream instead
            return torch.from_numpy(buf)

        rounds.device_replies = True
        rounds.reply_device_buffer = reply_bytes
        reqs = eng.generate([[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 1, 2]], SamplingParams(max_tokens=24))
        total = eng.metrics(reqs)["total"]
    assert [r.output for r in reqs] == ref
    assert armed and all(armed) and total["rounds"]["ok"] > 0


def test_the_proxy_wakes_an_engine_parked_on_the_host():
    """Park "host" with a polling proxy (the CUDA setting): the engine thread sleeps on `released` in
    half-second slices, so rounds come back fast only if the proxy's release wakes it."""
    c = cfg(park="host", wait="poll", wait_slice_us=500_000, selftest_rounds=0, deadline_ms=2000,
            round_budget_ms=1500)
    assert c.proxy_spec()["wake_release"] and not cfg(wait="poll").proxy_spec()["wake_release"]
    r = open_rounds(c)
    rng = np.random.default_rng(9)
    try:
        t0 = time.monotonic()
        for t in range(1, 21):
            reqs = random_requests(rng, t, VOCAB)
            res = r.result(r.submit(reqs), timeout_s=5)
            assert res.status == Status.OK and score_round(reqs, res, VOCAB)[1] == 0
        assert time.monotonic() - t0 < 3.0  # 20 slices unwoken would be 10 s
    finally:
        r.close()


def test_the_proxy_copies_only_the_used_part_of_a_staging_slot():
    """copy_staged: descriptor, table and the counted tokens reach the private buffer (the parse gives
    the packed requests back); the rest of the slot is not copied; a count past the slot is clamped."""
    from draftrelay.handoff.proxy import copy_staged
    from draftrelay.handoff.region import Layout, RegionConfig, pack_staging, unpack_staging

    L = Layout(RegionConfig(4, 256, 8, VOCAB))
    reqs = random_requests(np.random.default_rng(2), 1, VOCAB)
    staged = np.full(L.staging_size, 0x5A, np.uint8)
    pack_staging(L, 7, reqs, out=staged)
    private = np.full(L.staging_size, 0xAB, np.uint8)
    copy_staged(L, private, staged)
    _, got = unpack_staging(L, private, 7)
    assert [(r.req_id, r.position, r.tokens.tolist(), r.n_out) for r in got] == \
           [(r.req_id, r.position, np.asarray(r.tokens).tolist(), r.n_out) for r in reqs]
    used = L.staging_tok_off + 4 * sum(len(r.tokens) for r in reqs)
    assert (private[used:] == 0xAB).all()  # the unused tokens of the slot stayed where they were
    staged[8:12] = np.frombuffer(np.uint32(10**6).tobytes(), np.uint8)  # a torn count
    copy_staged(L, private, staged)  # clamped to the slot: no error here, the parse refuses it
    with pytest.raises(ValueError):
        unpack_staging(L, private, 7)


def test_a_recovery_while_a_round_is_host_parked_releases_it_with_zero_drafts():
    """The proxy is killed while the engine thread waits for a host-parked round: the stream has nothing
    of it to drain, the recovery resets the words and respawns; the waiter takes the new generation as
    the end of its round, puts nothing on the stream (its ops would land after the reset), the round
    decodes with zero drafts, and rounds after the respawn are exact again."""
    import os
    import signal

    r = open_rounds(cfg(park="host", selftest_rounds=1, deadline_ms=5000, round_budget_ms=4000,
                        round_spec={"kind": "builtin", "faults": dict(p_delay=1.0, delay_ms=3000)}))
    try:
        req = RoundRequest(1, 1, 0, np.array([5, 6], np.int32), 3)
        rid = r.submit([req])
        os.kill(r.proxy.pid, signal.SIGKILL)
        t0 = time.monotonic()
        res = r.result(rid, timeout_s=10)
        assert time.monotonic() - t0 < 2.5  # ended by the recovery, not by the 3 s delay or the deadline
        assert res.counts.sum() == 0 and res.status != Status.OK
        assert r.wait_settled() == "live" and r.stats()["generation"] == 1
        assert r.stats()["watchdog_fires"] == 0 and word(r, W.CONSUMED) == 0  # no op of it after the reset
    finally:
        r.close()
