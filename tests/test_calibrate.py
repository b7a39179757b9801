"""Round timing measured against a real worker process, the budget and deadline that follow, the
loud warning when most rounds fail, and the local worker's thread count."""

from __future__ import annotations

import socket

import pytest
import torch

from draftrelay.engine import calibrate as C
from draftrelay.engine import loading as L
from draftrelay.engine.metrics import speculation_warning
from draftrelay.handoff.rounds import AsyncRounds
from draftrelay.worker.process import start_worker_process

SLOW = 7  # the test drafter sleeps in a step whose tokens contain this one


@pytest.fixture(scope="module")
def slow_worker():
    w = start_worker_process(["--model", "test", "--test-vocab", "1000", "--test-slow-token", str(SLOW),
                              "--test-delay-ms", "300"])
    yield w
    w.stop()


def spec_of(w) -> dict:
    return {"kind": "worker", "host": w.host, "port": w.port}


def test_measured_prompt_round_sets_the_budget(slow_worker):
    prompt = [3, SLOW, 11, 12]
    timing = C.measure_rounds(spec_of(slow_worker), prompt, [1, 4], repeats=2)
    assert timing.prompt_tokens == 4 and timing.prefill_s >= 0.3  # the prompt holds the slow token
    assert set(timing.by_k) == {1, 4} and max(timing.by_k.values()) < 0.3  # steady blocks do not
    assert timing.budget_ms(4) >= 2 * 300 + 100
    rs = C.round_settings(spec_of(slow_worker), prompt, 4)
    assert rs.budget_ms >= 700 and rs.deadline_ms == rs.budget_ms + 50
    assert rs.round_costs_s is not None and set(rs.round_costs_s) == {1, 4}
    assert "measured STEP" in rs.note
    # the probe's session is closed: the worker serves a full-size session right after
    assert L.check_worker({**spec_of(slow_worker), "max_requests": 8}) == ""


def test_fast_steady_rounds_keep_the_floor(slow_worker):
    timing = C.measure_rounds(spec_of(slow_worker), [1, 2, 3], [2], repeats=1)
    assert timing.prefill_s < 0.3
    assert timing.budget_ms(2) == 150.0  # never below the floor
    assert timing.steady_s(6) > 0 and timing.steady_s(2) == timing.by_k[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flags_win_and_an_unreachable_worker_keeps_the_defaults():
    dead = {"kind": "worker", "host": "127.0.0.1", "port": free_port(), "connect_timeout_s": 0.2}
    rs = C.round_settings(dead, [1, 2], 4, budget_ms=900.0, deadline_ms=1200.0)
    assert (rs.budget_ms, rs.deadline_ms, rs.timing) == (900.0, 1200.0, None)  # nothing measured
    rs = C.round_settings(dead, [1, 2], 4)
    assert (rs.budget_ms, rs.deadline_ms) == (150.0, 200.0) and "not measured" in rs.note
    rs = C.round_settings(dead, [1, 2], 4, deadline_ms=500.0)
    assert rs.deadline_ms == 500.0
    with pytest.raises(ValueError, match="at least one depth"):
        C.measure_rounds(dead, [1], [0])


def test_timing_interpolates_depths_it_did_not_measure():
    t = C.RoundTiming(0.01, 3, {1: 0.10, 4: 0.40})
    assert t.steady_s(2) == pytest.approx(0.20) and t.steady_s(6) == pytest.approx(0.60)
    assert C.RoundTiming(0.01, 3, {2: 0.2}).steady_s(4) == pytest.approx(0.4)
    assert t.as_dict()["steady_ms_by_k"] == {"1": 100.0, "4": 400.0}


def test_speculation_warning_names_the_reasons():
    rounds = {"ok": 0, "failed": 30, "watchdog": 0, "target_only": 30}
    assert speculation_warning(rounds, {"failed_by_reason": {"timeout": 30}}) == \
        "speculation off: 30 of 30 rounds failed: timeout"
    two = speculation_warning(rounds, {"failed_by_reason": {"timeout": 20, "breaker": 10}})
    assert two == "speculation off: 30 of 30 rounds failed: timeout 20, breaker 10"
    wd = speculation_warning({"ok": 2, "failed": 0, "watchdog": 6}, {"failed_by_reason": {}, "watchdog": 6})
    assert wd == "speculation off: 6 of 8 rounds failed: watchdog"
    assert speculation_warning({"ok": 20, "failed": 10, "watchdog": 0}, {"failed_by_reason": {"timeout": 10}}) == ""
    assert speculation_warning({"ok": 0, "failed": 2, "watchdog": 0}, {}) == ""  # too few rounds to judge
    said = speculation_warning(rounds, {"failed_by_reason": {"timeout": 20, "breaker": 10},
                                        "first_failure": {"breaker": "3 failures in a row", "timeout": "no reply"}})
    assert said == "speculation off: 30 of 30 rounds failed: timeout 20, breaker 10 (first timeout: no reply)"


def test_local_cpu_worker_gets_every_allowed_core(monkeypatch):
    seen = {}

    def fake(args, env=None):
        seen["args"], seen["env"] = args, env
        return None

    import draftrelay.worker.process as wp

    monkeypatch.setattr(wp, "start_worker_process", fake)
    cpu = torch.device("cpu")
    L.start_local_worker("some/dir", cpu, 4, 256, 1)
    n = L.default_threads()
    assert n >= 1 and seen["args"][-2:] == ["--threads", str(n)]
    assert seen["env"] == {"OMP_NUM_THREADS": str(n), **L.CPU_WORKER_OMP_ENV}
    assert int(seen["env"]["GOMP_SPINCOUNT"]) <= 20_000  # an idle worker thread sleeps within about a millisecond
    L.start_local_worker("some/dir", cpu, 4, 256, 1, threads=3)
    assert seen["args"][-2:] == ["--threads", "3"]
    L.start_local_worker("tiny", cpu, 4, 256, 1)
    assert seen["args"][-2:] == ["--threads", "1"]  # the tiny drafter runs fastest on one thread


def test_cpu_hand_off_blocks_and_its_watchdog_polls_at_a_share_of_the_deadline():
    spec = {"kind": "worker", "host": "127.0.0.1", "port": 1}
    cpu = L.handoff_config(spec, torch.device("cpu"), 12_000.0, True, round_budget_ms=11_950.0)
    assert cpu.wait_mode == "block" and cpu.watchdog_poll_us == 120_000 and cpu.round_budget_ms == 11_950.0
    assert L.handoff_config(spec, torch.device("cpu"), 50.0, True).watchdog_poll_us == 1000  # never below 1 ms
    gpu = L.handoff_config(spec, torch.device("cuda"), 12_000.0, False)
    assert gpu.wait_mode == "poll" and gpu.watchdog_poll_us == 1000  # the GPU path keeps its settings
    # on a CPU the periodic wake-ups are spaced out (they land on the target's cores), inside the loss limit
    assert (cpu.wait_slice_us, cpu.supervise_ms, cpu.heartbeat_ms) == (20_000, 50.0, 100.0)
    assert cpu.heartbeat_ms < cpu.supervise_ms * 4 < 1000 * AsyncRounds(cpu).loss_limit_s
    assert (gpu.wait_slice_us, gpu.supervise_ms, gpu.heartbeat_ms) == (2000, 10.0, 20.0)


def test_a_round_of_several_requests_is_timed_whole(slow_worker):
    """serve on a CPU measures its budget over a full batch: each request of the round carries the prompt, and
    the test drafter sleeps once per request whose tokens hold the slow one, so three take three sleeps."""
    prompt = [3, SLOW, 11, 12]
    timing = C.measure_rounds(spec_of(slow_worker), prompt, [1, 2], repeats=1, requests=3)
    assert timing.prefill_s >= 3 * 0.3 and max(timing.by_k.values()) < 0.3
    rs = C.round_settings(spec_of(slow_worker), prompt, 2, requests=3)
    assert rs.budget_ms >= 2 * 900 + 100 and "(3 requests a round)" in rs.note
    assert L.check_worker({**spec_of(slow_worker), "max_requests": 8}) == ""  # every probe row freed
    with pytest.raises(ValueError, match="requests must be >= 1"):
        C.measure_rounds(spec_of(slow_worker), prompt, [1], requests=0)
