"""The static-shape draft step (what the worker captures as one CUDA graph on a GPU) against the eager
step, on CPU: the same drafts and confidences over rounds with rollback, padding and mixed frames."""

from __future__ import annotations

import numpy as np

from draftrelay.wire import protocol as P
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.drafters import load_drafter
from test_worker_lean import make as make_worker


def make(mode):
    return make_worker("tiny", mode)


def test_static_step_equals_eager_step():
    de, ce, se = make("eager")
    ds, cs, ss = make("static")
    rng = np.random.default_rng(3)
    ctx = {rid: 0 for rid in (1, 2, 3)}
    pending = {rid: rng.integers(0, 256, 30 if rid == 1 else 5).astype(np.int32) for rid in ctx}
    static_frames = 0
    for rnd in range(30):
        rids = [r for r in ctx if rng.random() < 0.8] or [1]
        blocks = [P.Block(r, 0, ctx[r], pending[r], int(rng.integers(1, 7))) for r in rids]
        if all(len(pending[r]) <= 16 for r in rids):
            static_frames += 1
        a, b = ce.step(se, blocks), cs.step(ss, blocks)
        assert a.status.tolist() == b.status.tolist() and a.counts.tolist() == b.counts.tolist()
        assert a.drafts.tolist() == b.drafts.tolist(), rnd
        # a prompt extended first (the static path) sums in another order than in one forward: fp32 rounding
        np.testing.assert_allclose(a.confidences, b.confidences, atol=2e-5)
        for i, r in enumerate(rids):
            ctx[r] += len(pending[r])
            d = a.drafts[i, :a.counts[i]]
            k = int(rng.integers(0, len(d) + 1))
            pending[r] = np.concatenate([d[:k], rng.integers(0, 256, 1)]).astype(np.int32)
            assert de.cache.lengths[se.requests[r].row] == ds.cache.lengths[ss.requests[r].row]
    assert static_frames >= 20 and len(ds._static) >= 3  # several (B, T, n_steps, kv) keys were built


def test_warm_builds_every_key_up_front():
    d = load_drafter("tiny", device="cpu", n_rows=4, max_ctx=600, n_out_max=6, mode="static")
    assert d.cache.max_len == 600 + 17
    assert d.warm([3], max_batch=2) == 2 * 3 * 3  # B 1-2, T buckets 1-4 (<= n_out + 1), kv 256 / 512 / 617
    assert {k[3] for k in d._static} == {256, 512, 617}
    assert load_drafter("tiny", device="cpu", n_rows=4, max_ctx=600, mode="eager").warm([3], 2) == 0


def test_the_planning_forward_leaves_every_row_and_the_drafts_as_they_were():
    """plan_warm's forward (run at a CUDA worker's start so the kernel planner sees every product
    before the first round) writes only the scratch row and leaves it empty: a session's drafts
    after it equal a fresh drafter's."""
    da, ca, sa = make("eager")
    db, cb, sb = make("eager")
    blocks = [P.Block(1, 0, 0, np.arange(5, dtype=np.int32), 4)]
    before = ca.step(sa, blocks)
    lengths = [int(x) for x in da.cache.lengths]
    da._plan_forward()
    da.plan_warm()  # a CPU: nothing to plan, nothing run
    assert [int(x) for x in da.cache.lengths] == lengths and int(da.cache.lengths[da.n_rows]) == 0
    nxt = [P.Block(1, 0, 5, before.drafts[0, :2].astype(np.int32), 4)]
    cb.step(sb, blocks)
    assert ca.step(sa, nxt).drafts.tolist() == cb.step(sb, nxt).drafts.tolist()


def test_catch_up_frames_and_short_windows_use_the_steps_built_at_start():
    """A frame with blocks longer than PAD_LIMIT (a request catching up after plain steps, a new prompt,
    one beyond BATCHED_HEAD) extends those eagerly and drafts with a step built at start, and a window
    shorter than the built steps drafts with a longer step cut back: no step is built after the warm-up,
    and every round's drafts, confidences and row lengths equal the eager drafter's."""
    from draftrelay.worker.drafters import BATCHED_HEAD, PAD_LIMIT

    def fresh(mode):
        d = load_drafter("tiny", device="cpu", n_rows=6, max_ctx=700, n_out_max=6, mode=mode)
        core = WorkerCore(d, max_requests=5)
        s, _ = core.open_session(P.Hello(max_requests=5, n_out_max=6))
        return d, core, s

    de, ce, se = fresh("eager")
    ds, cs, ss = fresh("static")
    built = ds.warm([4], max_batch=5)
    assert built == len(ds._static) > 0
    rng = np.random.default_rng(11)
    lens = {1: 40, 2: BATCHED_HEAD + 50, 3: 20, 4: 3, 5: 12}  # 12: a T bucket (16) not built for k = 4
    pending = {r: rng.integers(0, 256, n).astype(np.int32) for r, n in lens.items()}
    ctx = dict.fromkeys(lens, 0)
    long_frames = short_windows = extended = 0
    for rnd in range(24):
        rids = [r for r in ctx if rng.random() < 0.75] or [1, 3]
        if rnd % 5 == 2:  # two requests catch up at once (plain steps the drafter missed)
            for r in rids[:2]:
                pending[r] = np.concatenate([pending[r], rng.integers(0, 256, int(rng.integers(14, 30)))]
                                            ).astype(np.int32)
        window = 4 if rng.random() < 0.6 else int(rng.integers(1, 4))
        short_windows += window < 4
        long_frames += any(len(pending[r]) > PAD_LIMIT for r in rids)
        blocks = [P.Block(r, 0, ctx[r], pending[r], window) for r in rids]
        a, b = ce.step(se, blocks), cs.step(ss, blocks)
        extended += ds._extended
        assert a.status.tolist() == b.status.tolist() and a.counts.tolist() == b.counts.tolist(), rnd
        assert a.drafts.tolist() == b.drafts.tolist(), rnd
        # a batched prefill sums in another order than one per request: fp32 rounding only
        np.testing.assert_allclose(a.confidences, b.confidences, atol=2e-5)
        for i, r in enumerate(rids):
            ctx[r] += len(pending[r])
            assert de.cache.lengths[se.requests[r].row] == ds.cache.lengths[ss.requests[r].row], (rnd, r)
            d = a.drafts[i, :a.counts[i]]
            k = int(rng.integers(0, len(d) + 1))
            pending[r] = np.concatenate([d[:k], rng.integers(0, 256, 1)]).astype(np.int32)
    assert long_frames >= 5 and short_windows >= 4 and extended >= long_frames + 1
    assert len(ds._static) == built, sorted(set(ds._static))  # nothing built after the warm-up


def test_a_one_draft_frame_of_three_tokens_extends_eagerly_unless_the_k_step_is_built():
    """Why benchmarks/replay_headline.py warms its drafter before timing the STEP table: on a cold drafter
    a round of three tokens asking one draft (more than a steady round of one draft sends) extends its jobs
    eagerly on every call, since no step of its T bucket is ever built; warmed for k = 4, as a worker the
    engine starts is (--warm-graphs k), the same frame runs the built 4-step step and extends nothing."""
    from draftrelay.worker.drafters import Job

    extended = {}
    for warm in (False, True):
        d = load_drafter("tiny", device="cpu", n_rows=5, max_ctx=512, n_out_max=8, mode="static")
        rng = np.random.default_rng(5)
        for r in range(4):
            d.run([Job(r, 0, rng.integers(0, 256, 64).astype(np.int32))], 0)
        if warm:
            d.warm([4], 4, 128)
        got = []
        for it in range(3):
            d.run([Job(r, 64 + 3 * it, rng.integers(0, 256, 3).astype(np.int32)) for r in range(4)], 1)
            got.append(d._extended)
        extended[warm] = got
    assert extended == {False: [4, 4, 4], True: [0, 0, 0]}


def test_a_round_of_fewer_drafts_runs_its_own_step_only_where_one_was_built():
    """The depth policy asks any depth up to k_max. A drafter warmed for k_max alone runs every shallower
    round on the k_max step (the first drafts returned), so a 2-draft round costs a 6-draft one; warmed for
    every depth (what loading.start_local_worker(warm_depths=True) asks on a GPU), each depth runs its own
    step, and the drafts are the same either way."""
    from draftrelay.worker.drafters import Job

    used, drafts = {}, {}
    for steps in ((6,), (1, 2, 3, 4, 5, 6)):
        d = load_drafter("tiny", device="cpu", n_rows=3, max_ctx=512, n_out_max=8, mode="static")
        rng = np.random.default_rng(2)
        d.run([Job(0, 0, rng.integers(0, 256, 40).astype(np.int32))], 0)
        d.warm(list(steps), 1, 256)
        built, ran = set(d._static), []
        get = d._get_static
        d._get_static = lambda key, get=get, ran=ran: ran.append(key[2]) or get(key)  # the step each round ran
        keep, out = 40, []
        for n in (2, 6, 1, 3):
            toks = rng.integers(0, 256, 2).astype(np.int32)
            got, _ = d.run([Job(0, keep, toks)], n)
            out.append(got[0, :n].tolist())
            keep += 2
        assert set(d._static) == built  # nothing captured after the warm-up either way
        used[steps], drafts[steps] = ran, out
    assert used == {(6,): [6, 6, 6, 6], (1, 2, 3, 4, 5, 6): [2, 6, 1, 3]}
    assert drafts[(6,)] == drafts[(1, 2, 3, 4, 5, 6)]


def test_the_warm_up_says_its_progress():
    """warm's progress(done, total): once before the first capture, then after each, ending at the number
    built; the worker's WarmProgress turns it into a start line, a line every `every_s` seconds and an end
    line on stderr, and a worker started with --warm-graphs prints them into its log."""
    import io

    from draftrelay.worker.cli import WarmProgress
    from draftrelay.worker.process import start_worker_process

    d = load_drafter("tiny", device="cpu", n_rows=3, max_ctx=300, n_out_max=6, mode="static")
    calls = []
    built = d.warm([1, 3], 2, 0, progress=lambda done, total: calls.append((done, total)))
    total = calls[0][1]
    assert built == total > 0 and calls == [(i, total) for i in range(total + 1)]
    out = io.StringIO()
    say = WarmProgress("1,3", every_s=3600, out=out)
    for c in calls:
        say(*c)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"draftrelay worker: capturing {total} draft-step graphs (--warm-graphs 1,3)"
    assert len(lines) == 2 and lines[1].startswith(f"draftrelay worker: {total} draft-step graphs captured in ")
    out = io.StringIO()
    say = WarmProgress("1,3", every_s=0, out=out)
    for c in calls:
        say(*c)
    assert len(out.getvalue().splitlines()) == total + 1  # the start, one a graph between, the end
    assert load_drafter("tiny", device="cpu", n_rows=3, max_ctx=300, mode="lean").warm([2], 1) == 0
    with start_worker_process(["--model", "tiny", "--device", "cpu", "--max-ctx", "300", "--rows", "3",
                               "--mode", "static", "--warm-graphs", "2", "--warm-batch", "1"]) as w:
        log = w.log()
    assert "draftrelay worker: capturing " in log and " draft-step graphs captured in " in log, log[-2000:]
