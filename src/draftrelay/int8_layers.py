"""A GPU drafter's layer products on int8 weights (`draftrelay worker --quant int8` on a CUDA drafter).

At one request the 0.5B drafter's STEP is five forwards of 24 layers, and its four products a layer
(q|k|v, o_proj, gate|up, down: 15.6 MB of bf16 weights) take most of each forward: the products are read
at 2-3 TB/s, far from a launch-bound floor. Read as int8 with one fp32 scale per output row (absmax / 127,
rounded to nearest: `int8_head.quantize_rows`, the head's scheme) they are half the bytes. The fast path's
products then run on the plan's tiles with the int8 conversion where they multiply (`kernels.triton_ops`:
`int8_norm_linear` for q|k|v with its norm and bias, `int8_linear` for o_proj and down, `norm_mlp`'s gate|up
with its norm and the SiLU it stores), each under an int8 plan key timed against the bf16 product it
replaces; where no int8 tile beats it (or the rows are a prefill chunk past the plan's rows) the product
reads the bf16 weight, which stays loaded beside its copy (the plain path, prefill and the tensor-parallel
ranks read it; 0.36 GB more for the 0.5B's layers).

The drafts are approximate: each weight moves by at most half its row's step, so a near-tie among the
drafter's top tokens can go the other way. The target verifies every draft, so the output does not change,
only how many drafts it keeps (the CPU drafter's int8 products, worker/quant.py, measured that on the
reference pair: docs/ENGINE.md). `--head-int8` is the head's own switch; with both, every large product of
a draft step reads int8.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from draftrelay.int8_head import quantize_rows

Q8 = tuple[torch.Tensor, torch.Tensor]  # (int8 q [N, K], fp32 row scales [N])


class LayerInt8(NamedTuple):
    """One layer's int8 copies, each (q, row scales) of the bf16 weight of the same name in LayerWeights."""
    wqkv: Q8
    wo: Q8
    wgu: Q8
    wd: Q8


def linears(blk) -> tuple:
    """A layer block's four products as its nn.Linear modules, in LayerInt8's order (what the copies stand for)."""
    return blk.self_attn.qkv, blk.self_attn.o_proj, blk.mlp.gate_up, blk.mlp.down_proj


def quantize_layers(model) -> list[LayerInt8]:
    """The int8 copies of every layer's four products of `model` (a model.Transformer), made on its device
    now (never inside a graph capture: the loader calls this before the first forward)."""
    if model.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("int8 layers: quantized inside a graph capture; quantize before the first forward")
    out = []
    for blk in model.layers:
        w = blk.weights()
        out.append(LayerInt8(*(quantize_rows(t.detach()) for t in (w.wqkv, w.wo, w.wgu, w.wd))))
    return out


def dequantized(model, layers: list[LayerInt8] | None = None):
    """A copy of `model` whose four products a layer hold q * s of their int8 copies (`layers`, else made now
    from its weights) in its dtype, with no copies of its own: the model the copies stand for, which the
    tests and benchmarks/int8_head_agreement.py compare against."""
    layers = quantize_layers(model) if layers is None else layers
    own, model.int8_layers = model.int8_layers, None  # not deep-copied along
    try:
        out = copy.deepcopy(model)
    finally:
        model.int8_layers = own
    with torch.no_grad():
        for blk, q8 in zip(out.layers, layers, strict=True):
            for lin, (q, s) in zip(linears(blk), q8, strict=True):
                lin.weight.copy_((q.float() * s[:, None]).to(lin.weight.dtype))
    return out


def nbytes(layers: list[LayerInt8]) -> int:
    """The bytes the copies hold (int8 values and fp32 scales)."""
    return sum(q.numel() + 4 * s.numel() for lay in layers for q, s in lay)
