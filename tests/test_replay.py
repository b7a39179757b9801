"""Trace replay: a replayed run's acceptance equals the trace's own count, exactly, through the real
engine, proxy, worker process and wire (CPU, built-in tiny shapes, a synthetic trace)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.model import tiny_model_id, tiny_pair
from draftrelay.replay import (
    CostTable,
    ReplayDrafter,
    Trace,
    TraceEntry,
    TraceError,
    count_accepted,
    install_replay_target,
)
from draftrelay.worker.drafters import Job
from draftrelay.worker.process import start_worker_process

VOCAB = 256
MAX_TOKENS = 40


def synthetic_trace(seed: int = 0, n: int = 3, length: int = 48, hit: float = 0.7) -> Trace:
    """Random target sequences; the drafter's top-1 is the target's token with probability `hit`."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        prompt = [int(x) for x in rng.integers(0, VOCAB, 5 + 3 * i)]
        target = [int(x) for x in rng.integers(0, VOCAB, length)]
        top = []
        for t in target:
            first = t if rng.random() < hit else int((t + 1 + rng.integers(0, VOCAB - 1)) % VOCAB)
            rest = [int(x) for x in rng.choice([v for v in range(VOCAB) if v != first], 3, replace=False)]
            top.append([first, *rest])
        entries.append(TraceEntry(prompt, target, top, name=f"e{i}"))
    return Trace(pair="synthetic test pair", top_f=4, entries=entries, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    tr = synthetic_trace()
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    tr.save(str(path))
    return tr, str(path)


def engine_run(trace, mode, spec, k=4, max_batch=3):
    target, _ = tiny_pair()
    cfg = EngineConfig(mode=mode, n_draft=k, max_batch=max_batch, max_len=256,
                       handoff=HandoffConfig(round_spec=spec, deadline_ms=5000, round_budget_ms=4000))
    hook = install_replay_target(target, trace, n_rows=max_batch + 1, max_len=cfg.max_len)
    try:
        with Engine(target, cfg) as eng:
            reqs = eng.generate([e.prompt for e in trace.entries], SamplingParams(max_tokens=MAX_TOKENS))
            return reqs, eng.metrics()
    finally:
        hook.remove()


def test_trace_round_trip_and_refusals(trace_file, tmp_path):
    tr, path = trace_file
    back = Trace.load(path)
    assert back.entries[1].target == tr.entries[1].target and back.top_f == 4 and back.pair == tr.pair
    bad = json.load(open(path))
    bad["entries"][0]["draft_top"] = bad["entries"][0]["draft_top"][:-1]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(TraceError, match="entry 0: 47 draft_top rows for 48 target tokens"):
        Trace.load(str(p))
    p.write_text("{}")
    with pytest.raises(TraceError, match="not a draftrelay-trace-1 file"):
        Trace.load(str(p))


def test_off_mode_follows_the_trace(trace_file):
    tr, _ = trace_file
    reqs, _ = engine_run(tr, "off", {"kind": "builtin"})
    assert [r.output for r in reqs] == [e.target[:MAX_TOKENS] for e in tr.entries]


@pytest.mark.parametrize("mode,k", [("sync", 4), ("async", 4), ("sync", 2)])
def test_replayed_acceptance_equals_the_trace_count(trace_file, mode, k):
    tr, path = trace_file
    w = start_worker_process(["--model", f"replay:{path}:tiny", "--device", "cpu", "--dtype", "float32"],
                             env={"OMP_NUM_THREADS": "1"})
    try:
        spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id()}
        reqs, m = engine_run(tr, mode, spec, k=k)
    finally:
        w.stop()
    assert m["total"]["rounds"]["failed"] == 0 and m["total"]["rounds"]["watchdog"] == 0
    for r, e in zip(reqs, tr.entries, strict=True):
        assert r.output == e.target[:MAX_TOKENS]  # greedy output: the target's (the trace's)
        expect = [kept for offered, kept in count_accepted(e, k, MAX_TOKENS) if offered]
        assert r.kept == expect, (e.name, r.kept, expect)
    total = sum(sum(kept for _, kept in count_accepted(e, k, MAX_TOKENS)) for e in tr.entries)
    assert total == sum(sum(r.kept) for r in reqs) and total > 10  # the trace's count, exactly


def test_replay_drafter_off_trace_and_rollback():
    tr = synthetic_trace(seed=3, n=1, hit=1.0)  # the drafter is always right on the trace
    e = tr.entries[0]
    cost = CostTable({(1, 3, 256): 0.0})
    d = ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=128, vocab_size=VOCAB)
    first = np.asarray(e.prompt + e.target[:1], np.int32)
    drafts, _ = d.run([Job(0, 0, first)], 3)
    assert drafts[0].tolist() == e.target[1:4]
    # the client accepted one draft and then its own correction differs from draft 2: off the trace
    n = len(first)
    wrong = (e.target[2] + 1) % VOCAB
    drafts, _ = d.run([Job(0, n + 1, np.asarray([wrong], np.int32))], 2)
    assert all(int(x) != e.target[3] for x in drafts[0][:1])
    # roll back to the true prefix: on the trace again
    drafts, _ = d.run([Job(0, n, np.asarray(e.target[1:3], np.int32))], 2)
    assert drafts[0].tolist() == e.target[3:5]
    assert [t for t, _ in d.top_f(0, n + 2, 4)][0] == e.target[3]


def test_emulated_device_spends_the_table():
    import time

    tr = synthetic_trace(seed=1, n=1)
    d = ReplayDrafter(tr, cost=CostTable({(1, 4, 256): 0.030, (2, 4, 256): 0.060}), n_rows=2, max_ctx=128,
                      vocab_size=VOCAB)
    t0 = time.perf_counter()
    d.run([Job(0, 0, np.asarray(tr.entries[0].prompt, np.int32))], 4)
    dt = time.perf_counter() - t0
    assert 0.029 <= dt < 0.2
