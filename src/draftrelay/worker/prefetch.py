"""The worker's half of the speculation cache: after answering a STEP, draft the next round for the
likely outcomes of the verify now running on the engine (see draftrelay.speculation.table).

For each request the STEP just served (context C of length L = base, drafts f1..fk):
  1. one forward over (C[-1], f1..fk) in a scratch row (a copy of the request's draft KV) gives the
     drafter's distribution at each of the k+1 places the verify can stop (k corrections, 1 bonus);
  2. `choose_branches` picks the F most likely outcomes (a kept, token y) from those distributions
     and the session's running per-position acceptance;
  3. every branch gets its own scratch row (the KV of C + f1..fa, copied) and all branches of all
     requests are drafted in ONE batched drafter run: extension by [y], then k greedy steps.
The request's own KV row is only read, never written: the next STEP sees exactly the state it would
have seen without prefetching. Scratch rows are full-context copies (simple and exact on the CPU
path; a GPU layout that shares the prefix is a separate piece of work).

The session's acceptance estimate learns from the next STEP's tokens: the block that follows a
round with drafts f starts with the accepted drafts, then the target's token.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from draftrelay.capture import GraphCapture, kv_bucket, kv_buckets
from draftrelay.replay import ReplayDrafter, spend
from draftrelay.speculation.table import Acceptance, Entry, Table, choose_branches, encode
from draftrelay.wire import protocol as P
from draftrelay.worker.drafters import Job, LlamaDrafter

log = logging.getLogger("draftrelay.worker")

TOP_M = 8  # candidates per position considered for branches (F <= (k + 1) * TOP_M)
# the forward over the stopping places runs with static shapes (a CUDA graph on a GPU) up to this kv
# bucket, eagerly beyond: on the H200 it ran at contexts up to 512 and hit an illegal memory access at
# 33K (T = k + 1 = 5 query positions, kv = the cache's full length), not yet explained
STATIC_STOPS_MAX_KV = 4096
# the pieces of a table's branch work: observe (acceptance from the STEP), stops (the forward over the k + 1
# stopping places, with its row copy), choose (choose_branches), run (the branch rows' copies and the batched
# run), entries (the table's entries and the hit records), encode (the BRANCHES payload)
PIECES = ("observe", "stops", "choose", "run", "entries", "encode")
DEVICE_PIECES = ("stops", "run")  # what a drafter on an emulated device spends as wall time (CostTable.prefetch)


class Prefetcher:
    """Branch drafting for one WorkerCore. Call `table(session, blocks, result, fanout)` with the
    core's lock held, right after the STEP was answered."""

    def __init__(self, drafter, max_fanout: int = 16) -> None:
        self.drafter = drafter
        self.max_fanout = max_fanout
        self.supported = isinstance(drafter, LlamaDrafter)
        self._scratch: LlamaDrafter | None = None
        self._acc: dict[int, Acceptance] = {}  # session id -> running acceptance
        self._last: dict[tuple[int, int], tuple[int, int, np.ndarray]] = {}  # (session, req) -> gen, base, drafts
        # request row -> (base L, round drafts f, [(prefix, scratch row, drafts, confidences)]): what a next
        # STEP that extends that row by a branch's prefix can be answered with (HitDrafter), until the
        # next prefetch reuses the scratch rows
        self.records: dict[int, tuple[int, np.ndarray, list]] = {}
        self._stops: dict[tuple[int, int, int], object] = {}  # static step-1 forwards by (requests, T, kv)
        self._stops_failed = False
        self.stats = {"tables": 0, "branches": 0, "prefetch_us": 0, "worker_side_hits": 0, "observed": 0,
                      "hit_mismatches": 0}
        # where the branch work goes, µs summed over tables (PIECES; device work included: every piece
        # ends in a host read of its results, so its wall time is the device's too)
        self.stats.update({f"{p}_us": 0 for p in PIECES})
        # fault injection for tests: every prefetch takes this much longer (a worker killed mid-prefetch)
        self.delay_s = float(os.environ.get("DRAFTRELAY_PREFETCH_DELAY_MS", "0") or 0) / 1000

    def forget_session(self, session_id: int) -> None:
        self._acc.pop(session_id, None)
        for key in [k for k in self._last if k[0] == session_id]:
            del self._last[key]

    def _scratch_for(self, rows: int) -> LlamaDrafter:
        d = self.drafter
        if self._scratch is None or self._scratch.n_rows < rows:
            n = 1 << max(0, rows - 1).bit_length()
            # the branch run is a batched 1-token extension + k steps: on a GPU the drafter's CUDA graphs
            # (one per (branches, k, kv bucket)), else eager
            mode = getattr(d, "mode", "eager")
            self._scratch = LlamaDrafter(d.model, n, d.max_ctx, d.n_out_max, d.model_id, d.tokenizer_hash,
                                         mode=mode)
            # the static forwards over the stopping places were built on (graph mode: captured reading)
            # the old scratch cache: kept, they would read rows nobody copies into any more, and the
            # branch choice would follow stale distributions (the drafts stay right, the hits fall)
            self._stops.clear()
        return self._scratch

    def _next_buckets(self, sc: LlamaDrafter, need: int) -> list[int]:
        """The kv bucket holding `need` keys and the next ones up to need + 512: built at once, so a
        growing context does not pay a capture in the middle of a run."""
        lo, hi = kv_bucket(need, sc.cache.max_len), kv_bucket(need + 512, sc.cache.max_len)
        return [kv for kv in kv_buckets(sc.cache.max_len) if lo <= kv <= hi]

    def _warm_branch_graphs(self, sc: LlamaDrafter, n_jobs: int, k: int, ctx: int) -> None:
        if sc.mode != "graph":
            return
        with sc._on_model_gpu():
            for kv in self._next_buckets(sc, ctx + 1 + k):
                sc._get_static((n_jobs, 1, k, kv))

    def _stops_static(self, sc: LlamaDrafter, R: int, T: int, kv: int, m: int):
        """Step 1 with static shapes (the drafter in static or graph mode): inputs in one device buffer,
        the forward over the first kv positions, softmax and top-m into static outputs; in graph mode
        captured once per (R, T, kv bucket) like the drafter's own steps."""
        key = (R, T, kv)
        g = self._stops.get(key)
        if g is not None:
            return g
        torch, model, cache = sc.torch, sc.model, sc.cache
        dev = model.device
        g = type("StopStep", (), {})()
        g.inbuf = torch.zeros(R * T + 2 * R, dtype=torch.int64, device=dev)
        g.host = torch.zeros(R * T + 2 * R, dtype=torch.int64, pin_memory=dev.type == "cuda")
        g.tokens = g.inbuf[:R * T].view(R, T)
        g.start, g.rows = g.inbuf[R * T:R * T + R], g.inbuf[R * T + R:]
        g.top_p = torch.zeros(R, T, m, dtype=torch.float32, device=dev)
        g.top_t = torch.zeros(R, T, m, dtype=torch.int64, device=dev)
        g.graph = None

        def step():
            logits = model(g.tokens, g.start, cache, g.rows, kv_len=kv)
            tp, tt = torch.softmax(logits.float(), -1).topk(m, dim=-1)
            g.top_p.copy_(tp)
            g.top_t.copy_(tt)

        g.step = step
        if sc.mode == "graph":
            g.rows.fill_(sc.n_rows)  # warm-up and capture write only into the scratch drafter's spare row
            if sc._capture is None:
                sc._capture = GraphCapture(dev)
            with torch.inference_mode():
                sc._capture.warm(step)
                g.graph, _ = sc._capture.capture(step)
        self._stops[key] = g
        return g

    def _observe(self, sid: int, blocks: list[P.Block]) -> Acceptance:
        acc = self._acc.setdefault(sid, Acceptance())
        for b in blocks:
            last = self._last.get((sid, b.request_id))
            if last is None or last[0] != b.generation or last[1] != b.position or len(b.tokens) == 0:
                continue
            f = last[2]
            m = min(len(f), len(b.tokens) - 1)
            eq = np.asarray(b.tokens[:m]) == f[:m]
            kept = m if eq.all() else int(np.argmin(eq))
            acc.update(len(f), kept)
            self.stats["observed"] += 1
        return acc

    def table(self, session, blocks: list[P.Block], result, fanout: int) -> Table:
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        sid = session.id
        acc = self._observe(sid, blocks)
        self._lap("observe", t0)
        fanout = max(0, min(fanout, self.max_fanout))
        todo = []  # (block index, request state, k)
        for i, b in enumerate(blocks):
            k = int(result.counts[i])
            st = session.requests.get(b.request_id)
            if st is None or k == 0 or int(result.status[i]) not in (P.OK, P.PARTIAL) or len(b.tokens) == 0:
                self._last.pop((sid, b.request_id), None)
                continue
            self._last[(sid, b.request_id)] = (b.generation, st.ctx_len, result.drafts[i, :k].astype(np.int32))
            if fanout and self.supported and st.ctx_len + k + 1 <= self.drafter.max_ctx:
                todo.append((i, st, k))
        entries: list[Entry] = []
        self.records.clear()  # the scratch rows are about to be reused
        if todo:
            entries = self._draft(blocks, result, todo, acc, fanout)
        self.stats["tables"] += 1
        self.stats["branches"] += sum(e.n_branches for e in entries)
        us = int((time.perf_counter() - t0) * 1e6)
        self.stats["prefetch_us"] += us
        return Table(entries, us, sid)

    def _lap(self, piece: str, t0: float) -> float:
        """Book the time since t0 to `piece`; returns now."""
        now = time.perf_counter()
        self.stats[f"{piece}_us"] += int((now - t0) * 1e6)
        return now

    def _draft(self, blocks, result, todo, acc: Acceptance, fanout: int) -> list[Entry]:
        t = time.perf_counter()
        top_t, top_p, base_rows = self._stop_distributions(blocks, result, todo, fanout)
        t = self._lap("stops", t)
        choices = []
        for n, (i, _st, k) in enumerate(todo):
            f = result.drafts[i, :k].astype(np.int32)
            choices.append([(a, y) for a, y, _ in choose_branches(top_t[n, :k + 1], top_p[n, :k + 1], f, acc.rates(k),
                                                                  fanout)])
        t = self._lap("choose", t)
        out_d, out_c = self._branch_run(result, todo, base_rows, choices)
        t = self._lap("run", t)
        out = self._entries(blocks, result, todo, choices, base_rows, out_d, out_c)
        self._lap("entries", t)
        return out

    def _stop_distributions(self, blocks, result, todo, fanout: int):
        """Step 1: one padded forward over (C[-1], f1..fk) for every request, each in the first of its
        `fanout` scratch rows. Returns the top TOP_M (tokens [R, k+1, m], probs) and those base rows."""
        d = self.drafter
        torch = d.torch
        main = d.cache
        sc = self._scratch_for(len(todo) * fanout)
        cache = sc.cache
        model = d.model
        with torch.inference_mode():
            T = 1 + max(k for _, _, k in todo)
            toks = np.zeros((len(todo), T), np.int64)
            starts = []
            base_rows = []
            for n, (i, st, k) in enumerate(todo):
                L = st.ctx_len
                row = n * fanout
                _copy_row(main, st.row, cache, row, L - 1)
                toks[n, 0] = int(blocks[i].tokens[-1])
                toks[n, 1:1 + k] = result.drafts[i, :k]
                starts.append(L - 1)
                base_rows.append(row)
            m = min(TOP_M, model.cfg.vocab_size)
            kv = kv_bucket(max(starts) + T, cache.max_len)
            if sc.mode != "eager" and not self._stops_failed and kv <= STATIC_STOPS_MAX_KV:
                try:
                    top_t, top_p = self._stops_run(sc, toks, starts, base_rows, T, m)
                    return top_t, top_p, base_rows
                except Exception:  # like the drafter's own capture failure: eager from now on, not no tables
                    log.exception("prefetch: the static forward over the stopping places failed; eager from now on")
                    self._stops_failed = True
            logits = model(torch.from_numpy(toks).to(model.device), torch.tensor(starts), cache,
                           torch.tensor(base_rows))
            probs = torch.softmax(logits.float(), -1)
            top_p, top_t = probs.topk(m, dim=-1)  # ties: torch's order; choice only, never correctness
            return top_t.cpu().numpy(), top_p.cpu().numpy(), base_rows

    def _stops_run(self, sc: LlamaDrafter, toks: np.ndarray, starts: list[int], base_rows: list[int], T: int,
                   m: int) -> tuple[np.ndarray, np.ndarray]:
        cache = sc.cache
        R = len(starts)
        with sc.torch.inference_mode():
            with sc._on_model_gpu():
                if sc.mode == "graph":
                    for kv in self._next_buckets(sc, max(starts) + T):
                        self._stops_static(sc, R, T, kv, m)
                g = self._stops_static(sc, R, T, kv_bucket(max(starts) + T, cache.max_len), m)
                host = g.host.numpy()
                host[:R * T] = toks.reshape(-1)
                host[R * T:R * T + R] = starts
                host[R * T + R:] = base_rows
                g.inbuf.copy_(g.host, non_blocking=True)
                if g.graph is not None:
                    g.graph.replay()
                else:
                    g.step()
                top_t, top_p = g.top_t.cpu().numpy(), g.top_p.cpu().numpy()
        for n, row in enumerate(base_rows):  # a static forward leaves the row lengths to its caller
            cache.lengths[row] = starts[n] + T
        return top_t, top_p

    def _branch_run(self, result, todo, base_rows, choices):
        """Step 3: every branch (a, y) of every request gets a scratch row (the KV of C + f1..fa) and all
        are drafted in one batched run (extension by [y], then k steps). Returns (drafts, confidences),
        one row per branch in `choices` order."""
        sc = self._scratch
        cache = sc.cache
        jobs: list[Job] = []
        src_rows, dst_rows, n_max = [], [], 0
        with self.drafter.torch.inference_mode():
            for n, (_i, st, k) in enumerate(todo):
                L = st.ctx_len
                base = base_rows[n]
                cache.lengths[base] = L + k  # (C[-1], f1..fk) fed: KV of C + f1..fk
                for b, (a, y) in enumerate(choices[n]):
                    if b:
                        src_rows.append(base)
                        dst_rows.append(base + b)
                        n_max = max(n_max, L + a)
                    jobs.append(Job(base + b, L + a, np.array([y], np.int32)))
            # every branch row's KV in one gather per tensor (positions past a branch's own length are
            # never read: the lengths say where each row ends)
            _copy_rows(self.drafter.torch, cache, src_rows, dst_rows, n_max)
            for j in jobs:  # each branch row holds C + f1..fa (the base row is cut back from C + f1..fk)
                cache.lengths[j.row] = j.keep
        k_max = max(k for _, _, k in todo)
        if not jobs:
            return np.zeros((0, k_max), np.int32), np.zeros((0, k_max), np.float32)
        self._warm_branch_graphs(sc, len(jobs), k_max, max(j.keep for j in jobs))
        return sc.run(jobs, k_max)

    def _entries(self, blocks, result, todo, choices, base_rows, out_d, out_c) -> list[Entry]:
        """The table's entries, and the records a next STEP can be answered from (HitDrafter)."""
        entries = []
        first = 0
        for n, pairs in enumerate(choices):
            i, st, k = todo[n]
            b = blocks[i]
            nb = len(pairs)
            f = result.drafts[i, :k].astype(np.int32)
            rows = [base_rows[n] + j if base_rows[n] >= 0 else -1 for j in range(nb)]
            self.records[st.row] = (st.ctx_len, f, [
                (np.concatenate([f[:a], [y]]).astype(np.int32), rows[j], out_d[first + j, :k].copy(),
                 out_c[first + j, :k].copy()) for j, (a, y) in enumerate(pairs)])
            entries.append(Entry(b.request_id, b.generation, st.ctx_len, f,
                                 np.array([a for a, _ in pairs], np.int32), np.array([y for _, y in pairs], np.int32),
                                 out_d[first:first + nb, :k].astype(np.int32).reshape(nb, k)))
            first += nb
        return entries


class HitDrafter:
    """The core's drafter while prefetching is on: a STEP whose block extends a request exactly by a
    prefetched branch's prefix is answered from that branch (its drafts, confidences and KV, copied
    back into the request's row) instead of drafting again, the worker-side half of a hit. Every other
    job goes to the real drafter, and a job on a row drops that row's record: the record then no
    longer describes the row. Everything else is the real drafter's."""

    def __init__(self, drafter, prefetcher: Prefetcher) -> None:
        self._d = drafter
        self._pf = prefetcher

    def __getattr__(self, name):
        return getattr(self._d, name)

    def _hit(self, job: Job, n_steps: int):
        rec = self._pf.records.get(job.row)
        if rec is None:
            return None
        L, f, branches = rec
        c = job.keep - L
        if c < 0 or c >= len(f) or n_steps < 1:
            return None
        want = np.concatenate([f[:c], job.tokens]).astype(np.int32)
        for prefix, srow, d, conf in branches:
            if n_steps <= len(d) and len(prefix) == len(want) and np.array_equal(prefix, want):
                return srow, d[:n_steps], conf[:n_steps]
        return None

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        hits = {i: h for i, j in enumerate(jobs) if (h := self._hit(j, n_steps)) is not None}
        for j in jobs:
            self._pf.records.pop(j.row, None)
        if not hits:
            return self._d.run(jobs, n_steps)
        drafts = np.zeros((len(jobs), n_steps), np.int32)
        confs = np.zeros((len(jobs), n_steps), np.float32)
        idx = [i for i in range(len(jobs)) if i not in hits]
        if idx:
            drafts[idx], confs[idx] = self._d.run([jobs[i] for i in idx], n_steps)
        self._answer(jobs, hits, n_steps, drafts, confs)
        self._pf.stats["worker_side_hits"] += len(hits)
        return drafts, confs

    def _answer(self, jobs: list[Job], hits: dict, n_steps: int, drafts: np.ndarray, confs: np.ndarray) -> None:
        """The hit jobs' drafts and confidences from their branches, and the branch's KV into the row."""
        sc = self._pf._scratch.cache
        for i, (srow, d, c) in hits.items():
            j = jobs[i]
            # the same row length the drafter leaves: context + the first n_steps - 1 drafts
            _copy_row(sc, srow, self._d.cache, j.row, j.keep + len(j.tokens) + n_steps - 1)
            drafts[i], confs[i] = d, c


class ReplayPrefetcher(Prefetcher):
    """Branches for a ReplayDrafter (benchmarks: a real pair's acceptance replayed from a trace). The
    outcomes (a, y) are chosen with `choose_branches` from the trace's recorded top candidates at the k + 1
    stopping places (ReplayDrafter.stops) and the session's running acceptance, as for a real drafter;
    each branch's drafts are what the ReplayDrafter would draft after context + f1..fa, y. The cost is
    the real branch work: with a real inner drafter, Prefetcher's forward and batched run on scratch rows
    of the inner model (their tokens replaced by the trace's); for a drafter on an emulated second
    device, the measured seconds of that work (CostTable.prefetch) spent as wall time."""

    def __init__(self, drafter: ReplayDrafter, max_fanout: int = 16) -> None:
        inner = drafter.inner
        real = isinstance(inner, LlamaDrafter)
        super().__init__(inner if real else drafter, max_fanout)
        self.replay = drafter
        self.real = real
        self.supported = real or (drafter.cost is not None and bool(drafter.cost.prefetch))
        if not self.supported:
            log.warning("replay prefetch: no branch cost (inner %r, no prefetch entries in the cost table): "
                        "empty tables", type(inner).__name__)

    def _draft(self, blocks, result, todo, acc: Acceptance, fanout: int) -> list[Entry]:
        rd = self.replay
        m = min(TOP_M, rd.trace.top_f)
        base_rows = [-1] * len(todo)
        t = time.perf_counter()
        if self.real:  # the real step 1 (its distributions are the random model's: only its cost is used)
            _, _, base_rows = self._stop_distributions(blocks, result, todo, fanout)
            t = self._lap("stops", t)
        choices = []
        for i, st, k in todo:
            f = result.drafts[i, :k].astype(np.int32)
            tok, prob = rd.stops(st.row, st.ctx_len, f, m)
            choices.append([(a, y) for a, y, _ in choose_branches(tok, prob, f, acc.rates(k), fanout)])
        k_max = max(k for _, _, k in todo)
        t = self._lap("choose", t)
        if self.real:  # the real step 3 on the chosen outcomes
            _, out_c = self._branch_run(result, todo, base_rows, choices)
        else:  # the device pieces (DEVICE_PIECES) as measured; the host pieces run here for real
            ctx = max(st.ctx_len for _, st, _ in todo)
            spend(rd.cost.lookup_prefetch(len(todo), fanout, k_max, ctx))
            out_c = None
        t = self._lap("run", t)
        out_d = np.zeros((sum(len(c) for c in choices), k_max), np.int32)
        row = 0
        for (i, st, k), pairs in zip(todo, choices, strict=True):
            f = result.drafts[i, :k].astype(np.int32)
            for a, y in pairs:
                out_d[row, :k] = rd.branch_drafts(st.row, st.ctx_len, np.concatenate([f[:a], [y]]), k)
                row += 1
        if out_c is None:
            out_c = np.zeros(out_d.shape, np.float32)
        out = self._entries(blocks, result, todo, choices, base_rows, out_d, out_c)
        self._lap("entries", t)
        return out


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
            srow, d, _ = hits[i]
            pf.stats["hit_mismatches"] += int(not np.array_equal(d, drafts[i]))
            if pf.real:
                j = jobs[i]
                _copy_row(pf._scratch.cache, srow, self._d.inner.cache, j.row, j.keep + len(j.tokens) + n_steps - 1)


def make_prefetcher(drafter) -> tuple[Prefetcher, object]:
    """The prefetcher for a core's drafter and the drafter the core then uses (a HitDrafter where the
    prefetcher can branch, so hits skip the drafting)."""
    if isinstance(drafter, ReplayDrafter):
        pf = ReplayPrefetcher(drafter)
        return pf, (ReplayHitDrafter(drafter, pf) if pf.supported else drafter)
    pf = Prefetcher(drafter)
    return pf, (HitDrafter(drafter, pf) if pf.supported else drafter)


def _copy_row(src, src_row: int, dst, dst_row: int, n: int) -> None:
    """KV of the first n positions of src's row into dst's row (the two caches share the model's shape)."""
    if n > 0:
        dst.k[:, dst_row, :, :n] = src.k[:, src_row, :, :n]
        dst.v[:, dst_row, :, :n] = src.v[:, src_row, :, :n]
    dst.lengths[dst_row] = n


def _copy_rows(torch, cache, src_rows: list[int], dst_rows: list[int], n: int) -> None:
    """KV of the first n positions of each src row into its dst row, one indexed copy per tensor."""
    if not dst_rows or n <= 0:
        return
    src = torch.tensor(src_rows, device=cache.k.device)
    dst = torch.tensor(dst_rows, device=cache.k.device)
    cache.k[:, dst, :, :n] = cache.k[:, src, :, :n]
    cache.v[:, dst, :, :n] = cache.v[:, src, :, :n]


def branches_payload(core, session, blocks: list[P.Block], result, fanout: int) -> bytes:
    """The BRANCHES frame's payload for the STEP just answered (an empty table when the drafter
    cannot branch, so the client never waits for a frame that will not come)."""
    with core.lock:
        pf = core.prefetcher
        if pf is None:
            pf, core.drafter = make_prefetcher(core.drafter)
            core.prefetcher = pf
        if session.id not in core.sessions:
            return encode(Table([], 0, session.id))
        try:
            table = pf.table(session, blocks, result, fanout)
            t0 = time.perf_counter()
            out = encode(table)
            pf._lap("encode", t0)
            return out
        except Exception:  # prefetching is an optimisation: its failure costs the next round's hit only
            log.exception("prefetch failed in session %016x", session.id)
            return encode(Table([], 0, session.id))
