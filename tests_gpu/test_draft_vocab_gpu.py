"""A draft vocabulary (draft_vocab.py) on a real GPU (not collected by CI):
`pytest -q tests_gpu/test_draft_vocab_gpu.py`.

The 0.5B shape's head restricted to ids 0..32767, on the fast path: the worker's drafts in graph replay
equal its eager drafts in >= 95 % of request-rounds, every draft is a kept id, and each round's first
draft is the full head's argmax over the kept ids up to a bf16 near-tie (the restricted head is another
product shape, so the planner may pick another kernel with another summation order).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from draftrelay import kernels
from draftrelay import model as M
from draftrelay.draft_vocab import DraftVocab
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available("cuda")),
                                reason="needs a CUDA GPU with Triton")
DEV = torch.device("cuda")
N = 32768


def test_restricted_drafts_graph_equals_eager_and_pick_is_the_kept_argmax():
    cfg = M.ModelConfig(**SHAPES["qwen2.5-0.5b"], name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=int.from_bytes(os.urandom(2), "little"), device=DEV,
                                 dtype=torch.bfloat16, draw_on="device")
    model.draft_vocab = DraftVocab.top(N, cfg.vocab_size)
    ds = {"graph": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="graph"),
          "eager": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="eager")}
    n_req, rounds, n_out = 3, 20, 4
    rng = np.random.default_rng(0)
    ctx = {r: list(rng.integers(0, cfg.vocab_size, 40 + 7 * r)) for r in range(n_req)}
    synced = dict.fromkeys(ctx, 0)
    same, ties, far = 0, 0, []
    for _ in range(rounds):
        jobs = [Job(r, synced[r], np.array(ctx[r][synced[r]:], np.int32)) for r in range(n_req)]
        res = {k: d.run([Job(j.row, j.keep, j.tokens.copy()) for j in jobs], n_out)[0] for k, d in ds.items()}
        for r in range(n_req):
            same += int(np.array_equal(res["graph"][r], res["eager"][r]))
            assert int(res["eager"][r].max()) < N and int(res["graph"][r].max()) < N
            vocab, model.draft_vocab = model.draft_vocab, None  # the full head's logits after the context
            cache = model.new_cache(1, len(ctx[r]) + 1)
            with torch.inference_mode():
                full = model(torch.tensor([ctx[r]]), torch.tensor([0]), cache, torch.tensor([0]),
                             last_only=True)[0, 0, :N].float()
            model.draft_vocab = vocab
            pick, best = int(res["eager"][r][0]), int(full.argmax())
            if pick != best:
                ties += 1
                gap = float(full[best] - full[pick])
                if gap > 0.05 * float(full.abs().max()):
                    far.append({"pick": pick, "best": best, "gap": gap})
        for r in range(n_req):
            keep = int(rng.integers(0, n_out + 1))
            synced[r] = len(ctx[r])
            ctx[r] += list(res["eager"][r][:keep]) + [int(rng.integers(0, cfg.vocab_size))]
    total = rounds * n_req
    assert same >= 0.95 * total, (same, total)
    assert not far, far  # a pick other than the kept argmax only at a near-tie
    assert ties <= 0.2 * total, ties


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pick_kernels_map_columns_to_ids_as_the_reference(dtype):
    from draftrelay.kernels import reference as R
    from draftrelay.kernels import triton_ops as TO

    g = torch.Generator(device=DEV).manual_seed(5)
    dv = DraftVocab.top(N, 151936)
    ids = dv.ids_on(DEV)
    sub = torch.randn(8, N, device=DEV, generator=g).to(dtype)
    sub[0, 100] = sub[0, 5000] = sub[0].max() + 1  # a tie across chunks: the lower column's id
    tok, conf = TO.greedy_pick(sub, ids)
    rt, rc = R.greedy_pick(sub, ids)
    assert torch.equal(tok, rt) and int(tok[0]) == 100
    assert torch.allclose(conf, rc, rtol=1e-5)
    t2, c2, top, probs = TO.greedy_top(sub, 8, ids)
    r2, rc2, rtop, rprobs = R.greedy_top(sub, 8, ids)
    assert torch.equal(t2, r2) and torch.equal(top, rtop) and torch.allclose(probs, rprobs, rtol=1e-4)
    assert torch.equal(top[:, 0], tok)
