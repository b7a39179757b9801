"""A GPU drafter's head in int8: half the bytes of the largest product of its greedy forwards.

The 0.5B drafter's head is 151,936 x 896 (272 MB in bf16): at one request it is read once per draft
token, about 87 us of a forward near 0.7 ms on an H100, and nothing else in the forward is as large.
A greedy drafter needs the argmax of the head's output (and its softmax probability, the draft's
confidence), not exact logits. So `draftrelay worker --head-int8` reads the head as int8 with one fp32
scale per row (absmax / 127, rounded to nearest): 136 MB, the rows times the int8 values summed in fp32
and each sum times its row's scale (`kernels.reference.int8_linear`; on CUDA the plan's tile with the int8
conversion where it multiplies, `triton_ops.int8_linear` / `int8_norm_linear`).

The drafts are then approximate: each weight moves by at most half its row's step (absmax / 254), so a
logit moves by at most absmax * ||h||_1 / 254, and where the drafter's top two logits are closer than
that the draft can go the other way; the confidence moves likewise. The target verifies every draft, so
the output does not change, only how many drafts it keeps (greedy_head.py does the same screening on a
CPU with an exact argmax; here the int8 logits are taken as they are).

Where it runs: the greedy forwards of the one-card fast path (`Transformer.forward(..., greedy=True)`), on
rows the plan gives an int8 tile (the bf16 key's candidates, kernels.plan.bucket_candidates: on the large
heads the multiply-and-sum tiles at one row and the dot tiles, each int8 tile converted to bf16 before its
dot, at more; chosen only where one beats the bf16 product it replaces), else the bf16 head as before; the plain path,
the forked rows' logits and the tensor-parallel ranks read the bf16 head. The int8 copy is made once per
head tensor (a draft vocabulary's rows are quantized after they are picked) and kept beside the bf16 one,
which the embedding (tied) and the other paths still read.
"""

from __future__ import annotations

import torch

QMAX = 127  # int8's symmetric range: -127 .. 127 (-128 unused, so a row's scale maps both signs alike)
_BUILD_ROWS = 16384  # rows quantized at a time (bounds the fp32 temporaries)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q int8 [N, K], s fp32 [N]) with w[n] ~= q[n] * s[n]: s[n] the row's
    absmax / 127, q rounded to nearest (a zero row: s 0, q 0). On w's device, in slices of rows."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"int8 head: a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r0 in range(0, w.shape[0], _BUILD_ROWS):
        wf = w[r0:r0 + _BUILD_ROWS].float()
        sc = wf.abs().amax(dim=1) / QMAX
        if not torch.isfinite(sc).all():
            raise ValueError(f"int8 head: rows {r0}..{r0 + len(sc) - 1} hold a value that is not finite")
        q[r0:r0 + _BUILD_ROWS] = torch.round(wf / sc.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)
        s[r0:r0 + _BUILD_ROWS] = sc
    return q, s


class Int8Head:
    """The int8 copies of a model's heads, one per head tensor (`of`), made the first time each is read
    (before any graph capture: the forwards are warmed eagerly first)."""

    def __init__(self) -> None:
        self._copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, s) of head w [V, D] (quantize_rows), made once per (storage, device, dtype, shape)."""
        key = (w.data_ptr(), w.device, w.dtype, tuple(w.shape))
        got = self._copies.get(key)
        if got is None:
            if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("int8 head: a head first read inside a graph capture (its copy would be made by "
                                   "the graph's replays); read it once eagerly first (Int8Head.of)")
            got = self._copies[key] = quantize_rows(w.detach())
        return got

    def nbytes(self) -> int:
        return sum(q.numel() + 4 * s.numel() for q, s in self._copies.values())
