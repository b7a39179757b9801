"""Weight-only int8 and int4 products for a drafter on a CPU (`draftrelay worker --quant int8|int4`).

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

int4 (`Int4Linear`): 4-bit weights in groups of 32 along K, each group with its own bf16 scale and
offset (min/max), through torch's CPU kernel `aten._weight_int4pack_mm_for_cpu` (bf16 activations). It
reads an eighth of fp32's bytes and its inner loop is cheaper than int8's: the measured per-draft time is
in the worker docs (`benchmarks/cpu_draft.py --quant int4`). A group of 32 at 4 bits moves each product
further from fp32 (about 8 % relative on Gaussian weights, against int8's 1 %), so the drafter agrees with
its fp32 self less often: what that costs in accepted drafts is measured, not assumed
(`benchmarks/real_pair.py --drafter-quant int4`). The kernel requires N a multiple of 16 and K of the
group; any other product is tried as int8 (see MAKERS), then stays dense.

Only the lean loop runs them: a frame with a block longer than its padded extension (a prompt) goes the
eager path on the model's own weights, so a request's prompt KV is the fp32 one and its later rounds and
branches draft on int8 products.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from draftrelay import model as M

log = logging.getLogger("draftrelay.worker")

QUANTS = ("none", "int8", "int4")
K_MULTIPLE = 16  # row lengths the int8 kernel reads correctly (see the module's docstring)
CHECK_TOL = 0.1  # relative error of the check product above which it stays fp32 (a misread is off by orders;
# int8 rounding of a row with outliers reached 0.04 on the reference drafter)
INT4_GROUP = 32  # weights per (scale, offset) along K: the finest group the int4 kernel takes
INT4_N_MULTIPLE = 16  # the int4 packing refuses other row counts
INT4_CHECK_TOL = 0.25  # 4-bit groups are ~0.08 off on Gaussian weights; a misread is off by orders


def _int8_op():
    return getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def _int4_ops():
    mm = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    return (mm, pack) if mm is not None and pack is not None else None


def available(quant: str = "int8") -> str:
    """Why weight-only `quant` cannot run in this torch ("" when it can, or for "none")."""
    if quant == "int8" and _int8_op() is None:
        return f"this torch ({torch.__version__}) has no aten._weight_int8pack_mm"
    if quant == "int4" and _int4_ops() is None:
        return f"this torch ({torch.__version__}) has no aten._weight_int4pack_mm_for_cpu"
    return ""


def _check_error(lin, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """Relative error of lin's product against the fp32 one on three fixed random rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[1], generator=gen, dtype=torch.float32)
    ref = F.linear(x, w.detach().float(), None if b is None else b.detach().float())
    return float((lin(x).float() - ref).norm() / ref.norm().clamp_min(1e-30))


class _WeightOnly:
    """A weight-only product's call: x of any float dtype and shape [..., K] as bf16 rows into the
    subclass's kernel (`_product`, [M, K] bf16 -> [M, N]), the result in x's dtype and shape, plus the bias."""

    N: int
    K: int
    bias: torch.Tensor | None

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._product(x.reshape(-1, self.K).to(torch.bfloat16)).view(*lead, self.N).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Int8Linear(_WeightOnly):
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
        err = _check_error(lin, w, b)
        if not err < CHECK_TOL:  # not finite or too far: a wrong kernel result, not rounding
            log.warning("int8 product %s stays fp32: its check product is off by %.3g (limit %g)", name, err,
                        CHECK_TOL)
            return None
        return lin

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.q, self.scale)

    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()


class Int4Linear(_WeightOnly):
    """y = x @ W^T (+ b) with W as 4-bit values in groups of INT4_GROUP along K, each group with a bf16
    scale and offset: W ~ (q - 8) * scale + offset, q in 0..15 (the kernel's form), packed by torch's CPU
    int4 packing. Called with x of any float dtype and shape [..., K]; returns x's dtype."""

    def __init__(self, packed: torch.Tensor, scale_offset: torch.Tensor, n: int, k: int,
                 bias: torch.Tensor | None) -> None:
        self.packed, self.scale_offset, self.bias = packed, scale_offset, bias
        self.N, self.K = n, k
        self._op = _int4_ops()[0]

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 q [N, K] in 0..15, bf16 [K / INT4_GROUP, N, 2] of (scale, offset)): per group, the 16
        levels span its min..max, offset = min + 8 * scale, so (q - 8) * scale + offset = min + q * scale. A
        constant group takes scale |value| / 8 (1 for zeros): its value is then q = 0 exactly."""
        n, k = w.shape
        wg = w.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        flat = torch.where(lo != 0, lo.abs() / 8.0, torch.ones_like(lo))
        scale = torch.where(hi > lo, (hi - lo) / 15.0, flat)
        # rounded once to bf16 first, so q is chosen against the scale and offset the kernel will use
        scale = scale.to(torch.bfloat16).float()
        offset = (lo + 8.0 * scale).to(torch.bfloat16).float()
        q = torch.round((wg - offset) / scale + 8.0).clamp_(0, 15)
        so = torch.stack([scale.squeeze(-1), offset.squeeze(-1)], -1).transpose(0, 1).contiguous()
        return q.view(n, k).to(torch.int32), so.to(torch.bfloat16)

    @classmethod
    def make(cls, w: torch.Tensor, b: torch.Tensor | None, name: str) -> Int4Linear | None:
        """The int4 product of weight w [N, K] (and bias b), or None (w stays dense) where the kernel is
        missing, N or K do not fit its packing, or the check product misses fp32 by more than INT4_CHECK_TOL."""
        why = available("int4")
        n, k = w.shape
        if not why and w.device.type != "cpu":
            why = f"the weight is on {w.device}, not the CPU"
        if not why and (k % INT4_GROUP or n % INT4_N_MULTIPLE):
            why = f"[N, K] = [{n}, {k}]: the int4 kernel needs N a multiple of {INT4_N_MULTIPLE}, K of {INT4_GROUP}"
        if why:
            log.warning("int4 product %s declined: %s", name, why)
            return None
        q, so = cls.quantize(w)
        lin = cls(_int4_ops()[1](q, 1), so, n, k, None if b is None else b.detach())
        err = _check_error(lin, w, b)
        if not err < INT4_CHECK_TOL:
            log.warning("int4 product %s declined: its check product is off by %.3g (limit %g)", name, err,
                        INT4_CHECK_TOL)
            return None
        return lin

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.packed, INT4_GROUP, self.scale_offset)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + 2 * self.scale_offset.numel()


# what each quant tries in turn for a product: int4 falls back to int8 before the dense weights, so a drafter
# whose products are all quantized one way or the other is batch-invariant (both kernels give a row the same
# values whatever rows run beside it; fp32 GEMMs do not, and a bf16 rounding of the next product's input
# then turns their last-bit differences into visible ones, and a forked branch row's drafts into other drafts
# than a fresh round's)
MAKERS = {"int8": (Int8Linear.make,), "int4": (Int4Linear.make, Int8Linear.make)}


class DenseLinear:
    """The plain product (model.linear: MKL or oneDNN, as cpu_linear chose): a layer's product without
    quantization."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.w, self.b = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return M.linear(x, self.w, self.b)


def layer_products(layers, quant: str) -> list[tuple]:
    """Per layer (q|k|v, o, gate|up, down) as callables on the layer's input: DenseLinear views of its
    weights (quant "none"), or Int8Linear / Int4Linear where quantization applies (quant "int8" / "int4"; an
    int4 product that declines is tried as int8, and one that declines that stays dense)."""
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    out = []
    for i, w in enumerate(layers):
        prods = []
        for name, wt, b in (("qkv", w.wqkv, w.bqkv), ("o", w.wo, None), ("gate_up", w.wgu, None), ("down", w.wd, None)):
            lin = None
            for make in MAKERS.get(quant, ()):
                lin = make(wt, b, f"layer {i} {name}")
                if lin is not None:
                    break
            prods.append(lin if lin is not None else DenseLinear(wt, b))
        out.append(tuple(prods))
    return out
