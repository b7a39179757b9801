"""Engine figures: where each decode step's time goes, what each round gave, and the totals.

Step parts (seconds, one entry per decode step): submit = the engine thread's cost of starting the
round (sync: the whole round); wait = blocked in result(); verify = the verify forward up to its
logits on the host (on a GPU: launches + whatever did not overlap); host = the rest; step = all.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import numpy as np

from draftrelay.round import RoundResult, Status

from .request import Request

PARTS = ("submit", "wait", "verify", "host", "step")
ROUND_KINDS = ("ok", "failed", "watchdog", "target_only")


class StepClock:
    """One decode step's clock: `with clock.part("wait"): ...` adds to that part; `stop` books it."""

    def __init__(self, timing: dict[str, list[float]]) -> None:
        self.timing = timing
        self.t0 = time.perf_counter()
        self.parts = {"submit": 0.0, "wait": 0.0, "verify": 0.0}
        self._name, self._t = "", 0.0

    def part(self, name: str) -> StepClock:
        self._name = name
        return self

    # a plain context manager (not contextlib's generator one): a few microseconds less per part
    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.parts[self._name] += time.perf_counter() - self._t

    def stop(self, batch: list[Request]) -> None:
        dt = time.perf_counter() - self.t0
        for r in batch:
            r.step_s.append(dt)
        for k, v in self.parts.items():
            self.timing[k].append(v)
        self.timing["host"].append(dt - sum(self.parts.values()))
        self.timing["step"].append(dt)


def new_timing() -> dict[str, list[float]]:
    return {k: [] for k in PARTS}


def record_round(r: Request, res: RoundResult | None, asked: int, offered: int, kept: int) -> None:
    """Book one step of `r`: the round's outcome (if it asked for drafts) and drafts kept by position."""
    if res is not None and asked:
        r.rounds["ok" if res.ok else ("watchdog" if res.status == Status.WATCHDOG else "failed")] += 1
    if res is not None and asked and offered == 0:
        r.rounds["target_only"] += 1
    if offered:
        r.kept.append(kept)
        while len(r.pos_tries) < offered:
            r.pos_tries.append(0)
            r.pos_hits.append(0)
        for j in range(offered):
            r.pos_tries[j] += 1
            r.pos_hits[j] += j < kept


def totals(reqs: list[Request], timing: dict[str, list[float]], wall_s: float) -> tuple[dict, list[dict]]:
    """(totals over `reqs`, per-request metrics)."""
    per = [r.metrics() for r in reqs]
    out_tokens = sum(m["output_tokens"] for m in per)
    kept = [k for r in reqs for k in r.kept]
    tries: Counter = Counter()
    hits: Counter = Counter()
    rounds: Counter = Counter()
    for r in reqs:
        for j, (h, t) in enumerate(zip(r.pos_hits, r.pos_tries, strict=True)):
            tries[j] += t
            hits[j] += h
        rounds.update(r.rounds)
    total = {
        "requests": len(per), "output_tokens": out_tokens, "wall_s": wall_s,
        "tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s_mean": float(np.mean([m["ttft_s"] for m in per])) if per else 0.0,
        "step_p50_ms": statistics.median([m["step_p50_ms"] for m in per]) if per else 0.0,
        "mean_accepted": float(np.mean(kept)) if kept else 0.0,
        "tokens_per_step": (sum(m["output_tokens"] - 1 for m in per) / max(1, sum(m["steps"] for m in per))),
        "accept_rate_by_pos": [hits[j] / tries[j] for j in sorted(tries)],
        "rounds": {k: rounds.get(k, 0) for k in ROUND_KINDS},
        "step_parts_p50_ms": {k: 1e3 * statistics.median(v) if v else 0.0 for k, v in timing.items()},
    }
    return total, per


def speculation_warning(rounds: dict, handoff: dict, min_rounds: int = 4) -> str:
    """'' or the loud line for a run where most rounds brought no drafts, e.g. "speculation off: 30 of
    30 rounds failed: timeout 20, breaker 10" (rounds: the requests' round counts; handoff: the rounds'
    stats, whose failure reasons name the cause)."""
    asked = rounds.get("ok", 0) + rounds.get("failed", 0) + rounds.get("watchdog", 0)
    bad = rounds.get("failed", 0) + rounds.get("watchdog", 0)
    if asked < min_rounds or 2 * bad <= asked:
        return ""
    reasons = dict(handoff.get("failed_by_reason", {}))
    if handoff.get("watchdog"):
        reasons["watchdog"] = handoff["watchdog"]
    named = sorted(reasons.items(), key=lambda kv: -kv[1])
    why = named[0][0] if len(named) == 1 else ", ".join(f"{k} {v}" for k, v in named)
    # what the first failure of the commonest reason said (a timeout names the part of the round that ran out)
    first = handoff.get("first_failure", {}).get(named[0][0], "") if named else ""
    return (f"speculation off: {bad} of {asked} rounds failed" + (f": {why}" if why else "")
            + (f" (first {named[0][0]}: {first})" if first else ""))
