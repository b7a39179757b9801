"""The oracle and the math of the P2P collectives, in plain torch.

`reference_*`: every rank copies every payload to its own device and adds in fp32 in rank order; the
argmax of a vocabulary split is the argmax of the concatenated logits. `sum_in_rank_order` and
`combine_argmax` are that math, shared with the emulation (emulated.py), and kernels.cu implements the
same: all-reduce out = dtype(((x0 + x1) + x2) + ...) with every term in fp32, one rounding at the end;
argmax exchange per row: the best (value, id) over ranks, a NaN value beats any number, equal values go
to the lower id; top2 = the larger of the winner's own runner-up and every other rank's best value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sum_in_rank_order(terms: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = terms[0].to(torch.float32)
    for t in terms[1:]:
        acc = acc + t.to(torch.float32)
    return acc.to(dtype)


def _better(av: torch.Tensor, ai: torch.Tensor, bv: torch.Tensor, bi: torch.Tensor) -> torch.Tensor:
    an, bn = torch.isnan(av), torch.isnan(bv)
    return torch.where(an != bn, an, torch.where(~an & (av != bv), av > bv, ai < bi))


def combine_argmax(
    v1s: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], v2s: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-rank (top1, id, top2) rows in rank order, as the kernel does."""
    wv, wi = v1s[0], ids[0]
    wk = torch.zeros_like(ids[0])
    for k in range(1, len(v1s)):
        b = _better(v1s[k], ids[k], wv, wi)
        wv, wi = torch.where(b, v1s[k], wv), torch.where(b, ids[k], wi)
        wk = torch.where(b, torch.full_like(wk, k), wk)
    s2 = torch.full_like(wv, float("-inf"))
    for k in range(len(v1s)):
        own2 = v2s[k] if v2s[k] is not None else torch.full_like(wv, float("-inf"))
        cand = torch.where(wk == k, own2, v1s[k])
        s2 = torch.where(cand > s2, cand, s2)
    return wv, wi, s2


def reference_shard_argmax(
    logits: torch.Tensor, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top1 value, lowest id of it + offset, top2 value) per row; a NaN counts as the largest value."""
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"shard_argmax: logits must be 2-D [rows, V>=1], got {tuple(logits.shape)}")
    x = logits.to(torch.float32)
    rows, v = x.shape
    ar = torch.arange(v, device=x.device).expand(rows, v)
    nan = torch.isnan(x)
    big = torch.full_like(ar, v)
    x_nonan = torch.where(nan, torch.full_like(x, float("-inf")), x)
    m = x_nonan.max(dim=1).values
    first_max = torch.where(x_nonan == m[:, None], ar, big).min(dim=1).values
    first_nan = torch.where(nan, ar, big).min(dim=1).values
    has_nan = nan.any(dim=1)
    idx = torch.where(has_nan, first_nan, first_max)
    v1 = torch.where(has_nan, torch.full_like(m, float("nan")), m)
    if v >= 2:
        v2 = torch.topk(x_nonan, 2, dim=1).values[:, 1].contiguous()
    else:
        v2 = torch.full_like(m, float("-inf"))
    return v1, idx.to(torch.int64) + offset, v2


def reference_all_reduce(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle: every rank copies every payload to its own device, adds in fp32 in rank order."""
    outs = []
    for x in xs:
        gathered = [t.to(x.device, copy=True) for t in xs]
        outs.append(sum_in_rank_order(gathered, x.dtype))
    return outs


def reference_argmax(shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle for a vocabulary split: argmax of the concatenated logits (rank 0 = lowest ids)."""
    full = torch.cat([s.to(shards[0].device, torch.float32) for s in shards], dim=1)
    return reference_shard_argmax(full, 0)
