"""The engine's half of the speculation cache: one decode step that can start its verify without
waiting for the round.

Sequential speculation: step N's round carries what step N-1 accepted, so the verify waits for the
round. With the cache the worker, right after answering round N-1, drafts round N for the likely
outcomes of verify N-1 (draftrelay.worker.prefetch) and the proxy writes that branch table into
shared memory (draftrelay.handoff.branch_shm) while verify N-1 runs. Step N then:

  1. settles the round of step N-1 if the engine did not wait for it (its result updates what the
     drafter holds: `synced`, generations, restarts, exactly as a waited-for round does);
  2. submits round N as usual (it carries the outcome of N-1 to the worker: its KV and the next
     table follow the true sequence), then looks up the table that followed the last round it
     collected (stamp = that round's stream round, current epoch, crc) and, per request, the branch
     whose prefix equals what the engine appended since the drafter's position (table.select);
  3. wait rule "all" (the default): a hit for every request that wants drafts: verify now with the
     branch drafts; round N stays in flight and is settled at the next step. Any miss: wait for round
     N and use its drafts, an ordinary round. Wait rule "rows": verify now if any request has drafts
     (a hit, or its round tail: see `_tail`), the others without. A table that has not arrived is
     waited for only while round N is not done (the proxy writes a table before it starts the next
     round, so after that it will not come). Wait rule "early": where the table is there before round N
     is submitted, the lookup comes first and round N asks each row what its verify takes (k drafts for
     a hit; none for a miss, which verifies without drafts and gets a k = 0 entry in the next table);
     else the step is an "all" step (`_decode_early`, WAIT_RULES).

A worker on the engine's GPU declines the cache (SHARED_GPU_REFUSAL). The guard (engine/cache_guard.py, on
by default) chooses per step and batch class between the fan-out, half of it and plain sequential rounds
(`_plain_step`: the engine's ordinary step on these rounds, the proxy's STEP without a fan-out), whichever
measures faster; `adapt=True` (class Adapt) is the older single probe of tables against none instead.

Host selection: rounds on the emulated stream, on a CPU or on a GPU (loading.handoff_config with
host_rounds=True: the drafts reach the engine on the host and are copied to the device with the verify's
other inputs). With CUDA rounds the same choice would be made on the device: the
table slot's bytes copied to device memory on the engine's stream right after the reply, a kernel
comparing each row's accepted tokens with the branch prefixes and gathering the matching branch's
drafts into the verify's input (the `drafts_from_reply` buffer), with a per-row hit flag the host
reads after the verify. `select_on_device` is that selection as tensor ops (tested on the CPU against the
host selection); the CUDA rounds do not use it yet (the proxy would write the dense layout, table.dense,
and the engine would enqueue the copy and the selection behind the reply), so with CUDA rounds the cache
stays off and says why (`refusal`); on a GPU it runs with host rounds.

Correctness: a branch is used only when request id, generation, base position and the whole prefix
match, which pins its drafts to the drafter's continuation of the true sequence; anything else
(absent, late, torn, stale stamp or epoch, bad crc, bad bytes) is a miss. Drafts are verified like any
others, so even a wrong table costs speed, never a token.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch

from draftrelay.handoff.branch_shm import TableShm
from draftrelay.round import StampedRounds, Status
from draftrelay.speculation import table as TB

from .cache_guard import CacheGuard
from .metrics import StepClock
from .verify import VerifyInputs

# how often a verify waiting for its table looks whether its round ended without one (it sleeps on the table
# memory's written word and wakes at once when a table lands, TableShm.wait_written): on a host whose
# hand-off polls (a GPU host: cores to spare) every 0.1 ms, else every 0.5 ms (a small CPU machine, where the
# worker and the proxy need the cores this thread would take). Asleep on the round instead, it would see a
# table only at its next look: 0.25 ms late on average at 0.5 ms, on the path of every hit.
POLL_S = 0.0005
POLL_S_BUSY = 0.0001
# F when the cache is switched on without one: the smallest fan-out above 80 % of outcomes at k = 4, on
# the tiny pair (83-84 %; benchmarks/results/spec_cache_cpu.json) and on the replayed Qwen2.5-Coder
# 0.5B -> 1.5B trace (83.0 %; 4: 73 %, 16: 89 %; benchmarks/results/replay_headline_cache.json); the
# worker's branch step grows with F
DEFAULT_FANOUT = 8
# when a step waits for its round: "all" (the default) when any request that asks for drafts missed;
# "rows" only when none has drafts (a hit or a round tail), so one miss does not hold back the rows that
# hit. Measured on the H200 at four requests (benchmarks/results/replay_headline_cache.json, short:4),
# "rows" is the slower one (0.54-0.56 x sync against 0.83-0.84 x): a step that does not wait still waits
# for the table, which comes after the worker's STEP (real drafting for every row that missed or took
# its tail) plus the branch work of all four rows, and its miss rows verify one token or k - 1 drafts
# "early": where the table is there when the step starts (or within table_wait_ms), it is looked up before
# round N is submitted, so each row's round asks what that row's verify will take: a row that hit asks its
# k drafts (the worker answers it from the branch), a row that missed asks none and verifies without drafts
# (its round carries its tokens; the next table has a k = 0 entry for it, branches over the target's one
# token); the step waits for its round only when no row hit. Where the table is not there yet (the worker
# is the longer chain), the step is an "all" step: round N goes out at once, so the worker takes it up right
# after the table, with no wait for the engine's lookup in its chain (on the shared 2-core CPU, looking up
# first and waiting for the table made every step slower: benchmarks/results/spec_cache_cpu.json)
WAIT_RULES = ("all", "rows", "early")
SHARED_GPU_REFUSAL = (
    "the worker shares the engine's GPU: its branch work runs during the verify and the two time-slice the "
    "GPU, so cache steps are slower than sequential ones (benchmarks/results/replay_headline_cache.json); "
    "spec_options shared_gpu=True runs it anyway")


class Adapt:
    """Whether tables pay, measured: `probe_steps` steps with tables, then (tables paused: the proxy sends
    STEPs without a fan-out, so the worker does no branch work) two steps to let the last table pass and
    `probe_steps` ordinary steps; output tokens per second of the two windows decide. Tables stay on only
    if they were faster by more than `margin` (the goal is never to be slower than sequential steps);
    the next probe comes `reprobe_steps` steps later (the batch and the text change)."""

    def __init__(self, probe_steps: int, margin: float, reprobe_steps: int) -> None:
        self.n, self.margin, self.reprobe = probe_steps, margin, reprobe_steps
        self.phase, self.left = "cache", probe_steps  # cache -> settle -> plain -> decided -> cache ...
        self.plain = False  # tables paused
        self.win = [0, 0.0]  # tokens, seconds of the window being measured
        self.tok_s = {"cache": 0.0, "plain": 0.0}
        self.decisions: list[str] = []

    def step(self, tokens: int, seconds: float) -> bool:
        """Book one step; returns whether tables are paused from the next step on."""
        if self.phase in ("cache", "plain"):
            self.win[0] += tokens
            self.win[1] += seconds
        self.left -= 1
        if self.left > 0:
            return self.plain
        if self.phase == "cache":
            self.tok_s["cache"] = self.win[0] / self.win[1] if self.win[1] > 0 else 0.0
            self.phase, self.left, self.plain = "settle", 2, True
        elif self.phase == "settle":
            self.phase, self.left, self.win = "plain", self.n, [0, 0.0]
        elif self.phase == "plain":
            self.tok_s["plain"] = self.win[0] / self.win[1] if self.win[1] > 0 else 0.0
            keep = self.tok_s["cache"] > self.tok_s["plain"] * (1 + self.margin)
            self.decisions.append("tables" if keep else "plain")
            self.phase, self.left, self.plain = "decided", self.reprobe, not keep
        else:  # decided: probe again, tables on
            self.phase, self.left, self.plain, self.win = "cache", self.n, False, [0, 0.0]
        return self.plain

    def stats(self) -> dict:
        why = ""
        if self.decisions and self.decisions[-1] == "plain":
            why = (f"tables off: {self.tok_s['cache']:.1f} tokens/s with them against {self.tok_s['plain']:.1f} "
                   f"without (measured; the next probe in {self.left} steps)")
        return {"phase": self.phase, "paused": self.plain, "tok_s_with_tables": self.tok_s["cache"],
                "tok_s_without": self.tok_s["plain"], "decisions": list(self.decisions), "off_reason": why}


class SpecCache:
    def __init__(self, fanout: int, branch_budget_ms: float | None = None, push_faults: dict | None = None,
                 capacity: int = 1 << 20, log: bool = False, wait_rule: str = "all",
                 shared_gpu: bool = False, adapt: bool = False, probe_steps: int = 16,
                 adapt_margin: float = 0.02, reprobe_steps: int = 512, table_wait_ms: float | None = None,
                 guard: bool = True, guard_options: dict | None = None, depth: str = "fixed") -> None:
        if not 1 <= fanout <= TB.MAX_BRANCHES:
            raise ValueError(f"spec-cache fan-out must be within [1, {TB.MAX_BRANCHES}], got {fanout}")
        if wait_rule not in WAIT_RULES:
            raise ValueError(f"spec-cache wait_rule must be one of {WAIT_RULES}, got {wait_rule!r}")
        self.fanout = fanout
        self.wait_rule = wait_rule
        if table_wait_ms is not None and table_wait_ms < 0:
            raise ValueError(f"spec-cache table_wait_ms must be >= 0, got {table_wait_ms}")
        # "early": how long a step waits for its table before it looks up first (0: only a look)
        self.table_wait_s = 0.0 if table_wait_ms is None else table_wait_ms / 1000
        self.shared_gpu = shared_gpu  # run even when the worker shares the engine's GPU (benchmarks)
        if probe_steps < 2 or reprobe_steps < 1:
            raise ValueError(f"spec-cache probe_steps must be >= 2 and reprobe_steps >= 1, got {probe_steps}, "
                             f"{reprobe_steps}")
        self.adapt = Adapt(probe_steps, adapt_margin, reprobe_steps) if adapt else None
        # the guard (engine/cache_guard.py): per batch class, the fan-out or plain rounds, whichever measures
        # faster; adapt=True (one probe of tables against none, for every batch alike) replaces it
        # guard_options={"depths": [None, k - 1]} lets it choose the depth of cache steps too (opt-in: on the
        # H200's short replay runs the extra probe cost more than the depth gained, docs/SPEC_CACHE.md)
        self._guard_options = dict(guard_options or {})
        # depth "policy": a cache step drafts the depth the engine's depth policy rates best with the round
        # hidden (DepthPolicy.best_hidden: tokens per verify second), at most the engine's k, and the policy
        # learns from cache steps too (their acceptance and verify widths); "fixed": the engine's k (or the
        # guard's depth). On a CPU a deep verify of text the drafter predicts poorly costs more than it gains
        if depth not in ("fixed", "policy"):
            raise ValueError(f"spec-cache depth must be 'fixed' or 'policy', got {depth!r}")
        self.depth = depth
        self.guard: CacheGuard | None = None
        if guard and not adapt:
            self.guard = CacheGuard(fanout, **self._guard_options)  # options checked now, not at the first step
        self._fanout_word: int | None = None  # what the table memory's fan-out word says (None: the spec's)
        self.branch_budget_ms = branch_budget_ms
        self.push_faults = push_faults
        self.shm = TableShm.create(capacity)
        self.active = False
        self.refusal = ""
        self.vocab = 0
        self.poll_s = POLL_S
        # (rid, RoundPlan, rows verified without drafts, {row: the branch drafts it verified}) of a round not
        # waited for
        self._inflight = None
        # request id -> (generation, base, drafts): the drafts of the settled round for a row that verified
        # without drafts while that round was in flight; usable at the next step only (see _tail)
        self._tails: dict[int, tuple[int, int, list[int]]] = {}
        self._early: dict[int, object] = {}  # results collected while polling for a table
        self._stamp: int | None = None  # stream round of the last collected OK round
        self._proxy_gen = None
        self.log: list[dict] | None = [] if log else None
        self.c: Counter = Counter()
        self.miss_reasons: Counter = Counter()
        self.wait_hit_s: list[float] = []
        self.wait_miss_s: list[float] = []

    # -- set-up ------------------------------------------------------------------------------------
    def round_spec(self, spec: dict, round_budget_ms: float) -> dict:
        """The proxy's round spec with the table memfd and the fan-out added. The proxy waits for a table
        up to branch_budget_ms (default: the round budget): the worker's next reply comes after its
        table on the same connection anyway, so a shorter wait would only give up tables early."""
        spec = dict(spec)
        budget = round_budget_ms if self.branch_budget_ms is None else self.branch_budget_ms
        sc = {"fd": self.shm.fd, "fanout": self.fanout, "branch_budget_s": budget / 1000}
        if self.push_faults:
            sc["push_faults"] = dict(self.push_faults)
        spec["spec_cache"] = sc
        spec["pass_fds"] = [self.shm.fd]
        return spec

    def bind(self, rounds, vocab: int, device_drafts: bool) -> None:
        self.vocab = vocab
        self.active, self.refusal = False, ""
        cfg = getattr(rounds, "cfg", None)
        self.poll_s = POLL_S_BUSY if getattr(cfg, "wait_mode", "") == "poll" else POLL_S
        mode = getattr(rounds, "mode", "off")
        if mode != "async" or not isinstance(rounds, StampedRounds):
            why = getattr(rounds, "refusal", "")
            self.refusal = f"needs async rounds (rounds are {mode}{': ' + why if why else ''})"
        elif device_drafts:
            self.refusal = ("CUDA rounds: device-side branch selection (select_on_device) is not wired in; "
                            "host rounds on the GPU (handoff_config host_rounds=True) select on the host")
        elif rounds.round_spec.get("spec_cache", {}).get("fd") != self.shm.fd:
            self.refusal = "the rounds were not opened with this cache's table (round_spec)"
        elif rounds.round_spec.get("kind") != "worker":
            self.refusal = "needs a worker round function"
        elif getattr(cfg, "worker_shares_gpu", False) and not self.shared_gpu:
            self.refusal = SHARED_GPU_REFUSAL
        else:
            self.active = True
            self._proxy_gen = rounds.generation
            if self.guard is not None and not self.guard.classes:
                # a worker on the engine's GPU (shared_gpu=True runs the cache there): the guard starts each
                # batch class with plain rounds (measured faster there, SHARED_GPU_REFUSAL) and probes tables
                self.guard.start_plain = bool(getattr(cfg, "worker_shares_gpu", False))

    @staticmethod
    def select_on_device(ok: torch.Tensor, prefix: torch.Tensor, prefix_len: torch.Tensor, drafts: torch.Tensor,
                         new: torch.Tensor, new_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection as tensor ops only (no host sync, graph-capturable): the CUDA path's hook.

        ok [B], prefix [B, F, k+1], prefix_len [B, F], drafts [B, F, k]: the dense table (table.dense);
        new [B, k+1], new_len [B]: the tokens each row appended since the drafter's position (on the CUDA
        path: the verify's accepted drafts and its correction/bonus, computed on the device). Returns
        (drafts [B, k] of the first matching branch, zeros where none; hit [B] bool). Equal to `table.select`
        row by row (tests/test_spec_cache_units.py). Not yet wired into the CUDA rounds: see the module
        docstring."""
        K1 = prefix.shape[-1]
        pos = torch.arange(K1, device=prefix.device)
        inside = pos[None, None, :] < prefix_len[:, :, None]
        same = (prefix == new[:, None, :K1]) | ~inside
        match = same.all(-1) & (prefix_len == new_len[:, None]) & (prefix_len > 0) & ok[:, None]
        hit = match.any(-1)
        first = torch.argmax(match.to(torch.int8), dim=-1)  # the first matching branch (0 when none)
        out = torch.gather(drafts, 1, first[:, None, None].expand(-1, 1, drafts.shape[-1]))[:, 0]
        return out * hit[:, None].to(out.dtype), hit

    # -- one step ---------------------------------------------------------------------------------
    def _check_generation(self, rounds: StampedRounds) -> None:
        g = rounds.generation
        if g != self._proxy_gen:  # a new proxy: nothing the old one wrote may match, nor its stamps
            self._proxy_gen = g
            self.shm.bump_epoch()
            self._stamp = None
            self.c["epochs"] += 1

    def _result(self, rounds, rid: int):
        res = self._early.pop(rid, None)
        return res if res is not None else rounds.result(rid)

    def _collected(self, res) -> None:
        ok = res.ok and res.proxy_generation == self._proxy_gen
        self._stamp = res.stream_round if ok else None

    def settle(self, eng) -> None:
        """Collect the round the last verify did not wait for: its result moves the drafter bookkeeping
        (planner.settle) exactly as a waited-for round's does."""
        if self._inflight is None:
            return
        rid, plan, bare, used = self._inflight
        self._inflight = None
        res = self._result(eng.rounds, rid)
        out = eng.planner.settle(plan, res, eng.vocab)
        self._collected(res)
        if res.ok:  # a branch's drafts are what the round returns for its outcome (their first ones where the
            # branch was drafted shallower than the round asked: the guard changed the depth): count where not
            self.c["hit_drafts_differ"] += sum(1 for i, d in used.items() if out[i][:len(d)] != d)
        for i in bare:  # rows that verified without drafts: keep the round's drafts for the next step
            r = plan.batch[i]
            if out[i]:
                self._tails[r.id] = (r.generation, r.synced, out[i])
        kind = "ok" if res.ok else ("watchdog" if res.status == Status.WATCHDOG else "failed")
        for i, r in enumerate(plan.batch):
            if plan.n_out[i]:
                r.rounds[kind] += 1

    def _round_done(self, rounds, rid: int, wait_s: float = 0.0) -> bool:
        """Whether round `rid` is finished, waiting up to wait_s on its event (a futex wait, not a spin:
        on a small CPU the worker and the proxy need the cores this thread would burn)."""
        if rid in self._early:
            return True
        try:
            self._early[rid] = rounds.result(rid, timeout_s=wait_s)
        except TimeoutError:
            return False
        return True

    def _await_table(self, rounds, rid: int, stamp: int) -> tuple[TB.Table | None, str]:
        limit = time.perf_counter() + 2.0 + rounds.deadline_s
        while True:
            seen = self.shm.written  # before the look: a table written after it ends the sleep below
            body, why = self.shm.read(stamp)
            if body is None and why in ("absent", "torn"):
                if self._round_done(rounds, rid, 0.0):
                    body, why = self.shm.read(stamp)  # written just before the round was picked up?
                    if body is None:
                        return None, "late" if why == "absent" else why
                elif time.perf_counter() > limit:
                    return None, "timeout"
                else:
                    # asleep until the proxy writes a table (its futex wake) or poll_s passes, then the
                    # round is looked at again: a table is seen the moment it lands, a round that ends
                    # without one (the table will not come) within poll_s
                    self.shm.wait_written(seen, self.poll_s)
                    continue
            if body is None:
                return None, why
            try:
                return TB.decode(body, self.vocab), ""
            except TB.TableError:
                return None, "corrupt"

    def _lookup(self, rounds: StampedRounds, batch: list, plan, t: int, stamp: int | None,
                need: list[int]) -> dict[int, list[int]]:
        """The branch drafts of every request of `need` (indices into the plan) that hits, by index; each
        lookup is counted (a hit, or a miss with its reason)."""
        table, why = (None, "no_table") if stamp is None else self._await_table(rounds, t, stamp)
        return self._select(batch, plan, table, why, need)

    def _select(self, batch: list, plan, table: TB.Table | None, why: str, need: list[int]) -> dict[int, list[int]]:
        """The branch drafts of every request of `need` that hits `table` (None: a miss for `why`)."""
        hits: dict[int, list[int]] = {}
        for i in need:
            r = batch[i]
            self.c["lookups"] += 1
            entry = table.entry(r.id) if table is not None else None
            new = r.tokens(r.synced, r.seq_len)
            b = TB.select(entry, r.id, r.generation, r.synced, new) if entry is not None else -1
            r.cache["lookups"] += 1  # per request too: the server's usage carries them
            r.cache["hits"] += b >= 0
            if b >= 0:
                hits[i] = entry.drafts_of(b, plan.n_out[i])  # (fewer where the confidence stop ends them)
                self.c["hits"] += 1
                if len(entry.drafts) == 0:  # a k = 0 entry: the row's last verify took no drafts
                    self.c["k0_hits"] += 1
            elif why:
                self.miss_reasons[why] += 1
            elif entry is None:
                self.miss_reasons["no_entry"] += 1  # e.g. the request's first round: no table yet
            elif entry.base != r.synced or entry.generation != r.generation:
                self.miss_reasons["stale_entry"] += 1  # a table about another point of the sequence
            else:
                self.miss_reasons["no_match"] += 1  # the outcome was not among the branches
            if entry is not None:
                self.c["k0_lookups"] += len(entry.drafts) == 0
                self.c["entries"] += 1
                self.c["branches"] += entry.n_branches
            if self.log is not None:
                self.log.append({"request": r.id, "base": r.synced, "new": list(new), "hit": b >= 0,
                                 "drafts": entry.drafts.tolist() if entry is not None and entry.base == r.synced
                                 else None, "why": "" if b >= 0 else (why or "no_match")})
        return hits

    def _tail(self, r, n_out: int) -> list[int]:
        """Drafts for a request that missed, from the round it verified without: that round's drafts
        continue the sequence at r.synced (the position the round brought the drafter to); the step that
        verified without them appended `new`. If `new` is a proper prefix of those drafts, the rest of them
        is the drafter's continuation of the true sequence (the branch-selection criterion: base and
        prefix pin the context), i.e. what a just-in-time round would return first."""
        t = self._tails.get(r.id)
        if t is None or t[0] != r.generation or t[1] != r.synced:
            return []
        d = t[2]
        new = r.tokens(r.synced, r.seq_len)
        n = len(new)
        if not 0 < n < len(d) or list(new) != d[:n]:
            return []
        return d[n:n + n_out]

    def _table_now(self, stamp: int, wait_s: float) -> tuple[TB.Table | None, str]:
        """Wait rule "early": the table following round `stamp` if it is there within wait_s; (None, why)
        otherwise ("absent" or "torn": not there yet; anything else: it is there and a miss)."""
        limit = time.perf_counter() + wait_s
        while True:
            seen = self.shm.written
            body, why = self.shm.read(stamp)
            if body is not None:
                try:
                    return TB.decode(body, self.vocab), ""
                except TB.TableError:
                    return None, "corrupt"
            left = limit - time.perf_counter()
            if why not in ("absent", "torn") or left <= 0:
                return None, why
            self.shm.wait_written(seen, min(left, self.poll_s))

    def _decode_early(self, eng, batch: list, clock, t_step: float, before: list[int], plan, table, why: str,
                      steady: bool, depth: int | None) -> None:
        """Wait rule "early" (see WAIT_RULES) once the table that followed the settled round is there (or
        known to be a miss): look each request that asks for drafts up in it; if any hit, the rows that hit
        verify their branch drafts and the rows that missed verify none, and round N, asking the hit rows
        their drafts and the missed rows none, stays in flight; if none hit, round N is an ordinary one,
        waited for."""
        asking = [i for i, n in enumerate(plan.n_out) if n]
        hits: dict[int, list[int]] = {}
        t_wait = time.perf_counter()
        with clock.part("wait"):
            if asking:
                hits = self._select(batch, plan, table, why, asking)
        fast = bool(hits)
        drafts: list[list[int]] = [[] for _ in batch]
        bare = [i for i in asking if i not in hits]
        if fast:  # a row that missed asks no drafts: its verify takes none, its next table has a k = 0 entry
            for i in bare:
                plan.n_out[i] = 0
        res = None
        t = self._submit(eng, plan, clock)
        inp = VerifyInputs.of(batch)
        with clock.part("wait"):
            if fast:  # the missed rows' round asks nothing of them: none is bare in flight
                self._go_fast(t, plan, [], len(bare), t_wait, hits)
                drafts = [hits.get(i, []) for i in range(len(batch))]
            elif t:
                res, drafts = self._wait_round(eng, plan, t)
                if asking:
                    self.c["waited_steps"] += 1
                    self.wait_miss_s.append(time.perf_counter() - t_wait)
            self.c["asking_rows"] += len(asking)
            self.c["rows_with_drafts"] += sum(1 for i in asking if drafts[i])
        eng._verify_and_accept(batch, inp, drafts, res, [0] * len(batch) if fast else plan.wanted, clock)
        self._after_step(eng, batch, fast, before, t_step, steady, depth)

    def _go_fast(self, t, plan, bare: list[int], n_bare: int, t_wait: float, hits: dict) -> None:
        """A step that verifies without waiting: round t stays in flight (settled by the next step),
        `bare` its rows verified without drafts, `hits` the branch drafts of the rows that hit."""
        self._inflight = (t, plan, bare, dict(hits))
        self.c["fast_steps"] += 1
        self.c["bare_rows"] += n_bare
        self.wait_hit_s.append(time.perf_counter() - t_wait)

    def _wait_round(self, eng, plan, t) -> tuple:
        """A step that waits for round t: (its result, each row's drafts)."""
        res = self._result(eng.rounds, t)
        drafts = eng.planner.settle(plan, res, eng.vocab)
        self._collected(res)
        return res, drafts

    def _after_step(self, eng, batch: list, fast: bool, before: list[int], t_step: float, steady: bool,
                    depth: int | None) -> None:
        """Book the step (its rows' output lengths were `before`; its plan's depth was `depth`, None: the
        engine's k)."""
        if fast and not eng.waiting and all(r.done for r in eng.running):
            self.settle(eng)  # no next step will: settle now, so the drafter's bookkeeping is complete
        gained = [len(r.output) - n for r, n in zip(batch, before, strict=True)]
        tokens, seconds = sum(gained), time.perf_counter() - t_step
        if self.adapt is not None:
            paused = self.adapt.step(tokens, seconds)
            if paused != self.shm.paused:
                self.shm.set_paused(paused)
        if self.guard is not None:
            self.guard.observe(tokens, seconds, steady, self._tokens_by_depth(eng, gained, depth))

    def _tokens_by_depth(self, eng, gained: list[int], depth: int | None) -> dict:
        """What this step would have yielded at each of the guard's depths up to its own (None: the engine's
        k): a row that took g tokens (accepted drafts + 1) at depth k takes min(g, d + 1) at d <= k, since the
        first d drafts are accepted or rejected alike at either depth (greedy: the same tokens; sampled: the
        same law). So every step measures the tokens of the shallower depths on the same text, and a depth
        is not judged on the few steps of its own probe (the text's ups and downs would decide)."""
        def drafts(d: int | None) -> int:
            return eng.cfg.n_draft if d is None else d

        k = drafts(depth)
        return {d: sum(min(g, drafts(d) + 1) for g in gained) for d in self.guard.depths if drafts(d) <= k}

    def _set_fanout(self, f: int | None) -> None:
        """The fan-out the proxy's next STEP asks (None: the round spec's; 0: none)."""
        if f == self.fanout:
            f = None
        if f != self._fanout_word:
            self.shm.set_fanout(f)
            self._fanout_word = f

    def _steady(self, eng, plan) -> bool:
        """Whether this step costs what the guard should learn from: some row asks drafts and no row's
        round carries a catch-up (more than k + 2 tokens: a new request's prompt, tokens a plain step at
        depth 0 left behind)."""
        return any(plan.n_out) and max(len(x) for x in plan.send) <= eng.cfg.n_draft + 2

    @staticmethod
    def _submit(eng, plan, clock):
        """The plan's round, sent (its round number), or None where no request of it asks one."""
        if not plan.asks:
            return None
        with clock.part("submit"):
            return eng.rounds.submit(eng.planner.blocks(plan, eng.rounds.capacity or eng.cfg.max_batch))

    def _plain_step(self, eng, batch: list, clock, t_step: float, before: list[int]) -> None:
        """The guard chose plain rounds: the engine's ordinary step (the depth policy's k where it has one),
        on this cache's rounds; the proxy sends its STEP without a fan-out."""
        self._tails.clear()
        k = eng.depth.choose() if eng.depth is not None else None
        plan = eng.planner.plan(batch, drafting=k != 0, k=k)
        steady = self._steady(eng, plan)
        res = None
        t = self._submit(eng, plan, clock)
        inp = VerifyInputs.of(batch)
        drafts: list[list[int]] = [[] for _ in batch]
        if t:
            with clock.part("wait"):
                res, drafts = self._wait_round(eng, plan, t)
            self._stamp = None  # its STEP asked no fan-out: no table follows it (the next lookup is a miss at once)
        if any(plan.n_out):
            self.c["plain_steps"] += 1
        used = eng._verify_and_accept(batch, inp, drafts, res, plan.wanted, clock, n_out=plan.n_out)
        if eng.depth is not None:
            eng._observe_depth(plan, k, used, clock)
        self._after_step(eng, batch, False, before, t_step, steady, k)

    def decode(self, eng, batch: list) -> None:
        """One step (Engine._decode with the cache active): settle the round left in flight, submit
        round N; each request that asks for drafts takes its branch (a hit) or else its round tail
        (`_tail`, decided before round N is submitted); if any has drafts (wait_rule "rows"; "all": if
        every one hit) the verify starts now, the others verify without drafts and round N stays in
        flight; else the step waits for round N. Wait rule "early": where the table is there, `_decode_early`;
        else this step as under "all"."""
        clock = StepClock(eng.timing)
        t_step, before = time.perf_counter(), [len(r.output) for r in batch]
        rounds = eng.rounds
        self._check_generation(rounds)
        with clock.part("wait"):
            self.settle(eng)
        if self.guard is not None:
            if "pooled" not in self._guard_options:  # own tokens where choices differ in what a step yields
                self.guard.pooled = eng.depth is None and self.wait_rule != "early"
            arm = self.guard.choose(len(batch))
            self._set_fanout(arm.fanout)
            if arm.fanout == 0:
                return self._plain_step(eng, batch, clock, t_step, before)
            depth = arm.depth
        else:
            depth = None
        learn = self.depth == "policy" and eng.depth is not None
        if learn and depth is None:
            depth = eng.depth.best_hidden(eng.cfg.n_draft)
        stamp = self._stamp
        plan = eng.planner.plan(batch, drafting=True, k=depth)  # (None: the engine's k)
        steady = self._steady(eng, plan)
        plain = self.adapt is not None and self.adapt.plain  # tables paused: an ordinary step
        rule = self.wait_rule
        if rule == "early" and not plain and any(plan.n_out):
            table, why = None, "no_table"
            if stamp is not None:
                with clock.part("wait"):
                    table, why = self._table_now(stamp, self.table_wait_s)
            if table is not None or why not in ("absent", "torn"):
                return self._decode_early(eng, batch, clock, t_step, before, plan, table, why, steady, depth)
            rule = "all"  # the table is not there yet: round N goes out now, as under "all"
        # rows with a round tail verify it, and round N asks each of them exactly that many drafts: then
        # round N's drafts are the tail itself (the drafter's continuation of the same context), so its
        # table models the outcomes of this verify and the row is back in step with the tables
        tails: dict[int, list[int]] = {}
        if rule == "rows" and not plain:
            for i, n in enumerate(plan.n_out):
                if n and (d := self._tail(batch[i], n)):
                    tails[i] = d
                    plan.n_out[i] = len(d)
        self._tails.clear()
        res = None
        t = self._submit(eng, plan, clock)
        inp = VerifyInputs.of(batch)
        drafts: list[list[int]] = [[] for _ in batch]
        fast = False
        with clock.part("wait"):
            t_wait = time.perf_counter()
            asking = [i for i, n in enumerate(plan.n_out) if n]
            lookup = [] if plain else [i for i in asking if i not in tails]
            hits = self._lookup(rounds, batch, plan, t, stamp, lookup) if t and lookup else {}
            if rule in ("all", "early"):
                fast = bool(asking) and len(hits) == len(asking)
            else:
                fast = bool(hits or tails)
            if fast:  # verify now on what the rows have; round N stays in flight
                bare = [i for i in lookup if i not in hits]
                self._go_fast(t, plan, bare, len(bare), t_wait, hits)
                drafts = [hits.get(i) or tails.get(i) or [] for i in range(len(batch))]
            elif t:
                res, drafts = self._wait_round(eng, plan, t)
                if asking and plain:
                    self.c["plain_steps"] += 1
                elif asking:
                    self.c["waited_steps"] += 1
                    self.wait_miss_s.append(time.perf_counter() - t_wait)
            self.c["tail_rows"] += len(tails)
            self.c["asking_rows"] += len(asking)
            self.c["rows_with_drafts"] += sum(1 for i in asking if drafts[i])
        # a fast step's round is booked when it is settled; the drafts it verified are the branch's
        verified = eng._verify_and_accept(batch, inp, drafts, res, [0] * len(batch) if fast else plan.wanted, clock,
                                          n_out=plan.n_out if learn else None)
        if learn and any(verified):
            eng._observe_verify_width(verified, clock)
        self._after_step(eng, batch, fast, before, t_step, steady, depth)

    # -- state ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        n = self.c["lookups"]
        wh, wm = self.wait_hit_s, self.wait_miss_s
        return {
            "active": self.active, "refusal": self.refusal, "fanout": self.fanout,
            "selection": "host" if self.active else "",
            # request-rounds: the table lookups and the rows that took their round tail instead
            "request_rounds": n + self.c["tail_rows"], "lookups": n, "hits": self.c["hits"],
            "hit_rate": self.c["hits"] / n if n else 0.0,
            "misses": dict(sorted(self.miss_reasons.items())),
            "branches_per_round": self.c["branches"] / self.c["entries"] if self.c["entries"] else 0.0,
            "wait_rule": self.wait_rule,
            "fast_steps": self.c["fast_steps"], "waited_steps": self.c["waited_steps"],
            "tail_rows": self.c["tail_rows"], "bare_rows": self.c["bare_rows"],
            # lookups in / hits on k = 0 entries (rule "early": rows whose last verify took no drafts)
            "k0_lookups": self.c["k0_lookups"], "k0_hits": self.c["k0_hits"],
            # rows that asked for drafts and verified some without waiting for their round, or on its drafts
            "rows_with_drafts": (self.c["rows_with_drafts"] / self.c["asking_rows"]) if self.c["asking_rows"] else 0.0,
            "wait_ms_p50_hit": 1e3 * float(np.median(wh)) if wh else 0.0,
            "wait_ms_p50_miss": 1e3 * float(np.median(wm)) if wm else 0.0,
            "wait_ms_mean": 1e3 * float(np.mean(wh + wm)) if wh or wm else 0.0,
            "epochs": self.c["epochs"],
            # hit rows whose settled round returned other drafts than the branch they verified (0 unless a
            # table was forged: a branch's drafts are the round's own for that outcome)
            "hit_drafts_differ": self.c["hit_drafts_differ"],
            "plain_steps": self.c["plain_steps"],
            "adapt": self.adapt.stats() if self.adapt is not None else None,
            "guard": self.guard.stats() if self.guard is not None else None,
        }

    def reset_stats(self) -> None:
        """Forget the counters (e.g. after a warm-up); what the guard learnt stays."""
        self.c.clear()
        self.miss_reasons.clear()
        self.wait_hit_s.clear()
        self.wait_miss_s.clear()

    def close(self, eng) -> None:
        if self._inflight is not None and eng.rounds is not None:
            try:
                self.settle(eng)
            except Exception:  # closing: the result no longer matters
                self._inflight = None
        self._early.clear()
        self._tails.clear()
        self.shm.close()
