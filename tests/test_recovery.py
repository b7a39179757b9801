"""Recovery on the emulated stream: loss detection, respawn, shutdown and the fault drills."""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np

from draftrelay.handoff import drills, native
from draftrelay.handoff.region import Region, RegionConfig, W
from draftrelay.handoff.rounds import HandoffConfig, open_rounds
from draftrelay.round import RoundRequest, Status


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    drills.add_arguments(p)
    ns = p.parse_args(["kill"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_kill_9_during_three_requests_respawns_and_all_complete():
    r = drills.drill_kill(args(tokens=150, signal_at=40))
    assert r["requests_completed"] == "3/3"
    assert r["loss_cause"] == "exit"
    assert r["detected_after_ms"] < 1500 and r["respawn_started_after_ms"] < 3000
    assert r["new_proxy_pid_differs"] and r["old_proxy_state"] == "gone"
    assert r["stopped_or_zombie_children"] == 0
    assert r["generation"] == 1 and r["respawns_left"] == 2
    assert r["wrong_drafts"] == 0 and r["exact_drafts"] > 0
    assert r["round_status"].get("UNAVAILABLE", 0) > 0  # target-only while recovering
    assert r["max_submit_ms"] < 300


def test_sigstop_is_lost_by_heartbeat_and_leaves_no_stopped_process():
    r = drills.drill_stop(args(tokens=150, signal_at=40))
    assert r["requests_completed"] == "2/2"
    assert r["loss_cause"] == "heartbeat", r
    assert "against the 400 ms limit" in r["loss_detail"]
    assert r["old_proxy_state"] == "gone" and r["stopped_or_zombie_children"] == 0
    assert r["memfds_before"] == r["memfds_after"]
    assert r["wrong_drafts"] == 0 and r["max_submit_ms"] < 300


def test_stopped_proxy_costs_at_most_3_parked_rounds_at_20ms_deadline():
    r = drills.drill_stop(args(tokens=120, signal_at=30, deadline_ms=20.0))
    assert r["loss_cause"] == "fires"
    assert r["parked_rounds_before_loss"] <= 3
    assert r["detected_after_ms"] < 200
    assert r["wrong_drafts"] == 0 and r["requests_completed"] == "2/2"


def test_idle_longer_than_the_loss_limit_is_not_a_loss():
    r = drills.drill_idle(args(tokens=60, idle_s=1.0))
    assert r["idle_s"] > r["loss_limit_s"]
    assert r["losses"] == 0 and r["requests_completed"] == "2/2" and r["wrong_drafts"] == 0
    assert r["round_status"] == {"OK": 60}  # one round per step carries both requests


def test_slow_but_live_proxy_is_not_lost():
    r = drills.drill_slow(args(tokens=15, deadline_ms=40.0))
    assert r["losses"] == {}
    assert r["watchdog"] > 0 and r["late_discarded"] > 0
    assert r["wrong_drafts"] == 0


def test_soak_6000_rounds_with_a_kill_every_2000():
    r = drills.drill_soak(args(rounds=6000, kill_every=2000, deadline_ms=50.0))
    assert r["kills"] == 3 and r["respawns"] == 3
    assert r["wrong_drafts"] == 0 and r["exact_drafts"] == 4 * r["round_status"]["OK"]  # every OK round exact
    assert r["round_status"]["OK"] > 3000
    assert r["rounds"] == 6000 and r["state"] == "live"


def test_respawn_budget_spent_goes_target_only_and_says_so():
    cfg = HandoffConfig(vocab_size=100, deadline_ms=20.0, max_respawns=1, selftest_rounds=1)
    r = open_rounds(cfg)
    try:
        for _ in range(2):
            os.kill(r.proxy.pid, signal.SIGKILL)
            d = drills.Drive(1, 30)
            d.run(r, 100, step_sleep_s=0.005)
            r.wait_settled()
        st = r.stats()
        assert st["state"] == "target_only" and "budget spent" in st["target_only_reason"]
        assert st["respawns_used"] == 1 and st["respawns_left"] == 0
        res = r.result(r.submit([RoundRequest(1, 1, 0, np.array([1], np.int32), 2)]))
        assert res.status == Status.UNAVAILABLE and res.counts.sum() == 0
        assert r.proxy.proc.poll() is not None  # no proxy left running
    finally:
        r.close()


def test_budget_restored_after_the_reset_interval():
    cfg = HandoffConfig(vocab_size=100, deadline_ms=20.0, max_respawns=1, respawn_reset_s=0.3, selftest_rounds=1)
    r = open_rounds(cfg)
    try:
        for _ in range(2):
            os.kill(r.proxy.pid, signal.SIGKILL)
            drills.Drive(1, 20).run(r, 100, step_sleep_s=0.005)
            assert r.wait_settled() == "live"
            time.sleep(0.4)
        assert r.stats()["generation"] == 2
    finally:
        r.close()


def test_shutdown_kills_and_reaps_and_frees_everything():
    before_fds = len(os.listdir("/proc/self/fd"))
    r = open_rounds(HandoffConfig(vocab_size=100, selftest_rounds=1))
    pid = r.proxy.pid
    os.kill(pid, signal.SIGSTOP)  # even a stopped proxy
    r.submit([RoundRequest(1, 1, 0, np.array([1], np.int32), 2)])
    t0 = time.monotonic()
    r.close()
    assert time.monotonic() - t0 < 1.0
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped: no zombie
    assert len(os.listdir("/proc/self/fd")) == before_fds
    with open("/proc/self/maps") as f:
        assert "memfd:draftrelay" not in f.read()


def test_20000_resets_against_the_live_watchdog_never_fire():
    """Rounds 1..3 then a reset, 20,000 times, with pauses longer than the deadline now and then: a
    watchdog that kept its memory of a gathered value across a reset would fire on the next round 3.
    A fire is legitimate only for a round that really stayed unreleased past the deadline (this
    machine can be loaded), so fires must not exceed the rounds the test itself saw overdue."""
    deadline_s = 0.005
    region = Region.create(RegionConfig(vocab_size=100))
    L = region.layout
    wd = native.Watchdog(region.base, L.word(W.GATHERED), L.word(W.RELEASED), (L.claim(0), L.claim(1)),
                         L.word(W.WD_FIRES), deadline_us=int(deadline_s * 1e6), poll_us=20)
    words = [L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED), L.claim(0), L.claim(1)]
    a_g, a_r = region.base + L.word(W.GATHERED), region.base + L.word(W.RELEASED)
    overdue = 0
    try:
        for i in range(20_000):
            for g in (1, 2, 3):
                t0 = time.perf_counter()
                native.store32(a_g, g)
                native.store_max32(a_r, g)
                overdue += time.perf_counter() - t0 > deadline_s / 2
            wd.reset_words(words)
            if i % 500 == 0:
                time.sleep(2 * deadline_s)
        time.sleep(0.02)
        assert wd.fires <= overdue, (wd.fires, overdue)
        native.store32(a_g, 1)  # and it still fires when it should
        assert native.wait_geq32(a_r, 1, 0, 100, 1_000_000) == native.WAIT_OK
        assert wd.fires >= 1
    finally:
        wd.stop()
        region.close()


def test_80_engine_freezes_cause_no_false_loss():
    r = drills.drill_freeze(args(deadline_ms=20.0, freezes=80, freeze_ms=350.0, run_ms=40.0))
    assert r["loss_limit_s"] * 1000 < r["freeze_ms"]  # each freeze is longer than the loss limit
    assert r["losses"] == 0, r
    assert r["rounds"] > 80 and r["wrong_drafts"] == 0


def test_stats_as_prometheus_text_and_http_endpoint():
    import socket
    import subprocess
    import sys
    import urllib.request

    from draftrelay.handoff import metrics

    r = open_rounds(HandoffConfig(vocab_size=100, deadline_ms=20.0, selftest_rounds=1))
    try:
        drills.Drive(1, 10).run(r, 100)
        os.kill(r.proxy.pid, signal.SIGKILL)
        drills.Drive(1, 30).run(r, 100, step_sleep_s=0.005)
        assert r.wait_settled() == "live"
        text = metrics.render(r.stats())
        assert 'draftrelay_proxy_losses_total{cause="exit"} 1.0' in text
        assert "draftrelay_generation 1.0" in text and "draftrelay_respawns_left 2.0" in text
        assert 'draftrelay_async_state{state="live"} 1.0' in text
        ok = r.stats()["ok"]
        assert f'draftrelay_rounds_total{{status="ok"}} {float(ok)}' in text
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server, _ = metrics.serve(port, r.stats)
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            assert 'draftrelay_proxy_losses_total{cause="exit"} 1.0' in body
            out = subprocess.run([sys.executable, "-m", "draftrelay.cli", "stats", "--url", f"http://127.0.0.1:{port}/"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and "draftrelay_generation 1.0" in out.stdout
        finally:
            server.shutdown()
    finally:
        r.close()


def test_stats_cli_reports_an_unreachable_endpoint_clearly():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "draftrelay.cli", "stats", "--url", "http://127.0.0.1:9/"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read http://127.0.0.1:9/" in out.stderr
