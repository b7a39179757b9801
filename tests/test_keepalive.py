"""An idle engine keeps its worker session: the client PINGs once a third of the worker's idle timeout
has passed without a frame (DrafterClient.keepalive), the proxy between rounds and SyncRounds' timer
call it, so the first round after a pause between requests is an ordinary one instead of failing on
SESSION_EXPIRED and reaching a new session that knows none of the requests."""

from __future__ import annotations

import time

import numpy as np
import pytest

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig, SyncRounds
from draftrelay.model import tiny_model_id, tiny_pair
from draftrelay.wire import Block, DrafterClient, WireRemoteError
from draftrelay.wire import protocol as P
from draftrelay.worker.process import start_worker_process

IDLE_S = 0.6  # the worker's idle timeout here: a pause of 1.5 s would expire an unkept session twice over


def test_keepalive_pings_only_when_due_and_keeps_the_session():
    with start_worker_process(["--model", "test", "--idle-timeout", str(IDLE_S)], timeout=30) as w:
        c = DrafterClient(w.host, w.port, timeout=2.0)
        assert not c.keepalive()  # not connected: nothing to keep
        sid = c.connect().session_id
        assert c.info.idle_timeout_ms == int(IDLE_S * 1000)
        assert not c.keepalive() and c.stats["keepalives"] == 0  # just connected: not due
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            time.sleep(0.05)
            c.keepalive()
        # due every 0.2 s (a third of 0.6 s): about 7 PINGs in 1.5 s, never one per call (30 calls)
        assert 4 <= c.stats["keepalives"] <= 9, c.stats
        r = c.step([Block(1, 0, 0, np.asarray([1, 2], np.int32), 2)])
        assert r.session_id == sid and r[0].status == 0  # the same session, 2.5 idle timeouts later
        c.close()
        # without it the same pause expires the session (the worker's contract test covers the error)
        d = DrafterClient(w.host, w.port, timeout=2.0)
        d.connect()
        time.sleep(1.5)
        with pytest.raises(WireRemoteError) as e:
            d.step([Block(1, 0, 0, np.asarray([1, 2], np.int32), 2)])
        assert e.value.code == P.SESSION_EXPIRED
        d.close()


def test_a_keepalive_to_a_gone_worker_drops_the_connection_without_tripping_the_breaker():
    w = start_worker_process(["--model", "test", "--idle-timeout", str(IDLE_S)], timeout=30)
    c = DrafterClient(w.host, w.port, timeout=0.5, breaker_failures=1)
    c.connect()
    w.stop()
    time.sleep(0.3)
    assert not c.keepalive() and c.stats["keepalive_failures"] == 1 and not c.connected
    assert not c.breaker_open  # no round failed: a later round just reconnects (here: and fails itself)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_idle_engine_keeps_its_worker_session(mode, monkeypatch):
    monkeypatch.setattr(SyncRounds, "KEEPALIVE_POLL_S", 0.05)  # the timer's tick (1 s by default)
    target = tiny_pair()[0]
    prompts = [list(b"def add(a, b):")]
    with start_worker_process(["--model", "tiny", "--device", "cpu", "--idle-timeout", str(IDLE_S)],
                              env={"OMP_NUM_THREADS": "1"}, timeout=60) as w:
        spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id()}
        h = HandoffConfig(round_spec=spec, deadline_ms=3000, round_budget_ms=2500)
        cfg = EngineConfig(mode=mode, n_draft=4, max_batch=1, max_len=256, handoff=h)
        with Engine(target, cfg) as eng:
            assert isinstance(eng.rounds, SyncRounds) == (mode == "sync")
            first = eng.generate(prompts, SamplingParams(max_tokens=16))[0]
            time.sleep(1.5)  # 2.5 idle timeouts without a round
            second = eng.generate(prompts, SamplingParams(max_tokens=16))[0]
            hs = eng.metrics()["total"]["handoff"]
        log = w.log()
        assert "expired" not in log, log[-2000:]  # the worker never expired the engine's session
        assert second.output == first.output
        assert second.rounds["failed"] == 0 and second.rounds["ok"] > 0, (second.rounds, hs)
        assert hs["failed"] == 0, hs
