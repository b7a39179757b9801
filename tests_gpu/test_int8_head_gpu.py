"""A drafter's head read as int8 (int8_head.py) on a real GPU (not collected by CI):
`pytest -q tests_gpu/test_int8_head_gpu.py`.

Each int8 candidate at the 0.5B head's shape (one row and four, bf16 activations) against its definition
(`reference.int8_linear` / `int8_norm_linear`), and x + delta bit for bit, and the plan's yardstick of an
int8 key the bf16 product it replaces; then the 0.5B shape's drafter
with the int8 head, three requests: graph replay equals eager in >= 95 % of request-rounds with every
mismatch a near-tie (tests_gpu/near_tie.py, on the int8 head's logits), and each round's first draft is
the bf16 head's argmax up to a near-tie (the int8 rounding moves a logit by at most absmax * ||h||_1 / 254).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from draft_rounds import draft_rounds
from draftrelay import kernels
from draftrelay import model as M
from draftrelay.int8_head import Int8Head, quantize_rows
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R
from draftrelay.worker.drafters import SHAPES, LlamaDrafter
from near_tie import near_tie

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available("cuda")),
                                reason="needs a CUDA GPU with Triton")
DEV = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("pro", [P.PRO_NORM, P.PRO_NONE])
@pytest.mark.parametrize("N", [151936, 32768])
def test_int8_candidates_equal_their_definition(pro, N, rows):
    from draftrelay.kernels import triton_ops as TO
    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(2), "little"))
    K, bf = 896, torch.bfloat16
    x = torch.randn(rows, K, device=DEV, generator=g).to(bf)
    q, s = quantize_rows((torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(bf))
    d = torch.randn(rows, K, device=DEV, generator=g).to(bf) if pro == P.PRO_NORM else None
    nw = torch.randn(K, device=DEV, generator=g).to(bf)
    ref_x, ref = R.int8_norm_linear(x, d, nw, 1e-6, q, s) if pro == P.PRO_NORM else (x, R.int8_linear(x, q, s))
    cands = P.bucket_candidates(pro, rows, N, K, P.INT8)
    assert cands and (rows == 1 or all(c.dot for c in cands))  # four rows: the dot tiles on int8 tiles
    for cfg in cands:
        got_x, got = TO.skinny_linear(pro, cfg, x, q, None, d, nw, 1e-6, w_scale=s)
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert torch.equal(got_x, ref_x) and err < 1e-2, (cfg, err)
    # the public pair plans the INT8 key against the bf16 product it replaces (not the dequantizing
    # definition, some 6x slower) and runs its choice, or returns None (the caller's bf16 head)
    out = TO.int8_norm_linear(x, d, nw, 1e-6, q, s) if pro == P.PRO_NORM else (x, TO.int8_linear(x, q, s))
    key = P.plan_key(0, pro, rows, N, K, P.INT8, False, pro == P.PRO_NORM)[0]
    bf_key = P.plan_key(0, pro, rows, N, K, "bfloat16", False, pro == P.PRO_NORM)[0]
    TO.PLANNER.choose(bf_key, P.bucket_candidates(pro, rows, N, K))
    q_rep, bf_rep = TO.PLANNER.report.get(key), TO.PLANNER.report.get(bf_key)
    if q_rep and bf_rep:  # both measured in this process (a plan cache or seed may have answered instead)
        assert 0.7 < q_rep["cublas"] / bf_rep["cublas"] < 1.4, (q_rep, bf_rep)
    assert (out is None) == (TO.PLANNER.table[key] is None)
    if out is not None:
        assert float((out[1].double() - ref.double()).norm() / ref.double().norm()) < 1e-2


def test_int8_head_drafts_graph_equals_eager_and_first_draft_is_the_bf16_argmax_up_to_a_near_tie():
    cfg = M.ModelConfig(**SHAPES["qwen2.5-0.5b"], name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=int.from_bytes(os.urandom(2), "little"), device=DEV,
                                 dtype=torch.bfloat16, draw_on="device")
    model.int8_head = Int8Head()
    q, s = model.int8_head.of(model.head_weight())
    deq = (q.float() * s[:, None]).to(torch.bfloat16)  # the int8 head as a bf16 weight: its logits in rounding
    ds = {"graph": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="graph"),
          "eager": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="eager")}
    ds["graph"].plan_warm()
    n_req, rounds = 3, 30  # 90 request-rounds (three rows: the int8 head's multi-row tiles too)
    same, moved, far, mism = 0, 0, [], []

    def logits(seq: list[int], fast: bool, head: torch.Tensor | None) -> torch.Tensor:
        """The last position's logits of seq, the head read as given (None: bf16), on one path."""
        model.fast, head8, model.int8_head = fast, model.int8_head, None
        if head is not None:
            model.head_weight = lambda: head
        try:
            cache = model.new_cache(1, len(seq) + 1)
            with torch.inference_mode():
                return model(torch.tensor([seq]), torch.tensor([0]), cache, torch.tensor([0]),
                             last_only=True)[0, 0].float()
        finally:
            model.fast, model.int8_head = True, head8
            model.__dict__.pop("head_weight", None)

    model.fast = True
    for rnd, ctx, res in draft_rounds(ds, cfg.vocab_size, n_req, rounds):
        for r in range(n_req):
            if np.array_equal(res["graph"][r], res["eager"][r]):
                same += 1
            else:  # the first differing draft, classified on the int8 head's logits there (fast vs plain)
                j = int(np.argmax(res["graph"][r] != res["eager"][r]))
                seq = ctx[r] + list(res["eager"][r][:j])
                mism.append({"round": rnd, "row": r, "pos": j, **near_tie(
                    logits(seq, True, deq), logits(seq, False, deq), int(res["eager"][r][j]),
                    int(res["graph"][r][j]))})
            full = logits(ctx[r], False, None)  # the bf16 head's logits after the context
            pick, best = int(res["eager"][r][0]), int(full.argmax())
            if pick != best:
                moved += 1
                if float(full[best] - full[pick]) > 0.05 * float(full.abs().max()):
                    far.append({"pick": pick, "best": best, "gap": float(full[best] - full[pick])})
    model.fast = None
    total = rounds * n_req
    print("int8 head graph == eager:", same, "of", total, "near-ties", sum(m["near_tie"] for m in mism), "of",
          len(mism), [(round(m["margin_a"], 3), round(m["margin_b"], 3), round(m["tol"], 3)) for m in mism])
    assert all(m["near_tie"] for m in mism), mism
    assert same >= 0.95 * total, (same, total, mism)
    assert not far, far
    assert moved <= 0.3 * total, moved
    assert q.dtype == torch.int8 and model.int8_head.nbytes() == q.numel() + 4 * s.numel()
