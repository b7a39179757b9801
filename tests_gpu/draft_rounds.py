"""Rounds of greedy drafts on two drafters of one model (graph replay against eager), shared by the GPU draft
checks: each round every request drafts from its context on both, then accepts a random prefix of the eager
drafts plus one random token (a round's outcome as the target's verify would leave it)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from draftrelay.worker.drafters import Job


def draft_rounds(ds: dict, vocab: int, n_req: int = 3, rounds: int = 30, n_out: int = 4,
                 seed: int = 0) -> Iterator[tuple[int, dict[int, list[int]], dict[str, list[np.ndarray]]]]:
    """Yields (round, each request's context before the round, each drafter's drafts per request) for `rounds`
    rounds of n_req requests (contexts of 40 + 7 r random ids at first); ds maps names to drafters with an
    "eager" one, whose drafts the contexts accept from."""
    rng = np.random.default_rng(seed)
    ctx = {r: list(rng.integers(0, vocab, 40 + 7 * r)) for r in range(n_req)}
    synced = dict.fromkeys(ctx, 0)
    for rnd in range(rounds):
        jobs = [Job(r, synced[r], np.array(ctx[r][synced[r]:], np.int32)) for r in range(n_req)]
        res = {k: d.run([Job(j.row, j.keep, j.tokens.copy()) for j in jobs], n_out)[0] for k, d in ds.items()}
        yield rnd, {r: list(c) for r, c in ctx.items()}, res
        for r in range(n_req):  # accept a random prefix of the eager drafts, plus one token
            keep = int(rng.integers(0, n_out + 1))
            synced[r] = len(ctx[r])
            ctx[r] += list(res["eager"][r][:keep]) + [int(rng.integers(0, vocab))]
