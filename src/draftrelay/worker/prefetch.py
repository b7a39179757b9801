"""The worker's half of the speculation cache: after answering a STEP, draft the next round for the
likely outcomes of the verify now running on the engine (see draftrelay.speculation.table).

For each request the STEP just served (context C of length L = base, drafts f1..fk):
  1. the drafter's top candidates at each of the k+1 places the verify can stop (k corrections, 1
     bonus): from the branch run that answered the STEP where it was answered from a branch (that run
     fed every draft, the last one included), else one forward over (C[-1], f1..fk) in a forked row;
  2. `choose_branches` picks the F most likely outcomes (a kept, token y) from those candidates and
     the session's running per-position acceptance;
  3. every branch gets a forked scratch row and all branches of all requests are drafted in ONE batched
     run: the first forward (y, or f_k then y for a bonus branch), then k greedy steps.
A forked row (worker.fork) holds only its own positions and reads the request's row below its pivot in
place: nothing of the context is copied, so the branch work does not grow with the context by copies.
The request's own KV row is only read, never written: the next STEP sees exactly the state it would
have seen without prefetching (a STEP answered from a branch copies that branch's few own positions in).

The session's acceptance estimate learns from the next STEP's tokens: the block that follows a
round with drafts f starts with the accepted drafts, then the target's token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from draftrelay import SettingError, env_choice, env_ms
from draftrelay.capture import GraphCapture, kv_bucket, kv_buckets
from draftrelay.memory import KVMemoryError
from draftrelay.model import positions_ahead
from draftrelay.replay import ReplayDrafter, spend
from draftrelay.speculation.table import (
    MAX_K,
    Acceptance,
    Entry,
    Table,
    allot_branches,
    choose_branches,
    draft_confs,
    encode,
)
from draftrelay.wire import protocol as P
from draftrelay.worker.draft_stop import stop_counts
from draftrelay.worker.drafters import Job, LlamaDrafter
from draftrelay.worker.fork import LeanFork, fork_forward

log = logging.getLogger("draftrelay.worker")

TOP_M = 8  # candidates per position considered for branches (F <= (k + 1) * TOP_M)
MAX_FANOUT = 16  # branches a request gets at most (a STEP asking more gets this many; shared: SHARE_CAP)
# the pieces of a table's branch work: observe (acceptance from the STEP), stops (the forward over the k + 1
# stopping places, where one runs), choose (choose_branches), run (the batched branch run), bonus (its last
# forward, the bonus place's candidates: booked only where Prefetcher.sync_bonus waits for it; else it runs
# on the device while the table goes out), entries (the table's entries and the hit records), encode (the
# BRANCHES payload). DEVICE_PIECES: what a drafter on an emulated device spends as wall time (CostTable)
PIECES = ("observe", "stops", "choose", "run", "bonus", "entries", "encode")
DEVICE_PIECES = ("stops", "run", "bonus")
# When the bonus place's forward runs on a GPU (it feeds a branch's last draft d_k; only the table after a
# STEP answered from that branch reads its candidates). "queued" (the default): over every branch of the
# run, launched right behind the table, so it runs while the table travels and the engine's next STEP comes
# back; "lazy": when that table reads it, over the answering branches only (one row a request). Queued is
# the faster on the H200 with the drafter on an emulated second device (benchmarks/replay_headline.py, F = 8:
# hit step 1.23 x the bound against 1.32 x lazy; docs/SPEC_CACHE.md): the queued forward overlaps the trips
# between the table and the next STEP (wire, proxy, host pieces), while a lazy one (0.8 ms for one row
# against 1.0 for eight) waits for that STEP. The lean loop (a CPU) always reads it lazily, those rows only.
BONUS_MODES = ("queued", "lazy")
BONUS = os.environ.get("DRAFTRELAY_BRANCH_BONUS", "queued")
# Whether branch work the client's next STEP waits behind is cut (Preempted) where what is left of it takes
# longer than a STEP: "on" (the default) bounds that STEP's wait by one device step; "off" always finishes
# the table (tests about hit steps, and A/B runs)
CUT_MODES = ("on", "off")
# How a batch's branches are shared: "on" (the default), the batch's n x F branches go where they raise the
# chance that every request hits (allot_branches), up to SHARE_CAP x F for one request; "off", F each. Under
# the engine's wait rule a step goes without waiting only when all its rows hit, so at four requests the
# chance that all four hit is the figure: counted on the replay trace (benchmarks/hit_curve.py --batch 4,
# docs/SPEC_CACHE.md). One request gets its F either way.
SHARE_MODES = ("on", "off")
SHARE_CAP = 2


class Preempted(Exception):
    """The client's next STEP is waiting (table(interrupt=...)) and the branch work left would take longer
    than a STEP: the table would come later than that STEP's reply could, so it is of no use, and it holds
    that STEP up. Raised between device steps; the table goes out empty."""


class Branch(NamedTuple):
    """One pre-drafted branch the next STEP can be answered from (HitDrafter): its prefix (f1..fa, y), its
    forked scratch row and the first position that row holds (`lo`: below it the request's own row
    holds the branch's KV), its drafts and confidences, and the drafter's top candidates at the first
    k_run places a verify of those drafts can stop (None where the branch run did not give them; the
    place after the last draft is row `q` of the run's bonus forward, ForkSteps.bonus_tops)."""
    prefix: np.ndarray
    row: int
    lo: int
    drafts: np.ndarray
    confs: np.ndarray
    top_t: np.ndarray | None
    top_p: np.ndarray | None
    q: int = -1


# A forked row's own positions in the lean loop's compact scratch (LeanFork(compact=True)): a branch writes
# at most k + 2 positions from its pivot (the first forward's two tokens, then k - 1 drafts and the bonus
# place; the stopping places' forward k + 1), and k is at most the wire's MAX_K
COMPACT_POSITIONS = MAX_K + 2


def scratch_size(rows: int) -> int:
    """The usable branch rows ForkSteps.scratch makes for `rows`: the next power of two, so the scratch is
    made afresh only at each doubling (it holds one spare row beyond them)."""
    return 1 << max(0, rows - 1).bit_length()


class ForkSteps:
    """The branch work's two device steps on forked rows (worker.fork): scratch rows that hold only their
    own positions and read the request's row below a pivot, so no step copies a context.

      stops(...)     the forward over (C[-1], f1..fk): top candidates at the k + 1 stopping places;
      branches(...)  every branch of every request in one batched run: the first forward (y, or f_k, y
                     for a bonus branch), then k one-token steps feeding each greedy draft: the drafts,
                     confidences and the top candidates at the first k places a verify of those drafts
                     can stop, so a STEP answered from the branch needs no forward over its stopping
                     places but the last one's;
      bonus_tops(qs) that last place's (after d_k: a forward feeding d_k) for branches qs of the run
                     (BONUS: run when read, over those branches only, or queued behind the table).

    Static shapes per key ((rows, T or k, kv bucket)); in the drafter's graph mode each is one CUDA graph
    (captured in a pool of its own), else the same buffers run as they are."""

    def __init__(self, drafter: LlamaDrafter) -> None:
        self.d = drafter
        self.torch = drafter.torch
        self.cache = None  # the scratch KVCache (its rows are forked rows)
        self.n_rows = 0  # usable scratch rows; row n_rows is the spare one for warm-up and capture
        # the scratch the memory refused (draftrelay/memory.py): (rows, why); as many rows or more are refused
        # again at once, not tried and logged every round (each round's table is then empty: hits lost only)
        self.refused: tuple[int, str] | None = None
        self._steps: dict[tuple, object] = {}
        self._capture = None
        # the last branch run's bonus place: (read(qs) -> top tokens [len(qs), m] and probabilities of its
        # branches qs, B, m, {q: (tokens [m], probs [m]) read so far})
        self._bonus = None
        self._graph_failed = False
        if BONUS not in BONUS_MODES:
            raise SettingError(f"DRAFTRELAY_BRANCH_BONUS={BONUS!r}: expected one of {', '.join(BONUS_MODES)}")
        self.last_bonus_s = 0.0  # the bonus forward's seconds when branches() waited for it
        self._lean_fork: LeanFork | None = None
        self.cut = None  # (seconds of work left) -> None or Preempted: the lean loop's look between forwards
        # (Prefetcher._cut)

    @property
    def compact(self) -> bool:
        """Whether the scratch rows hold position p at p - pivot (the lean loop's LeanFork, a CPU: rows of
        COMPACT_POSITIONS) rather than at p (the fast forward's kernels index the rows by position)."""
        return getattr(self.d, "_lean", None) is not None

    @property
    def graph(self) -> bool:
        return self.d.mode == "graph" and not self._graph_failed

    def scratch(self, rows: int) -> None:
        if self.cache is None or self.n_rows < rows:
            n = scratch_size(rows)
            if self.refused is not None and n >= self.refused[0]:
                raise KVMemoryError(self.refused[1])
            if self.cache is not None and self.cache.k.device.type == "cuda":
                # a bonus forward may still run on the old rows: its graph's memory must not be reused under it
                self.torch.cuda.synchronize(self.cache.k.device)
            self.cache = None
            self._steps.clear()  # static steps read the old cache's tensors
            self._bonus = None
            # and a fresh pool for the new steps: with every graph of the old one freed while a block of
            # it is still held, a capture into it fails torch's check (use_count > 0, seen on the H200
            # once the 32K table grew the rows), and the branch steps would run uncaptured from then on
            self._capture = None
            # compact rows (the lean loop, a CPU): COMPACT_POSITIONS a row instead of the context (on the
            # reference pair at a 4,352-token context, 33 branch rows took 3.5 GB where 53 MB now do)
            try:
                self.cache = self.d.model.new_cache(n + 1, COMPACT_POSITIONS if self.compact
                                                    else self.d.cache.max_len)
            except KVMemoryError as exc:
                self.refused = (n, f"branch rows: {exc}")
                log.warning("prefetch: %s; tables of %d branch rows or more stay empty", exc, n)
                raise KVMemoryError(self.refused[1]) from None
            self.n_rows = n

    def _lean(self) -> LeanFork | None:
        """The CPU's forked forward for a drafter in its lean loop (worker.fork.LeanFork), else None."""
        steps = getattr(self.d, "_lean", None)
        if steps is None:
            return None
        lf = self._lean_fork
        if lf is None or lf.cache is not self.cache or lf.parent_cache is not self.d.cache:
            lf = self._lean_fork = LeanFork(steps, self.cache, self.d.cache, compact=True)  # lean: compact rows
        return lf

    def _step(self, key: tuple, n_in: int, n_out: int, body):
        g = self._steps.get(key)
        if g is not None:
            return g
        torch, dev = self.torch, self.d.model.device
        g = type("ForkStep", (), {})()
        g.inbuf = torch.zeros(n_in, dtype=torch.int64, device=dev)
        g.host = torch.zeros(n_in, dtype=torch.int64, pin_memory=dev.type == "cuda")
        g.out = torch.zeros(n_out, dtype=torch.int32, device=dev)
        g.host_out = torch.zeros(n_out, dtype=torch.int32, pin_memory=dev.type == "cuda")
        g.graph = None
        g.run = lambda: body(g)
        if self.d.mode in ("eager", "lean"):  # one step per exact length: made per call, never kept
            return g
        if self.graph:
            if self._capture is None:
                self._capture = GraphCapture(dev)
            try:
                with torch.inference_mode():  # warm-up on the spare row: kernels compiled, blocks allocated
                    self._capture.warm(lambda: body(g, spare=self.n_rows))
                    g.graph, _ = self._capture.capture(g.run)
            except Exception:  # as the drafter's own capture failure: the same steps uncaptured from now on
                log.exception("prefetch: CUDA graph capture of a branch step failed; its steps run uncaptured")
                self._graph_failed = True
                g.graph = None
        self._steps[key] = g
        return g

    def _launch(self, g, host_in: np.ndarray) -> np.ndarray:
        torch = self.torch
        g.host.numpy()[:] = host_in
        with torch.inference_mode():
            g.inbuf.copy_(g.host, non_blocking=True)
            if g.graph is not None:
                g.graph.replay()
            else:
                g.run()
            g.host_out.copy_(g.out, non_blocking=True)
            if g.out.device.type == "cuda":
                torch.cuda.current_stream(g.out.device).synchronize()
        return g.host_out.numpy()

    def _pick_top(self, logits, m: int):
        """(argmax, its softmax probability, the top m ids, their probabilities) of logits [B, V]: the
        fast forward's greedy pick (fused on CUDA, ties to the lower id: the drafter's own drafting loop
        picks the same token with the same confidence) and the candidates in the same two launches
        (kernels.greedy_top; a torch top-k over the vocabulary cost ~120 us on an H200)."""
        from draftrelay.kernels import backend

        vocab = self.d.model.draft_vocab  # raw outputs hold a draft vocabulary's columns only (fork_forward)
        return backend(logits.device).greedy_top(logits, m, None if vocab is None else vocab.ids_on(logits.device))

    def _top(self, lf, m: int):
        probs = self.torch.softmax(lf, -1)
        tp, tt = probs.topk(m, dim=-1)  # ties: torch's order; the branch choice only, never correctness
        return probs, tp, tt

    def _buckets(self, need: int) -> list[int]:
        """The kv bucket holding `need` keys and, in graph mode, the next ones up to need + 512: their
        graphs are built at once, so a growing context does not pay a capture in the middle of a run.
        A drafter in eager or lean mode (the CPU) takes `need` itself."""
        if self.d.mode in ("eager", "lean"):  # shapes as they come: attention over the keys there are
            return [need]
        lo = kv_bucket(need, self.cache.max_len)
        if not self.graph:
            return [lo]
        hi = kv_bucket(need + 512, self.cache.max_len)
        return [kv for kv in kv_buckets(self.cache.max_len) if lo <= kv <= hi]

    def _stops_step(self, R: int, T: int, m: int, kv: int):
        torch, model = self.torch, self.d.model

        def body(g, spare=None):
            tokens = g.inbuf[:R * T].view(R, T)
            start, parent, row = (g.inbuf[R * T + i * R:R * T + (i + 1) * R] for i in range(3))
            if spare is not None:
                row = torch.full_like(row, spare)
            lf = fork_forward(model, tokens, start, self.cache, row, self.d.cache, parent, start, kv, raw=True)
            _, _, tt, tp = self._pick_top(lf.reshape(R * T, -1), m)
            g.out[:R * T * m].copy_(tt.reshape(-1).to(torch.int32))
            g.out[R * T * m:].view(torch.float32).copy_(tp.reshape(-1))

        return self._step(("stops", R, T, m, kv), R * T + 3 * R, 2 * R * T * m, body)

    def stops(self, toks: np.ndarray, starts: list[int], parents: list[int], rows: list[int],
              m: int) -> tuple[np.ndarray, np.ndarray]:
        """toks [R, T] at positions starts[r].. of forked rows rows[r] (pivot starts[r], parent parents[r])
        -> the top m tokens [R, T, m] and their probabilities."""
        R, T = toks.shape
        lf = self._lean()
        if lf is not None:
            torch = self.torch
            with torch.inference_mode():
                pos = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]
                logits = lf.forward(torch.from_numpy(np.ascontiguousarray(toks, np.int64)), pos,
                                    lf.plan(list(rows), list(parents), list(starts), T))
                _, tp, tt = self._top(logits, m)
            return tt.numpy().astype(np.int32).astype(np.int64), tp.numpy().copy()
        with self.d._on_model_gpu():
            kvs = self._buckets(max(starts) + T)
            for kv in kvs[1:]:
                self._stops_step(R, T, m, kv)
            g = self._stops_step(R, T, m, kvs[0])
            out = self._launch(g, np.concatenate([toks.reshape(-1), starts, parents, rows]).astype(np.int64))
        n = R * T * m
        return out[:n].reshape(R, T, m).copy(), out[n:].view(np.float32).reshape(R, T, m).copy()

    def _branch_steps(self, B: int, k: int, m: int, kv: int, R: int):
        """The branch run's step and its bonus step (which reads the run's buffers) for one key: over all B
        branches (BONUS "queued"), or over R of them, their indices its input ("lazy")."""
        torch, model = self.torch, self.d.model
        n_top = B * k * m

        def inputs(g, spare):
            start, at, parent, pivot, row = (g.inbuf[2 * B + i * B:2 * B + (i + 1) * B] for i in range(5))
            if spare is not None:
                row = torch.full_like(row, spare)
            return start, at, parent, pivot, row

        def body(g, spare=None):
            tokens = g.inbuf[:2 * B].view(B, 2)
            start, at, parent, pivot, row = inputs(g, spare)
            # each step: the head's output as it is (no fp32 copy of the vocabulary), the drafter's own
            # fused greedy pick (the same token and confidence as its drafting loop) and the top candidates
            # at that place with their probabilities, in one greedy_top
            pos = positions_ahead(start + at + 1, k - 1) if k > 1 else None  # as LlamaDrafter's loop
            lf = fork_forward(model, tokens, start, self.cache, row, self.d.cache, parent, pivot, kv,
                              logits_at=at, raw=True)[:, 0]
            toks, confs, tts, tps = [], [], [], []
            for s in range(k):
                tok, conf, tt_s, tp_s = self._pick_top(lf, m)
                toks.append(tok)
                confs.append(conf)
                tts.append(tt_s)
                tps.append(tp_s)
                if s < k - 1:
                    lf = fork_forward(model, tok[:, None], pos[s], self.cache, row, self.d.cache, parent, pivot,
                                      kv, raw=True)[:, 0]
            tt, tp = torch.stack(tts, 1), torch.stack(tps, 1)  # [B, k, m]
            conf = torch.stack(confs, 1)  # [B, k]
            o = g.out
            o[:B * k].copy_(torch.stack(toks, 1).reshape(-1).to(torch.int32))
            o[B * k:2 * B * k].view(torch.float32).copy_(conf.reshape(-1))
            o[2 * B * k:2 * B * k + n_top].copy_(tt.reshape(-1).to(torch.int32))
            o[2 * B * k + n_top:].view(torch.float32).copy_(tp.reshape(-1))

        g = self._step(("branches", B, k, m, kv), 7 * B, 2 * B * k + 2 * n_top, body)

        def bonus(gb, spare=None):  # feeds d_k (g's output) at its position: the bonus place's candidates
            start, at, parent, pivot, row = inputs(g, spare)
            dk = g.out[:B * k].view(B, k)[:, k - 1:].long()
            if BONUS == "lazy":  # only branches gb.inbuf[:R] of the run (g's buffers hold it until the next)
                idx = gb.inbuf[:R]
                start, at, parent, pivot, row, dk = (x.index_select(0, idx) for x in (start, at, parent, pivot,
                                                                                        row, dk))
            n = dk.shape[0]
            lf = fork_forward(model, dk, start + at + k, self.cache, row, self.d.cache, parent, pivot, kv,
                              raw=True)[:, 0]
            _, _, tt, tp = self._pick_top(lf, m)
            gb.out[:n * m].copy_(tt.reshape(-1).to(torch.int32))
            gb.out[n * m:].view(torch.float32).copy_(tp.reshape(-1))

        if BONUS == "lazy":
            return g, self._step(("bonus_at", B, R, k, m, kv), R, 2 * R * m, bonus)
        return g, self._step(("bonus", B, k, m, kv), 1, 2 * B * m, bonus)

    def branches(self, first: np.ndarray, last: list[int], starts: list[int], parents: list[int],
                 pivots: list[int], rows: list[int], k: int, m: int, sync_bonus: bool = False,
                 firsts: list[int] | None = None):
        """first [B, 2] (y, or f_k then y; right-padded) at positions starts[b].. of forked rows rows[b]
        (below pivots[b]: row parents[b] of the drafter's cache); last[b]: the index of y. -> drafts
        int32 [B, k], confidences [B, k], top tokens [B, k, m] and probabilities at the first k stopping
        places of a verify of those drafts. The last place's (after d_k: one more forward, feeding d_k):
        `bonus_tops(qs)`, run when read (BONUS "lazy": over as many rows as `firsts`, the index of each
        request's first branch) or launched behind the run without waiting for it ("queued": on a GPU it
        runs while the table goes out). sync_bonus: the bonus forward of branches `firsts` here and now
        (to time it: what a table after a STEP answered from a branch of each request runs)."""
        torch = self.torch
        B = first.shape[0]
        firsts = list(firsts) if firsts else [0]
        if self._lean() is not None:
            return self._lean_branches(first, last, starts, parents, pivots, rows, k, m, sync_bonus, firsts)
        n_top = B * k * m
        R = len(firsts)
        host = np.concatenate([first.reshape(-1), starts, last, parents, pivots, rows]).astype(np.int64)
        with self.d._on_model_gpu():
            kvs = self._buckets(max(starts) + 2 + k)
            for kv in kvs[1:]:
                self._branch_steps(B, k, m, kv, R)
            g, gb = self._branch_steps(B, k, m, kvs[0], R)
            out = self._launch(g, host)
            d = out[:B * k].reshape(B, k).copy()
            c = out[B * k:2 * B * k].view(np.float32).reshape(B, k).copy()
            o = 2 * B * k
            tt = out[o:o + n_top].reshape(B, k, m).copy()
            tp = out[o + n_top:].view(np.float32).reshape(B, k, m).copy()
            t_bonus = time.perf_counter()
            if BONUS == "lazy":
                self._bonus = (lambda qs: self._bonus_at(gb, B, R, m, qs), B, m, {})
            else:
                with torch.inference_mode():
                    if gb.graph is not None:
                        gb.graph.replay()
                    else:
                        gb.run()
                    gb.host_out.copy_(gb.out, non_blocking=True)
                self._bonus = (lambda qs: self._bonus_read(gb, B, m, qs), B, m, {})
            if sync_bonus:
                self.bonus_tops(firsts)
                self.last_bonus_s = time.perf_counter() - t_bonus
        return d, c, tt, tp

    def _bonus_at(self, gb, B: int, R: int, m: int, qs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The lazy bonus step gb (R rows) over branches qs of its run, R at a time; a short batch is
        filled with other branches of the run (each branch its own scratch row: nothing read is touched)."""
        tts, tps = [], []
        with self.d._on_model_gpu():
            for i in range(0, len(qs), R):
                part = list(qs[i:i + R])
                n = len(part)
                part += [q for q in range(B) if q not in qs][:R - n]
                out = self._launch(gb, np.asarray(part, np.int64))
                tts.append(out[:R * m].reshape(R, m)[:n].astype(np.int64))
                tps.append(out[R * m:].view(np.float32).reshape(R, m)[:n].copy())
        return np.concatenate(tts), np.concatenate(tps)

    def _bonus_read(self, gb, B: int, m: int, qs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Branches qs of the queued bonus step gb (all B rows), waiting for it."""
        if gb.out.device.type == "cuda":
            self.torch.cuda.current_stream(gb.out.device).synchronize()
        out = gb.host_out.numpy()
        return (out[:B * m].reshape(B, m)[qs].astype(np.int64),
                out[B * m:].view(np.float32).reshape(B, m)[qs].copy())

    def _lean_branches(self, first: np.ndarray, last: list[int], starts: list[int], parents: list[int],
                       pivots: list[int], rows: list[int], k: int, m: int, sync_bonus: bool, firsts: list[int]):
        """branches() in the lean loop's forked forward (a CPU): the same drafts, confidences and
        candidates. The bonus forward is not run here but by bonus_tops(qs), over the branches a next
        table reads it for (those that answered a STEP), whatever BONUS says: on a CPU nothing runs
        behind the table, so a forward run here would only delay it."""
        torch = self.torch
        lf = self._lean()
        T = first.shape[1]
        first_plan, plan = lf.plan(rows, parents, pivots, T), lf.plan(rows, parents, pivots)
        with torch.inference_mode():
            start = torch.tensor(starts)
            at = torch.tensor(last)
            logits = lf.forward(torch.from_numpy(np.ascontiguousarray(first, np.int64)),
                                start[:, None] + torch.arange(T)[None, :], first_plan, pick=at)
            pos = start + at + 1  # the first draft's position
            picked, toks = [], []
            t_fwd = time.perf_counter()
            for s in range(k):
                tok = logits.argmax(-1)  # ties go to the lower id, as the drafter's lean loop picks
                picked.append(logits)
                toks.append(tok)
                if s < k - 1:
                    if self.cut is not None:  # a CPU's forward is the longest a next STEP then waits
                        now = time.perf_counter()
                        self.cut((k - 1 - s) * (now - t_fwd))
                        t_fwd = now
                    logits = lf.forward(tok[:, None], (pos + s)[:, None], plan)[:, 0]
            probs = torch.softmax(torch.stack(picked, 1), -1)  # [B, k, V]
            tok = torch.stack(toks, 1)
            conf = probs.gather(-1, tok[..., None])[..., 0]
            tp, tt = probs.topk(m, dim=-1)
        d_k, at_k = tok[:, k - 1:], (pos + k - 1)[:, None]

        def bonus(qs: list[int]) -> tuple[np.ndarray, np.ndarray]:  # feeds d_k of branches qs at its position
            sel = torch.tensor(qs, dtype=torch.int64)  # ascending: a parent's rows stay consecutive (ForkPlan)
            sub = lf.plan([rows[q] for q in qs], [parents[q] for q in qs], [pivots[q] for q in qs])
            with torch.inference_mode():
                _, bp, bt = self._top(lf.forward(d_k[sel], at_k[sel], sub)[:, 0], m)
            return bt.numpy().astype(np.int64), bp.numpy().copy()

        self._bonus = (bonus, first.shape[0], m, {})
        if sync_bonus:
            t_bonus = time.perf_counter()
            self.bonus_tops(firsts)
            self.last_bonus_s = time.perf_counter() - t_bonus
        return (tok.numpy().astype(np.int32), conf.numpy().astype(np.float32), tt.numpy().astype(np.int32),
                tp.numpy().astype(np.float32))

    def bonus_tops(self, qs: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """The last branch run's candidates at the bonus place of its branches qs (top tokens [len(qs), m],
        probabilities): those not read yet run now (BONUS "lazy", the lean loop) or are waited for
        ("queued"). None before any run, or for a branch the run did not have."""
        if self._bonus is None:
            return None
        read, B, m, got = self._bonus
        if not all(0 <= q < B for q in qs):
            return None
        todo = sorted({int(q) for q in qs} - set(got))
        if todo:
            tt, tp = read(todo)
            for j, q in enumerate(todo):
                got[q] = (tt[j], tp[j])
        return (np.stack([got[q][0] for q in qs]).reshape(len(qs), m),
                np.stack([got[q][1] for q in qs]).reshape(len(qs), m))


class Prefetcher:
    """Branch drafting for one WorkerCore. Call `table(session, blocks, result, fanout)` with the
    core's lock held, right after the STEP was answered."""

    def __init__(self, drafter, max_fanout: int | None = None) -> None:
        self.drafter = drafter
        self.max_fanout = MAX_FANOUT if max_fanout is None else max_fanout
        self.supported = isinstance(drafter, LlamaDrafter)
        self.fork = ForkSteps(drafter) if self.supported else None
        if self.fork is not None:
            self.fork.cut = self._cut  # (a no-op outside table(), or without its interrupt)
        self._acc: dict[int, Acceptance] = {}  # session id -> acceptance by confidence (table.Acceptance)
        self.k_run = 0  # the deepest round of the frame being branched (a k = 0 entry's drafts per branch)
        # (session, req) -> gen, base, drafts, their confidences (draft_confs; None until a table chose from them)
        self._last: dict[tuple[int, int], tuple[int, int, np.ndarray, np.ndarray | None]] = {}
        self._confs: dict[int, np.ndarray] = {}  # block index -> its drafts' confidences, in the table being made
        # request row -> (base L, round drafts f, [Branch]): what a next STEP that extends that row by a
        # branch's prefix can be answered with (HitDrafter), until the next prefetch reuses the scratch rows
        self.records: dict[int, tuple[int, np.ndarray, list[Branch]]] = {}
        # request row -> (context length, drafts, the Branch) of the STEP just answered from a branch
        # (HitDrafter): that branch's own candidates at the stopping places, so the table after it runs no
        # forward over them (Branch.top_t None: no candidates, e.g. the replay drafter's branches)
        self.answered: dict[int, tuple[int, np.ndarray, Branch]] = {}
        self.sync_bonus = False  # wait for (and book) the bonus place's forward in each table (to time it)
        self.stats = {"tables": 0, "branches": 0, "prefetch_us": 0, "worker_side_hits": 0, "observed": 0,
                      "hit_mismatches": 0, "stops_forwards": 0, "stops_from_branches": 0, "preempted": 0}
        self._interrupt: Callable[[], bool] | None = None  # table()'s, while it runs
        self._step_s = 0.0  # the worker time of the last STEP not answered from a branch
        self._took = {p: 0.0 for p in PIECES}  # each piece's seconds in the last table (the work left, _cut)
        # where the branch work goes, µs summed over tables (PIECES; device work included: every piece
        # ends in a host read of its results, so its wall time is the device's too)
        self.stats.update({f"{p}_us": 0 for p in PIECES})
        # fault injection for tests: every prefetch takes this much longer (a worker killed mid-prefetch, a
        # drafter slower than the verify); cut like device work
        self.delay_s = env_ms("DRAFTRELAY_PREFETCH_DELAY_MS") / 1000
        self.cut_late = env_choice("DRAFTRELAY_BRANCH_CUT", "on", CUT_MODES)
        self.share = env_choice("DRAFTRELAY_BRANCH_SHARE", "on", SHARE_MODES)

    def device_free(self) -> None:
        """Wait for the drafter's device to finish work queued behind a table (the real device orders it
        itself; the emulated one does not: ReplayPrefetcher)."""

    def forget_request(self, session_id: int, request_id: int, row: int) -> None:
        """A request that ended or was evicted: its last drafts and its row's branch records go (a plain
        round, which builds no table, may be the one that ends it)."""
        self._last.pop((session_id, request_id), None)
        self.records.pop(row, None)

    def forget_session(self, session_id: int) -> None:
        self._acc.pop(session_id, None)
        for key in [k for k in self._last if k[0] == session_id]:
            del self._last[key]

    def _observe(self, sid: int, blocks: list[P.Block]) -> Acceptance:
        acc = self._acc.setdefault(sid, Acceptance())
        for b in blocks:
            last = self._last.get((sid, b.request_id))
            if last is None or last[0] != b.generation or last[1] != b.position or len(b.tokens) == 0:
                continue
            f, confs = last[2], last[3]
            if confs is None:  # no table was chosen for that round: its drafts' confidences are not known
                continue
            m = min(len(f), len(b.tokens) - 1)
            eq = np.asarray(b.tokens[:m]) == f[:m]
            kept = m if eq.all() else int(np.argmin(eq))
            acc.update(confs, kept)
            self.stats["observed"] += 1
        return acc

    def table(self, session, blocks: list[P.Block], result, fanout: int,
              interrupt: Callable[[], bool] | None = None) -> Table:
        """The branch table for the STEP just answered. interrupt() True (the client's next STEP waits):
        the work stops at its next device step and the table goes out empty (Preempted)."""
        t0 = time.perf_counter()
        if not self.answered:  # a drafted STEP: what the next one takes unless answered from a branch
            self._step_s = int(result.worker_us) / 1e6
        sid = session.id
        acc = self._observe(sid, blocks)
        self._lap("observe", t0)
        fanout = max(0, min(fanout, self.max_fanout))
        # a request that asked no drafts (its verify runs without drafts: the target's one token) gets a k = 0
        # entry, branches over that token with as many drafts as the frame's deepest round (none if no round
        # of the frame asked any). A round's depth is what it asked: under the confidence stop it may have
        # drafted fewer, and its branches are drafted as deep as the next round asks (each then offering what
        # the stop would return: Branch counts)
        self.k_run = k_run = int(max((max(int(c), _asked(b)) for c, b in zip(result.counts, blocks, strict=True)),
                                     default=0))
        todo = []  # (block index, request state, k)
        for i, b in enumerate(blocks):
            k = int(result.counts[i])
            st = session.requests.get(b.request_id)
            if (st is None or (k == 0 and (b.n_out or not k_run)) or int(result.status[i]) not in (P.OK, P.PARTIAL)
                    or len(b.tokens) == 0):
                self._last.pop((sid, b.request_id), None)
                continue
            if k:
                self._last[(sid, b.request_id)] = (b.generation, st.ctx_len, result.drafts[i, :k].astype(np.int32),
                                                   None)
            else:
                self._last.pop((sid, b.request_id), None)
            if (fanout and self.supported and st.ctx_len + max(k, k_run) + 1 <= self.drafter.max_ctx
                    and self._fits(max(k, _asked(b))) and self._holds(st, k)):
                todo.append((i, st, k))
        entries: list[Entry] = []
        self.records.clear()  # the scratch rows are about to be reused
        self._interrupt = interrupt if self.cut_late == "on" else None
        try:
            self._delay()
            if todo:
                self._confs = {}
                entries = self._draft(blocks, result, todo, acc, fanout)
                for i, confs in self._confs.items():  # what the next STEP's tokens calibrate (_observe)
                    key = (sid, blocks[i].request_id)
                    if key in self._last:
                        self._last[key] = (*self._last[key][:3], confs)
        except Preempted:
            entries = []
            self.records.clear()  # nothing of the cut run may answer a STEP
            if self.fork is not None:
                self.fork._bonus = None
            self.stats["preempted"] += 1
        finally:
            self.answered.clear()
            self._interrupt = None
        self.stats["tables"] += 1
        self.stats["branches"] += sum(e.n_branches for e in entries)
        us = int((time.perf_counter() - t0) * 1e6)
        self.stats["prefetch_us"] += us
        return Table(entries, us, sid)

    def _fits(self, k: int) -> bool:
        """Whether the forward over k + 1 stopping places has the fast attention's shapes (forked rows
        need them: n_rep * (k + 1) query rows per kv head, at most model.DECODE_ROWS)."""
        from draftrelay.model import DECODE_ROWS

        model = getattr(self.drafter, "model", None)
        return model is None or model.cfg.n_rep * (k + 1) <= DECODE_ROWS

    def _holds(self, st, k: int) -> bool:
        """Whether the request's row holds C + f1..f(k-1) (k = 0: C), what every branch's forked row reads
        below its pivot (a drafter that cut its run short holds less: no branches then)."""
        cache = getattr(self.drafter, "cache", None)
        return cache is None or int(cache.lengths[st.row]) >= st.ctx_len + max(k - 1, 0)

    def _delay(self) -> None:
        """The injected delay (delay_s), slept in slices that are cut as device work is."""
        end = time.perf_counter() + self.delay_s
        while (left := end - time.perf_counter()) > 0:
            self._cut(left)
            time.sleep(min(left, 0.005))

    def _cut(self, left_s: float) -> None:
        """Before each device step, with the seconds of work left (as the last table took them): stop if
        that is longer than a STEP and the client's next STEP is already waiting (table's interrupt). A
        shorter rest still gives a table no later than that STEP's reply, and a hit saves the STEP."""
        if self._interrupt is not None and left_s > self._step_s and self._interrupt():
            raise Preempted

    def _lap(self, piece: str, t0: float) -> float:
        """Book the time since t0 to `piece`; returns now."""
        now = time.perf_counter()
        self.stats[f"{piece}_us"] += int((now - t0) * 1e6)
        self._took[piece] = now - t0
        return now

    def _from_branch(self, st, f: np.ndarray) -> bool:
        """Whether the STEP just answered for this request (context length, drafts f) came from a branch
        (f: the branch's drafts, or their first ones where the confidence stop ended the reply there)."""
        h = self.answered.get(st.row)
        return h is not None and h[0] == st.ctx_len and len(f) <= len(h[1]) and np.array_equal(h[1][:len(f)], f)

    def _answered_top(self, st, f: np.ndarray):
        """The candidates at the stopping places of the STEP just answered from a branch for this request,
        or None (the STEP drafted: a forward over them is needed)."""
        if not self._from_branch(st, f):
            return None
        br = self.answered[st.row][2]
        n = len(f)
        if br.top_t is None:
            return None
        if n < len(br.top_t):
            return br.top_t[:n + 1], br.top_p[:n + 1]
        q = self._bonus_branch(st, f)
        bonus = self.fork.bonus_tops([q]) if q is not None else None
        if bonus is None:
            return None
        return np.concatenate([br.top_t, bonus[0]]), np.concatenate([br.top_p, bonus[1]])

    def _bonus_branch(self, st, f: np.ndarray) -> int | None:
        """The run's branch whose bonus place the table after this STEP reads: the branch that answered it
        with all its drafts f (its candidates at the other places are the run's own), else None."""
        if not self._from_branch(st, f):
            return None
        br = self.answered[st.row][2]
        return br.q if br.top_t is not None and br.q >= 0 and len(f) == len(br.top_t) else None

    def _bonus_first(self, result, todo, t: float) -> float:
        """Before the table's step 1 (which may remake the scratch rows): the bonus places the table reads,
        of the branches that answered the STEP just served with all their drafts (their candidates at the
        other places are the run's own), in one batch, booked as "bonus". Returns the time it ended."""
        found = (self._bonus_branch(st, result.drafts[i, :k].astype(np.int32)) for i, st, k in todo)
        qs = [q for q in found if q is not None]
        if qs and self.fork is not None and self.fork.bonus_tops(qs) is not None:
            return self._lap("bonus", t)
        return t

    def _cap(self, fanout: int, n_requests: int) -> int:
        """The most branches one request of the batch may get: F for one request or with sharing off,
        else up to SHARE_CAP x F (the batch's total stays n x F: _share)."""
        if n_requests <= 1 or self.share == "off":
            return fanout
        return min(self.max_fanout, SHARE_CAP * fanout)

    def _choose(self, i: int, top_t: np.ndarray, top_p: np.ndarray, drafts: np.ndarray, acc: Acceptance,
                cap: int) -> list[tuple[int, int, float]]:
        """The `cap` most likely outcomes (a, y, p) for block i, whose round drafted `drafts`, from the
        candidates [k + 1, m] at its stopping places; the drafts' confidences are kept (`_confs`) for the
        next STEP's tokens to calibrate `acc` with (_observe)."""
        f = np.asarray(drafts, np.int32)
        confs = self._confs[i] = draft_confs(top_t, top_p, f)
        return choose_branches(top_t, top_p, f, acc.rates(confs), cap)

    @staticmethod
    def _share(cands: list[list[tuple[int, int, float]]], fanout: int) -> list[list[tuple[int, int]]]:
        """The outcomes (a, y) each request branches on: n x F in all, where they raise the chance that
        every request hits (allot_branches; with at most F candidates each, F each)."""
        counts = allot_branches([[p for _, _, p in c] for c in cands], len(cands) * fanout)
        return [[(a, y) for a, y, _ in c[:n]] for c, n in zip(cands, counts, strict=True)]

    @staticmethod
    def _branch_rows(choices: list[list[tuple[int, int]]]) -> list[int]:
        """Each request's first scratch row for its branches, which lie side by side (n x F rows in all:
        the rows the stopping places' forward used are read out by then, and no branch reads them)."""
        return [int(x) for x in np.cumsum([0] + [len(c) for c in choices[:-1]])]

    def _draft(self, blocks, result, todo, acc: Acceptance, fanout: int) -> list[Entry]:
        t = self._bonus_first(result, todo, time.perf_counter())
        self._cut(self._took["stops"] + self._took["run"])
        top_t, top_p = self._stop_distributions(blocks, result, todo, fanout)
        t = self._lap("stops", t)
        cap = self._cap(fanout, len(todo))
        choices = self._share([self._choose(i, top_t[n, :k + 1], top_p[n, :k + 1], result.drafts[i, :k], acc, cap)
                               for n, (i, _st, k) in enumerate(todo)], fanout)
        base_rows = self._branch_rows(choices)
        t = self._lap("choose", t)
        self._cut(self._took["run"])
        run = self._branch_run(result, todo, base_rows, choices)
        t = self._lap("run", t)
        out = self._entries(blocks, result, todo, choices, base_rows, *run)
        self._lap("entries", t)
        return out

    def _stop_distributions(self, blocks, result, todo, fanout: int):
        """Step 1: the top TOP_M candidates (tokens [R, k+1, m], probs) at each request's k + 1 stopping
        places. A request whose STEP was answered from a branch has them from that branch's run; the others
        get one padded forward over (C[-1], f1..fk), each in the first of its `fanout` forked scratch rows
        (pivot L - 1: nothing of the context is copied; the branches use the rows afresh, _branch_rows)."""
        d = self.drafter
        self.fork.scratch(len(todo) * fanout)
        T = 1 + max(k for _, _, k in todo)
        m = min(TOP_M, d.model.cfg.vocab_size)
        top_t = np.zeros((len(todo), T, m), np.int64)
        top_p = np.zeros((len(todo), T, m), np.float32)
        stop_rows = [n * fanout for n in range(len(todo))]
        need = []
        for n, (i, st, k) in enumerate(todo):
            got = self._answered_top(st, result.drafts[i, :k].astype(np.int32))
            if got is None:
                need.append(n)
            else:
                top_t[n, :k + 1], top_p[n, :k + 1] = got
        self.stats["stops_from_branches"] += len(todo) - len(need)
        if need:
            toks = np.zeros((len(need), T), np.int64)
            starts, parents, rows = [], [], []
            for r, n in enumerate(need):
                i, st, k = todo[n]
                toks[r, 0] = int(blocks[i].tokens[-1])
                toks[r, 1:1 + k] = result.drafts[i, :k]
                starts.append(st.ctx_len - 1)
                parents.append(st.row)
                rows.append(stop_rows[n])
            tt, tp = self.fork.stops(toks, starts, parents, rows, m)
            top_t[need], top_p[need] = tt, tp
            self.stats["stops_forwards"] += 1
        return top_t, top_p

    def _branch_run(self, result, todo, base_rows, choices):
        """Step 3: every branch (a, y) of every request gets a forked scratch row (pivot L + a, or L + k - 1
        for a bonus branch, which feeds f_k first; below it the request's row) and all are drafted in one
        batched run. Returns (drafts, confidences, top tokens, top probs, lo), one row per branch in
        `choices` order."""
        first, last, starts, parents, pivots, rows = [], [], [], [], [], []
        for n, (i, st, k) in enumerate(todo):
            L = st.ctx_len
            f = result.drafts[i, :k]
            for b, (a, y) in enumerate(choices[n]):
                rows.append(base_rows[n] + b)
                parents.append(st.row)
                if a < k or k == 0:  # y at L + a (k = 0: right after the context)
                    first.append((y, 0))
                    last.append(0)
                    starts.append(L + a)
                else:
                    first.append((int(f[k - 1]), y))
                    last.append(1)
                    starts.append(L + k - 1)
                pivots.append(starts[-1])
        # every branch is drafted as deep as the frame's deepest round asked (k_run, set by table())
        k_max = max(max(k for _, _, k in todo), self.k_run)
        if not rows:
            z = np.zeros((0, k_max), np.int32)
            return z, z.astype(np.float32), None, None, []
        m = min(TOP_M, self.drafter.model.cfg.vocab_size)
        # each request's first branch (the lazy bonus step's rows: one a request)
        firsts = sorted({x for x in self._branch_rows(choices) if x < len(rows)})
        d, c, tt, tp = self.fork.branches(np.asarray(first, np.int64), last, starts, parents, pivots, rows, k_max, m,
                                          sync_bonus=self.sync_bonus, firsts=firsts)
        if self.sync_bonus:  # its own piece: in the worker it runs while the table goes out
            us = int(self.fork.last_bonus_s * 1e6)
            self.stats["run_us"] -= us
            self.stats["bonus_us"] += us
        return d, c, tt, tp, pivots

    def _entries(self, blocks, result, todo, choices, base_rows, out_d, out_c, out_tt=None, out_tp=None,
                 lows=None) -> list[Entry]:
        """The table's entries, and the records a next STEP can be answered from (HitDrafter)."""
        entries = []
        first = 0
        for n, pairs in enumerate(choices):
            i, st, k = todo[n]
            b = blocks[i]
            nb = len(pairs)
            kb = max(k, _asked(b)) or self.k_run  # drafts per branch: what the round asked (k = 0 entry: the frame's)
            f = result.drafts[i, :k].astype(np.int32)
            # under the confidence stop a round after this outcome returns the branch's drafts up to and
            # including its first unsure one: what the engine may use, and what the worker answers from it
            stop = float(getattr(b, "min_conf", 0.0))
            counts = (stop_counts(out_c[first:first + nb, :kb], [stop] * nb, [kb] * nb).astype(np.int32)
                      if stop > 0 and nb else None)
            branches = []
            for j, (a, y) in enumerate(pairs):
                q = first + j
                row = base_rows[n] + j if base_rows[n] >= 0 else -1
                tops = (None, None) if out_tt is None else (out_tt[q].copy(), out_tp[q].copy())
                branches.append(Branch(np.concatenate([f[:a], [y]]).astype(np.int32), row,
                                       lows[q] if lows else 0, out_d[q, :kb].copy(), out_c[q, :kb].copy(), *tops,
                                       q if out_tt is not None else -1))
            self.records[st.row] = (st.ctx_len, f, branches)
            entries.append(Entry(b.request_id, b.generation, st.ctx_len, f,
                                 np.array([a for a, _ in pairs], np.int32), np.array([y for _, y in pairs], np.int32),
                                 out_d[first:first + nb, :kb].astype(np.int32).reshape(nb, kb), counts))
            first += nb
        return entries


class HitDrafter:
    """The core's drafter while prefetching is on: a STEP whose block extends a request exactly by a
    prefetched branch's prefix is answered from that branch (its drafts, confidences and KV, copied
    back into the request's row) instead of drafting again, the worker-side half of a hit. Every other
    job goes to the real drafter, and a job on a row drops that row's record: the record then no
    longer describes the row. Everything else is the real drafter's."""

    # each job's draft count of the frame being run, set by WorkerCore before run() (None: not given). The
    # jobs no branch answers are drafted only as deep as the deepest of them asks: a block asking no drafts
    # (the engine's "early" rule: a row that missed) costs its extension only, not the frame's depth
    windows: list[int] | None = None

    def __init__(self, drafter, prefetcher: Prefetcher) -> None:
        self._d = drafter
        self._pf = prefetcher

    def __getattr__(self, name):
        return getattr(self._d, name)

    def _hit(self, job: Job, n_steps: int) -> Branch | None:
        rec = self._pf.records.get(job.row)
        if rec is None:
            return None
        L, f, branches = rec
        c = job.keep - L
        if c < 0 or c > max(len(f) - 1, 0) or n_steps < 1:  # a k = 0 record: c = 0, the token right after L
            return None
        want = np.concatenate([f[:c], job.tokens]).astype(np.int32)
        for br in branches:
            if n_steps <= len(br.drafts) and len(br.prefix) == len(want) and np.array_equal(br.prefix, want):
                return br
        return None

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        windows, self.windows = self.windows, None
        if windows is None or len(windows) != len(jobs):
            windows = [n_steps] * len(jobs)
        hits = {i: h for i, j in enumerate(jobs) if (h := self._hit(j, n_steps)) is not None}
        pf = self._pf
        for j in jobs:
            pf.records.pop(j.row, None)
            pf.answered.pop(j.row, None)
        if len(hits) < len(jobs):
            pf.device_free()
        idx = [i for i in range(len(jobs)) if i not in hits]
        deep = max((windows[i] for i in idx), default=0)  # what the jobs no branch answers need
        if not hits and deep == n_steps:
            return self._d.run(jobs, n_steps)
        drafts = np.zeros((len(jobs), n_steps), np.int32)
        confs = np.zeros((len(jobs), n_steps), np.float32)
        if idx:
            d, c = self._d.run([jobs[i] for i in idx], deep)
            drafts[idx, :deep], confs[idx, :deep] = d, c
        self._answer(jobs, hits, n_steps, drafts, confs)
        for i, br in hits.items():  # the next table reads this round's stopping places from the branch
            j = jobs[i]
            pf.answered[j.row] = (j.keep + len(j.tokens), drafts[i].copy(), br)
        pf.stats["worker_side_hits"] += len(hits)
        return drafts, confs

    def _answer(self, jobs: list[Job], hits: dict, n_steps: int, drafts: np.ndarray, confs: np.ndarray) -> None:
        """The hit jobs' drafts and confidences from their branches, and the branch's own KV (its forked
        row from its pivot on; below it the request's row already holds it) into the request's row."""
        sc = self._pf.fork.cache
        for i, br in hits.items():
            j = jobs[i]
            # the same row length the drafter leaves: context + the first n_steps - 1 drafts
            _copy_row(sc, br.row, self._d.cache, j.row, j.keep + len(j.tokens) + n_steps - 1, lo=br.lo,
                      compact=self._pf.fork.compact)
            drafts[i], confs[i] = br.drafts[:n_steps], br.confs[:n_steps]


class ReplayPrefetcher(Prefetcher):
    """Branches for a ReplayDrafter (benchmarks: a real pair's acceptance replayed from a trace). The
    outcomes (a, y) are chosen with `choose_branches` from the trace's recorded top candidates at the k + 1
    stopping places (ReplayDrafter.stops) and the session's acceptance by confidence, as for a real drafter;
    each branch's drafts are what the ReplayDrafter would draft after context + f1..fa, y. The cost is
    the real branch work: with a real inner drafter, Prefetcher's forward and batched run on scratch rows
    of the inner model (their tokens replaced by the trace's); for a drafter on an emulated second
    device, the measured seconds of that work (CostTable.prefetch) spent as wall time."""

    def __init__(self, drafter: ReplayDrafter, max_fanout: int | None = None) -> None:
        inner = drafter.inner
        real = isinstance(inner, LlamaDrafter)
        super().__init__(inner if real else drafter, max_fanout)
        self.replay = drafter
        self.real = real
        self._busy_until = 0.0  # the emulated device is busy until then (the bonus forward behind a table)
        self.supported = real or (drafter.cost is not None and bool(drafter.cost.prefetch))
        if not self.supported:
            log.warning("replay prefetch: no branch cost (inner %r, no prefetch entries in the cost table): "
                        "empty tables", type(inner).__name__)

    def _draft(self, blocks, result, todo, acc: Acceptance, fanout: int) -> list[Entry]:
        rd = self.replay
        m = min(TOP_M, rd.trace.top_f)
        t = time.perf_counter()
        if self.real:  # the real step 1 (its distributions are the random model's: only its cost is used)
            t = self._bonus_first(result, todo, t)
            self._cut(self._took["stops"] + self._took["run"])
            self._stop_distributions(blocks, result, todo, fanout)
            t = self._lap("stops", t)
        cap = self._cap(fanout, len(todo))
        cands = []
        for i, st, k in todo:
            f = result.drafts[i, :k].astype(np.int32)
            tok, prob = rd.stops(st.row, st.ctx_len, f, m)
            cands.append(self._choose(i, tok, prob, f, acc, cap))
        choices = self._share(cands, fanout)
        base_rows = self._branch_rows(choices) if self.real else [-1] * len(todo)
        k_max = max(max(k for _, _, k in todo), self.k_run)
        t = self._lap("choose", t)
        self._cut(self._took["run"])  # (as a real device's: before its branch run, which is one launch)
        run = None
        if self.real:  # the real step 3 on the chosen outcomes
            run = self._branch_run(result, todo, base_rows, choices)
        else:  # the device pieces (DEVICE_PIECES) as measured; the host pieces run here for real
            ctx = max(st.ctx_len for _, st, _ in todo)
            key = (len(todo), fanout, k_max, ctx)
            s, bonus = rd.cost.lookup_prefetch(*key), rd.cost.lookup_prefetch_bonus(*key)
            # after a STEP answered from branches for every request, the real work has no forward over the
            # stopping places (the branch run gave their candidates)
            answered = [self._from_branch(st, result.drafts[i, :k]) for i, st, k in todo]
            if all(answered):
                s -= rd.cost.lookup_prefetch_stops(*key)
                self.stats["stops_from_branches"] += len(todo)
            else:
                self.stats["stops_forwards"] += 1
            self.device_free()
            if rd.cost.bonus_mode == "lazy":  # the answering branches' bonus forward first, none behind the table
                spend(s if any(answered) else s - bonus)
            else:
                spend(s - bonus)
                # the bonus forward runs on the device after the table is out: the device's next work waits for it
                self._busy_until = time.perf_counter() + bonus
        t = self._lap("run", t)
        out_d = np.zeros((sum(len(c) for c in choices), k_max), np.int32)
        row = 0
        for (i, st, k), pairs in zip(todo, choices, strict=True):
            f = result.drafts[i, :k].astype(np.int32)
            kb = max(k, _asked(blocks[i])) or self.k_run
            for a, y in pairs:
                out_d[row, :kb] = rd.branch_drafts(st.row, st.ctx_len, np.concatenate([f[:a], [y]]), kb)
                row += 1
        if run is None:
            out = self._entries(blocks, result, todo, choices, base_rows, out_d, np.zeros(out_d.shape, np.float32))
        else:
            out = self._entries(blocks, result, todo, choices, base_rows, out_d, *run[1:])
        self._lap("entries", t)
        return out


    def device_free(self) -> None:
        """The emulated device's queue: wait for the work still running on it (the last bonus forward)."""
        left = self._busy_until - time.perf_counter()
        if left > 0:
            spend(left)


class ReplayHitDrafter(HitDrafter):
    """HitDrafter for a ReplayDrafter: a job answered from a branch costs nothing (no inner run, no
    emulated wall time) and goes through ReplayDrafter.book, so hist, lengths and on_trace end exactly as
    an ordinary run leaves them; with a real inner drafter the branch's KV is copied back into the inner
    drafter's row as HitDrafter does. `stats["hit_mismatches"]` counts hits whose booked drafts differ
    from the branch's (none, by construction: the branch's drafts are what book returns)."""

    def _answer(self, jobs: list[Job], hits: dict, n_steps: int, drafts: np.ndarray, confs: np.ndarray) -> None:
        hi = sorted(hits)
        drafts[hi], confs[hi] = self._d.book([jobs[i] for i in hi], n_steps)
        pf = self._pf
        for i in hi:
            br = hits[i]
            pf.stats["hit_mismatches"] += int(not np.array_equal(br.drafts[:n_steps], drafts[i]))
            if pf.real:
                j = jobs[i]
                _copy_row(pf.fork.cache, br.row, self._d.inner.cache, j.row, j.keep + len(j.tokens) + n_steps - 1,
                          lo=br.lo, compact=pf.fork.compact)


def make_prefetcher(drafter) -> tuple[Prefetcher, object]:
    """The prefetcher for a core's drafter and the drafter the core then uses (a HitDrafter where the
    prefetcher can branch, so hits skip the drafting)."""
    if isinstance(drafter, ReplayDrafter):
        pf = ReplayPrefetcher(drafter)
        return pf, (ReplayHitDrafter(drafter, pf) if pf.supported else drafter)
    pf = Prefetcher(drafter)
    return pf, (HitDrafter(drafter, pf) if pf.supported else drafter)


def _asked(block) -> int:
    """Drafts a block's round asked for (the confidence stop may have returned fewer)."""
    return int(getattr(block, "n_out", 0))


def _copy_row(src, src_row: int, dst, dst_row: int, n: int, lo: int = 0, compact: bool = False) -> None:
    """KV of positions lo .. n - 1 of src's row into dst's row, whose length becomes n (the two caches
    share the model's shape; a forked row's positions below its pivot are dst's already). compact: src's
    row holds position p at p - lo (a compact forked row, lo its pivot)."""
    if n > lo:
        a, b = (0, n - lo) if compact else (lo, n)
        if b > src.max_len:
            raise ValueError(f"_copy_row: positions {lo} .. {n - 1} exceed the source row's {src.max_len} slots")
        dst.k[:, dst_row, :, lo:n] = src.k[:, src_row, :, a:b]
        dst.v[:, dst_row, :, lo:n] = src.v[:, src_row, :, a:b]
    dst.lengths[dst_row] = n


def branches_payload(core, session, blocks: list[P.Block], result, fanout: int,
                     interrupt: Callable[[], bool] | None = None) -> bytes:
    """The BRANCHES frame's payload for the STEP just answered (an empty table when the drafter
    cannot branch, so the client never waits for a frame that will not come; or when interrupt()
    says the client's next STEP already waits: Prefetcher.table)."""
    with core.lock:
        pf = core.prefetcher
        if pf is None:
            pf, core.drafter = make_prefetcher(core.drafter)
            core.prefetcher = pf
        if session.id not in core.sessions:
            return encode(Table([], 0, session.id))
        try:
            table = pf.table(session, blocks, result, fanout, interrupt)
            t0 = time.perf_counter()
            out = encode(table)
            pf._lap("encode", t0)
            return out
        except KVMemoryError:  # branch rows the memory refused: said once, where they were refused (scratch)
            return encode(Table([], 0, session.id))
        except Exception:  # prefetching is an optimisation: its failure costs the next round's hit only
            log.exception("prefetch failed in session %016x", session.id)
            return encode(Table([], 0, session.id))
