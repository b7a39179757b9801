"""CPU threads of the target's forward: one thread or all of them, whichever the step clock says is faster.

On a CPU whose cores other processes also use (a local drafter worker, other jobs), a forward on two
OpenMP threads waits at every parallel region for the slower thread; when that thread's core is taken,
the wait is a scheduler time slice, hundreds of times per forward, and the waiting thread spins. On the
2-core development machine under a load average of 4-6, a 1.5B fp32 decode step took 1.26 s p50 on two
threads and 0.45 s on one, while on an idle machine two threads take 0.23 s against 0.42 s. Neither
count is right for both, and the load changes while a request decodes, so the engine measures.

Probes are not symmetric. On all threads, a rise of load shows in the steps themselves: they slow past
one thread's (older, lighter-loaded, so optimistic) average and the policy switches at once, with no
probe. So a probe of one thread from all threads only refreshes that average, and costs at most
`probe_cost_fewer` (1 %) of the time: on the idle 2-core VM a one-thread probe is 1.8-1.9 x a step, and
at the symmetric 5 % the probes alone took 5 % of a target-only decode (7-9 probes in 127 steps). On one
thread, a fall of load shows only in a probe of all threads (their average is the loaded one, pessimistic),
so those keep `probe_cost` (5 %).

The policy keeps, per (thread count, verify width), an exponential average of the forward's wall time.
Each step runs with the count whose average is lower at that width (for a width measured with only one
count, the ratio of the two counts at the other widths decides); every `probe_every` steps one forward
runs with the other count (less often where the other count is much slower: probes cost at most 5 % of
the time), so a change of load is seen within a few probes: a probe weighs more than an ordinary step
(the other count's average is otherwise many steps old), and one well below that average brings the
next probe forward. A change of count costs a
thread-pool resize (~1.5 ms), so the count is set only when it changes, and restored on close.

Thread counts change the order of floating-point reductions inside GEMMs (fp32 logits differ in the
last bits), as a change of verify width already does; greedy output depends on it only at exact ties.
"""

from __future__ import annotations

import math

import torch


class ThreadPolicy:
    """choose(width) before a forward, observe(width, seconds) after it; apply() sets torch's count."""

    def __init__(self, max_threads: int, probe_every: int = 12, alpha: float = 0.3, margin: float = 0.03,
                 probe_cost: float = 0.05, probe_alpha: float = 0.7, probe_cost_fewer: float = 0.01) -> None:
        if max_threads < 2:
            raise ValueError(f"ThreadPolicy: needs at least 2 threads to choose from, got {max_threads}")
        if probe_every < 2:
            raise ValueError(f"ThreadPolicy: probe_every must be >= 2, got {probe_every}")
        if not 0 < probe_cost_fewer <= probe_cost:
            raise ValueError(f"ThreadPolicy: probe_cost_fewer must be in (0, probe_cost = {probe_cost}], "
                             f"got {probe_cost_fewer}")
        self.options = (1, max_threads)
        self.probe_every, self.alpha, self.margin, self.probe_cost = probe_every, alpha, margin, probe_cost
        self.probe_cost_fewer = probe_cost_fewer
        self.probe_alpha = probe_alpha
        self.mean: dict[tuple[int, int], float] = {}
        self.best = max_threads  # torch's default until measured otherwise
        self.steps = 0
        self.chosen = {n: 0 for n in self.options}
        self.probes = 0
        self._n = 0  # the count this step runs with
        self._since_probe = 0
        self._soon = False  # the last probe ran well below its count's average: probe again at probe_every
        self.probing = False  # this step runs the other count (its time says nothing about the best one's)
        self._restore = torch.get_num_threads()

    def _ratio(self) -> float | None:
        """Geometric mean over widths measured with both counts of time(1 thread) / time(all)."""
        a, b = self.options
        logs = [math.log(self.mean[(a, w)] / self.mean[(b, w)]) for (n, w) in self.mean
                if n == a and (b, w) in self.mean]
        return math.exp(sum(logs) / len(logs)) if logs else None

    def faster(self, width: int) -> int:
        """The count expected to run a forward of this width faster (the current one on a near tie)."""
        a, b = self.options
        ta, tb = self.mean.get((a, width)), self.mean.get((b, width))
        if ta is not None and tb is not None:
            r = ta / tb
        else:
            r = self._ratio()
        if r is None:
            return self.best
        if r < 1 - self.margin:
            return a
        if r > 1 + self.margin:
            return b
        return self.best

    def interval(self, width: int) -> int:
        """Steps between probes: probe_every, or more where the other count is much slower, so that
        probing costs at most `probe_cost` of the time (a probe 2.8x slower: every 36 steps), and at most
        `probe_cost_fewer` where the probe is of fewer threads than the best (1.8x slower: every 80)."""
        a, b = self.options
        ta, tb = self.mean.get((a, width)), self.mean.get((b, width))
        r = ta / tb if ta is not None and tb is not None else self._ratio()
        if r is None or self._soon:
            return self.probe_every
        slow = max(r, 1 / r)
        cost = self.probe_cost_fewer if self.best == b else self.probe_cost
        return max(self.probe_every, math.ceil((slow - 1) / cost))

    def choose(self, width: int) -> int:
        self.steps += 1
        self.best = self.faster(width)
        a, b = self.options
        other = b if self.best == a else a
        # explore the other count at once where nothing compares them yet, then every probe_every steps
        self._since_probe += 1
        if self._ratio() is None:
            # no width measured with both counts yet: the other count once anywhere, then where this
            # width has the best count's time already (that pair is the ratio). Probing every new width
            # instead ran the depth policy's first verifies (widths 7, 1, 2, 3: each new) all on one
            # thread, the 7-wide one 1.7x slower, none of them timed for the depth policy
            seen = any(n == other for n, _ in self.mean)
            explore = not seen or (self.best, width) in self.mean and (other, width) not in self.mean
        else:
            explore = False
        if explore or self._since_probe >= self.interval(width):
            n = other
            self.probes += 1
            self._since_probe = 0
            self._soon = False
        else:
            n = self.best
        self.chosen[n] += 1
        self._n = n
        self.probing = n != self.best
        return n

    def apply(self, n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def observe(self, width: int, seconds: float) -> None:
        """A probe weighs more than a step of the count in use (probe_alpha): the other count is measured
        only every few dozen steps, so with the usual weight one slow probe under a passing load would keep
        it off for several probes, hundreds of steps, after the load has gone. A probe well below its
        count's average (the load fell) brings the next probe forward to probe_every steps."""
        key = (self._n or self.best, width)
        old = self.mean.get(key)
        a = self.probe_alpha if self.probing else self.alpha
        self.mean[key] = seconds if old is None else old + a * (seconds - old)
        if self.probing and old is not None and seconds < 0.8 * old:
            self._soon = True

    def restore(self) -> None:
        self.apply(self._restore)

    def summary(self) -> dict:
        return {"chosen": {str(n): c for n, c in self.chosen.items()}, "probes": self.probes,
                "forward_ms": {f"{n}@{w}": round(1e3 * v, 1) for (n, w), v in sorted(self.mean.items())}}
