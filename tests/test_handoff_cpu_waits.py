"""The CPU hand-off's waits: what the engine side and the proxy cost while a round is out and between
rounds, and the emulated stream's inline runs (EmulatedStream.inline: the engine thread that waits for
a host-staged round's reply runs the stream's part of it; nothing wakes the stream thread).

CPU time, never wall time: the time a thread or process spent on a CPU (/proc/.../schedstat, in ns) over
a window in which it should only sleep. The bounds are far above what a sleeping waiter costs and far
below what a polling one does (a 50 µs spin per wait, a 20 µs nap loop: milliseconds per window)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from draftrelay.engine.loading import handoff_config
from draftrelay.handoff import native
from draftrelay.handoff.region import Region, RegionConfig, W
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig, open_rounds
from draftrelay.handoff.stream import EmulatedStream
from draftrelay.round import RoundRequest
from draftrelay.testing import deterministic_draft

VOCAB = 5000


def cpu_ns(pid: int | str = "self", tid: int | None = None) -> int:
    """CPU time a process (all its threads) or one thread of it has run, in ns."""
    if tid is not None:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return total


def request(i: int, n_out: int = 4) -> RoundRequest:
    return RoundRequest(i % 7, 1, 3 * i, np.arange(i % 5 + 1, dtype=np.int32), n_out)


def assert_exact(req: RoundRequest, res) -> None:
    want, _ = deterministic_draft(req, VOCAB)
    assert res.ok and int(res.counts[0]) == req.n_out and np.array_equal(res.drafts[0, :req.n_out], want)


def cpu_config(spec: dict, **kw) -> HandoffConfig:
    """The hand-off `draftrelay demo` / `generate` open on a CPU (engine.loading.handoff_config)."""
    h = handoff_config(spec, torch.device("cpu"), 500.0, True, vocab_size=VOCAB, max_requests=4,
                       max_tokens=256, max_drafts=8, selftest_rounds=2, loss_fires=10**6, **kw)
    assert h.wait_mode == "block" and h.backend == "emulated" and h.spin_us == 0 and h.stream_spin_us == 0
    return h


def test_the_stream_thread_does_nothing_for_host_staged_rounds():
    """Every host-staged round's reply is copied by the engine thread waiting for it: inline_runs counts
    them and the stream thread stays asleep. Without the inline runs it wakes for each round (and spins
    50 µs there with HandoffConfig's default stream spin): milliseconds of CPU over 200 rounds."""
    r = open_rounds(HandoffConfig(vocab_size=VOCAB, max_requests=4, max_tokens=256, max_drafts=8,
                                  selftest_rounds=2, loss_fires=10**6, deadline_ms=500.0))
    assert isinstance(r, AsyncRounds), r.refusal
    try:
        st = r.stream
        assert isinstance(st, EmulatedStream) and st.inline
        runs0, tid = st.inline_runs, st._thread.native_id
        busy0 = cpu_ns(tid=tid)
        for i in range(200):
            q = [request(i)]
            assert_exact(q[0], r.result(r.submit(q), timeout_s=5.0))
        busy = cpu_ns(tid=tid) - busy0
        assert st.inline_runs - runs0 == 200
        assert busy < 1_000_000, f"the stream thread ran {busy / 1e6:.2f} ms over 200 rounds"
        assert native.load32(r.region.word_addr(W.CONSUMED)) == native.load32(r.region.word_addr(W.RELEASED))
    finally:
        r.close()


def test_a_round_out_and_the_gap_between_rounds_cost_the_cpu_nothing():
    """The CPU hand-off while a round is out for 300 ms (the proxy's round function sleeps: a slow
    worker), and while the engine verifies for 300 ms before its next round: the engine process (every
    thread: its waiting thread, the watchdog, the supervisor, the stream thread) and the proxy process
    stay asleep. A spinning or napping wait on either side costs tens of ms per window."""
    r = open_rounds(cpu_config({"kind": "builtin", "faults": dict(p_delay=1.0, delay_ms=300)},
                               round_budget_ms=1000.0))
    assert isinstance(r, AsyncRounds), r.refusal
    try:
        pid = r.proxy.pid
        for i in range(3):
            q = [request(i)]
            t = r.submit(q)
            time.sleep(0.02)  # the proxy is in its round now (a 300 ms sleep)
            engine0, proxy0 = cpu_ns(), cpu_ns(pid)
            res = r.result(t, timeout_s=5.0)
            out = cpu_ns() - engine0, cpu_ns(pid) - proxy0
            assert_exact(q[0], res)
            # the window covers ~280 ms of round: the wake-ups at its end (the engine thread's decode of the
            # reply included) are a fraction of a millisecond
            assert out[0] < 10_000_000 and out[1] < 5_000_000, f"round out: engine, proxy CPU {out} ns"
            engine0, proxy0 = cpu_ns(), cpu_ns(pid)
            time.sleep(0.3)  # the "verify": the proxy waits for the next round's announcement
            gap = cpu_ns() - engine0, cpu_ns(pid) - proxy0
            assert gap[0] < 10_000_000 and gap[1] < 3_000_000, f"between rounds: engine, proxy CPU {gap} ns"
    finally:
        r.close()


# -- the deferred batch's order and its ends, on a bare region (no proxy) ---------------------------

@pytest.fixture
def bare():
    region = Region.create(RegionConfig(2, 64, 4, VOCAB))
    st = EmulatedStream(region, spin_us=0, wait="block", slice_us=20_000)
    L = region.layout
    offs = (L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED))
    region.reply_view(0)[:8] = np.arange(8, dtype=np.uint8) + 1  # what the reply copy must bring
    try:
        yield region, st, offs
    finally:
        st.close()
        region.close()


def release(region: Region, t: int) -> None:
    native.store_max32_wake(region.word_addr(W.RELEASED), t)


def test_a_batch_recorded_after_a_deferred_one_runs_after_it(bare):
    """Nobody waits for the deferred reply batch, a later batch needs the thread: the thread gets both, in
    order (the later one's event only after the release the deferred one waits for)."""
    region, st, offs = bare
    dst = np.zeros(region.layout.reply_size, np.uint8)
    ev1 = st.enqueue_reply(0, 1, dst, offs)
    ev2 = st.record()
    time.sleep(0.05)
    assert not ev2.query() and not ev1.query()  # the thread sleeps on `released` for the deferred batch
    release(region, 1)
    assert ev2.wait(2.0) and ev1.wait(0)
    assert st.inline_runs == 0 and native.load32(region.word_addr(W.CONSUMED)) == 1
    assert np.array_equal(dst[:8], np.arange(8, dtype=np.uint8) + 1)


def test_an_inline_wait_that_times_out_resumes_later(bare):
    """wait(timeout) on the deferred batch gives up on `released` without running what follows; a later
    wait finishes it on the waiting thread (no copy, no `consumed` before the release)."""
    region, st, offs = bare
    dst = np.zeros(region.layout.reply_size, np.uint8)
    ev = st.enqueue_reply(0, 1, dst, offs)
    assert not ev.wait(0.03) and not ev.query()
    assert native.load32(region.word_addr(W.CONSUMED)) == 0 and not dst.any()
    release(region, 1)
    assert ev.wait(1.0) and st.inline_runs == 1 and native.load32(region.word_addr(W.CONSUMED)) == 1
    assert np.array_equal(dst[:8], np.arange(8, dtype=np.uint8) + 1)


def test_a_batch_recorded_while_a_waiter_runs_the_deferred_one_waits_for_it(bare):
    """A thread sleeps inline on the deferred batch's `released`; another records a batch meanwhile (the
    supervisor's drain): it is held and runs on the stream thread only after the deferred batch."""
    region, st, offs = bare
    dst = np.zeros(region.layout.reply_size, np.uint8)
    ev1 = st.enqueue_reply(0, 1, dst, offs)
    waiter = threading.Thread(target=ev1.wait, args=(5.0,))
    waiter.start()
    time.sleep(0.05)  # the waiter is asleep inline on `released`
    ev2 = st.record()
    assert not ev2.wait(0.05)
    release(region, 1)
    assert ev2.wait(2.0) and ev1.query()
    waiter.join(2.0)
    assert not waiter.is_alive() and st.inline_runs == 1
    assert native.load32(region.word_addr(W.CONSUMED)) == 1


def test_closing_wakes_an_inline_waiter(bare):
    """close() wakes a thread asleep inline on a word nobody releases, as it wakes the stream thread."""
    region, st, offs = bare
    ev = st.enqueue_reply(0, 1, np.zeros(region.layout.reply_size, np.uint8), offs)
    done = []
    waiter = threading.Thread(target=lambda: done.append(ev.wait(30.0)))
    waiter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    st.close()
    waiter.join(2.0)
    assert not waiter.is_alive() and done == [False] and time.monotonic() - t0 < 1.0


# -- the watchdog asleep on the words ---------------------------------------------------------------

def new_thread(before: set[str]) -> int:
    (tid,) = set(os.listdir("/proc/self/task")) - before
    return int(tid)


def wakeups(tid: int) -> int:
    """Times thread tid was put on a CPU (schedstat's third field)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[2])


def test_a_watchdog_asleep_on_the_words_wakes_per_change_and_fires_on_time():
    """sleep_on_words: idle, the watchdog sleeps through its 1 ms polls (a napping one wakes ~200 times in
    200 ms); a round announced with a waking store is watched to its deadline, fired (claim 2t + 1,
    released, a waiter on `released` woken) neither before it nor much after; a round the proxy claims
    and stalls is only assisted; a round released in time (waking store) never fires."""
    buf = np.zeros(128, np.uint32)
    base = int(buf.ctypes.data)
    g, r, c0, c1, f = 0, 64, 128, 192, 256
    before = set(os.listdir("/proc/self/task"))
    wd = native.Watchdog(base, g, r, (c0, c1), f, deadline_us=60_000, poll_us=1000)
    try:
        tid = new_thread(before)
        wd.sleep_on_words(1_000_000)
        time.sleep(0.02)
        w0 = wakeups(tid)
        time.sleep(0.2)
        assert wakeups(tid) - w0 <= 3
        t0 = time.monotonic()
        native.store32_wake(base + g, 1)  # round 1, nobody releases it
        assert native.wait_geq32_block(base + r, 1, 0, 1_000_000, 2_000_000) == native.WAIT_OK
        took = time.monotonic() - t0
        assert 0.055 <= took < 0.25, took
        assert native.load32(base + c1) == 3 and wd.fires == 1 and native.load32(base + f) == 1
        assert wakeups(tid) - w0 <= 8
        native.store32_wake(base + g, 2)  # the proxy claims round 2 (2t) and stalls: an assist, no fire
        assert native.claim32(base + c0, 4, 4)
        assert native.wait_geq32_block(base + r, 2, 0, 1_000_000, 2_000_000) == native.WAIT_OK
        assert native.load32(base + c0) == 4 and wd.fires == 1 and wd.assists == 1
        native.store32_wake(base + g, 3)  # round 3, released in time
        time.sleep(0.01)
        native.store_max32_wake(base + r, 3)
        time.sleep(0.1)
        assert wd.fires == 1 and native.load32(base + c1) == 3
    finally:
        t0 = time.monotonic()
        wd.stop()  # wakes the sleeping watchdog: no slice (1 s here) to sit out
        assert time.monotonic() - t0 < 0.5


def test_the_cpu_hand_off_watchdog_sleeps_between_rounds():
    """AsyncRounds on the emulated stream with blocking waits puts its watchdog to sleep on the words:
    over 100 rounds and 200 ms of idling with a 1 ms watchdog poll it wakes a few times per round, not
    once a millisecond."""
    before = set(os.listdir("/proc/self/task"))
    wd_threads: list[int] = []
    real = native.Watchdog.__init__

    def spy(self, *a, **kw):
        b = set(os.listdir("/proc/self/task"))
        real(self, *a, **kw)
        wd_threads.append(new_thread(b))

    native.Watchdog.__init__ = spy
    try:
        r = open_rounds(HandoffConfig(vocab_size=VOCAB, max_requests=4, max_tokens=256, max_drafts=8,
                                      selftest_rounds=2, loss_fires=10**6, deadline_ms=500.0,
                                      watchdog_poll_us=1000, wait_slice_us=100_000))
    finally:
        native.Watchdog.__init__ = real
    assert isinstance(r, AsyncRounds) and before and len(wd_threads) == 1
    try:
        tid = wd_threads[0]
        w0 = wakeups(tid)
        for i in range(100):
            q = [request(i)]
            assert_exact(q[0], r.result(r.submit(q), timeout_s=5.0))
        time.sleep(0.2)
        assert wakeups(tid) - w0 <= 3 * 100 + 10
        w1 = wakeups(tid)
        time.sleep(0.3)
        assert wakeups(tid) - w1 <= 5
    finally:
        r.close()
