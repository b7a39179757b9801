"""docs/TP2.md's near-tie rule, shared by the GPU draft checks: two bf16 paths (fused kernels against the
plain forward, a batched branch run against a fresh round) may pick different greedy tokens where the
top two logits lie within rounding of each other. A mismatch the rule does not call a near-tie is a
wrong draft."""

from __future__ import annotations

import torch


def near_tie(la: torch.Tensor, lb: torch.Tensor, ta: int, tb: int) -> dict:
    """la, lb: one position's logits on the two paths; ta, tb: the tokens each picked. tol = max(largest
    |la - lb|, 4 bf16 ulps of the top logit); a numeric near-tie when both paths' margins between the two
    tokens are <= 2 tol and tol is <= 5 % of the logits' spread. Over the ids both paths can pick: a
    drafter with a draft vocabulary gives -inf outside it (draft_vocab.widen), which would make tol NaN."""
    kept = torch.isfinite(la) & torch.isfinite(lb)
    la, lb = la.where(kept, la[kept].min()), lb.where(kept, lb[kept].min())  # outside: the kept ones' floor
    diff = float((la - lb).abs().max())
    ulp = float(la.abs().max()) * 2 ** -7
    tol = max(diff, 4 * ulp)
    ma, mb = float(la[ta] - la[tb]), float(lb[tb] - lb[ta])
    spread = float(la.max() - la.min())
    return {"tol": tol, "margin_a": ma, "margin_b": mb, "near_tie": abs(ma) <= 2 * tol and abs(mb) <= 2 * tol
            and tol <= 0.05 * spread}
