"""Draft depth: how many drafts to ask for this step, from measured costs and running acceptance.

A step at depth k costs round(k) + verify(k + 1) + the host's share h, and yields 1 + E[kept | k]
tokens per request; a step at depth 0 is a plain decode, verify(1) + h, one token. The policy picks
the k in 0..k_max with the highest expected tokens per second:

    rate(k) = (1 + s * sum_{i<k} prod_{j<=i} p_j) / (round(k) + verify(k + 1) + h)      rate(0) = 1 / (verify(1) + h)

p_j is the conditional acceptance at position j (the draft at j is kept given all before it were),
s the share of rounds that came back at all (a timed-out round costs its time and gives nothing).
Speculating has to beat rate(0) by `min_gain` (noise margin), else the step is a plain decode; while
at 0, a probe (a round at the best positive depth or its neighbour) refreshes the acceptance and the
round cost, so speculation comes back when the text gets easier or the drafter faster. A probe after
plain steps first catches the drafter up on every token it missed, a round the round curve does not
take (it prefills), so the probe runs its depth once more and that round is timed; the gap to the
next probe starts at `probe_every` steps and doubles (up to `probe_max`) with every probe that finds
speculation still not paying, so probing costs little where it never pays; the acceptance counts fade
at depth 0 (`idle_decay` per plain step) so that a probe's news is not outweighed by old text.

Costs are running estimates from the engine's own step clock, each a scale times a shape
(`ScaledCurve`): every measurement moves the scale (the machine's current speed: a shared CPU's load
moves all depths alike), and the relative cost of its depth or width slowly; the shape is
non-decreasing, interpolated between measured points and a least-squares line beyond them (both are
close to linear in k on CPU and GPU alike). While speculating, every `refresh_every` steps one step
runs at the best depth's neighbour (best - 1 or best + 1) measured longer ago, so the depths the choice
is between never keep a cost that one bad measurement gave them, and no step pays for a far one; when
the best depth is within `close` of a plain decode, every other refresh is a plain step instead.
Until the width-1 verify and a second width have been timed, and a round at two depths (unless
`round_costs` seeded them: engine/calibrate.py measures the worker before decoding), the policy explores
those first; the deepest step is tried once among them (on a CPU it costs several plain steps), and
every other probe at depth 0 asks a neighbour of the best depth instead of the best one.
One depth serves the whole batch (the verify is as wide as its longest draft), and costs are kept by
depth and width only: a change of batch size moves them, and the running averages follow within a
few steps. Acceptance counts decay per round (`decay`), so the estimate follows the text it is drafting; a
position not tried yet is estimated from the one before it (shrunk toward it with `prior_weight`).

With the worker's confidence stop (EngineConfig.draft_stop) k is a cap: a round drafts m <= k, ending
after the first draft the drafter is unsure of. Rounds are then timed at the m they drafted, a position
the stop never offered is no rejection there (Acceptance.offer: offered given all before it kept), and a
cap's cost is averaged over the m it drafts (Acceptance.drafted_dist, from how often the drafter went on
after each position); without the stop every asked draft comes back and the model is the plain one. A
drafter that computes every asked draft whatever the stop returns (CUDA graphs and static steps, TP2,
replay) costs round(k) for any m: DepthConfig.fixed_rounds books its rounds at k and prices a cap at
round(k) + verify(m + 1), averaged over m (EngineConfig.fixed_rounds; `generate` sets it from the worker's
HELLO_OK, wire.protocol.HELLO_OK_FIXED_ROUNDS).

Greedy output never depends on k (a kept draft equals the target's own argmax), so the policy changes
speed only; with sampling, rejection sampling is lossless at every k too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class CostCurve:
    """Seconds as a function of a small integer x (a depth or a width), never falling with x: an
    exponential average per measured x, made non-decreasing over the measured points (pool adjacent
    violators: on a loaded CPU a 2-wide verify can average below a 1-wide one, and a curve that falls
    would call a deeper step cheaper), interpolated between them and extended by a least-squares line
    beyond them."""

    def __init__(self, alpha: float = 0.25) -> None:
        self.alpha = alpha
        self.mean: dict[int, float] = {}

    def add(self, x: int, seconds: float) -> None:
        old = self.mean.get(x)
        self.mean[x] = seconds if old is None else old + self.alpha * (seconds - old)

    def known(self, x: int) -> bool:
        return x in self.mean

    def fitted(self) -> tuple[list[int], list[float]]:
        """The measured xs and their non-decreasing fit."""
        xs = sorted(self.mean)
        blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
        for x in xs:
            blocks.append([self.mean[x], 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        return xs, [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]

    def __call__(self, x: int) -> float | None:
        if not self.mean:
            return None
        xs, ys = self.fitted()
        if x in self.mean:
            return ys[xs.index(x)]
        if len(xs) < 2:
            return None
        if xs[0] < x < xs[-1]:
            return float(np.interp(x, xs, ys))
        slope, icpt = np.polyfit(np.array(xs, float), np.array(ys), 1)
        slope = max(float(slope), 0.0)
        if x > xs[-1]:
            return max(float(icpt + slope * x), ys[-1])
        return max(min(float(icpt + slope * x), ys[0]), 1e-9)


class ScaledCurve:
    """cost(x) = scale * shape(x): the machine's current speed (`scale`, updated by every measurement at
    any x) times the relative cost of x (`shape`, a CostCurve normalised to 1 at the first x measured,
    each other x the median of its last few relative measurements).
    The load of a shared CPU moves every depth's and width's cost together; a policy that sits at one
    depth measures only that one, so with a plain average per x the costs of the others stay whatever
    they were when last measured (an outlier measured once at the deepest width kept it off for good).
    Here a measurement at x moves the scale for all of them, and the shape only slowly."""

    def __init__(self, alpha: float = 0.25, shape_alpha: float = 0.1, down_alpha: float | None = None) -> None:
        self.alpha, self.down_alpha = alpha, alpha if down_alpha is None else max(alpha, down_alpha)
        self.shape = CostCurve(shape_alpha)
        self.scale: float | None = None
        self.ref: int | None = None
        # the last round(1 / shape_alpha) relative costs of each x: its shape is their median
        self.window = max(1, round(1 / shape_alpha))
        self._rel: dict[int, list[float]] = {}

    def add(self, x: int, seconds: float) -> None:
        if self.ref is None:
            self.ref, self.scale = x, seconds
            self.shape.mean[x] = 1.0
            return
        rel = self.shape(x)
        if rel is not None:
            # down_alpha (the round curve's): a load spike only ever makes a measurement slower, so one
            # below the estimate may be believed at once and one above it only slowly
            target = seconds / rel
            a = self.alpha if target >= self.scale else self.down_alpha
            self.scale += a * (target - self.scale)
        if x != self.ref:
            # a median, not an exponential average: a load spike during a measurement only ever makes
            # it slower, and the average kept one such outlier (a 2-wide verify timed at 3x a 1-wide one
            # during exploration) for dozens of measurements, speculation off meanwhile; the median
            # halves it at the second measurement and drops it at the third
            r = self._rel.setdefault(x, [])
            r.append(seconds / self.scale)
            del r[:-self.window]
            self.shape.mean[x] = float(np.median(r))

    def known(self, x: int) -> bool:
        return self.shape.known(x)

    def __call__(self, x: int) -> float | None:
        rel = self.shape(x)
        return None if rel is None or self.scale is None else self.scale * rel

    @property
    def mean(self) -> dict[int, float]:
        """The current estimate at every measured x."""
        return {x: self(x) for x in self.shape.mean}


class Acceptance:
    """Decayed per-position counts of the rounds of a request:
      tries[j]  position j was offered with every draft before it kept; hits[j]  it was kept too
      reach[j]  every draft before j was kept and the round asked for j (offered or not: the confidence
                stop may have ended the round before it, which is no rejection at j)
      at[j]     position j was drafted and the round asked for j + 1; go[j]  position j + 1 was drafted too
    so p_j = hits/tries (kept, given offered), o_j = tries/reach (offered, given all before it kept) and
    c_j = go/at (the drafter went on after j, kept or not: it sets what the round and the verify cost).
    Without the confidence stop every asked draft comes back: o = c = 1, and the model is the plain one."""

    def __init__(self, k_max: int, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.97,
                 deep_decay: float | None = None) -> None:
        self.tries = np.zeros(k_max)
        self.hits = np.zeros(k_max)
        self.reach = np.zeros(k_max)
        self.at = np.zeros(k_max)
        self.go = np.zeros(k_max)
        self.prior, self.w, self.decay = prior, prior_weight, decay
        # positions after the first decay faster (decay ** 2 per round: the last ~16 rounds): they are
        # judged only in rounds deep enough to reach them, so after a change of text (code, then prose)
        # the old text's counts there outweighed the new one's for dozens of rounds (a policy that
        # mostly asks 1 draft on prose kept position 1 at code's 0.7 against the 0.46 it kept), and
        # the depth chosen was one too deep; a faded position borrows the one before it (`_chain`)
        self.deep_decay = decay ** 2 if deep_decay is None else deep_decay
        self.rounds = 0.0
        self.answered = 0.0

    def add(self, asked: int, offered: int, kept: int) -> None:
        """One request's round: `asked` drafts wanted, `offered` came back, `kept` were accepted."""
        if asked <= 0:
            return
        for a in (self.tries, self.hits, self.reach, self.at, self.go):
            a *= self.decay
            a[1:] *= self.deep_decay / self.decay if self.decay else 0.0
        self.rounds = self.rounds * self.decay + 1
        self.answered = self.answered * self.decay + (offered > 0)
        L = len(self.tries)
        n = min(offered, L)
        reached = min(kept + 1, n)  # positions 0..kept were judged (kept + 1-th rejected, if offered)
        self.tries[:reached] += 1
        self.hits[:min(kept, n)] += 1
        if offered > 0:  # a failed round says nothing about where the drafter stops
            self.reach[:min(kept + 1, asked, L)] += 1
            self.at[:min(offered, asked - 1, L)] += 1
            self.go[:min(offered - 1, L)] += 1

    def fade(self, factor: float) -> None:
        """Every count times `factor` (a step with no round: the evidence ages all the same)."""
        for a in (self.tries, self.hits, self.reach, self.at, self.go):
            a *= factor
        self.rounds *= factor
        self.answered *= factor

    def _chain(self, num: np.ndarray, den: np.ndarray, start: float) -> np.ndarray:
        """num/den at every position, each shrunk toward the one before it (position 0: toward start)."""
        out = np.empty(len(num))
        q = start
        for j in range(len(out)):
            q = (num[j] + self.w * q) / (den[j] + self.w)
            out[j] = q
        return out

    def cond(self) -> np.ndarray:
        """p_j for every position, each shrunk toward the one before it (position 0: toward the prior)."""
        return self._chain(self.hits, self.tries, self.prior)

    def offer(self) -> np.ndarray:
        """o_j: position j is offered, given every draft before it was kept (1 without the confidence stop)."""
        return self._chain(self.tries, self.reach, 1.0)

    def cont(self) -> np.ndarray:
        """c_j: the drafter drafts position j + 1 after position j when asked to (1 without the stop)."""
        return self._chain(self.go, self.at, 1.0)

    def success(self) -> float:
        """The share of rounds that brought drafts (a failed or late round brings none)."""
        return (self.answered + self.w) / (self.rounds + self.w)

    def expected_kept(self, k: int, kept_if_offered: np.ndarray | None = None) -> float:
        """kept_if_offered: cond() * offer(), when the caller has it for every position already."""
        if k <= 0:
            return 0.0
        co = self.cond() * self.offer() if kept_if_offered is None else kept_if_offered
        return self.success() * float(np.cumprod(co[:k]).sum())

    def drafted_dist(self, k: int, cont: np.ndarray | None = None) -> np.ndarray:
        """P(the round drafts m) for m = 1..k at a cap of k (index m - 1): all mass at k without the stop.
        cont: cont(), when the caller has it already."""
        if k <= 0:
            return np.zeros(0)
        c = self.cont() if cont is None else cont
        surv = np.concatenate(([1.0], np.cumprod(c[:k - 1])))  # P(m >= i) for i = 1..k
        return surv - np.concatenate((surv[1:], [0.0]))


@dataclass
class DepthConfig:
    probe_every: int = 16  # steps at depth 0 before the first probe (and after speculation paid again)
    probe_max: int = 128  # the longest gap: every probe that still finds speculation not paying doubles it
    close: float = 1.25  # the best depth within this factor of a plain decode: every other refresh is plain
    round_down_alpha: float = 0.75  # the round cost's scale follows a measurement below it this fast
    refresh_every: int = 24  # steps at a positive depth between refreshes of the longest-unmeasured depth
    min_gain: float = 1.03  # speculate only when its expected rate beats a plain decode by this factor
    prior: float = 0.6  # acceptance assumed at a position before any round reached it
    prior_weight: float = 2.0
    decay: float = 0.97  # per round: the acceptance estimate follows the last ~30 rounds
    idle_decay: float = 0.99  # per plain step: at depth 0 the text moves on while no round measures it
    catch_up_tokens: int = 0  # rounds sending more tokens than this are not timed (0: k_max + 2)
    # the drafter computes every draft a round asks whatever the confidence stop returns (a static or graph
    # drafter, TP2, replay: worker/drafters.py): a round asking k costs round(k) however few drafts come back,
    # so rounds are booked at k and a cap's step costs round(k) + verify(m + 1), averaged over the m it drafts
    fixed_rounds: bool = False


class DepthPolicy:
    """choose() before each step; observe_*() after it, with what the engine measured."""

    def __init__(self, k_max: int, cfg: DepthConfig | None = None, round_costs: dict[int, float] | None = None) -> None:
        if k_max < 1:
            raise ValueError(f"DepthPolicy: k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self.cfg = cfg or DepthConfig()
        # rounds move down fast: a policy at depth 0 times one round per probe, and a round cost a load
        # spike had inflated 4x took a dozen probes (hundreds of plain steps) to come down at alpha alone
        self.round = ScaledCurve(down_alpha=self.cfg.round_down_alpha)
        self.verify = ScaledCurve()
        self.host = CostCurve()
        self.acc = Acceptance(k_max, self.cfg.prior, self.cfg.prior_weight, self.cfg.decay)
        for k, s in sorted((round_costs or {}).items()):
            if 0 < int(k) <= k_max:
                self.round.add(int(k), float(s))
        self._at_zero = 0  # consecutive steps chosen at depth 0
        self._gap = self.cfg.probe_every  # steps at depth 0 before the next probe
        self._probe_k = 0  # depth of the probe round of the last step (0: it was no probe)
        self._retime = 0  # the probe's round went untimed (a catch-up): this depth once more, timed
        self._plain_turn = False  # the next close-call refresh is a plain step
        self._explore_left = 6  # exploring steps allowed (failed rounds time no verify width)
        self._deep_tried = False  # the k_max step of the exploration has run
        self.chosen: dict[int, int] = {}  # depth -> steps (metrics)
        self.probes = 0
        self.refreshes = 0
        self._steps = 0
        self._since_refresh = 0
        self._seen: dict[int, int] = {}  # verify width -> the step it was last measured

    # -- the decision ------------------------------------------------------------------------------
    def _explore(self) -> int | None:
        """A depth whose cost the model cannot estimate yet, if any (a few steps at most: rounds that
        fail bring no drafts, so their verify width stays unmeasured)."""
        if self._explore_left <= 0:
            return None
        k = None
        if not self.verify.known(self.k_max + 1) and not self._deep_tried:
            # once: on a CPU the deepest step costs several plain ones (a 7-wide verify on top of a
            # 6-draft round), and a step whose verify was not timed (a failed round, a thread probe)
            # would repeat it; the line through the narrower widths stands in for it meanwhile
            k, self._deep_tried = self.k_max, True
        elif not self.verify.known(1):
            k = 0
        elif self.verify(2) is None:  # one width timed: the cheapest second one gives the line
            k = 1
        elif self.round(1) is None:  # one round depth timed: a second one gives the line
            k = 1 if not self.round.known(1) else self.k_max
        if k is not None:
            self._explore_left -= 1
        return k

    def rates(self) -> list[float]:
        """Expected tokens per second at each depth 0..k_max (0.0 where not estimable). With the confidence
        stop, depth k is a cap: the round drafts m <= k (Acceptance.drafted_dist) and the step costs
        round(m) + verify(m + 1), averaged over m; round(k) + verify(m + 1) with fixed_rounds."""
        h = self.host(0) or 0.0
        v1 = self.verify(1)
        out = [1.0 / (v1 + h) if v1 is not None else 0.0]
        rounds = [None] + [self.round(m) for m in range(1, self.k_max + 1)]
        verifies = [None] + [self.verify(m + 1) for m in range(1, self.k_max + 1)]
        # the acceptance chains once per call, not once per depth (each is a loop over every position)
        co, cont = self.acc.cond() * self.acc.offer(), self.acc.cont()
        for k in range(1, self.k_max + 1):
            dist = self.acc.drafted_dist(k, cont)
            cost = 0.0
            for m in range(1, k + 1):
                if dist[m - 1] <= 1e-9:
                    continue
                r = rounds[k] if self.cfg.fixed_rounds else rounds[m]
                if r is None or verifies[m] is None:
                    cost = None
                    break
                cost += dist[m - 1] * (r + verifies[m])
            out.append(0.0 if cost is None else (1.0 + self.acc.expected_kept(k, co)) / (cost + h))
        return out

    def best_hidden(self, k_cap: int) -> int:
        """The depth 1..k_cap with the most expected tokens per second where the round costs nothing (a
        speculation-cache step: its round was drafted during the last verify), among the depths whose verify
        width has been timed; k_cap where none has. On a CPU a verify's cost grows with its width (on one
        core of the Intel VM a 7-wide verify of the 1.5B target cost 2.2x a 3-wide one), so on text the
        drafter predicts poorly a cache step of k_cap drafts verifies many positions for few tokens."""
        h = self.host(0) or 0.0
        co = self.acc.cond() * self.acc.offer()
        best, rate = k_cap, -1.0
        for k in range(1, min(k_cap, self.k_max) + 1):
            v = self.verify(k + 1)
            if v is None:
                continue
            r = (1.0 + self.acc.expected_kept(k, co)) / (v + h)
            if r > rate:
                best, rate = k, r
        return best

    def choose(self) -> int:
        self._steps += 1
        probe = 0
        k = None
        if self._retime:
            # the probe's second half: after `_gap` plain steps its first round carried every token the
            # drafter missed (a catch-up, which the round curve does not take: it prefills), so without
            # this step a policy at depth 0 never timed a round again, and a round cost inflated by a
            # load spike kept it at 0 for good
            k = probe = self._retime
            self._retime = 0
        if k is None:
            k = self._explore()
        if k is None:
            rates = self.rates()
            best = 1 + int(np.argmax(rates[1:])) if max(rates[1:]) > 0 else self.k_max
            if rates[best] >= self.cfg.min_gain * rates[0]:
                k = best
                self._gap = self.cfg.probe_every
                self._since_refresh += 1
                if self._since_refresh >= self.cfg.refresh_every:  # re-measure a neighbour of the best
                    # only best - 1 and best + 1: the shared scale keeps every depth's cost current, and
                    # a depth can become the best only through its neighbours; a refresh far away (k_max
                    # while 2 is best) cost a wide verify and a long round for nothing
                    k = self._stale_neighbour(best)
                    if rates[best] < self.cfg.close * rates[0]:
                        # a close call: every other refresh is a plain step, whose cost is otherwise
                        # timed only at the start and in failed rounds (a 1-wide verify kept at 218 ms
                        # while the machine ran it in 205 made k = 2 look 7 % better than a plain
                        # decode on prose, where it was 3 % worse); it costs next to nothing there
                        k = 0 if self._plain_turn else k
                        self._plain_turn = not self._plain_turn
                    self._since_refresh = 0
                    self.refreshes += 1
            elif self._at_zero >= self._gap:
                k = probe = best
                self.probes += 1
                # each probe that finds speculation still not paying doubles the gap to the next (up to
                # probe_max): a probe costs a round, a catch-up of every token the drafter missed and a
                # wider verify, a few plain steps' worth where nothing is kept
                self._gap = min(self.cfg.probe_max, 2 * self._gap)
                if self.probes % 2 == 0:  # every other probe at a neighbour of the best: its cost and
                    # acceptance are otherwise only interpolated (a round line through k = 1 and k_max
                    # put a 2-draft round at 1.6x its cost, and the probes kept asking k = 1)
                    k = probe = self._stale_neighbour(best)
            else:
                k = 0
        self._probe_k = probe
        self._at_zero = self._at_zero + 1 if k == 0 else 0
        if k == 0 and self._at_zero > 1:
            # the acceptance counts fade while no round brings news (not on a single plain refresh): after
            # a long stretch at depth 0 what a probe finds weighs more than the rounds long before it
            self.acc.fade(self.cfg.idle_decay)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def _stale_neighbour(self, best: int) -> int:
        """best - 1 or best + 1 (within 1..k_max; best itself when neither is), whichever verify width
        was measured longer ago."""
        near = [d for d in (best - 1, best + 1) if 1 <= d <= self.k_max] or [best]
        return min(near, key=lambda d: self._seen.get(d + 1, -1))

    # -- what the step measured -------------------------------------------------------------------------
    def observe_round(self, k: int, seconds: float, sent_tokens: int, drafted: int = 0) -> None:
        """A round asking depth k took `seconds` of the engine's time (submit + wait). drafted: the most
        drafts it brought a request (the confidence stop may end it before k): its cost is that depth's;
        0 (a failed round) books it at k."""
        limit = self.cfg.catch_up_tokens or self.k_max + 2
        d = drafted if 0 < drafted <= k and not self.cfg.fixed_rounds else k
        if sent_tokens > limit:  # a catch-up round also prefills: not a depth cost
            if self._probe_k == k and drafted > 0:
                self._retime = k  # time the probe's depth on the next step
            return
        if drafted <= 0 and self.round(d) is not None and seconds < self.round(d):
            return  # a round that failed fast (a refusal, a disconnect) says nothing about what one costs
        if 0 < d <= self.k_max:
            self.round.add(d, seconds)

    def observe_verify(self, width: int, seconds: float) -> None:
        self.verify.add(width, seconds)
        self._seen[width] = self._steps

    def observe_host(self, seconds: float) -> None:
        self.host.add(0, seconds)

    def observe_accept(self, asked: int, offered: int, kept: int) -> None:
        self.acc.add(asked, offered, kept)

    def summary(self) -> dict:
        """For metrics: depths chosen, probes, and the model's current view."""
        rates = self.rates()
        return {"chosen": dict(sorted(self.chosen.items())), "probes": self.probes, "refreshes": self.refreshes,
                "accept_cond_by_pos": [round(float(x), 3) for x in self.acc.cond()],
                "offered_by_pos": [round(float(x), 3) for x in self.acc.offer()],
                "drafted_on_by_pos": [round(float(x), 3) for x in self.acc.cont()],
                "round_success": round(self.acc.success(), 3),
                "round_ms_by_k": {k: round(1e3 * v, 2) for k, v in sorted(self.round.mean.items())},
                "verify_ms_by_width": {t: round(1e3 * v, 2) for t, v in sorted(self.verify.mean.items())},
                "expected_tok_per_s_by_k": [round(r, 2) for r in rates]}


def batch_bucket(n: int) -> int:
    """The batch-size class a step's costs are kept under: 1, 2, 4, 8, ... (the smallest power of
    two >= n). A verify's cost and a round's grow with the batch; within one class they differ
    little, and every class has to learn its own costs before it can decide."""
    b = 1
    while b < n:
        b *= 2
    return b


class StepRates:
    """Measured output per second of a batch class's plain steps and speculative ones, as the server
    sees them: wall seconds of a whole step (round, verify, acceptance and the server's own work
    around it) and the tokens it gave each row. Exponential averages of both; a rate is known after
    `min_steps` steps of its kind."""

    def __init__(self, alpha: float = 0.2, min_steps: int = 3) -> None:
        self.alpha, self.min_steps = alpha, min_steps
        self.sec = {False: 0.0, True: 0.0}
        self.tok = {False: 0.0, True: 0.0}
        self.n = {False: 0, True: 0}

    def add(self, spec: bool, seconds: float, tokens_per_row: float) -> None:
        a = 1.0 if self.n[spec] == 0 else self.alpha
        self.sec[spec] += a * (seconds - self.sec[spec])
        self.tok[spec] += a * (tokens_per_row - self.tok[spec])
        self.n[spec] += 1

    def rate(self, spec: bool) -> float | None:
        if self.n[spec] < self.min_steps or self.sec[spec] <= 0:
            return None
        return self.tok[spec] / self.sec[spec]


class BatchDepthPolicy:
    """Speculate at k_max or not at all, decided per batch-size class (batch_bucket) by the output
    rates the server measures; the DepthPolicy interface (choose, observe_*, summary) plus `batch`
    (the running batch's size) and `catch_up` (a request in the batch has not been sent to the
    drafter yet), both set before each choose(), and observe_step(), the whole step's wall time and
    tokens per row, reported after it.

    Why not one DepthPolicy: it keeps costs by depth and width only, so under a server's changing
    batch it judges each batch by another batch's costs; it times only steady rounds, and a round
    after plain steps carries the tokens the drafter missed (catch-up), so once it sits at depth 0
    its probe rounds are never timed and it cannot come back; and depths below k_max ask a worker
    for draft-step shapes it did not capture at start (a capture inside a round outlasts its
    deadline). Here each class keeps the measured rate (tokens per row per wall second of the whole
    step: rounds, verify, and the server's own work around them, StepRates) of its plain steps and
    of its steady speculative steps: a speculative step that follows a plain one or carries a new
    request is a catch-up step and is not counted. Speculation runs where it measures at least
    `margin` times the plain rate and steps aside where it does not; a probe of `probe_len`
    speculative steps every `probe_every` plain ones, and a plain step every `plain_every`
    speculative ones, keep both rates current. A class starts speculating (its rate is measured
    first), then takes plain steps until that rate is measured too."""

    def __init__(self, k_max: int, margin: float = 1.0, probe_every: int = 16, probe_len: int = 3,
                 plain_every: int = 32) -> None:
        if k_max < 1:
            raise ValueError(f"BatchDepthPolicy: k_max must be >= 1, got {k_max}")
        if probe_len < 2:
            raise ValueError(f"BatchDepthPolicy: probe_len must be >= 2 (its first step catches up), got {probe_len}")
        self.k_max, self.margin = k_max, margin
        self.probe_every, self.probe_len, self.plain_every = probe_every, probe_len, plain_every
        self.rates: dict[int, StepRates] = {}
        self.chosen: dict[int, dict[int, int]] = {}
        self.probes: dict[int, int] = {}
        self._run: dict[int, int] = {}  # steps of the current kind in a row, per class
        self._probe_left = 0
        self.batch = 1
        self.catch_up = False
        self.last_k = 0
        self._counted = False  # whether the last step's measurement is a steady one
        self.acc = Acceptance(k_max)

    @property
    def bucket(self) -> int:
        return batch_bucket(max(1, self.batch))

    def choose(self) -> int:
        b = self.bucket
        if b not in self.rates:
            self.rates[b], self.chosen[b], self.probes[b], self._run[b] = StepRates(), {}, 0, 0
        r = self.rates[b]
        plain, spec = r.rate(False), r.rate(True)
        if spec is None and r.n[False] == 0 or spec is None and plain is not None:
            k = self.k_max  # measure speculation first (and again if its rate went unknown)
        elif plain is None:
            k = 0
        elif self._probe_left > 0:
            k = self.k_max
            self._probe_left -= 1
        elif spec >= self.margin * plain:
            k = 0 if self.last_k and self._run[b] >= self.plain_every else self.k_max
        elif not self.last_k and self._run[b] >= self.probe_every:
            k = self.k_max
            self._probe_left = self.probe_len - 1
            self.probes[b] += 1
        else:
            k = 0
        # a speculative step after a plain one (the drafter catches up on what it missed) or with a
        # request the drafter has not seen (its prompt) is not a steady step
        self._counted = not (k and (not self.last_k or self.catch_up))
        if k and not self._counted and r.n[True] < r.min_steps and self.chosen[b].get(k, 0) >= 16:
            self._counted = True  # new requests at every step: a rate from catch-up steps beats none
        self._run[b] = self._run[b] + 1 if bool(k) == bool(self.last_k) else 1
        self.last_k = k
        self.chosen[b][k] = self.chosen[b].get(k, 0) + 1
        return k

    def observe_step(self, seconds: float, tokens_per_row: float) -> None:
        """The last chosen step's wall time and the tokens it gave each row on average."""
        if self._counted and seconds > 0 and tokens_per_row > 0:
            self.rates[self.bucket].add(self.last_k > 0, seconds, tokens_per_row)

    # the engine's per-part reports: this policy judges whole steps (observe_step)
    def observe_round(self, k: int, seconds: float, sent_tokens: int, drafted: int = 0) -> None:
        pass

    def observe_verify(self, width: int, seconds: float) -> None:
        pass

    def observe_host(self, seconds: float) -> None:
        pass

    def observe_accept(self, asked: int, offered: int, kept: int) -> None:
        self.acc.add(asked, offered, kept)

    def summary(self) -> dict:
        """Per batch class: depths chosen, probes, the measured plain and speculative rates (tokens per
        row per second) and how many steps each rests on; the acceptance seen."""
        out = {}
        for b in sorted(self.rates):
            r = self.rates[b]
            out[b] = {"chosen": dict(sorted(self.chosen[b].items())), "probes": self.probes[b],
                      "measured_tok_per_s": {"plain": r.rate(False), "spec": r.rate(True)},
                      "measured_steps": {"plain": r.n[False], "spec": r.n[True]}}
        return {"by_batch": out, "accept_cond_by_pos": [round(float(x), 3) for x in self.acc.cond()],
                "round_success": round(self.acc.success(), 3)}
