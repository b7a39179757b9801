"""Round timing measured before decoding: how long the worker's STEP takes here, and the round budget
and watchdog deadline that follow from it.

A fixed budget is wrong in both directions: 150 ms fails every round of a 0.5B drafter on a small CPU
(its 4-draft STEP takes 370-560 ms), and on a GPU worker (a ~13 ms STEP) it lets a stuck round hold
the stream ten times longer than it needs. `measure_rounds` opens its own session with the worker,
sends one prompt-sized block (the first round of a request carries its prompt) and then one-token
blocks asking for each depth in `ks`, a few times each, and closes the session (its rows are freed).
The figures are round trips as the engine sees them: network, framing and the drafter's forward.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

# a block id no engine request uses (the probe's session is its own anyway)
_PROBE_ID = (1 << 62) + 7


@dataclass
class RoundTiming:
    prefill_s: float  # the first round: the probe prompt (prompt_tokens) plus the deepest draft
    prompt_tokens: int
    by_k: dict[int, float] = field(default_factory=dict)  # steady rounds (one token in), median s by depth

    def steady_s(self, k: int) -> float:
        """The steady round at depth k: measured, or linear in k between / beyond the measured depths."""
        if k in self.by_k:
            return self.by_k[k]
        ks = sorted(self.by_k)
        if not ks:
            return 0.0
        if len(ks) == 1:
            return self.by_k[ks[0]] * max(k, 1) / max(ks[0], 1)
        a, b = np.polyfit(np.array(ks, float), np.array([self.by_k[x] for x in ks]), 1)
        return float(max(a * k + b, min(self.by_k.values()) * 0.5))

    def budget_ms(self, k_max: int, margin: float = 2.0, floor_ms: float = 150.0) -> float:
        """What the proxy allows one round: `margin` x the slowest of the prompt round and the deepest
        steady round, plus 100 ms for scheduling noise; never below `floor_ms`."""
        worst = max(self.prefill_s, self.steady_s(k_max))
        return max(floor_ms, 1e3 * margin * worst + 100.0)

    def as_dict(self) -> dict:
        return {"prefill_ms": 1e3 * self.prefill_s, "prompt_tokens": self.prompt_tokens,
                "steady_ms_by_k": {str(k): 1e3 * v for k, v in sorted(self.by_k.items())}}


def deadline_for(budget_ms: float) -> float:
    """The watchdog deadline that goes with a round budget: the proxy gets its whole budget (and
    publishes a TIMEOUT itself) before the watchdog claims the round."""
    return budget_ms + 50.0


def measure_rounds(spec: dict, prompt: list[int], ks: list[int], repeats: int = 3,
                   timeout_s: float = 120.0, requests: int = 1) -> RoundTiming:
    """Time STEP rounds against the worker `spec` names (see the module docstring); `requests` requests in
    each round, all with the same tokens (a server's full batch: on a CPU a round of eight costs several
    times a round of one). Raises wire.client.WireError when the worker cannot be reached or refuses."""
    from draftrelay.wire import protocol as P
    from draftrelay.wire.roundfn import client_from_spec

    ks = sorted({int(k) for k in ks if k > 0})
    if not ks or not prompt:
        raise ValueError("measure_rounds: need a prompt and at least one depth > 0")
    if requests < 1:
        raise ValueError(f"measure_rounds: requests must be >= 1, got {requests}")
    client = client_from_spec({**spec, "n_out_max": max(ks), "max_requests": requests,
                               "client_name": "draftrelay-calibrate"})
    try:
        client.connect(timeout=timeout_s)
        toks = np.asarray(prompt, np.int32)
        pos = 0

        def step(tokens: np.ndarray, n_out: int, flags: int = 0) -> tuple[float, np.ndarray]:
            nonlocal pos
            t0 = time.perf_counter()
            reply = client.step([P.Block(_PROBE_ID + r, 1, pos, tokens, n_out, flags) for r in range(requests)],
                                timeout=timeout_s)
            dt = time.perf_counter() - t0
            pos += len(tokens)
            return dt, reply.drafts[0, :int(reply.counts[0])]

        prefill_s, drafts = step(toks, ks[-1])
        by_k: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(repeats):
            for k in ks:
                # the drafter's own first guess as the next token: a realistic one-token block
                nxt = np.asarray(drafts[:1] if len(drafts) else toks[-1:], np.int32)
                dt, drafts = step(nxt, k)
                by_k[k].append(dt)
        try:
            step(np.zeros(0, np.int32), 0, P.FLAG_END)
        except Exception:  # freeing the probe's row is a courtesy: closing the session frees it too
            pass
    finally:
        client.close()
    return RoundTiming(prefill_s, len(prompt), {k: statistics.median(v) for k, v in by_k.items()})


@dataclass
class RoundSettings:
    budget_ms: float
    deadline_ms: float
    timing: RoundTiming | None  # None: both were given, nothing was measured
    note: str  # one line for the CLI: what was measured and what follows from it

    @property
    def round_costs_s(self) -> dict[int, float] | None:
        return dict(self.timing.by_k) if self.timing else None


def round_settings(spec: dict, prompt: list[int], k_max: int, budget_ms: float | None = None,
                   deadline_ms: float | None = None, requests: int = 1) -> RoundSettings:
    """The round budget and watchdog deadline for rounds to `spec`: each one given wins; what is not
    given follows a measurement (measure_rounds at depths 1 and k_max); a worker that cannot be measured
    leaves the fixed defaults (150 ms, 200 ms), said in the note."""
    from draftrelay.wire.client import WireError

    timing, failed = None, ""
    if budget_ms is None or deadline_ms is None:
        try:
            timing = measure_rounds(spec, prompt, [1, max(1, k_max)], requests=requests)
        except WireError as exc:
            failed = f" (not measured: {exc}; the fixed default)"
    if budget_ms is None:
        budget_ms = timing.budget_ms(max(1, k_max)) if timing else 150.0
    if deadline_ms is None:
        deadline_ms = deadline_for(budget_ms)
    note = f"round budget {budget_ms:.0f} ms, deadline {deadline_ms:.0f} ms{failed}"
    if timing is not None:
        if requests > 1:
            note += f" ({requests} requests a round)"
        steady = ", ".join(f"k={k} {1e3 * v:.1f} ms" for k, v in sorted(timing.by_k.items()))
        note += f" (measured STEP: {steady}; prompt of {timing.prompt_tokens} tokens {1e3 * timing.prefill_s:.1f} ms)"
    return RoundSettings(float(budget_ms), float(deadline_ms), timing, note)
