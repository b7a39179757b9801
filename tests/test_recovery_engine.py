"""Recovery under the real engine: the proxy is killed three times while concurrent requests decode
against a real worker process. Faults cost speed, never tokens: the greedy output equals the
target-only run, the worker keeps its process and serves each new proxy's new session."""

from __future__ import annotations

import os
import signal
import time

import pytest

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig
from draftrelay.model import tiny_model_id, tiny_pair
from draftrelay.worker.process import start_worker_process

PROMPTS = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"speculative")]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


def generate(target, mode: str, handoff: HandoffConfig | None = None, on_step=None):
    cfg = EngineConfig(mode=mode, n_draft=4, max_batch=3, max_len=256, handoff=handoff or HandoffConfig())
    with Engine(target, cfg) as eng:
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), on_step=on_step)
        if isinstance(eng.rounds, AsyncRounds):
            end = time.monotonic() + 10
            while len(eng.rounds.loss_log) < 3 and time.monotonic() < end:  # the last kill may be fresh
                time.sleep(0.005)
            eng.rounds.wait_settled()
        return [r.output for r in reqs], eng.metrics()


def test_proxy_killed_three_times_output_identical_to_target_only(target):
    reference, _ = generate(target, "off")
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env={"OMP_NUM_THREADS": "1"})
    kills: list[int] = []
    pids: list[int] = []
    steps = {"n": 0}

    def on_step(eng) -> None:
        steps["n"] += 1
        r = eng.rounds
        assert isinstance(r, AsyncRounds)
        if steps["n"] in (3, 9, 15):
            r.wait_settled()  # each kill hits a live proxy of a new generation
            pids.append(r.proxy.pid)
            kills.append(steps["n"])
            os.kill(r.proxy.pid, signal.SIGKILL)

    try:
        spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id()}
        h = HandoffConfig(round_spec=spec, deadline_ms=3000, round_budget_ms=2500)
        out, m = generate(target, "async", h, on_step)
        assert w.proc.poll() is None  # the worker kept its process through three proxy losses
    finally:
        w.stop()
    assert len(kills) == 3 and len(set(pids)) == 3
    assert out == reference  # 3 of 3 requests complete, token for token
    st = m["total"]["handoff"]
    assert st["respawns_used"] == 3 and st["proxy_losses"] == {"exit": 3} and st["generation"] == 3
    t = m["total"]
    assert t["rounds"]["ok"] > 0  # drafting resumed on the new proxies' sessions
