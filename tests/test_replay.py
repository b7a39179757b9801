"""Trace replay: a replayed run's acceptance equals the trace's own count, exactly, through the real
engine, proxy, worker process and wire (CPU, built-in tiny shapes, a synthetic trace)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftrelay import replay
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


def synthetic_trace(seed: int = 0, n: int = 3, length: int = 48, hit: float = 0.7, second: bool = False) -> Trace:
    return replay.synthetic_trace(VOCAB, n, length, hit, seed=seed, second=second, pair="synthetic test pair")


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


# ---- the speculation cache on replayed acceptance ------------------------------------------------------

ZERO_COST = {"entries": [{"jobs": 1, "n_steps": 4, "kv": 256, "s": 0.0},
                         {"kind": "prefetch", "jobs": 1, "fanout": 4, "k": 4, "kv": 256, "s": 0.0}]}


def lockstep(core, entry, k: int, fanout: int):
    """Drive one WorkerCore like the engine would for one trace entry (greedy, the target is the trace):
    per round the block, the drafts, the decoded branch table."""
    from draftrelay.speculation import table as TB
    from draftrelay.wire import protocol as P
    from draftrelay.worker.prefetch import branches_payload

    seq = entry.sequence
    session, _ = core.open_session(P.Hello(max_requests=1, n_out_max=8))
    held, n, pos = len(entry.prompt) + 1, 1, 0  # engine: prompt + first token; drafter: nothing yet
    out = []
    while n < len(entry.target) - k - 1:
        block = P.Block(7, 1, pos, np.asarray(seq[pos:held], np.int32), k)
        res = core.step(session, [block])
        f = res.drafts[0, :k].tolist()
        table = TB.decode(branches_payload(core, session, [block], res, fanout), VOCAB) if fanout else None
        kept = 0
        while kept < k and f[kept] == seq[held + kept]:
            kept += 1
        out.append((block, f, table))
        pos, held, n = held, held + kept + 1, n + kept + 1
    return out


def test_replay_branches_leave_the_drafter_as_plain_rounds_do(tmp_path):
    """The replay prefetcher's worker-side hits (STEPs answered from a branch, at no cost) leave the
    ReplayDrafter's drafts and bookkeeping exactly as plain rounds leave them, and every branch holds what a
    fresh round of its context would draft."""
    from draftrelay.speculation import table as TB
    from draftrelay.worker.core import WorkerCore

    tr = synthetic_trace(seed=5, n=1, length=64, hit=0.6, second=True)
    e = tr.entries[0]
    cost = CostTable.load(_write(tmp_path / "cost.json", ZERO_COST))
    plain = WorkerCore(ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=128, vocab_size=VOCAB))
    cached = WorkerCore(ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=128, vocab_size=VOCAB))
    a = lockstep(plain, e, 4, 0)
    b = lockstep(cached, e, 4, 8)
    assert [f for _, f, _ in a] == [f for _, f, _ in b]
    da, db = plain.drafter, cached.drafter._d
    for name in ("lengths", "on_trace", "follow"):
        assert np.array_equal(getattr(da, name), getattr(db, name)), name
    for r in range(2):
        assert np.array_equal(da.hist[r, :da.lengths[r]], db.hist[r, :db.lengths[r]])
    pf = cached.prefetcher
    expect_hits = 0
    for (_, _, table), (nxt, _, _) in zip(b, b[1:], strict=False):
        ent = table.entry(7)
        assert ent is not None and ent.n_branches == 8
        hit = TB.select(ent, 7, 1, nxt.position, nxt.tokens) >= 0
        expect_hits += hit
        for j in range(ent.n_branches):  # each branch = what a fresh replay drafter drafts after its context
            fresh = ReplayDrafter(tr, cost=cost, n_rows=1, max_ctx=128, vocab_size=VOCAB)
            fresh.run([Job(0, 0, np.asarray(e.sequence[:ent.base], np.int32))], 0)  # the request's context
            want, _ = fresh.run([Job(0, ent.base, ent.prefix(j))], 4)
            assert ent.branch_drafts[j].tolist() == want[0].tolist(), (ent.base, j)
    assert pf.stats["worker_side_hits"] == expect_hits > 3 and pf.stats["hit_mismatches"] == 0


def _write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def trace_candidates(e: TraceEntry, base: int, f: list[int], m: int):
    """The replay's branch candidates recomputed from the trace alone (docs/REPLAY.md): recorded top-m
    where the first a drafts are true, the recorded probabilities on placeholder tokens elsewhere."""
    seq = e.sequence
    k = len(f)
    tok = np.zeros((k + 1, m), np.int64)
    prob = np.zeros((k + 1, m))
    for a in range(k + 1):
        n = base + a
        j = n - len(e.prompt)
        if not 0 <= j < len(e.target):
            tok[a] = (np.arange(m) + 1 + (seq[n] if n < len(seq) else 0)) % VOCAB
            continue
        prob[a] = e.draft_prob[j][:m]
        true_so_far = f[:a] == seq[base:base + a]
        tok[a] = e.draft_top[j][:m] if true_so_far else (seq[n] + 1 + np.arange(m)) % VOCAB
    return tok, prob


@pytest.mark.parametrize("inner,F", [("emulated", 4), ("emulated", 8), ("tiny", 8)])
def test_cache_on_replay_keeps_the_trace_count_and_hits_as_counted(tmp_path, inner, F):
    """Through the worker process, proxy and engine (host selection): greedy output = the trace's,
    acceptance = the trace's count exactly, and the hit count = a direct count from the trace and the
    branch choice (the worker's acceptance estimate replayed from the rounds)."""
    from draftrelay.engine.engine import Engine, EngineConfig
    from draftrelay.speculation import table as TB
    from draftrelay.worker.prefetch import TOP_M

    tr = synthetic_trace(seed=7, n=3, length=48, hit=0.7, second=True)
    rng = np.random.default_rng(1)
    for ent in tr.entries:  # probabilities, so the branch choice has something to rank
        ent.draft_prob = [sorted(rng.dirichlet(np.ones(4)).round(4).tolist(), reverse=True) for _ in ent.target]
    path = str(tmp_path / "trace.json")
    tr.save(path)
    k = 4
    if inner == "emulated":
        cost = {"entries": [{"jobs": 1, "n_steps": k, "kv": 256, "s": 0.001},
                            {"kind": "prefetch", "jobs": 1, "fanout": F, "k": k, "kv": 256, "s": 0.001}]}
        spec_model = f"replay:{path}:emulated={_write(tmp_path / 'cost.json', cost)}"
    else:
        spec_model = f"replay:{path}:tiny"
    w = start_worker_process(["--model", spec_model, "--device", "cpu", "--dtype", "float32"],
                             env={"OMP_NUM_THREADS": "1"})
    target, _ = tiny_pair()
    spec = {"kind": "worker", "host": w.host, "port": w.port,
            "model_id": tiny_model_id() if inner == "tiny" else "replay-emulated"}
    # the guard off: every step a cache step, so the recount below replays every round
    cfg = EngineConfig(mode="async", n_draft=k, max_batch=1, max_len=256, spec_fanout=F,
                       spec_options={"log": True, "guard": False},
                       handoff=HandoffConfig(round_spec=spec, deadline_ms=5000, round_budget_ms=4000))
    hook = install_replay_target(target, tr, n_rows=2, max_len=cfg.max_len)
    try:
        with Engine(target, cfg) as eng:
            reqs = eng.generate([e.prompt for e in tr.entries], SamplingParams(max_tokens=MAX_TOKENS))
            m = eng.metrics()
            log = eng.spec_cache.log
    finally:
        hook.remove()
        w.stop()
    sc = m["total"]["spec_cache"]
    assert sc["active"] and m["total"]["rounds"]["failed"] == 0 and m["total"]["rounds"]["watchdog"] == 0
    for r, e in zip(reqs, tr.entries, strict=True):
        assert r.output == e.target[:MAX_TOKENS]  # = target-only (test_off_mode_follows_the_trace)
        assert r.kept == [kept for offered, kept in count_accepted(e, k, MAX_TOKENS) if offered], e.name
    # the direct count: per lookup, the candidates from the trace, the worker's acceptance replayed
    by_id = {r.id: e for r, e in zip(reqs, tr.entries, strict=True)}
    acc = TB.Acceptance()
    expect = 0
    for rec in log:
        if rec["drafts"] is None:
            continue
        e, f, new = by_id[rec["request"]], rec["drafts"], rec["new"]
        tok, prob = trace_candidates(e, rec["base"], f, min(TOP_M, tr.top_f))
        confs = TB.draft_confs(tok, prob, np.asarray(f))
        chosen = TB.choose_branches(tok, prob, np.asarray(f, np.int32), acc.rates(confs), F)
        a = len(new) - 1
        expect += new[:a] == f[:a] and any(ca == a and cy == new[a] for ca, cy, _ in chosen)
        mm = min(len(f), a)
        eq = np.asarray(new[:mm]) == np.asarray(f[:mm])
        acc.update(confs, mm if eq.all() else int(np.argmin(eq)))
    assert sc["hits"] == sum(rec["hit"] for rec in log) == expect > 5, (sc, expect)
    assert set(sc["misses"]) <= {"no_match", "no_entry", "no_table"}, sc["misses"]


def test_emulated_branch_work_spends_the_device_pieces_and_does_the_host_pieces():
    """On the emulated device the prefetch cost (the device pieces, as measure_costs records them) is
    spent in `run`, no forward over the stopping places runs, and the host pieces run for real."""
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.prefetch import DEVICE_PIECES

    tr = synthetic_trace(seed=2, n=1, length=40)
    cost = CostTable({(1, 4, 256): 0.0}, prefetch={(1, 4, 4, 256): 0.004})
    e = tr.entries[0]
    core = WorkerCore(ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=len(e.sequence) + 64, vocab_size=VOCAB))
    rounds = lockstep(core, e, 4, 4)
    st = core.prefetcher.stats
    tables = sum(1 for _, _, t in rounds if t is not None and t.entries)
    assert tables >= 3 and st["stops_us"] == 0 and set(DEVICE_PIECES) == {"stops", "run", "bonus"}
    assert 4000 * tables <= st["run_us"] < 4000 * tables + 20000 * tables, st
    assert st["choose_us"] > 0 and st["entries_us"] > 0 and st["encode_us"] > 0


@pytest.mark.parametrize("bonus_mode", ["queued", "lazy"])
def test_emulated_device_spends_the_bonus_forward_where_it_was_measured_and_skips_answered_stops(bonus_mode):
    """The emulated device spends a table's work less its bonus forward before the table goes out; with
    the bonus measured queued it keeps that forward queued (the next STEP that drafts waits for it), with it
    measured lazy a table after a STEP answered from branches spends it before the run and nothing waits
    behind a table. After a STEP answered from branches it spends no forward over the stopping places."""
    import time

    from draftrelay.worker.core import WorkerCore

    tr = synthetic_trace(seed=2, n=1, length=40)
    cost = CostTable({(1, 4, 256): 0.0}, prefetch={(1, 4, 4, 256): 0.010}, prefetch_stops={(1, 4, 4, 256): 0.004},
                     prefetch_bonus={(1, 4, 4, 256): 0.003}, bonus_mode=bonus_mode)
    e = tr.entries[0]
    core = WorkerCore(ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=len(e.sequence) + 64, vocab_size=VOCAB))
    rounds = lockstep(core, e, 4, 4)
    st = core.prefetcher.stats
    tables = sum(1 for _, _, t in rounds if t is not None and t.entries)
    after_hit, drafted = st["stops_from_branches"], st["stops_forwards"]
    assert after_hit >= 1 and drafted >= 1 and after_hit + drafted == tables, st
    # per table: 10 - 3 ms after a drafted STEP; after a STEP answered from a branch 10 - 3 - 4 (queued) or
    # 10 - 4 (lazy: the answering branch's bonus forward before the run)
    hit = 0.003 if bonus_mode == "queued" else 0.006
    spent = 1e-6 * st["run_us"]
    assert 0.007 * drafted + hit * after_hit <= spent < 0.007 * drafted + hit * after_hit + 0.02 * tables, st
    pf = core.prefetcher
    if bonus_mode == "lazy":
        assert pf._busy_until == 0.0
        return
    pf._busy_until = time.perf_counter() + 0.05
    t0 = time.perf_counter()
    pf.device_free()
    assert time.perf_counter() - t0 >= 0.045


def test_cost_table_keeps_the_branch_work_and_takes_the_nearest_entry(tmp_path):
    t = CostTable({(1, 4, 256): 0.004, (4, 4, 256): 0.005}, "test",
                  prefetch={(1, 4, 4, 256): 0.006, (1, 8, 4, 256): 0.007, (4, 8, 4, 32768): 0.020})
    path = str(tmp_path / "cost.json")
    t.save(path)
    back = CostTable.load(path)
    assert back.seconds == t.seconds and back.prefetch == t.prefetch
    assert back.lookup_prefetch_stops(1, 8, 4, 300) == 0.0 == back.lookup_prefetch_bonus(1, 8, 4, 300)
    t.prefetch_stops, t.prefetch_bonus = {(1, 8, 4, 256): 0.002}, {(1, 8, 4, 256): 0.001}  # parts of the entries
    t.save(path)
    back = CostTable.load(path)
    assert back.lookup_prefetch_stops(1, 8, 4, 300) == 0.002 and back.lookup_prefetch_bonus(1, 8, 4, 300) == 0.001
    assert back.lookup_prefetch_stops(4, 8, 4, 30000) == 0.0
    assert back.bonus_mode == "queued"  # the default
    t.bonus_mode = "lazy"
    t.save(path)
    assert CostTable.load(path).bonus_mode == "lazy"
    d = json.load(open(path))
    d["bonus_mode"] = "soon"
    (tmp_path / "mode.json").write_text(json.dumps(d))
    with pytest.raises(TraceError, match="bonus_mode 'soon'"):
        CostTable.load(str(tmp_path / "mode.json"))
    assert back.lookup_prefetch(1, 8, 4, 300) == 0.007 and back.lookup_prefetch(4, 8, 4, 30000) == 0.020
    assert back.lookup_prefetch(2, 5, 4, 200) == 0.006  # nearest: requests first, then F
    with pytest.raises(TraceError, match="no prefetch entries"):
        CostTable({(1, 4, 256): 0.004}).lookup_prefetch(1, 8, 4, 256)
    (tmp_path / "bad.json").write_text(json.dumps({"entries": [{"kind": "prefetch", "jobs": 1, "fanout": 8,
                                                                 "k": 4, "kv": 256, "s": 0.1}]}))
    with pytest.raises(TraceError, match="no STEP entries"):
        CostTable.load(str(tmp_path / "bad.json"))


def test_worker_metrics_report_the_branch_work_by_piece():
    """`draftrelay worker --metrics-port`: the prefetcher's tables, branches and seconds by piece, as its
    stats count them (the emulated device's run spent as measured)."""
    import types

    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.metrics import WorkerCollector
    from draftrelay.worker.prefetch import PIECES

    tr = synthetic_trace(seed=2, n=1, length=40)
    cost = CostTable({(1, 4, 256): 0.0}, prefetch={(1, 4, 4, 256): 0.002})
    e = tr.entries[0]
    core = WorkerCore(ReplayDrafter(tr, cost=cost, n_rows=2, max_ctx=len(e.sequence) + 64, vocab_size=VOCAB))
    lockstep(core, e, 4, 4)
    srv = types.SimpleNamespace(core=core, refusals={}, stats={}, active_connections=lambda: 0)
    fams = {f.name: f for f in WorkerCollector(srv).collect()}
    st = core.prefetcher.stats
    assert fams["draftrelay_worker_branch_tables"].samples[0].value == st["tables"] >= 3
    assert fams["draftrelay_worker_branch_branches"].samples[0].value == st["branches"] > 0
    work = {s.labels["piece"]: s.value for s in fams["draftrelay_worker_branch_work_seconds"].samples}
    assert set(work) == set(PIECES)
    assert work["run"] == pytest.approx(st["run_us"] / 1e6) and work["run"] >= 0.002 * 3
    assert work["choose"] > 0 and work["encode"] > 0


def test_a_replay_drafter_costs_rounds_as_what_it_replays_through():
    """An emulated device spends every asked draft's cost (fixed rounds, HELLO_OK_FIXED_ROUNDS); a real
    drafter underneath decides for itself (a lean one stops computing where the stop ends it)."""
    from draftrelay.worker.drafters import LlamaDrafter

    tr = synthetic_trace(seed=1, n=1)
    assert ReplayDrafter(tr, cost=CostTable({(1, 4, 256): 0.0}), n_rows=2, max_ctx=128,
                         vocab_size=VOCAB).fixed_rounds is True
    _, dm = tiny_pair()
    for mode, fixed in (("lean", False), ("static", True)):
        inner = LlamaDrafter(dm, 2, 128, 8, tiny_model_id(), "", mode)
        assert ReplayDrafter(tr, inner=inner).fixed_rounds is fixed


def test_replay_drafter_loads_its_inner_drafter_with_the_quant_asked(trace_file):
    """replay:TRACE:INNER --quant int8: the inner drafter (whose STEP the replay spends) is the quantized one, as
    benchmarks/replay_headline.py --drafter-quant asks of its workers."""
    from draftrelay.worker.drafters import load_drafter

    _, path = trace_file
    plain = load_drafter(f"replay:{path}:tiny", device="cpu", dtype="float32", n_rows=2, max_ctx=128)
    q = load_drafter(f"replay:{path}:tiny", device="cpu", dtype="float32", n_rows=2, max_ctx=128, quant="int8")
    assert "int8 products" in q.inner.info and "int8" not in plain.inner.info, (q.inner.info, plain.inner.info)
    with pytest.raises(ValueError, match="no weights to quantize"):  # an emulated drafter has no forward
        load_drafter(f"replay:{path}:emulated=cost.json", device="cpu", quant="int8")
