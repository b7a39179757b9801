"""The CPU hand-off scenarios, unchanged, on every stream backend (`backend`: emulated | cuda).

Each test here runs a test of tests/test_handoff.py or tests/test_recovery.py as it is: the same body,
the same assertions, with only the configuration those modules build (`cfg()`, the drills' `args()`)
pointed at the backend under test. The CUDA runs park a real stream (a non-default one) on the host
flag while the real proxy process answers; the emulated runs are the CPU tests themselves. The soak and
the late proxy, whose outcome depends on how the stream parks, also run on the memop round path
(`cuda-memop`).

    python3 -m pytest -q tests_gpu/test_handoff_scenarios.py            # emulated everywhere, cuda on a GPU
"""

from __future__ import annotations

import pytest

import test_handoff as handoff  # tests/ (conftest.py puts it on the path)
import test_recovery as recovery


@pytest.fixture
def on_backend(backend, monkeypatch) -> str:
    """Point the CPU modules' configuration builders at `backend`."""
    base_cfg, base_args = handoff.cfg, recovery.args

    def cfg(**kw):
        extra: dict = {"backend": backend}
        if backend == "cuda":
            import torch

            extra["cuda_stream"] = torch.cuda.Stream()  # never park the legacy default stream
        return base_cfg(**{**extra, **kw})

    monkeypatch.setattr(handoff, "cfg", cfg)
    monkeypatch.setattr(recovery, "args", lambda **kw: base_args(**{"backend": backend, **kw}))
    return backend


# the backends every scenario runs on; the soak and the late proxy add cuda-memop (the fixture's third param)
BOTH = pytest.mark.parametrize("backend", ["emulated", "cuda"], indirect=True)


@BOTH
def test_clean_rounds(on_backend):
    handoff.check_clean_rounds()


def test_faulted_soak_10000_rounds(on_backend):
    handoff.test_faulted_soak_10000_rounds_zero_wrong_drafts()


@pytest.mark.parametrize("point", handoff.STALL_POINTS)
def test_late_proxy(on_backend, point):
    handoff.test_late_proxy_cannot_change_what_the_engine_reads(point)


@BOTH
@pytest.mark.parametrize("case", ["region", "proxy_exits", "proxy_never_ready", "proxy_slow", "selftest"])
def test_refusals_leave_nothing_behind(on_backend, case, monkeypatch, tmp_path):
    handoff.test_refusal_paths_leave_nothing_behind(case, monkeypatch, tmp_path)


@BOTH
def test_bad_replies_never_become_drafts(on_backend):
    handoff.test_corrupt_or_oversized_replies_never_become_drafts()


@BOTH
def test_enqueue_returns_before_the_round_completes(on_backend):
    handoff.test_enqueue_returns_before_the_round_completes()


@BOTH
def test_close_with_a_parked_round(on_backend):
    handoff.test_close_with_a_parked_round_drains_through_the_watchdog()


@BOTH
def test_drill_kill(on_backend):
    recovery.test_kill_9_during_three_requests_respawns_and_all_complete()


@BOTH
def test_drill_stop(on_backend):
    recovery.test_sigstop_is_lost_by_heartbeat_and_leaves_no_stopped_process()


@BOTH
def test_drill_stop_at_20ms_deadline(on_backend):
    recovery.test_stopped_proxy_costs_at_most_3_parked_rounds_at_20ms_deadline()


@BOTH
def test_drill_idle(on_backend):
    recovery.test_idle_longer_than_the_loss_limit_is_not_a_loss()


@BOTH
def test_drill_slow(on_backend):
    recovery.test_slow_but_live_proxy_is_not_lost()


@BOTH
def test_drill_soak_with_kills(on_backend):
    recovery.test_soak_6000_rounds_with_a_kill_every_2000()


@pytest.fixture
def park_on_backend(backend, monkeypatch) -> str:
    """tests/test_handoff_park.py's configuration pointed at `backend`."""
    import test_handoff_park as park

    base_cfg = park.cfg

    def cfg(**kw):
        extra: dict = {"backend": backend}
        if backend == "cuda":
            import torch

            extra["cuda_stream"] = torch.cuda.Stream()
        return base_cfg(**{**extra, **kw})

    monkeypatch.setattr(park, "cfg", cfg)
    return backend


@pytest.mark.parametrize("backend", ["cuda", "cuda-memop"], indirect=True)
@pytest.mark.parametrize("park_mode", ["stream", "host"])
def test_host_staged_soak(park_on_backend, park_mode):
    """Host staging (the round kernel staging nothing, or the memop reply ops) and both parks, faulted."""
    import test_handoff_park as park

    park.test_faulted_soak_zero_wrong_drafts(park_mode, True)


@pytest.mark.parametrize("backend", ["cuda", "cuda-memop"], indirect=True)
def test_round_in_flight_keeps_the_next_on_the_stream(park_on_backend):
    import test_handoff_park as park

    park.test_a_round_in_flight_keeps_the_next_one_on_the_stream()
