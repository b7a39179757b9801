"""The worker's slow-STEP report: a STEP over --slow-step-ms is counted and logged with what the
drafter did in it, and a fast one is not."""
from __future__ import annotations

import logging

import numpy as np

from draftrelay.wire import protocol as P
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.drafters import load_drafter


def _session(core):
    s, _ = core.open_session(P.Hello(max_requests=2, n_out_max=8))
    return s


def test_a_slow_step_is_counted_and_logged_with_its_blocks(caplog):
    core = WorkerCore(load_drafter("test", slow_token=7, delay_ms=80), max_requests=2, slow_step_ms=40)
    s = _session(core)
    with caplog.at_level(logging.WARNING, logger="draftrelay.worker"):
        core.step(s, [P.Block(1, 1, 0, np.array([1, 2, 3], np.int32), 4)])
        assert core.stats["slow_steps"] == 0 and "slow STEP" not in caplog.text
        core.step(s, [P.Block(2, 1, 0, np.array([5, 7], np.int32), 3)])
    assert core.stats["slow_steps"] == 1
    line = next(r.getMessage() for r in caplog.records if "slow STEP" in r.getMessage())
    assert "1 blocks, tokens per block [2], 3 drafts" in line, line
    ms = float(line.split("slow STEP: ")[1].split(" ms")[0])
    assert ms >= 80, line


def test_the_report_says_what_a_model_drafter_did_and_zero_turns_it_off(caplog):
    d = load_drafter("tiny", n_rows=4, max_ctx=256, mode="eager")
    core = WorkerCore(d, max_requests=2, slow_step_ms=1e-6)  # every STEP is "slow"
    s = _session(core)
    prompt = (np.arange(1, 40) * 13 % 256).astype(np.int32)  # > 16 tokens: the eager prefill path
    with caplog.at_level(logging.WARNING, logger="draftrelay.worker"):
        core.step(s, [P.Block(3, 1, 0, prompt, 2)])
    line = next(r.getMessage() for r in caplog.records if "slow STEP" in r.getMessage())
    assert "tokens per block [39]" in line and "drafter: " in line, line
    assert " eager, 0 graphs built" in line, line  # a CPU eager drafter prefills prompts whole
    off = WorkerCore(load_drafter("test", slow_token=7, delay_ms=30), max_requests=2, slow_step_ms=0)
    s2 = _session(off)
    off.step(s2, [P.Block(2, 1, 0, np.array([7], np.int32), 2)])
    assert off.stats["slow_steps"] == 0
