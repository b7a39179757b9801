"""A GPU drafter's layer products read as int8 (int8_layers.py, `worker --quant int8`) on a real GPU (not
collected by CI): `pytest -q tests_gpu/test_int8_layers_gpu.py`.

Each int8 candidate at the 0.5B layers' shapes (q|k|v with its norm and bias, o_proj, gate|up with its norm and
the SiLU output where the tile holds gate and up pairs, down; one row and four, bf16 activations) against its
definition, x + delta bit for bit; then the 0.5B shape's drafter with int8 layers (bf16 head), three requests:
graph replay equals eager in >= 95 % of request-rounds, every mismatch a near-tie (tests_gpu/near_tie.py) on
the logits of the fast forward against the plain forward of the same model with the dequantized weights.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from draft_rounds import draft_rounds
from draftrelay import kernels
from draftrelay import model as M
from draftrelay.int8_head import quantize_rows
from draftrelay.int8_layers import dequantized, quantize_layers
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R
from draftrelay.worker.drafters import SHAPES, LlamaDrafter
from near_tie import near_tie

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available("cuda")),
                                reason="needs a CUDA GPU with Triton")
DEV = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("what", ["qkv", "o", "gate_up", "down"])
def test_int8_layer_candidates_equal_their_definition(what, rows):
    from draftrelay.kernels import triton_ops as TO
    g = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(2), "little"))
    pro, N, K, bias = {"qkv": (P.PRO_NORM, 1152, 896, True), "o": (P.PRO_NONE, 896, 896, False),
                       "gate_up": (P.PRO_NORM, 9728, 896, False), "down": (P.PRO_NONE, 896, 4864, False)}[what]
    bf = torch.bfloat16
    x = torch.randn(rows, K, device=DEV, generator=g).to(bf)
    q, s = quantize_rows((torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(bf))
    b = torch.randn(N, device=DEV, generator=g).to(bf) if bias else None
    d = torch.randn(rows, K, device=DEV, generator=g).to(bf) if pro == P.PRO_NORM else None
    nw = torch.randn(K, device=DEV, generator=g).to(bf)
    ref_x, h = R.add_rms_norm(x, d, nw, 1e-6) if pro == P.PRO_NORM else (x, x)
    ref = R.int8_linear(h, q, s, b)
    cands = P.bucket_candidates(pro, rows, N, K, P.INT8)
    assert cands
    silu = 0
    for cfg in cands:
        got_x, got = TO.skinny_linear(pro, cfg, x, q, b, d, nw, 1e-6, w_scale=s)
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert torch.equal(got_x, ref_x) and err < 1e-2, (cfg, err)
        if what == "gate_up" and P.holds_silu_pairs(cfg):
            act = TO.skinny_linear(pro, cfg, x, q, None, d, nw, 1e-6, silu_out=True, w_scale=s)[1]
            want = R.silu_mul(ref)
            assert float((act.double() - want.double()).norm() / want.double().norm()) < 1e-2, cfg
            silu += 1
    assert what != "gate_up" or silu, "no gate|up tile stored SiLU * up"


def test_int8_layers_drafts_graph_equals_eager_up_to_a_near_tie():
    cfg = M.ModelConfig(**SHAPES["qwen2.5-0.5b"], name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=int.from_bytes(os.urandom(2), "little"), device=DEV,
                                 dtype=torch.bfloat16, draw_on="device")
    model.int8_layers = quantize_layers(model)  # the head stays bf16 (tied to the embedding: deq keeps it)
    deq = dequantized(model, model.int8_layers)
    ds = {"graph": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="graph"),
          "eager": LlamaDrafter(model, 4, 2048, 8, "d", "", mode="eager")}
    ds["graph"].plan_warm()
    n_req, rounds = 3, 30
    same, mism = 0, []

    def logits(net: M.Transformer, seq: list[int], fast: bool) -> torch.Tensor:
        net.fast = fast
        try:
            cache = net.new_cache(1, len(seq) + 1)
            with torch.inference_mode():
                return net(torch.tensor([seq]), torch.tensor([0]), cache, torch.tensor([0]),
                           last_only=True)[0, 0].float()
        finally:
            net.fast = True

    model.fast = True
    for rnd, ctx, res in draft_rounds(ds, cfg.vocab_size, n_req, rounds):
        for r in range(n_req):
            if np.array_equal(res["graph"][r], res["eager"][r]):
                same += 1
            else:  # the first differing draft: the dequantized model's fast and plain logits there
                j = int(np.argmax(res["graph"][r] != res["eager"][r]))
                seq = ctx[r] + list(res["eager"][r][:j])
                mism.append({"round": rnd, "row": r, "pos": j, **near_tie(
                    logits(deq, seq, True), logits(deq, seq, False), int(res["eager"][r][j]),
                    int(res["graph"][r][j]))})
    model.fast = None
    total = rounds * n_req
    assert same >= 0.95 * total, (same, total, mism)
    assert all(m["near_tie"] for m in mism), mism
    assert "int8 layer products" in ds["graph"].info
