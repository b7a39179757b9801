"""The greedy token of the LM head on the CPU without reading the whole head in full precision.

A batch-1 decode step on the CPU is bound by memory reads, and the head is one of the largest weights
(the 1.5B reference target's is 151,936 x 1,536 fp32, 933 MB of its 6.2 GB per step). A greedy step needs
only the argmax of h @ W^T, not every logit. So the head is screened first with an int8 copy of W
(one scale per row, a quarter of the bytes, torch's int8 weight-only GEMM), each approximate logit a_i
comes with a bound E_i on its distance from the full-precision one, and only the rows that could still be
the maximum (a_i + E_i >= max_j (a_j - E_j)) are computed in full precision: the argmax is that of the
full-precision logits. On the reference target a check over six prompts' 105 positions kept a median of
8 rows of 151,936 (at most 1,442).

The bound, for row i with c_i = max_j |W_ij|, s_i = c_i / 127 and q_i = round(W_i / s_i):
  quantization   |W_ij - s_i q_ij| <= s_i / 2                        -> c_i ||h||_1 / 254
  bf16 scale     the kernel's scale is bf16(s_i) (relative 2^-9)     -> c_i ||h||_1 / 512
  bf16 input     h is rounded to bf16 (relative 2^-9)                -> c_i ||h||_1 / 512 (x 1.002)
  accumulation   fp32 sums of 1,536 terms, here and in the full GEMM -> ~2e-4 c_i ||h||_1
  bf16 output    a_i itself is rounded (relative 2^-9)               -> |a_i| / 511
which E_i = c_i ||h||_1 / 64 + |a_i| / 64 covers with room (1/254 + 2/512 + 2e-4 < 1/64; measured errors
stay below a tenth of E_i). Any non-finite value, or a screen that keeps too many rows, falls back to the
full product.

The kept rows' logits come from a GEMM over those rows only; each is the same dot product as in the full
GEMM, so the argmax equals the full head's up to the order of an fp32 reduction (the same freedom a
change of thread count or verify width already takes): outputs differ only where the top two logits tie
within a few ulps.

A drafter also returns its confidence, p = softmax(l)[argmax] = 1 / sum_j exp(l_j - m) with m the maximum
(`head_pick`). The rows whose upper bound a_j + E_j comes within CONF_TAIL of the best lower bound are
computed in fp32 (a superset of the argmax's candidates; where a flat distribution has more of them than
CONF_MAX_FRACTION of the head, that many of the highest upper bounds); they give S = sum over them of
exp(l_j - m) exactly, and every other row j contributes between exp(a_j - E_j - m) and exp(a_j + E_j - m),
so p lies in [1 / (S + R_hi), 1 / (S + R_lo)] with R_lo / R_hi the two sums (tight where the rows left out
are far below the maximum: within 1e-3 on the reference drafter's code prompts, wider on flat prose
distributions). The value
returned is 1 / (S + R_a) with R_a the sum of exp(a_j - m), inside that interval, in practice within a
small fraction of the tail's mass of the full head's value. Where a confidence stop compares p with a
threshold, the interval (widened by CONF_MARGIN relative, more than the fp32 rounding of either
computation) must lie wholly on one side of it, else `head_pick` declines and the caller takes the full
head for that step: the stop's decisions are the full head's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from draftrelay import hugepages

SCREEN_MIN_BYTES = 64 << 20  # heads smaller than this run as one product (the screen would not pay)
SCREEN_MAX_ROWS = 16  # product rows (positions) up to which the screen runs: decode and verify widths
KEEP_MAX_FRACTION = 1 / 16  # a screen keeping more rows than this falls back to the full product
CONF_TAIL = 12.0  # head_pick: rows within this many logits of the floor are computed in fp32 ...
CONF_MAX_FRACTION = 1 / 32  # ... at most this fraction of them (those of highest upper bound)
CONF_MARGIN = 1e-4  # head_pick: relative widening of the confidence's interval before it decides a stop
_BUILD_ROWS = 8192  # rows quantized at a time (bounds the fp32 temporaries of the build)

_cache: dict[int, tuple[weakref.ref, int, ScreenedHead]] = {}


class ScreenedHead:
    """The int8 copy of one head: q [V, D] int8, scale [V] bf16, cmax [V] fp32 (max |W_i|)."""

    def __init__(self, w: torch.Tensor) -> None:
        V, D = w.shape
        self.q = hugepages.empty((V, D), torch.int8)  # read on every step, as the weights are
        self.cmax = torch.empty(V, dtype=torch.float32)
        with torch.no_grad():
            for i in range(0, V, _BUILD_ROWS):
                blk = w[i:i + _BUILD_ROWS].float()
                c = blk.abs().amax(1)
                s = torch.where(c > 0, c / 127, torch.ones_like(c))
                self.q[i:i + _BUILD_ROWS] = torch.round(blk / s[:, None]).clamp_(-127, 127).to(torch.int8)
                self.cmax[i:i + _BUILD_ROWS] = c
        self.scale = torch.where(self.cmax > 0, self.cmax / 127, torch.ones_like(self.cmax)).to(torch.bfloat16)

    def bounds(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, E), each [M, V]: the approximate logits of h [M, D] and the bound on their distance from the
        full-precision ones (the module's derivation)."""
        a = torch._weight_int8pack_mm(h.to(torch.bfloat16), self.q, self.scale).float()
        l1 = h.float().abs().sum(1, keepdim=True)  # [M, 1]
        return a, (self.cmax[None] * l1 + a.abs()) * (1 / 64)

    def candidates(self, h: torch.Tensor) -> torch.Tensor | None:
        """Rows of the head that may hold the argmax of some row of h [M, D] (ascending), or None when the
        screen cannot decide (non-finite values, too many rows kept)."""
        a, err = self.bounds(h)
        if not (torch.isfinite(a).all() and torch.isfinite(err).all()):
            return None
        floor = (a - err).amax(1, keepdim=True)
        keep = (a + err >= floor).any(0).nonzero()[:, 0]
        if keep.numel() > KEEP_MAX_FRACTION * self.q.shape[0]:
            return None
        return keep


def screened_for(w: torch.Tensor) -> ScreenedHead:
    """The int8 copy of head w, built on first use and rebuilt when w is written to (its version changes)."""
    key = id(w)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    sh = ScreenedHead(w)
    _cache[key] = (weakref.ref(w, lambda _, k=key: _cache.pop(k, None)), w._version, sh)
    return sh


def usable(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the screen runs for h [M, D] @ w^T: an fp32 CPU head big enough, few rows. (bf16 logits tie
    often at their 8 bits, and which of the tied rows a bf16 GEMM over a subset rounds up is not promised.)"""
    return (h.device.type == "cpu" and w.device.type == "cpu" and w.dim() == 2 and h.dim() == 2
            and 1 <= h.shape[0] <= SCREEN_MAX_ROWS and w.numel() * w.element_size() >= SCREEN_MIN_BYTES
            and w.dtype == h.dtype == torch.float32 and hasattr(torch, "_weight_int8pack_mm"))


def head_argmax(h: torch.Tensor, w: torch.Tensor, full=F.linear) -> torch.Tensor:
    """argmax over the vocabulary of h [M, D] @ w^T -> int64 [M]; screened where `usable`, else from
    `full(h, w)` (the caller's product: model.linear's row blocks)."""
    if usable(h, w):
        keep = screened_for(w).candidates(h)
        if keep is not None:
            return keep[F.linear(h, w[keep]).float().argmax(-1)]
    return full(h, w).float().argmax(-1)



def pick_interval(h: torch.Tensor, w: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(argmax int64 [M], confidence, its lower and upper bound, fp32 [M]) of h [M, D] @ w^T from the screen
    (the module's derivation; the bounds before CONF_MARGIN), or None where it does not run or decide."""
    if not usable(h, w):
        return None
    sh = screened_for(w)
    a, err = sh.bounds(h)
    if not torch.isfinite(err).all():  # err is non-finite wherever a or h is
        return None
    V = a.shape[1]
    hi = a + err
    floor = (a - err).amax(1, keepdim=True)  # each row's maximum logit is at least this
    if int((hi >= floor).any(0).sum()) > KEEP_MAX_FRACTION * V:  # the argmax's candidates
        return None
    cap = max(1, int(CONF_MAX_FRACTION * V))
    score = (hi - floor).amax(0)  # >= 0 exactly for the argmax's candidates
    near = score >= -CONF_TAIL
    if int(near.sum()) <= cap:
        keep = near.nonzero()[:, 0]
    else:  # a flat distribution: the cap's rows of highest upper bound (the candidates among them)
        keep = score.topk(cap).indices.sort().values
    exact = F.linear(h, w[keep]).float()  # [M, K]
    m, j = exact.max(-1, keepdim=True)
    s = torch.exp(exact - m).sum(-1)
    t = a - m
    t[:, keep] = float("-inf")  # the rows computed exactly are in s: the rest, each within t -/+ err
    p = 1 / (s + torch.exp(t).sum(-1))
    p_lo = 1 / (s + torch.exp(t + err).sum(-1))
    p_hi = 1 / (s + torch.exp(t - err).sum(-1))
    return keep[j[:, 0]], p, p_lo, p_hi


def head_pick(h: torch.Tensor, w: torch.Tensor, min_conf: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax int64 [M], confidence fp32 [M]) of the logits h [M, D] @ w^T, from the screen and the fp32
    rows near the top (`pick_interval`); None where the screen does not run or decide, or leaves some row's
    min_conf[m] (> 0; 0 or inf: no stop to decide) inside the confidence's interval widened by CONF_MARGIN:
    the caller then computes the full logits."""
    got = pick_interval(h, w)
    if got is None:
        return None
    tok, p, p_lo, p_hi = got
    if min_conf is not None:
        thr = min_conf.to(torch.float32)
        live = (thr > 0) & torch.isfinite(thr)
        if (live & (p_lo * (1 - CONF_MARGIN) < thr) & (p_hi * (1 + CONF_MARGIN) >= thr)).any():
            return None
    return tok, p
