"""The hand-off end to end on the emulated stream, with the proxy as a real separate process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from draftrelay.handoff.procinfo import children, fd_count, memfd_maps
from draftrelay.handoff.region import Region, RegionConfig, pack_staging
from draftrelay.handoff.rounds import AsyncRefused, AsyncRounds, HandoffConfig, SyncRounds, open_rounds
from draftrelay.round import RoundRequest, Status
from draftrelay.testing import STALL_POINTS, random_requests, score_in_flight, score_round

VOCAB = 5000


def make_requests(rng: np.random.Generator, t: int) -> list[RoundRequest]:
    return random_requests(rng, t, VOCAB)


def check_round(reqs: list[RoundRequest], res) -> tuple[int, int]:
    """(exact drafts, wrong drafts) in one result; failed rounds must carry zero drafts."""
    if res.status != Status.OK:
        assert res.counts.sum() == 0, f"failed round {res.round} ({res.status.name}) carries drafts"
    return score_round(reqs, res, VOCAB)


def cfg(**kw) -> HandoffConfig:
    # loss_fires is raised here: these tests stall and delay the proxy on purpose and check the hand-off
    # itself; the loss rule (3 fires with no finished round = lost) is exercised in test_recovery.py
    base = dict(vocab_size=VOCAB, max_requests=4, max_tokens=256, max_drafts=8, deadline_ms=20.0,
                selftest_rounds=4, loss_fires=10**6)
    base.update(kw)
    return HandoffConfig(**base)








# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", ["auto", "poll", "block"])
def test_clean_rounds_are_exact_and_counted(wait):
    check_clean_rounds(wait)


def check_clean_rounds(wait: str | None = None) -> None:
    """200 clean rounds, every one OK and exact; wait: the emulated stream's wait (None: the backend's
    default, as tests_gpu runs it on the CUDA backend)."""
    r = open_rounds(cfg() if wait is None else cfg(wait=wait))
    assert r.mode == "async", r.refusal
    if wait is not None:
        assert r.stream.wait == ("block" if wait == "auto" else wait)  # auto: block on the emulated stream
    rng = np.random.default_rng(0)
    try:
        exact = 0
        for t in range(1, 201):
            reqs = make_requests(rng, t)
            res = r.result(r.submit(reqs))
            assert res.status == Status.OK
            e, w = check_round(reqs, res)
            assert w == 0
            exact += e
        st = r.stats()
        assert st["rounds"] == 200 and st["ok"] == 200 and st["failed"] == 0 and exact > 0
    finally:
        r.close()


def test_score_in_flight_keeps_depth_rounds_in_flight_and_scores_each_once():
    """Results are asked for only once `depth` rounds are out, oldest first, and a wrong draft counts."""
    from draftrelay.testing import deterministic_draft

    asked: list[tuple[int, int]] = []  # (round asked for, rounds submitted so far)
    submitted = 0

    class Rounds:
        def result(self, t, timeout_s):
            asked.append((t, submitted))
            want, conf = deterministic_draft(reqs[t][0], VOCAB)
            drafts = np.zeros((1, 8), np.int32)
            drafts[0, :len(want)] = want if t != 2 else want + 1  # round 2's drafts are wrong
            c = np.zeros((1, 8), np.float32)
            c[0, :len(conf)] = conf
            return types.SimpleNamespace(status=Status.OK, counts=np.array([len(want)]), drafts=drafts, conf=c)

    reqs = {t: [RoundRequest(t, 1, 0, np.array([t], np.int32), 3)] for t in (1, 2, 3)}

    def submit():
        nonlocal submitted
        for t in (1, 2, 3):
            submitted += 1
            yield t, reqs[t]

    assert score_in_flight(Rounds(), submit(), VOCAB) == (6, 3)
    assert asked == [(1, 2), (2, 3), (3, 3)]


def test_faulted_soak_10000_rounds_zero_wrong_drafts():
    faults = dict(seed=7, p_delay=0.004, delay_ms=35, p_exception=0.02, p_disconnect=0.02, p_timeout=0.01,
                  p_bad_reply=0.01, p_corrupt=0.01, p_stall=0.006, stall_ms=35)
    r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": faults}))
    assert r.mode == "async", r.refusal
    rng = np.random.default_rng(1)
    t0 = time.monotonic()
    try:
        rounds_of_requests = (make_requests(rng, t) for t in range(1, 10_001))
        exact, wrong = score_in_flight(r, ((r.submit(reqs), reqs) for reqs in rounds_of_requests), VOCAB)
        st = r.stats()
    finally:
        r.close()
    elapsed = time.monotonic() - t0
    print(f"soak: {st} exact drafts {exact} in {elapsed:.1f} s")
    assert wrong == 0 and exact > 10_000  # scored, not skipped: ~3 drafts a round come back exact
    assert st["rounds"] == 10_000
    assert st["ok"] + st["failed"] + st["watchdog"] == st["rounds"]
    # every injected failure kind happened and was reported as itself
    fb = st["failed_by_reason"]
    for reason in ("exception", "disconnect", "timeout", "bad_reply"):
        assert fb.get(reason, 0) > 0, (reason, fb)
    assert st["watchdog"] > 0 and st["late_discarded"] > 0
    assert exact > 10_000
    assert elapsed < 60


@pytest.mark.parametrize("point", STALL_POINTS)
def test_late_proxy_cannot_change_what_the_engine_reads(point):
    """The proxy stalls past the deadline at one point of rounds 3, 6, 9, 12, then tries to publish."""
    results = []
    assists = 0
    for stall_ms in (30, 45, 70):
        faults = dict(seed=0, p_stall=1.0, stall_ms=stall_ms, stall_points=[point], every=3)
        r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": faults}, selftest_rounds=0))
        assert r.mode == "async", r.refusal
        rng = np.random.default_rng(stall_ms)
        try:
            for t in range(1, 14):
                reqs = make_requests(rng, t)
                results.append((reqs, r.result(r.submit(reqs), timeout_s=10)))
            st = r.stats()
        finally:
            r.close()
        assists += st["watchdog_assists"]
        if point != "release":  # a proxy that stalls after claiming has already won its round
            assert st["late_discarded"] + st["torn_skipped"] + st["proxy_skipped"] > 0, st
    wrong = sum(check_round(q, res)[1] for q, res in results)
    stalled = [res for q, res in results if res.round % 3 == 0]
    assert wrong == 0
    assert len(stalled) == 12
    if point == "release":
        # claimed before stalling: the reply is final and the watchdog only releases it (an OK round),
        # unless the proxy was still late from the previous stall and lost the claim outright
        assert assists > 0
        assert all(res.status in (Status.OK, Status.WATCHDOG) for res in stalled)
        assert sum(res.status == Status.OK for res in stalled) >= 6
    else:
        assert all(res.status == Status.WATCHDOG for res in stalled)


def test_proxy_process_imports_no_torch_or_cuda(tmp_path):
    import torch  # noqa: F401  the engine side has torch loaded; the child must not inherit any of it

    audit = tmp_path / "audit.json"
    r = open_rounds(cfg(proxy_audit=str(audit)))
    assert r.mode == "async", r.refusal
    pid = r.proxy.pid
    with open(f"/proc/{pid}/maps") as f:
        live_maps = f.read()
    r.close()
    info = json.loads(audit.read_text())
    assert info["pid"] == pid
    forbidden = ("torch", "cuda", "cupy", "pycuda", "triton", "jax", "numba")
    assert not [m for m in info["modules"] if m.split(".")[0] in forbidden]
    assert "numpy" in info["modules"]
    for lib in ("libtorch", "libcuda", "libcudart", "libnvrtc", "libc10"):
        assert lib not in live_maps
        assert not any(lib in x for x in info["libraries"])


def test_proxy_refuses_to_serve_with_torch_loaded():
    """If anything ever drags torch into the proxy, it refuses instead of serving."""
    code = ("import sys, torch, os\n"
            "from draftrelay.handoff.region import Region, RegionConfig\n"
            "from draftrelay.handoff import proxy\n"
            "reg = Region.create(RegionConfig(vocab_size=100))\n"
            "sys.exit(proxy.main(['--fd', str(reg.fd), '--spec', '{\"vocab_size\": 100}']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 4
    assert "must not load" in p.stderr and "torch" in p.stderr


def _refusal_case(case: str, monkeypatch, tmp_path) -> HandoffConfig:
    if case == "region":
        def no_memfd(*a, **k):
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(os, "memfd_create", no_memfd)
        return cfg()
    if case == "proxy_exits":
        return cfg(proxy_python="/bin/false")
    if case == "proxy_never_ready":
        script = tmp_path / "hang.sh"
        script.write_text("#!/bin/sh\nexec sleep 30\n")
        script.chmod(0o755)
        return cfg(proxy_start_timeout_s=1.0, proxy_python=str(script))
    if case == "proxy_slow":
        return cfg(proxy_start_timeout_s=0.001)
    if case == "selftest":
        return cfg(round_spec={"kind": "builtin", "faults": {"p_corrupt": 1.0, "in_selftest": True}})
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["region", "proxy_exits", "proxy_never_ready", "proxy_slow", "selftest"])
def test_refusal_paths_leave_nothing_behind(case, monkeypatch, tmp_path):
    fds, maps, kids = fd_count(), memfd_maps(), children()
    c = _refusal_case(case, monkeypatch, tmp_path)
    r = open_rounds(c)
    assert isinstance(r, SyncRounds) and r.mode == "sync"
    assert r.refusal, "a refusal must say why"
    print(case, "->", r.refusal)
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids
    # the sync fallback still serves rounds (builtin drafter), or fails them cleanly
    res = r.result(r.submit([RoundRequest(1, 1, 0, np.array([3], np.int32), 2)]))
    assert res.status in (Status.OK, Status.EXCEPTION)
    c.strict = True
    with pytest.raises(AsyncRefused):
        open_rounds(c)
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


def test_ctrl_c_during_start_cleans_up_and_stays_ctrl_c(monkeypatch):
    """A KeyboardInterrupt while the proxy is up (in the self-test) is not turned into a refusal: it
    propagates as itself, after the proxy, region and watchdog are gone."""
    fds, maps, kids = fd_count(), memfd_maps(), children()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncRounds, "_selftest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        open_rounds(cfg())
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


def test_refusal_reasons_name_the_cause():
    r = open_rounds(cfg(proxy_python="/bin/false"))
    assert "proxy exited during start (code 1)" in r.refusal
    with pytest.raises(ValueError, match="nonsense"):  # a bad round spec is a config error, not a refusal
        open_rounds(cfg(round_spec={"kind": "nonsense"}))
    r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": {"p_corrupt": 1.0, "in_selftest": True}}))
    assert "self-test" in r.refusal


def test_bad_descriptor_from_the_engine_is_a_failed_round_not_a_crash():
    r = open_rounds(cfg())
    assert r.mode == "async"
    try:
        L = r.region.layout
        good = [RoundRequest(1, 1, 0, np.array([5, 6], np.int32), 3)]
        src = pack_staging(L, 1, good)
        src[4:8].view("<u4")[0] = 999  # n_req out of range (round number is fixed by submit below)
        t = r._t + 1
        src[0:4].view("<u4")[0] = t
        res = r.result(r.submit(src=src, n_out=[3]), timeout_s=5)
        assert res.status == Status.BAD_DESC and res.counts.sum() == 0
        # and the next round is served normally
        res = r.result(r.submit(good), timeout_s=5)
        assert res.status == Status.OK and check_round(good, res) == (3, 0)
    finally:
        r.close()


def test_corrupt_or_oversized_replies_never_become_drafts():
    for fault in ("p_corrupt", "p_bad_reply"):
        r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": {fault: 1.0}}, selftest_rounds=0))
        assert r.mode == "async"
        try:
            reqs = [RoundRequest(1, 1, 0, np.array([5], np.int32), 4)]
            res = r.result(r.submit(reqs), timeout_s=5)
            assert res.status == Status.BAD_REPLY and res.counts.sum() == 0
        finally:
            r.close()


def test_proxy_given_a_foreign_region_exits_with_a_clear_error():
    fd = os.memfd_create("foreign")
    os.ftruncate(fd, 4096)
    try:
        p = subprocess.run([sys.executable, "-m", "draftrelay.handoff.proxy", "--fd", str(fd), "--spec", "{}"],
                           pass_fds=(fd,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert p.returncode == 3 and "magic" in p.stderr


def test_enqueue_returns_before_the_round_completes():
    """The engine thread only enqueues: submit returns while the proxy is still in the round."""
    faults = dict(p_delay=1.0, delay_ms=50)
    r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": faults}, deadline_ms=500, selftest_rounds=0))
    try:
        t0 = time.perf_counter()
        t = r.submit([RoundRequest(1, 1, 0, np.array([5], np.int32), 2)])
        submit_s = time.perf_counter() - t0
        res = r.result(t, timeout_s=5)
        total_s = time.perf_counter() - t0
        assert res.status == Status.OK
        assert submit_s < 0.01 < 0.05 <= total_s
    finally:
        r.close()


def test_close_with_a_parked_round_drains_through_the_watchdog():
    faults = dict(p_stall=1.0, stall_ms=10_000, stall_points=["read"])
    r = open_rounds(cfg(round_spec={"kind": "builtin", "faults": faults}, selftest_rounds=0))
    assert isinstance(r, AsyncRounds)
    r.submit([RoundRequest(1, 1, 0, np.array([5], np.int32), 2)])
    t0 = time.monotonic()
    r.close()  # the proxy is stopped (killed), the watchdog releases the parked stream
    assert time.monotonic() - t0 < 3.0
    assert r.region is None


def test_wait_mode_follows_the_backend_and_bad_names_are_refused():
    assert HandoffConfig(backend="emulated").wait_mode == "block"
    assert HandoffConfig(backend="cuda").wait_mode == "poll"  # the GPU writes `gathered` and cannot wake
    assert HandoffConfig(backend="cuda", wait="block").proxy_spec()["wait"] == "block"
    with pytest.raises(ValueError, match="wait 'spin'"):
        _ = HandoffConfig(wait="spin").wait_mode


def test_region_config_errors_are_clear():
    with pytest.raises(ValueError, match="max_drafts"):
        Region.create(RegionConfig(max_drafts=0))


def test_machine_info_names_where_a_figure_was_measured():
    """The versions come from the installed distributions; nvidia-smi's view only where it exists, torch's
    GPUs only where torch sees one (a CPU machine: neither)."""
    import shutil

    import torch

    from draftrelay.handoff.procinfo import machine_info

    info = machine_info(topology=True)
    assert info["torch"] == torch.__version__
    assert info["numpy"] == np.__version__ and info["cores"] == os.cpu_count()
    assert info["python"].count(".") == 2 and len(info["loadavg_1_5_15"]) == 3
    assert ("gpus" in info) == torch.cuda.is_available()
    assert ("nvidia_smi" in info) == ("topology" in info) == bool(shutil.which("nvidia-smi"))


def test_long_wait_slices_do_not_slow_closing_a_parked_stream_or_stopping_the_proxy():
    """The CPU hand-off sleeps on its words in long slices (engine.loading); a stream parked on a word
    nobody releases and a proxy asleep on `gathered` must still stop at once: close() and stop() wake them."""
    from draftrelay.handoff.stream import EmulatedStream

    region = Region.create(RegionConfig(2, 64, 4, VOCAB))
    try:
        st = EmulatedStream(region, wait="block", slice_us=30_000_000, poll_ms=30_000)
        st.wait_geq32(region.layout.word(0), 7)  # `gathered`, which nothing will raise
        st.record()
        time.sleep(0.2)  # the stream thread is asleep on the word now
        t0 = time.monotonic()
        st.close()
        assert time.monotonic() - t0 < 1.0
    finally:
        region.close()
    r = open_rounds(cfg(wait="block", wait_slice_us=30_000_000, selftest_rounds=1))
    assert isinstance(r, AsyncRounds)
    try:
        proxy = r.proxy
        time.sleep(0.2)  # the proxy is asleep on `gathered`
        t0 = time.monotonic()
        proxy.stop(timeout_s=5.0)  # SIGKILL only after 5 s: a prompt exit is the proxy seeing STOP
        assert time.monotonic() - t0 < 1.0 and proxy.proc.returncode == 0
        r.proxy = None
    finally:
        r.close()


def test_the_watchdog_deadline_follows_the_rounds_size():
    """The proxy hands the watchdog what RoundBudget gives a round beyond a steady one: a round that
    carries a catch-up request (more than CATCH_UP_TOKENS tokens) is not claimed at the steady
    deadline, a small round as slow still is, and a large round slower than its own budget is claimed
    once that budget has passed."""
    spec = {"kind": "builtin", "budget_per_catch_up_ms": 1000.0, "budget_per_token_us": 0.0}
    big = [RoundRequest(1, 1, 0, np.arange(40, dtype=np.int32), 2)]  # extra: 1 s
    small = [RoundRequest(2, 1, 0, np.array([5], np.int32), 2)]
    r = open_rounds(cfg(round_spec={**spec, "faults": dict(p_delay=1.0, delay_ms=300)}, deadline_ms=100,
                        selftest_rounds=0))
    assert isinstance(r, AsyncRounds), r.refusal
    try:
        res = r.result(r.submit(big), timeout_s=10)
        assert res.status == Status.OK and res.counts.sum() > 0  # 300 ms, past the steady 100 ms deadline
        t0 = time.monotonic()
        res = r.result(r.submit(small), timeout_s=10)
        assert res.status == Status.WATCHDOG and res.counts.sum() == 0
        assert time.monotonic() - t0 < 0.3  # claimed at its deadline, not when the proxy finished
    finally:
        r.close()
    r = open_rounds(cfg(round_spec={**spec, "faults": dict(p_delay=1.0, delay_ms=3000)}, deadline_ms=100,
                        selftest_rounds=0))
    try:
        t0 = time.monotonic()
        res = r.result(r.submit(big), timeout_s=10)
        took = time.monotonic() - t0
        assert res.status == Status.WATCHDOG and 1.05 <= took < 2.5, took  # deadline + the round's 1 s
    finally:
        r.close()


def test_an_async_rounds_failure_says_what_ran_out_sync_and_async_alike():
    """A worker slower than the round's budget: the failed round's detail (and the rounds' first_failure)
    names the part of the round that ran out, in async rounds (the proxy writes it into the reply slot)
    as in sync ones (the engine's thread sees the exception itself)."""
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.drafters import load_drafter
    from draftrelay.worker.server import WorkerServer

    slow = [RoundRequest(1, 1, 0, np.array([7], np.int32), 2)]
    for make in (SyncRounds, open_rounds):
        # a worker each: the late STEP of one holds the drafter's lock, and a new session's handshake waits
        # for it (that round's detail then says "connecting and the handshake")
        srv = WorkerServer(WorkerCore(load_drafter("test", test_vocab=VOCAB, slow_token=7, delay_ms=400),
                                      max_requests=4))
        host, port = srv.start()
        spec = {"kind": "worker", "host": host, "port": port, "max_requests": 4, "n_out_max": 8}
        r = make(cfg(round_spec=spec, round_budget_ms=100, deadline_ms=3000, selftest_rounds=0))
        try:
            res = r.result(r.submit(slow), timeout_s=10)
            assert res.status == Status.TIMEOUT, (make, res)
            assert "waiting for the STEP's reply" in res.detail and "ms of 100.0 ms" in res.detail, res.detail
            assert r.stats()["first_failure"]["timeout"] == res.detail[:300]
        finally:
            r.close()
            srv.stop()
