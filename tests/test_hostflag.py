"""The native helper: atomics, waits, claim, watchdog and heartbeat on real memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from draftrelay.handoff import native


def words(n: int = 64) -> tuple[np.ndarray, int]:
    buf = np.zeros(n, np.uint32)
    return buf, int(buf.ctypes.data)


def test_load_store_and_wrap_aware_geq():
    buf, base = words()
    native.store32(base, 7)
    assert native.load32(base) == 7 and buf[0] == 7
    native.store64(base + 8, 2**40 + 3)
    assert native.load64(base + 8) == 2**40 + 3
    assert native.geq32(5, 5) and native.geq32(6, 5) and not native.geq32(4, 5)
    assert native.geq32(2, 0xFFFFFFFE)  # across the wrap, 2 is "after" 2^32-2
    native.store32(base, 2)
    assert native.wait_geq32(base, 0xFFFFFFFE, 0, 0, 0) == native.WAIT_OK


def test_store_max_never_goes_backwards():
    buf, base = words()
    assert native.store_max32(base, 10) == 1
    assert native.store_max32(base, 4) == 0
    assert buf[0] == 10


def test_claim_has_exactly_one_winner_per_round_under_contention():
    buf, base = words()
    rounds = 2000
    wins = np.zeros((2, rounds + 1), np.int32)

    def contender(who: int) -> None:
        for t in range(1, rounds + 1):
            if native.claim32(base, 2 * t, 2 * t + who):
                wins[who, t] += 1

    threads = [threading.Thread(target=contender, args=(w,)) for w in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert np.all(wins[:, 1:].sum(axis=0) == 1)  # each round claimed exactly once
    # and a claimed round cannot be claimed again by anyone
    assert native.claim32(base, 2 * rounds, 2 * rounds) == 0


def test_wait_times_out_then_succeeds_and_aborts():
    buf, base = words()
    t0 = time.perf_counter()
    assert native.wait_geq32(base, 1, 100, 50, 20_000) == native.WAIT_TIMEOUT
    assert 0.015 < time.perf_counter() - t0 < 1.0

    def later() -> None:
        time.sleep(0.02)
        native.store32(base, 3)

    threading.Thread(target=later).start()
    assert native.wait_geq32(base, 3, 50, 20, 2_000_000) == native.WAIT_OK
    native.store32(base + 4, 1)
    assert native.wait_geq32(base, 99, 50, 20, -1, base + 4) == native.WAIT_ABORTED


def test_wait_releases_the_gil():
    buf, base = words()
    ticks = []

    def ticker() -> None:
        for _ in range(20):
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    th = threading.Thread(target=ticker)
    th.start()
    native.wait_geq32(base, 1, 200_000, 0, 100_000)  # 100 ms, spinning the whole time
    th.join()
    assert len(ticks) == 20  # the Python thread kept running during the native spin


def layout_offsets():
    # gathered, released, claim0, claim1, fires on separate lines of a 64-word buffer
    return 0, 64, 128, 192, 256


def test_watchdog_claims_and_releases_an_overdue_round_only():
    buf = np.zeros(128, np.uint32)
    base = int(buf.ctypes.data)
    g, r, c0, c1, f = layout_offsets()
    wd = native.Watchdog(base, g, r, (c0, c1), f, deadline_us=30_000, poll_us=500)
    try:
        native.store32(base + g, 1)  # round 1 staged, nobody releases
        time.sleep(0.01)
        assert native.load32(base + r) == 0  # not yet overdue
        assert native.wait_geq32(base + r, 1, 0, 200, 1_000_000) == native.WAIT_OK
        assert native.load32(base + c1) == 3  # 2t+1: the watchdog's claim on slot 1
        assert wd.fires == 1 and native.load32(base + f) == 1
        # round 2: the proxy claims (2t) but stalls before releasing; the watchdog only assists
        native.store32(base + g, 2)
        assert native.claim32(base + c0, 4, 4)
        assert native.wait_geq32(base + r, 2, 0, 200, 1_000_000) == native.WAIT_OK
        assert native.load32(base + c0) == 4
        assert wd.fires == 1 and wd.assists == 1
        # round 3 released in time: no fire
        native.store32(base + g, 3)
        native.store32(base + r, 3)
        time.sleep(0.06)
        assert wd.fires == 1
    finally:
        wd.stop()


def test_watchdog_deadline_extends_only_for_the_round_its_budget_word_names():
    """The budget word (round << 32) | microseconds: round 1 named in it gets deadline + 150 ms; a
    word naming another round (a stale one) extends nothing."""
    buf = np.zeros(128, np.uint32)
    base = int(buf.ctypes.data)
    g, r, c0, c1, f = layout_offsets()
    bw = 320  # its own line, 8-byte aligned
    wd = native.Watchdog(base, g, r, (c0, c1), f, deadline_us=30_000, poll_us=500, off_budget=bw)
    try:
        native.store64(base + bw, 1 << 32 | 150_000)
        t0 = time.monotonic()
        native.store32(base + g, 1)
        assert native.wait_geq32(base + r, 1, 0, 200, 1_000_000) == native.WAIT_OK
        assert time.monotonic() - t0 >= 0.17 and wd.fires == 1  # 30 + 150 ms, not 30
        t0 = time.monotonic()
        native.store32(base + g, 2)  # the word still names round 1
        assert native.wait_geq32(base + r, 2, 0, 200, 1_000_000) == native.WAIT_OK
        assert time.monotonic() - t0 < 0.15 and wd.fires == 2
    finally:
        wd.stop()


def test_watchdog_reset_under_lock_never_fires_spuriously():
    buf = np.zeros(128, np.uint32)
    base = int(buf.ctypes.data)
    g, r, c0, c1, f = layout_offsets()
    wd = native.Watchdog(base, g, r, (c0, c1), f, deadline_us=5_000, poll_us=50)
    try:
        for i in range(2000):
            native.store32(base + g, i % 7 + 1)
            native.store32(base + r, i % 7 + 1)
            wd.reset_words([g, r, c0, c1])
        time.sleep(0.02)
        assert wd.fires == 0
    finally:
        wd.stop()


def test_heartbeat_beats_and_stops():
    buf, base = words()
    hb = native.Heartbeat(base, 2_000)
    try:
        first = native.load64(base)
        time.sleep(0.02)
        assert native.load64(base) > first
    finally:
        hb.stop()
    last = native.load64(base)
    time.sleep(0.01)
    assert native.load64(base) == last


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_wait_on_a_closed_abort_word_is_not_needed(bad):
    # timeouts bound every host-side wait: a negative timeout is "forever", which the abort word ends
    buf, base = words()
    native.store32(base + 4, 1)
    assert native.wait_geq32(base, 5, 0, 10, bad, base + 4) == native.WAIT_ABORTED


def test_blocking_wait_is_woken_by_a_wake_store_and_sees_a_plain_store_within_a_slice():
    buf, base = words()
    got: list[tuple[int, float]] = []

    def waiter(v: int, slice_us: int) -> None:
        t0 = time.perf_counter()
        rc = native.wait_geq32_block(base, v, 0, slice_us, 10_000_000)
        got.append((rc, time.perf_counter() - t0))

    # a wake store ends a sleep with a 5 s slice long before the slice is over
    th = threading.Thread(target=waiter, args=(1, 5_000_000))
    th.start()
    time.sleep(0.05)
    native.store32_wake(base, 1)
    th.join(5.0)
    assert got[0][0] == native.WAIT_OK and got[0][1] < 2.0
    # a store that does not wake (a GPU's) is still seen, within a slice
    th = threading.Thread(target=waiter, args=(2, 20_000))
    th.start()
    time.sleep(0.05)
    native.store32(base, 2)
    th.join(5.0)
    assert got[1][0] == native.WAIT_OK
    # store-max wake raises and wakes; a value below does not satisfy the wait
    assert native.store_max32_wake(base, 5) == 1 and native.store_max32_wake(base, 3) == 0 and buf[0] == 5
    assert native.wait_geq32_block(base, 6, 0, 1000, 30_000) == native.WAIT_TIMEOUT
    assert native.wait_geq32_block(base, 0xFFFFFFFE, 0, 1000, 0) == native.WAIT_OK  # wrap-aware, as the poll
    buf[8] = 1
    assert native.wait_geq32_block(base, 9, 0, 1000, 5_000_000, base + 32) == native.WAIT_ABORTED


def test_blocking_wait_takes_no_cpu_while_it_waits():
    """The point of it: a waiter parked for a long round leaves the cores to the target."""
    buf, base = words()
    th = threading.Thread(target=native.wait_geq32_block, args=(base, 1, 0, 2000, 5_000_000))
    c0, t0 = time.process_time(), time.perf_counter()
    th.start()
    time.sleep(0.4)
    used = time.process_time() - c0
    native.store32_wake(base, 1)
    th.join(5.0)
    assert not th.is_alive()
    # the whole process (this thread sleeping too): a 20 µs nap poll costs tens of percent of a core
    assert used < 0.1 * (time.perf_counter() - t0)
