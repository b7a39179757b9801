"""Whether the speculation cache pays, measured per batch-size class, and at which fan-out.

The cache pays where the drafter works beside the verify on hardware of its own: then a step on a hit
costs max(verify, drafter STEP) instead of round + verify. Where the drafter shares what the verify
runs on (a worker on the engine's GPU: the two time-slice it; a small CPU: they share its cores and
memory bandwidth) or where the branch step grows too big (batch x F rows per drafter step), a cache
step is slower than a sequential one. The guard measures that instead of assuming it.

Choices ("arms", `Arm`) per step: a fan-out F from `arms` (the configured F and, by default, half of it)
at a depth from `depths` (the drafts a cache step asks: by default only the engine's k), or plain
sequential rounds (fan-out 0: the proxy then sends its STEPs without a fan-out, so the worker does no
branch work). Depths are a choice because a cache step's branch work grows with k (the worker drafts k
places of every branch row after a hit) while the verify it hides behind grows less: on the H200 at four
requests and F = 8, k = 3 ran 2.14 x target-only against 1.92 x at k = 4, one request faster at k = 4
(benchmarks/results/replay_headline_k3.json, replay_headline_k4.json). They are opt-in (depths=[None,
k - 1]): on that GPU's 128-token replay runs the extra probe cost more than a depth gained
(benchmarks/results/replay_headline_guard_depth2.json, docs/SPEC_CACHE.md).

Each batch-size class (depth.batch_bucket: 1, 2, 4, 8, ...) keeps its own measurements, since
the verify, the round and the branch step all grow with the batch:

  - a class starts at the largest F whose branch step stays within `max_rows` rows (batch class x F),
    or at 0 where the worker is known to share the engine's device (`start_plain`), and measures it
    for `window` steady steps; then the other of the two (0, or that F) for `window` steps: the first
    decision; then that F at each other depth, a probe each;
  - afterwards it runs its best choice, and every `interval` steady steps it probes one challenger for
    `window` steps: plain rounds (while the best is a fan-out) or a neighbour (the next F up or down in
    `arms` at the same depth, or the next depth at the same F; while the best is plain, the best-measured
    cache choice), whichever was measured longest ago. A probe that confirms the best doubles the
    interval (up to `max_interval`); a probe that changes it resets the interval to `probe_every`. So
    exploration is bounded: one window per interval, and the interval grows while nothing changes. A
    probe ends early, after `min_probe` booked steps, when the challenger measures slower than the best
    by more than `abort_ratio` (a sequential step at 1.6 x a cache step needs no full window to lose), so
    a clearly worse choice costs a few steps, not a window.

A fan-out must beat plain rounds by `margin` to be chosen (ties go to the sequential step, which costs the
worker nothing); one F replaces another only when it beats it by `margin` too.

Measured: tokens per second of whole decode steps (the engine's wall time from the start of a step to
the end of its verify and acceptance, so a step that settles the round a previous fast step left in flight
pays for it). Which tokens: with `pooled` (the default), greedy acceptance does not depend on where the
drafts come from (a hit's drafts are what the round would have returned), so every choice's rate is the
class's tokens per step over all recent steps divided by that choice's seconds per step: the text's
ups and downs then do not decide between choices measured a few steps apart. A shallower step yields
fewer tokens: the class's tokens per step at depth d are what each recent step would have yielded at d
(the caller's `by_depth`: a row that took g tokens at depth k takes min(g, d + 1) at d <= k), so the
depths too are compared on the same text, not on the few steps of a probe. Without it (the engine's
depth policy chooses k on the plain steps, or the "early" wait rule verifies some rows without drafts,
both of which change the tokens a step yields) each choice's own tokens count. Only steady steps count:
the `settle` steps after the fan-out changed (the STEP already out, and the table that follows it, were
asked with the old one) and steps in which a request catches up (its round carries more than k + 2
tokens: a prefill, not a step's cost) or none asks for drafts are not booked.

Greedy output never depends on the choice (the drafts of a hit are a just-in-time round's, and
sequential rounds are the engine's ordinary ones); only speed does.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import NamedTuple

from .depth import batch_bucket


class Arm(NamedTuple):
    """One choice of the guard: a fan-out (0: plain sequential rounds) and the depth its cache steps ask
    (None: the engine's k; plain rounds always None: the engine's own depth or its depth policy's)."""

    fanout: int
    depth: int | None = None

    @property
    def label(self) -> str:
        """Its name in metrics: "8" (F = 8 at the engine's k), "8@3" (at k = 3), "0" (plain rounds)."""
        return str(self.fanout) if self.depth is None else f"{self.fanout}@{self.depth}"


PLAIN = Arm(0)


class _Class:
    """One batch-size class's measurements and schedule."""

    def __init__(self, start: Arm, todo: list[Arm], window: int, interval: int, fit: Arm) -> None:
        self.best = start
        self.fit = fit  # the largest fan-out within the row budget, at the first depth
        self.todo = todo  # choices still to measure before the first decision
        # choice -> (tokens, {depth: tokens the step would have yielded at it}, seconds) of its last `window`
        # booked steps
        self.win: dict[Arm, deque] = {}
        self.window = window
        self.probe: Arm | None = None  # the challenger being measured
        self.probe_left = 0
        self.since = 0  # booked steps at the best since the last probe
        self.interval = interval
        self.booked = 0  # booked steps of the class
        self.last: dict[Arm, int] = {}  # choice -> `booked` when it was last measured
        self.chosen: Counter = Counter()  # choice -> steps (booked or not)
        self.measured: Counter = Counter()  # choice -> booked steps
        self.probes = 0
        self.decisions: list[Arm] = []  # the best after each probe

    def add(self, arm: Arm, tokens: float, by_depth: dict, seconds: float) -> None:
        self.win.setdefault(arm, deque(maxlen=self.window)).append((tokens, by_depth, seconds))
        self.booked += 1
        self.last[arm] = self.booked
        self.measured[arm] += 1

    def full(self, arm: Arm) -> bool:
        return len(self.win.get(arm, ())) >= self.window


class CacheGuard:
    def __init__(self, fanout: int, arms: list[int] | tuple[int, ...] | None = None,
                 depths: list[int | None] | tuple[int | None, ...] | None = None, window: int = 6,
                 probe_every: int = 32, max_interval: int = 512, margin: float = 0.03, settle: int = 1,
                 max_rows: int = 32, start_plain: bool = False, pooled: bool = True, min_probe: int = 2,
                 abort_ratio: float = 1.3) -> None:
        fans = sorted({int(a) for a in (arms if arms is not None else (fanout, fanout // 2)) if int(a) > 0})
        if not fans:
            raise ValueError(f"cache guard: needs at least one fan-out > 0 among its choices, got {arms!r}")
        # the depths a cache step may ask, the first one where a class starts (None: the engine's k)
        self.depths: list[int | None] = list(dict.fromkeys(depths)) if depths else [None]
        if any(d is not None and (not isinstance(d, int) or d < 1) for d in self.depths):
            raise ValueError(f"cache guard: depths must be None (the engine's k) or ints >= 1, got {depths!r}")
        if window < 1 or probe_every < 1 or max_interval < probe_every or settle < 0 or max_rows < 1:
            raise ValueError(f"cache guard: window {window}, probe_every {probe_every}, max_interval {max_interval}, "
                             f"settle {settle}, max_rows {max_rows}: need window, probe_every, max_rows >= 1, "
                             "max_interval >= probe_every and settle >= 0")
        if not margin >= 0:  # also refuses NaN
            raise ValueError(f"cache guard: margin must be >= 0, got {margin!r}")
        if min_probe < 1 or not abort_ratio >= 1:
            raise ValueError(f"cache guard: min_probe {min_probe} must be >= 1 and abort_ratio {abort_ratio!r} >= 1")
        self.min_probe, self.abort_ratio = min_probe, abort_ratio
        self.fans = fans  # ascending
        self.cache_arms = [Arm(f, d) for f in fans for d in self.depths]
        self.window, self.probe_every, self.max_interval = window, probe_every, max_interval
        self.margin, self.settle, self.max_rows = margin, settle, max_rows
        self.start_plain, self.pooled = start_plain, pooled
        self.classes: dict[int, _Class] = {}
        self.last_arm: Arm | None = None  # the choice of the step just made
        self._cls: _Class | None = None
        self._settle_left = 0
        self.switches = 0  # steps whose choice differs from the step before (the proxy's fan-out changed)

    @property
    def arms(self) -> list[Arm]:
        return [PLAIN] + self.cache_arms

    def _fit(self, bucket: int) -> Arm:
        """The largest fan-out whose branch step (bucket x F rows) stays within max_rows (else the smallest),
        at the first depth."""
        fits = [f for f in self.fans if bucket * f <= self.max_rows]
        return Arm(fits[-1] if fits else self.fans[0], self.depths[0])

    def _class(self, batch: int) -> _Class:
        b = batch_bucket(max(1, batch))
        c = self.classes.get(b)
        if c is None:
            f = self._fit(b)
            deeper = [Arm(f.fanout, d) for d in self.depths[1:]]  # its other depths, measured next
            start, todo = (PLAIN, [f, *deeper]) if self.start_plain else (f, [PLAIN, *deeper])
            c = self.classes[b] = _Class(start, todo, self.window, self.probe_every, f)
        return c

    # -- the decision ---------------------------------------------------------------------------------
    def choose(self, batch: int) -> Arm:
        """The choice for this step of `batch` requests (fan-out 0: a plain sequential step)."""
        c = self._cls = self._class(batch)
        arm = c.probe if c.probe is not None else c.best
        if self.last_arm is not None and arm != self.last_arm:
            self.switches += 1
            self._settle_left = self.settle
        self.last_arm = arm
        c.chosen[arm] += 1
        return arm

    def rate(self, c: _Class, arm: Arm) -> float | None:
        """Tokens per second of `arm` in class c (None: not measured)."""
        w = c.win.get(arm)
        if not w:
            return None
        sec = sum(s for *_, s in w) / len(w)
        if sec <= 0:
            return None
        if self.pooled:  # the class's tokens per step at this choice's depth, over every choice's recent steps
            steps = [by[arm.depth] for q in c.win.values() for _, by, _ in q if arm.depth in by]
            if steps:  # (none where the caller told no step's tokens at this depth: its own then)
                return (sum(steps) / len(steps)) / sec
        return (sum(t for t, *_ in w) / len(w)) / sec

    def _beats(self, c: _Class, a: Arm, b: Arm) -> bool:
        """Whether choice a measured faster than b by the margin (plain rounds win ties with a fan-out)."""
        ra, rb = self.rate(c, a), self.rate(c, b)
        if ra is None or rb is None:
            return False
        return ra > rb * (1 + self.margin)

    def _challenger(self, c: _Class) -> Arm:
        if c.todo:
            return c.todo.pop(0)
        if c.best == PLAIN:  # the best-measured cache choice (or the start one)
            known = [a for a in self.cache_arms if self.rate(c, a) is not None]
            return max(known, key=lambda a: self.rate(c, a)) if known else c.fit
        f, d = self.fans.index(c.best.fanout), self.depths.index(c.best.depth)
        near = [PLAIN] + [Arm(self.fans[j], c.best.depth) for j in (f - 1, f + 1) if 0 <= j < len(self.fans)]
        near += [Arm(c.best.fanout, self.depths[j]) for j in (d - 1, d + 1) if 0 <= j < len(self.depths)]
        return min(near, key=lambda a: c.last.get(a, -1))

    def _decide(self, c: _Class) -> None:
        """A probe ended: keep the best or switch to the challenger."""
        p, b = c.probe, c.best
        c.probe, c.since = None, 0
        if p == PLAIN:
            new = b if self._beats(c, b, PLAIN) else PLAIN
        elif b == PLAIN:
            new = p if self._beats(c, p, PLAIN) else PLAIN
        else:
            new = p if self._beats(c, p, b) else b
        c.interval = self.probe_every if new != b else min(2 * c.interval, self.max_interval)
        c.best = new
        c.probes += 1
        c.decisions.append(new)

    def observe(self, tokens: float, seconds: float, steady: bool = True, by_depth: dict | None = None) -> None:
        """The step just chosen: the tokens it gave (all its rows) and its wall seconds; steady: whether it
        is a step of the usual cost (see the module docstring); by_depth: {depth: the tokens it would have
        yielded at that depth} for the depths it can tell (its own and shallower ones)."""
        c, arm = self._cls, self.last_arm
        if c is None or arm is None:
            return
        if self._settle_left > 0:
            self._settle_left -= 1
            return
        if not steady or seconds <= 0:
            if arm == c.best and c.probe is None:
                # not measured, but the best's step all the same: where the plain steps' policy asks no
                # drafts for long (prose on a small CPU) the tables must still be probed again in time
                self._count_best(c)
            return
        # the tokens at each depth: the caller's (a step at depth k also tells what a shallower one would
        # have yielded, SpecCache._tokens_by_depth), else this step's own at its own depth
        c.add(arm, tokens, dict(by_depth) if by_depth is not None else {arm.depth: tokens}, seconds)
        if c.probe is not None and arm == c.probe:
            c.probe_left -= 1
            if c.probe_left <= 0 or self._clearly_slower(c):
                self._decide(c)
        elif arm == c.best:
            self._count_best(c)

    def _count_best(self, c: _Class) -> None:
        """One more step of the best choice: the next probe starts once the interval has passed."""
        c.since += 1
        if c.full(c.best) and (c.todo or c.since >= c.interval):
            c.probe = self._challenger(c)
            c.probe_left = self.window
            c.win.pop(c.probe, None)  # the probe decides on its own steps, not on ones measured long ago

    def _clearly_slower(self, c: _Class) -> bool:
        """Whether the probe has measured min_probe steps, all told slower than the best by abort_ratio."""
        if len(c.win.get(c.probe, ())) < self.min_probe:
            return False
        rp, rb = self.rate(c, c.probe), self.rate(c, c.best)
        return rp is not None and rb is not None and rp * self.abort_ratio < rb

    # -- metrics ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per batch class: the current choice, steps per choice (all and booked), the measured rates,
        probes and the decisions they led to; the switches of the proxy's fan-out overall. Choices by their
        labels (Arm.label)."""
        out = {}
        for b in sorted(self.classes):
            c = self.classes[b]
            out[b] = {"best": c.best.label, "probing": c.probe.label if c.probe is not None else None,
                      "chosen": {a.label: c.chosen[a] for a in sorted(c.chosen, key=self.arms.index)},
                      "measured_steps": {a.label: c.measured[a] for a in sorted(c.measured, key=self.arms.index)},
                      "tok_s": {a.label: round(r, 2) for a in self.arms if (r := self.rate(c, a)) is not None},
                      "probes": c.probes, "decisions": [a.label for a in c.decisions[-16:]],
                      "interval": c.interval}
        return {"arms": [a.label for a in self.arms], "by_batch": out, "switches": self.switches,
                "pooled": self.pooled,
                "window": self.window, "margin": self.margin, "abort_ratio": self.abort_ratio}

    def reset(self) -> None:
        """Forget every measurement (a new workload); the proxy's current fan-out stays as it is."""
        self.classes.clear()
        self._cls = None
        self._settle_left = self.settle
