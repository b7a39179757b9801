"""Weight-only int8 products for a drafter on a CPU (`draftrelay worker --quant int8`).

A CPU drafter's draft is bound by the bytes its products read: the reference 0.5B drafter in fp32 reads
about 1.4 GB of layer weights per draft (84 ms a draft on the 2-core development VM, ~30 GB/s). Its
weights as int8 with one bf16 scale per output row are a quarter of that. torch's CPU kernel for such
products (`aten._weight_int8pack_mm`, bf16 activations, the int8 weight rows dequantized in its inner
loop) is bound by that dequantization rather than by the bytes (about 8 GB/s of int8 weights there), so
a draft goes from 82 to 58 ms (1.42 x, `benchmarks/cpu_draft.py --int8`), where bf16 weights through
`F.linear` gain nothing at one row.

The drafts are then approximate: each product is within ~1 % of the fp32 one (the int8 rounding of each
weight, and the activations rounded to bf16), so a near-tie among the drafter's top tokens can go the other
way. The target verifies every draft, so the output does not change, only how many drafts it keeps (the
reference drafter's GGUF weights are 5-bit to begin with). The head is not quantized here: the lean loop
screens it through its own int8 copy with an exact argmax (greedy_head.py).

`_weight_int8pack_mm` reads out of bounds for some shapes (a row length of 200 returned garbage or crashed
the process in a probe; multiples of 16 were right), so a product is quantized only where its K is a
multiple of 16 and a check of its own weight against the fp32 product passes; any other product stays
fp32 (`Int8Linear.make` returns None and says why).

Only the lean loop runs them: a frame with a block longer than its padded extension (a prompt) goes the
eager path on the model's own weights, so a request's prompt KV is the fp32 one and its later rounds and
branches draft on int8 products.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("draftrelay.worker")

QUANTS = ("none", "int8")
K_MULTIPLE = 16  # row lengths the int8 kernel reads correctly (see the module's docstring)
CHECK_TOL = 0.1  # relative error of the check product above which it stays fp32 (a misread is off by orders;
# int8 rounding of a row with outliers reached 0.04 on the reference drafter)


def _int8_op():
    return getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def available() -> str:
    """Why weight-only int8 cannot run in this torch ("" when it can)."""
    if _int8_op() is None:
        return f"this torch ({torch.__version__}) has no aten._weight_int8pack_mm"
    return ""


class Int8Linear:
    """y = x @ W^T (+ b) with W as int8 rows and one scale per row: W ~ q * scale[:, None].
    Called with x of any float dtype and shape [..., K]; returns x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale, self.bias = q, scale, bias
        self.N, self.K = q.shape
        self._op = _int8_op()  # looked up once: each forward calls every layer's products

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [N, K], bf16 scales [N]): symmetric per row, scale = max |w| / 127 (a zero row keeps
        scale 1 and all-zero q)."""
        wf = w.detach().float()
        scale = wf.abs().amax(1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
        q = torch.round(wf / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return q.contiguous(), scale

    @classmethod
    def make(cls, w: torch.Tensor, b: torch.Tensor | None, name: str) -> Int8Linear | None:
        """The int8 product of weight w [N, K] (and bias b), or None (w stays fp32) where the kernel is
        missing, K is not a multiple of K_MULTIPLE, or the check product misses fp32 by more than CHECK_TOL."""
        why = available()
        if not why and w.device.type != "cpu":
            why = f"the weight is on {w.device}, not the CPU"
        if not why and w.shape[1] % K_MULTIPLE:
            why = f"K = {w.shape[1]} is not a multiple of {K_MULTIPLE}"
        if why:
            log.warning("int8 product %s stays %s: %s", name, str(w.dtype).replace("torch.", ""), why)
            return None
        q, scale = cls.quantize(w)
        lin = cls(q, scale, None if b is None else b.detach())
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, w.shape[1], generator=gen, dtype=torch.float32)
        ref = F.linear(x, w.detach().float(), None if b is None else b.detach().float())
        err = float((lin(x).float() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err < CHECK_TOL:  # not finite or too far: a wrong kernel result, not rounding
            log.warning("int8 product %s stays fp32: its check product is off by %.3g (limit %g)", name, err,
                        CHECK_TOL)
            return None
        return lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._op(x.reshape(-1, self.K).to(torch.bfloat16), self.q, self.scale)
        y = y.view(*lead, self.N).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()


class DenseLinear:
    """The plain product F.linear(x, w, b): what a layer's product is without quantization."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.w, self.b = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)


def layer_products(layers, quant: str) -> list[tuple]:
    """Per layer (q|k|v, o, gate|up, down) as callables on the layer's input: DenseLinear views of its
    weights (quant "none"), or Int8Linear where quantization applies (quant "int8"; each product that
    declines stays dense)."""
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    out = []
    for i, w in enumerate(layers):
        prods = []
        for name, wt, b in (("qkv", w.wqkv, w.bqkv), ("o", w.wo, None), ("gate_up", w.wgu, None), ("down", w.wd, None)):
            lin = Int8Linear.make(wt, b, f"layer {i} {name}") if quant == "int8" else None
            prods.append(lin if lin is not None else DenseLinear(wt, b))
        out.append(tuple(prods))
    return out
