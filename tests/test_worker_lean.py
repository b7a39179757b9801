"""The lean CPU drafting loop (LlamaDrafter mode "lean", worker/lean.py) against the eager step: the same
drafts and confidences, bit for bit, and the same KV row lengths, over rounds with rollback, padding,
mixed frames, rows that are not a run, prompts (which go through the eager path) and n_out 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftrelay import demo_pair
from draftrelay import model as M
from draftrelay.wire import protocol as P
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.drafters import LlamaDrafter, load_drafter


def make(spec, mode="auto", n_rows=6, quant="none"):
    """A drafter of spec on the CPU, a worker core over it and one open session (the worker tests' setting)."""
    d = load_drafter(spec, device="cpu", n_rows=n_rows, max_ctx=200, n_out_max=6, mode=mode, quant=quant)
    core = WorkerCore(d, max_requests=4)
    s, _ = core.open_session(P.Hello(max_requests=4, n_out_max=6))
    return d, core, s


@pytest.mark.parametrize("spec", ["tiny", "demo"])
def test_lean_step_equals_eager_step_bit_for_bit(spec):
    path = demo_pair.paths()[1] if spec == "demo" else spec
    de, ce, se = make(path, "eager")
    dl, cl, sl = make(path, "lean")
    assert dl.mode == "lean" and dl._lean is not None
    vocab = de.vocab_size
    rng = np.random.default_rng(5)
    ctx = {rid: 0 for rid in (1, 2, 3, 4)}
    pending = {rid: rng.integers(0, vocab, 30 if rid == 1 else 5).astype(np.int32) for rid in ctx}
    gen = {rid: 0 for rid in ctx}
    lean_frames = 0
    for rnd in range(40):
        rids = [r for r in ctx if rng.random() < 0.75] or [2]
        rng.shuffle(rids)  # rows not in order: the gather path as well as the in-place one
        blocks = [P.Block(r, gen[r], ctx[r], pending[r], int(rng.integers(0, 7))) for r in rids]
        if all(len(pending[r]) <= 16 for r in rids):
            lean_frames += 1
        a, b = ce.step(se, blocks), cl.step(sl, blocks)
        assert a.status.tolist() == b.status.tolist() and a.counts.tolist() == b.counts.tolist(), rnd
        assert a.drafts.tolist() == b.drafts.tolist(), rnd
        assert a.confidences.tobytes() == b.confidences.tobytes(), rnd
        for i, r in enumerate(rids):
            ctx[r] += len(pending[r])
            d = a.drafts[i, :a.counts[i]]
            k = int(rng.integers(0, len(d) + 1))
            pending[r] = np.concatenate([d[:k], rng.integers(0, vocab, 1)]).astype(np.int32)
            assert de.cache.lengths[se.requests[r].row] == dl.cache.lengths[sl.requests[r].row]
        if rnd == 20:  # request 3 starts over (a new generation): a prompt, a long extension, again
            gen[3] += 1
            ctx[3], pending[3] = 0, rng.integers(0, vocab, 40).astype(np.int32)
    assert lean_frames >= 25


def test_lean_run_rows_and_kv_equal_eager():
    """Direct run(): the K/V the lean loop leaves in the rows are the eager path's."""
    torch.manual_seed(0)
    de = load_drafter("tiny", device="cpu", n_rows=5, max_ctx=100, mode="eager")
    dl = load_drafter("tiny", device="cpu", n_rows=5, max_ctx=100, mode="lean")
    from draftrelay.worker.drafters import Job

    rng = np.random.default_rng(0)
    first = [Job(r, 0, rng.integers(0, 256, 9 + r).astype(np.int32)) for r in (0, 1, 3)]
    for d in (de, dl):
        d.run(first, 3)
    nxt = [Job(3, 11, np.array([5, 6], np.int32)), Job(0, 10, np.array([7], np.int32)),
           Job(1, 9, np.array([1, 2, 3], np.int32))]
    out = [d.run(nxt, 4) for d in (de, dl)]
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])
    for r in (0, 1, 3):
        n = int(de.cache.lengths[r])
        assert n == int(dl.cache.lengths[r])
        assert torch.equal(de.cache.k[:, r, :, :n], dl.cache.k[:, r, :, :n])
        assert torch.equal(de.cache.v[:, r, :, :n], dl.cache.v[:, r, :, :n])


def test_auto_picks_lean_on_cpu_and_eager_where_lean_does_not_apply():
    assert load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64).mode == "lean"
    cfg = M.tiny_config(1).replace(qk_norm=True)
    net = M.Transformer.random(cfg, seed=1)
    with pytest.raises(ValueError, match="lean"):
        LlamaDrafter(net, 2, 64, 4, "q", "", mode="lean")
    from draftrelay.worker import lean

    assert not lean.supports(net)
    assert LlamaDrafter(net, 2, 64, 4, "q", "", mode="eager").mode == "eager"


def test_lean_refuses_positions_past_the_cache():
    d = load_drafter("tiny", device="cpu", n_rows=2, max_ctx=8, n_out_max=4, mode="lean")
    from draftrelay.worker.drafters import Job

    d.run([Job(0, 0, np.arange(8, dtype=np.int32))], 1)
    room = d.cache.max_len - int(d.cache.lengths[0])
    with pytest.raises(ValueError, match="max_len"):
        d.run([Job(0, int(d.cache.lengths[0]), np.array([1], np.int32))], room + 1)


def test_lean_with_a_screened_head_drafts_as_the_full_head_and_stops_alike(monkeypatch):
    """A drafter whose head is screened (greedy_head.head_pick): the drafts of eager, the confidences close
    to eager's, and with the confidence stop at thresholds around them the same drafts kept."""
    from draftrelay import greedy_head as G
    from draftrelay.worker.draft_stop import stop_counts
    from draftrelay.worker.drafters import Job

    monkeypatch.setattr(G, "SCREEN_MIN_BYTES", 0)  # the test head is small
    monkeypatch.setattr(G, "KEEP_MAX_FRACTION", 1.0)  # and its logits spread less than a real head's
    G._cache.clear()
    cfg = M.tiny_config(n_layers=2).replace(vocab_size=2048, name="screened")
    net = M.Transformer.random(cfg, seed=4, std=0.08, embed_std=0.3)
    with torch.no_grad():
        net.lm_head.weight.mul_(10.0)  # logits spread as a trained drafter's (confidences 0.1-0.9)
    de = LlamaDrafter(net, 2, 120, 8, "m", "", mode="eager")
    dl = LlamaDrafter(net, 2, 120, 8, "m", "", mode="lean")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 2048, 12).astype(np.int32)
    screened_before = 0
    for thr in (0.0, 0.2, 0.5, 0.8):
        for d in (de, dl):
            d.run([Job(0, 0, prompt)], 0)
        je, jl = Job(0, 12, prompt[-1:] * 0 + 7, thr), Job(0, 12, prompt[-1:] * 0 + 7, thr)
        (de_d, de_c), (dl_d, dl_c) = de.run([je], 6), dl.run([jl], 6)
        ke = stop_counts(de_c, [thr], [6])[0]
        kl = stop_counts(dl_c, [thr], [6])[0]
        assert ke == kl and de_d[0, :ke].tolist() == dl_d[0, :kl].tolist(), thr
        assert np.allclose(de_c[0, :ke], dl_c[0, :kl], rtol=2e-3, atol=1e-5), thr
        assert dl._lean.screened > screened_before  # the screen ran
        screened_before = dl._lean.screened
    G._cache.clear()
