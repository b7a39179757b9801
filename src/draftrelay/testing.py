"""The deterministic drafter and what checks against it: the start-up self-test, drills, soaks, tests.

Its drafts are a pure function of the request block, so any party can recompute what a correct round
must return: the engine's self-test compares the proxy's answer bit for bit, a soak scores every
round, a drill tells a wrong draft from a missing one. Fault plans make a round function fail in
chosen, reproducible ways (deterministic per round). numpy-only: the proxy process imports it.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from draftrelay.round import Drafts, RoundFailure, RoundFn, RoundRequest, RoundResult, Status

_M = np.uint64(0x9E3779B97F4A7C15)


def deterministic_draft(req: RoundRequest, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        h = np.uint64(req.req_id * 1_000_003 + req.generation * 7919 + req.position * 104_729 + 17)
        if len(req.tokens):
            toks = req.tokens.astype(np.uint64)
            h ^= np.bitwise_xor.reduce(toks * (np.arange(len(toks), dtype=np.uint64) * _M + _M))
        idx = np.arange(1, req.n_out + 1, dtype=np.uint64)
        x = (h + idx * _M) * _M
        x ^= x >> np.uint64(29)
    drafts = (x % np.uint64(vocab_size)).astype(np.int32)
    conf = ((x >> np.uint64(40)) % np.uint64(1000)).astype(np.float32) / np.float32(1000.0)
    return drafts, conf


def builtin_round_fn(vocab_size: int) -> RoundFn:
    def fn(t: int, requests: list[RoundRequest], budget_s: float) -> Drafts:
        return [deterministic_draft(r, vocab_size) for r in requests]

    return fn


def random_requests(rng: np.random.Generator, t: int, vocab_size: int, max_req: int = 4) -> list[RoundRequest]:
    """Round t's requests for soaks against the built-in drafter: 1..max_req requests with random ids,
    generations and 0-8 tokens, each asking for 0-6 drafts (the empty cases included on purpose)."""
    n = int(rng.integers(1, max_req + 1))
    return [RoundRequest(int(rng.integers(0, 1000)), int(rng.integers(1, 5)), t * 3 + i,
                         rng.integers(0, vocab_size, int(rng.integers(0, 9))).astype(np.int32),
                         int(rng.integers(0, 7))) for i in range(n)]


def score_round(requests: list[RoundRequest], result: RoundResult, vocab_size: int) -> tuple[int, int]:
    """(exact drafts, wrong drafts) of a RoundResult for rounds of the built-in drafter: an OK round
    must carry each request's n_out drafts and confidences bit for bit; any other round must carry
    none (its drafts all count as wrong). Used by the self-test's peers: soaks, drills, probes."""
    if result.status != Status.OK:
        return 0, int(result.counts.sum())
    exact = wrong = 0
    for i, r in enumerate(requests):
        want, conf = deterministic_draft(r, vocab_size)
        k = int(result.counts[i])
        if k == r.n_out and np.array_equal(result.drafts[i, :k], want) and np.array_equal(result.conf[i, :k], conf):
            exact += k
        else:
            wrong += max(k, 1)
    return exact, wrong


def score_in_flight(rounds, submitted: Iterable[tuple[int, list[RoundRequest]]], vocab_size: int,
                    depth: int = 2, timeout_s: float = 10.0) -> tuple[int, int]:
    """(exact drafts, wrong drafts) of the rounds `submitted` yields as (round id, requests), pulled one at
    a time while `depth` rounds stay in flight (the engine runs two), each result scored by score_round."""
    exact = wrong = 0
    pending: collections.deque = collections.deque()

    def settle() -> None:
        nonlocal exact, wrong
        t, reqs = pending.popleft()
        e, w = score_round(reqs, rounds.result(t, timeout_s=timeout_s), vocab_size)
        exact, wrong = exact + e, wrong + w

    for item in submitted:
        pending.append(item)
        if len(pending) == depth:
            settle()
    while pending:
        settle()
    return exact, wrong


# ---------------------------------------------------------------------------------------------
# Fault injection (tests, drills, benchmarks). Deterministic per round so failures reproduce.

STALL_POINTS = ("read", "write", "claim", "release")


@dataclass
class FaultPlan:
    seed: int = 0
    p_delay: float = 0.0  # sleep delay_ms inside the round (beyond the deadline: a watchdog round)
    delay_ms: float = 0.0
    p_exception: float = 0.0
    p_disconnect: float = 0.0
    p_timeout: float = 0.0
    p_bad_reply: float = 0.0  # the round function returns garbage; the proxy must catch it
    p_corrupt: float = 0.0  # the proxy itself writes a corrupt OK reply; the engine must catch it
    p_stall: float = 0.0  # stop for stall_ms at one of stall_points
    stall_ms: float = 0.0
    stall_points: list[str] = field(default_factory=lambda: list(STALL_POINTS))
    every: int = 0  # if > 0, only rounds with t % every == 0 are considered
    in_selftest: bool = False  # also fault the engine's start-up self-test rounds

    def pick(self, t: int) -> tuple[str, str]:
        """(fault, stall point) for round t; ('', '') when the round runs clean."""
        if self.every and t % self.every:
            return "", ""
        rng = np.random.default_rng([self.seed, t])
        u = float(rng.random())
        for name in ("delay", "exception", "disconnect", "timeout", "bad_reply", "corrupt", "stall"):
            p = getattr(self, f"p_{name}")
            if u < p:
                point = self.stall_points[int(rng.integers(len(self.stall_points)))] if name == "stall" else ""
                return name, point
            u -= p
        return "", ""


def faulty(fn: RoundFn, plan: FaultPlan, vocab_size: int) -> RoundFn:
    """`fn` failing as the plan says, inside the round function (the faults the proxy must catch;
    stalls and corrupt replies are the proxy loop's own, see handoff.proxy.serve)."""
    def wrapped(t: int, requests: list[RoundRequest], budget_s: float) -> Drafts:
        fault, _ = plan.pick(t)
        if fault == "delay":
            time.sleep(plan.delay_ms / 1000)
        elif fault == "exception":
            raise RuntimeError(f"injected exception in round {t}")
        elif fault == "disconnect":
            raise RoundFailure(Status.DISCONNECT, "injected disconnect")
        elif fault == "timeout":
            raise RoundFailure(Status.TIMEOUT, "injected timeout")
        out = fn(t, requests, budget_s)
        if fault == "bad_reply" and out:
            d, c = out[0]
            out[0] = (np.full(len(d) + 3, vocab_size + 5, np.int32), np.zeros(len(d) + 3, np.float32))
        return out

    return wrapped


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value of observed counts against expected ones (Wilson-Hilferty
    approximation; no scipy needed). Cells with an expected count below 5 are pooled into one; an
    observation where nothing was expected (an impossible outcome) gives 0."""
    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    if (observed[expected <= 0] > 0).any():
        return 0.0
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    x = float(((obs - exp) ** 2 / exp).sum())
    k = len(exp) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))
