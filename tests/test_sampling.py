"""Acceptance rules: greedy exact match, and rejection sampling whose output distribution is the
target's. The statistical tests use a small vocabulary and enough samples that the two classic
mistakes (treating the drafter's confidence as the proposal probability, or resampling from p
without removing the rejected draft) are rejected by the same test that passes the real rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftrelay.engine.sampling import accept_greedy, accept_sampled, probs_from_logits, sample_from
from draftrelay.testing import chi2_pvalue


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, 7)  # all kept: bonus
    assert accept_greedy([5, 6, 7], [5, 9]) == (1, 6)  # second rejected: corrected
    assert accept_greedy([5, 6, 7], [4, 6]) == (0, 5)  # a later match does not count
    assert accept_greedy([3], []) == (0, 3)  # no drafts: plain decode


def test_sample_from_matches_distribution():
    p = torch.tensor([0.5, 0.0, 0.2, 0.3])
    g = torch.Generator().manual_seed(1)
    n = 6000
    counts = np.bincount([sample_from(p, g) for _ in range(n)], minlength=4)
    assert counts[1] == 0  # zero probability is never drawn
    assert chi2_pvalue(counts, p.numpy() * n) > 1e-3


def test_probs_from_logits_temperature_and_top_k():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.0])
    p = probs_from_logits(logits, 0.5)
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p2 = probs_from_logits(logits, 1.0, top_k=2)
    assert p2[0] == 0 and p2[3] == 0 and torch.isclose(p2.sum(), torch.tensor(1.0))



def test_probs_from_logits_top_p_keeps_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05 (sorted order 2, 0, 3, 1)
    p = torch.tensor([0.3, 0.05, 0.5, 0.15])
    logits = torch.log(p)
    for top_p, kept in [(0.5, [2]), (0.51, [2, 0]), (0.8, [2, 0]), (0.81, [2, 0, 3]), (0.95, [2, 0, 3]),
                        (0.96, [0, 1, 2, 3]), (1e-6, [2])]:
        q = probs_from_logits(logits, 1.0, top_p=top_p)
        assert sorted(torch.nonzero(q).flatten().tolist()) == sorted(kept), top_p
        assert torch.allclose(q[kept], p[kept] / p[kept].sum())
    # rows of a verify batch are filtered independently, and top_k applies first
    two = probs_from_logits(torch.stack([logits, logits.flip(0)]), 1.0, top_k=3, top_p=0.6)
    assert torch.nonzero(two[0]).flatten().tolist() == [0, 2]
    assert torch.nonzero(two[1]).flatten().tolist() == [1, 3]
    assert torch.allclose(two.sum(-1), torch.ones(2))


def test_engine_samples_within_top_p():
    # the nucleus of the tiny target at temperature 3: every sampled token must lie in it
    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams

    target, _ = M.tiny_pair(M.TINY_SEED)
    eng = Engine(target, EngineConfig(mode="off", max_batch=1, max_len=64))
    prompt = [5, 6, 7]
    with torch.inference_mode():
        cache = target.new_cache(1, 64)
        logits = target(torch.tensor([prompt]), torch.tensor([0]), cache, torch.tensor([0]))[0, -1]
    nucleus = set(torch.nonzero(probs_from_logits(logits, 3.0, top_p=0.5)).flatten().tolist())
    assert 4 < len(nucleus) < 32  # a real cut: the full distribution has 256 tokens
    firsts = {eng.generate([prompt], SamplingParams(max_tokens=1, temperature=3.0, top_p=0.5, seed=s))[0].output[0]
              for s in range(40)}
    assert firsts <= nucleus and len(firsts) > 1
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request(prompt, SamplingParams(top_p=0.0))


V = 6
P = torch.tensor([[0.10, 0.35, 0.05, 0.25, 0.15, 0.10],  # position 0
                  [0.30, 0.05, 0.20, 0.10, 0.25, 0.10],  # position 1
                  [0.15, 0.15, 0.15, 0.25, 0.20, 0.10]])  # the bonus position
DRAFTS = [1, 2]  # a likely first draft, an unlikely second one
CONF = [0.9, 0.9]  # the drafter's confidence in its (greedy) drafts


def _wrong_conf_as_q(p, drafts, gen):
    """Mistake 1: a greedy draft's confidence used as its proposal probability."""
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[i, x]) / CONF[i]):
            continue
        r = p[i].clone()
        r[x] = 0
        return i, sample_from(r, gen)
    return len(drafts), sample_from(p[len(drafts)], gen)


def _wrong_residual(p, drafts, gen):
    """Mistake 2: after a rejection, resample from p itself (the draft is not removed)."""
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < float(p[i, x]):
            continue
        return i, sample_from(p[i], gen)
    return len(drafts), sample_from(p[len(drafts)], gen)


def _emitted_pairs(rule, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of the first emitted token, and of the second given the first was draft 0."""
    g = torch.Generator().manual_seed(seed)
    first = np.zeros(V)
    second = np.zeros(V)
    for _ in range(n):
        kept, nxt = rule(P, DRAFTS, g)
        toks = DRAFTS[:kept] + [nxt]
        first[toks[0]] += 1
        if toks[0] == DRAFTS[0] and len(toks) > 1:
            second[toks[1]] += 1
    return first, second


def _passes(rule, n: int = 12000, seed: int = 7) -> bool:
    first, second = _emitted_pairs(rule, n, seed)
    p_first = chi2_pvalue(first, P[0].numpy() * n)
    # given token 0 == draft 0 was kept, token 1 must be distributed as P[1]
    p_second = chi2_pvalue(second, P[1].numpy() * second.sum())
    return p_first > 1e-3 and p_second > 1e-3


def test_rejection_sampling_point_mass_drafts_is_lossless():
    assert _passes(lambda p, d, g: accept_sampled(p, d, g))


@pytest.mark.parametrize("wrong", [_wrong_conf_as_q, _wrong_residual])
def test_the_statistical_test_rejects_wrong_rules(wrong):
    assert not _passes(wrong)


def test_rejection_sampling_with_proposal_distributions():
    """General q (drafts drawn from q): the emitted first token is still distributed as p."""
    q = torch.tensor([[0.4, 0.1, 0.1, 0.1, 0.2, 0.1],
                      [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(3)
    n = 10000
    first = np.zeros(V)
    for _ in range(n):
        d = [sample_from(q[0], g), sample_from(q[1], g)]
        kept, nxt = accept_sampled(P, d, g, q=q)
        first[(d[:kept] + [nxt])[0]] += 1
    assert chi2_pvalue(first, P[0].numpy() * n) > 1e-3
