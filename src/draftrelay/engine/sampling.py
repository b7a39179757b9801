"""Turning the target's logits into tokens, and deciding how many drafts to keep.

Two acceptance rules, both exact (the output distribution is the target's, whatever the drafts are):

  greedy (temperature 0): keep drafts while each equals the target's argmax at its position; the
      first mismatch is replaced by the target's argmax there; if all k match, the target's argmax
      after the last one is a free extra ("bonus") token. The output is exactly target-only greedy.

  sampling (temperature > 0): speculative rejection sampling (Leviathan et al. / Chen et al.).
      Draft x_i proposed with probability q_i(x) is kept with probability min(1, p_i(x) / q_i(x));
      the first rejected position is resampled from the residual norm(max(0, p_i - q_i)); if all
      are kept, the bonus is drawn from p_k. Every emitted token is then distributed as p.
      The worker's drafts are greedy (argmax of the drafter, see docs/CONTRACT.md), i.e. q_i is a
      point mass on x_i: keep with probability p_i(x_i), resample from p_i with x_i removed. Its
      confidence value is the drafter's probability of x_i, NOT the proposal probability, so it
      must not be used as q (tests/test_sampling.py shows that doing so biases the output).

Randomness comes from one torch.Generator per request (reproducible per seed); everything runs on
the logits' device.
"""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target distribution p for sampling: softmax(logits / T), optionally restricted to the top_k,
    then to the nucleus: the most likely tokens whose mass reaches top_p (at least one token).
    The acceptance rules use this p, so speculative output follows the restricted distribution."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        # drop a token when the mass of the tokens ranked above it already reaches top_p
        drop = (torch.cumsum(sp, dim=-1) - sp) >= top_p
        drop[..., 0] = False
        p = p.scatter(-1, idx, sp.masked_fill(drop, 0.0))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def sample_from(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from a 1-D distribution (inverse CDF with one uniform: cheap and reproducible)."""
    u = torch.rand((), generator=gen, device=gen.device if gen is not None else probs.device)
    cdf = torch.cumsum(probs.double(), dim=0)
    idx = int(torch.searchsorted(cdf, u.to(cdf.device, cdf.dtype) * cdf[-1], right=True))
    return min(idx, probs.shape[0] - 1)


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """(number of drafts kept, the next token). target_argmax has len(drafts) + 1 entries."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def accept_sampled(p: torch.Tensor, drafts: list[int], gen: torch.Generator | None,
                   q: torch.Tensor | None = None) -> tuple[int, int]:
    """Rejection sampling. p: [k+1, V] target probabilities at the k+1 verified positions;
    drafts: the k proposed tokens; q: [k, V] proposal distributions, or None for greedy drafts
    (point masses). Returns (number of drafts kept, the next token)."""
    k = len(drafts)
    for i, x in enumerate(drafts):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=gen, device=gen.device if gen is not None else p.device))
        if qx > 0 and u < min(1.0, px / qx):
            continue  # keep draft i
        if q is None:
            resid = p[i].clone()
            resid[x] = 0.0
        else:
            resid = torch.clamp(p[i] - q[i], min=0.0)
        if float(resid.sum()) <= 0.0:  # p == q: rejection had probability 0; guard against rounding
            resid = p[i]
        return i, sample_from(resid, gen)
    return k, sample_from(p[k], gen)


def accept(temperature: float, top_k: int, logits: torch.Tensor | None, argmax: list[int] | None, drafts: list[int],
           gen: torch.Generator | None, top_p: float = 1.0) -> tuple[int, int]:
    """One request's verdict on its verified drafts: (drafts kept, the next token).
    logits: [>= len(drafts) + 1, V] at the verified positions (None for greedy); argmax: their argmax (greedy)."""
    if temperature <= 0:
        return accept_greedy(argmax[:len(drafts) + 1], drafts)
    return accept_sampled(probs_from_logits(logits[:len(drafts) + 1], temperature, top_k, top_p), drafts, gen)


def first_token(temperature: float, top_k: int, logits: torch.Tensor, gen: torch.Generator | None,
                top_p: float = 1.0) -> int:
    """The token after a prefill, from the last position's logits."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    return sample_from(probs_from_logits(logits, temperature, top_k, top_p), gen)
