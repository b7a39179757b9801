"""Forked rows on a real GPU (not collected by CI): `pytest -q tests_gpu/test_fork_gpu.py`.

1. The forked attention kernel (worker/fork_triton.py) against its plain-torch definition on bf16 inputs
   of the 0.5B drafter's shape, one program per row and a 33K split with the combine, where a parent's
   rows in a block read its keys below their lowest pivot once (fork_triton.group_rows).
2. The branch work in graph mode on the 0.5B shape at random weights (at 700 tokens, and at 1,500 where the
   keys are split and shared): each branch's drafts against a
   fresh round of its context (the drafter's own graphs) agree in at least half the branches, and every
   mismatch is a numeric near-tie (tests_gpu/near_tie.py: the batched run and the fresh round run other
   kernels of the plan; at random weights the top two logits are often within rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftrelay import kernels
from draftrelay.worker import fork
from draftrelay.worker import fork_triton as FT
from near_tie import near_tie

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available("cuda")),
                                reason="needs a CUDA GPU with Triton")
DEV = torch.device("cuda")


@pytest.mark.parametrize("kv,starts,pivots,parents,T", [
    (512, [300, 7, 0, 511 - 6], [290, 7, 0, 400], None, 5),
    (33024, [33000, 1200], [32990, 1000], None, 5),
    # a parent's rows read its keys below their lowest pivot once (fork_triton.group_rows: blocks of 8 rows
    # at one token, 4 at two): five branches of one request, three of another, and two blocks at T = 2
    (33024, [33000 + i for i in range(8)], [32996 + i // 2 for i in range(8)], [0] * 5 + [1] * 3, 1),
    (33024, [32000 + 3 * i for i in range(6)], [31998 + i for i in range(6)], [2] * 6, 2)])
def test_fork_kernel_equals_its_definition_in_bf16(kv, starts, pivots, parents, T):
    g = torch.Generator(device=DEV).manual_seed(1)
    B, H, HK, D = len(starts), 14, 2, 64
    q = torch.randn(B, T, H, D, generator=g, device=DEV, dtype=torch.bfloat16)
    ck = torch.randn(B + 2, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    cv = torch.randn(B + 2, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    pk = torch.randn(3, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    pv = torch.randn(3, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    rows = torch.arange(B, device=DEV) + 1
    parent = torch.arange(B, device=DEV) % 3 if parents is None else torch.tensor(parents, device=DEV)
    st, pv_t = torch.tensor(starts, device=DEV), torch.tensor(pivots, device=DEV)
    if parents is not None:
        assert FT.group_rows(B, H // HK, T, False) == (8 if T == 1 else 4)
    got = FT.fork_attention(q, ck, cv, rows, st, kv, pk, pv, parent, pv_t)
    ref = fork.fork_attention_reference(q, ck, cv, rows, st, kv, pk, pv, parent, pv_t)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv,starts,pivots", [(512, [300, 7, 0, 511], [290, 7, 0, 400]),
                                              (1024, [1023, 600], [1000, 0])])
def test_fused_rope_fork_kernel_equals_rope_then_fork_attention_in_bf16(kv, starts, pivots):
    """One token per row, one chunk: RoPE, the K/V write and the forked attention in one launch against
    the reference RoPE + write and the forked attention's definition (the new key rounded to bf16 as
    the cache holds it)."""
    from draftrelay.kernels import reference as R

    g = torch.Generator(device=DEV).manual_seed(2)
    B, H, HK, D = len(starts), 14, 2, 64
    qkv = torch.randn(B, 1, (H + 2 * HK) * D, generator=g, device=DEV, dtype=torch.bfloat16)
    ck = torch.randn(B + 2, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    cv = torch.randn(B + 2, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    pk = torch.randn(3, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    pv = torch.randn(3, HK, kv + 8, D, generator=g, device=DEV, dtype=torch.bfloat16)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D))  # the 0.5B's rope_theta
    rows = torch.arange(B, device=DEV) + 1
    parent = torch.arange(B, device=DEV) % 3
    st, pv_t = torch.tensor(starts, device=DEV), torch.tensor(pivots, device=DEV)
    ck2, cv2 = ck.clone(), cv.clone()
    got = FT.fork_attention(qkv, ck, cv, rows, st, kv, pk, pv, parent, pv_t, (inv, H, HK))
    q = R.rope_kv_write(qkv, st, inv, H, HK, ck2, cv2, rows)
    ref = fork.fork_attention_reference(q, ck2, cv2, rows, st, kv, pk, pv, parent, pv_t)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ck.float(), ck2.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(cv, cv2)


def _two_requests_after_a_step(seed: int, L: int, k: int, draft_vocab: str = ""):
    """A 0.5B-shaped graph drafter (random weights) holding two random contexts of L tokens, after a STEP
    that drafted k for both: (drafter, contexts, (blocks, result, todo) as Prefetcher._draft takes them)."""
    import types

    from draftrelay.wire import protocol as P
    from draftrelay.worker.drafters import Job, load_drafter

    d = load_drafter("random:qwen2.5-0.5b", device="cuda", n_rows=4, max_ctx=2048, n_out_max=8,
                     draft_vocab=draft_vocab)
    rng = np.random.default_rng(seed)
    ctx = [rng.integers(0, d.vocab_size, L).astype(np.int32) for _ in range(2)]
    for r in range(2):
        d.run([Job(r, 0, ctx[r])], 0)
    drafts, _ = d.run([Job(r, L - 3, ctx[r][L - 3:]) for r in range(2)], k)
    blocks = [P.Block(r, 1, L - 3, ctx[r][L - 3:], k) for r in range(2)]
    todo = [(r, types.SimpleNamespace(row=r, ctx_len=L), k) for r in range(2)]
    return d, ctx, (blocks, types.SimpleNamespace(drafts=drafts), todo)


@pytest.mark.parametrize("draft_vocab,L", [("", 700), ("32768", 700), ("", 1500)])
def test_branches_in_graph_mode_are_the_rounds_of_their_contexts(draft_vocab, L):
    """At 1,500 tokens the keys are split: a request's branches read its keys below their pivots once."""

    from draftrelay.speculation.table import Acceptance
    from draftrelay.worker.drafters import Job
    from draftrelay.worker.prefetch import Prefetcher

    k, F = 4, 8
    d, ctx, (blocks, res, todo) = _two_requests_after_a_step(seed=0, L=L, k=k, draft_vocab=draft_vocab)
    assert d.mode == "graph"
    pf = Prefetcher(d)  # max_fanout 16: the two requests' 2 F branches shared (Prefetcher._share), in 2 F rows
    entries = pf._draft(blocks, res, todo, Acceptance(), F)
    agree = total = 0
    spare = 3
    mism = []
    for r, e in enumerate(entries):
        for b in range(e.n_branches):
            full = np.concatenate([ctx[r], e.prefix(b)]).astype(np.int32)
            d.run([Job(spare, 0, full[:-1])], 0)
            fresh, _ = d.run([Job(spare, len(full) - 1, full[-1:])], k)
            total += 1
            if draft_vocab:  # a draft vocabulary's branches draft its ids only (raw columns mapped in the pick)
                assert int(np.max(e.branch_drafts[b])) < int(draft_vocab), e.branch_drafts[b]
            if np.array_equal(fresh[0], e.branch_drafts[b]):
                agree += 1
                continue
            # the first differing draft, classified with the fused and the plain forward's logits there: the
            # batched branch run (F rows per request) and the fresh round (one row) run other kernels of the
            # plan, so at random weights a near-tie can go either way; a wrong branch would not be a near-tie
            j = int(np.argmax(fresh[0] != e.branch_drafts[b]))
            seq = torch.tensor(np.concatenate([full, fresh[0][:j]]).astype(np.int64)[None], device="cuda")
            lg = {}
            for fast in (True, False):
                d.model.fast = fast
                cache = d.model.new_cache(1, seq.shape[1] + 1)
                with torch.inference_mode():
                    lg[fast] = d.model(seq, torch.tensor([0]), cache, torch.tensor([0]), last_only=True)[0, 0]
            d.model.fast = None
            mism.append({"request": r, "branch": b, "pos": j,
                         **near_tie(lg[True], lg[False], int(fresh[0][j]), int(e.branch_drafts[b][j]))})
    assert total == 2 * F, total
    assert all(m["near_tie"] for m in mism), mism
    assert agree >= 0.5 * total, (agree, total, mism)


def test_lazy_bonus_in_graph_mode_gives_the_queued_bonus_candidates(monkeypatch):
    """The lazy bonus place (worker.prefetch.BONUS "lazy": captured over one row a request, the branches
    its input) against the queued one (every branch in one forward) after the same branch run, in graph
    mode on the 0.5B shape: the same top candidate in at least 3 of 4 branches (the two run other row
    buckets of the plan: at random weights near-ties flip), the same largest probability at every branch
    and the probabilities of the candidates both give within a few per cent (bf16 logits)."""

    from draftrelay.speculation.table import Acceptance
    from draftrelay.worker import prefetch

    k, F = 4, 8
    d, _, (blocks, res, todo) = _two_requests_after_a_step(seed=1, L=500, k=k)
    got = {}
    for mode in ("lazy", "queued"):
        monkeypatch.setattr(prefetch, "BONUS", mode)
        pf = prefetch.Prefetcher(d, max_fanout=F)
        entries = pf._draft(blocks, res, todo, Acceptance(), F)
        assert [e.n_branches for e in entries] == [F, F]
        if mode == "lazy":
            assert ("bonus_at", 2 * F, 2, k, 8) == next(key for key in pf.fork._steps if key[0] == "bonus_at")[:5]
            assert pf.fork._steps[next(key for key in pf.fork._steps if key[0] == "bonus_at")].graph is not None
        got[mode] = pf.fork.bonus_tops(list(range(2 * F)))
    (lt, lp), (qt, qp) = got["lazy"], got["queued"]
    assert lt.shape == qt.shape == (2 * F, 8)
    same_top = 0
    for q in range(2 * F):
        same_top += int(lt[q, 0] == qt[q, 0])
        # the largest probability is stable under rounding even where the top token flips at a near-tie
        assert abs(lp[q, 0] / qp[q, 0] - 1) < 0.05, (q, lp[q], qp[q])
        pq = {int(t): float(p) for t, p in zip(qt[q], qp[q], strict=True)}
        for t, p in zip(lt[q], lp[q], strict=True):  # bf16 logits: probability ratios within a few per cent
            if int(t) in pq:
                assert abs(p / pq[int(t)] - 1) < 0.05, (q, int(t), p, pq[int(t)])
    assert same_top >= 0.75 * 2 * F, same_top
