"""Sessions and STEP semantics (docs/CONTRACT.md §2-4), independent of the network.

`WorkerCore.step(session, blocks)` is exactly what the server runs for a STEP frame; tests call it
in-process as the reference the network path must equal bit for bit. One FIFO lock serializes the
drafter (one model, one KV cache) and the row pool across all sessions.

Fair share between sessions (docs/CONTRACT.md §2):
- rows: a session may reserve at most `max_requests` rows (half the pool by default), and a session
  that sent no STEP for `row_lease` seconds loses its rows (and its connection: SESSION_EXPIRED) as
  soon as a new session needs them; PING keeps a connection open, not its rows.
- compute: a frame's long prefills (first-round prompts) run in slices of about `prefill_slice_ms`
  (default: the median time of recent ordinary STEPs; at least 16 tokens),
  and the lock is handed to the next waiting session between slices, so one session's 8 x 4,000-token
  frame delays another session's STEP by one slice, not by the whole frame.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from draftrelay.wire import protocol as P
from draftrelay.worker.draft_stop import stop_counts
from draftrelay.worker.drafters import Drafter, Job

log = logging.getLogger("draftrelay.worker")


class StepFailed(RuntimeError):
    """The drafter could not finish a step safely (e.g. a TP collective failed): no drafts exist. The frame
    is answered INTERNAL (the server's ERROR) and its requests are dropped (resent from position 0)."""


class Refusal(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class FairLock:
    """A mutex handed to waiters in arrival order. threading.Lock lets the releasing thread take it again
    at once, so a session prefilling slice after slice would keep the drafter; here release() gives it
    to the longest waiter directly."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._held = False
        self._waiters: collections.deque[threading.Lock] = collections.deque()

    def acquire(self) -> None:
        with self._mu:
            if not self._held:
                self._held = True
                return
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append(gate)
        gate.acquire()  # released by the holder's release(): ownership passes without a gap

    def release(self) -> None:
        with self._mu:
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._held = False

    def waiting(self) -> int:
        return len(self._waiters)

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class RequestState:
    generation: int
    row: int
    ctx_len: int = 0  # tokens the worker was sent (last block's position + n_tokens)
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # returned last round
    last_used: int = 0


@dataclass
class Session:
    id: int
    max_requests: int
    n_out_max: int
    client_name: str
    free_rows: list[int]
    requests: dict[int, RequestState] = field(default_factory=dict)
    tick: int = 0
    steps: int = 0
    last_step: float = field(default_factory=time.monotonic)  # STEP frames only: PING does not count
    busy: bool = False  # inside step(): its rows are in use
    closed: bool = False
    on_evict: Callable[[str], None] | None = None  # the server closes the connection


@dataclass
class StepResult:
    request_ids: np.ndarray
    generations: np.ndarray
    status: np.ndarray
    counts: np.ndarray
    drafts: np.ndarray
    confidences: np.ndarray
    worker_us: int


LONG_EXTENSION = 16  # a frame extending some request by more tokens than this is a prefill: it is sliced
MIN_SLICE_TOKENS = 16  # progress per slice even where one forward costs more than the budget
MAX_SLICE_TOKENS = 256


class WorkerCore:
    def __init__(self, drafter: Drafter, max_requests: int | None = None, idle_timeout: float = 60.0,
                 max_frame: int = 4 << 20, row_lease: float = 10.0, prefill_slice_ms: float = 0.0,
                 capacity_wait: float = 0.5, slow_step_ms: float = 50.0):
        """slow_step_ms: a STEP taking longer than this (waiting for the drafter's lock included) is logged
        with what it did (`slow_steps` in the stats; 0: never): a round's budget is about three times
        that, and what overran it is otherwise invisible from the engine's side.
        max_requests: rows one session may reserve (None: half the pool, at least 1). row_lease: seconds
        without a STEP after which a session's rows may be reclaimed for a new session. prefill_slice_ms:
        the drafter time one prefill slice may take while other sessions exist (0: the median time of
        recent ordinary STEPs, so a waiting STEP is delayed by about one of its own; negative: no slicing)."""
        self.drafter = drafter
        self.max_requests = max(1, drafter.n_rows // 2) if max_requests is None else max_requests
        self.idle_timeout, self.max_frame = idle_timeout, max_frame
        self.row_lease, self.prefill_slice_ms, self.capacity_wait = row_lease, prefill_slice_ms, capacity_wait
        self.slow_step_s = slow_step_ms / 1000
        self._freed = threading.Condition()  # notified when a session's rows come back
        self._freed_count = 0
        self.lock = FairLock()
        # the speculation cache's branch drafting (worker/prefetch.py), made on the first STEP that asks
        # for branches; it keeps per-session state that must go when the session does
        self.prefetcher = None
        self.free_rows = list(range(drafter.n_rows))
        self.sessions: dict[int, Session] = {}
        self.stats = {"sessions_opened": 0, "sessions_closed": 0, "steps": 0, "blocks": 0, "refused_blocks": 0,
                      "drafter_errors": 0, "evictions": 0, "sessions_reclaimed": 0, "prefill_slices": 0,
                      "slow_steps": 0}
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)  # ordinary STEPs, seconds
        self._slice_tokens = 64.0  # adapted so a slice takes about the budget

    def rows_in_use(self) -> int:
        return self.drafter.n_rows - len(self.free_rows)

    # ---- sessions -------------------------------------------------------------------------------

    def open_session(self, h: P.Hello) -> tuple[Session, P.HelloOk]:
        d = self.drafter
        if h.proto_version != P.VERSION:
            raise Refusal(P.BAD_VERSION,
                          f"protocol version {h.proto_version} not supported (worker speaks {P.VERSION})")
        if h.model_id and h.model_id != d.model_id:
            raise Refusal(P.IDENTITY_MISMATCH, f"model_id: client expects {h.model_id!r}, worker serves {d.model_id!r}")
        if h.vocab_size and h.vocab_size != d.vocab_size:
            raise Refusal(P.IDENTITY_MISMATCH, f"vocab_size: client has {h.vocab_size}, drafter has {d.vocab_size}")
        if h.tokenizer_hash and d.tokenizer_hash and h.tokenizer_hash != d.tokenizer_hash:
            raise Refusal(P.IDENTITY_MISMATCH,
                          f"tokenizer_hash: client has {h.tokenizer_hash!r}, worker has {d.tokenizer_hash!r}")
        if h.flags != 0:
            raise Refusal(P.OVER_LIMITS, f"HELLO flags 0x{h.flags:x}: no flags are defined")
        if not 1 <= h.n_out_max <= d.n_out_max:
            raise Refusal(P.OVER_LIMITS, f"n_out_max {h.n_out_max}: worker allows 1..{d.n_out_max}")
        if not 1 <= h.max_requests <= self.max_requests:
            raise Refusal(P.OVER_LIMITS, f"max_requests {h.max_requests}: worker allows 1..{self.max_requests}")
        # a client reconnecting right after closing races its old session's thread, which frees the rows
        # once it sees the close: a HELLO short of rows waits up to capacity_wait for rows to come free
        deadline = time.monotonic() + self.capacity_wait
        while True:
            evicted: list[tuple[Session, str]] = []
            try:
                with self.lock:
                    if len(self.free_rows) < h.max_requests:
                        evicted = self._reclaim(h.max_requests - len(self.free_rows))
                    if len(self.free_rows) >= h.max_requests or time.monotonic() >= deadline:
                        return self._open(h, d)
                    seen = self._freed_count
            finally:
                for victim, msg in evicted:  # outside the lock: telling a peer may block on its socket
                    if victim.on_evict is not None:
                        victim.on_evict(msg)
            with self._freed:
                self._freed.wait_for(lambda seen=seen: self._freed_count != seen,
                                     max(0.0, deadline - time.monotonic()))

    def _open(self, h: P.Hello, d: Drafter) -> tuple[Session, P.HelloOk]:
        """Reserve the rows and make the session (under the lock)."""
        if len(self.free_rows) < h.max_requests:
            raise Refusal(P.OVER_CAPACITY, f"max_requests {h.max_requests}: only {len(self.free_rows)} of "
                                           f"{d.n_rows} draft-KV rows free (other sessions hold the rest and "
                                           f"sent a STEP within the row lease, {self.row_lease:g} s)")
        rows = [self.free_rows.pop() for _ in range(h.max_requests)]
        sid = 0
        while sid == 0 or sid in self.sessions:
            sid = secrets.randbits(64)
        s = Session(sid, h.max_requests, h.n_out_max, h.client_name, rows)
        self.sessions[sid] = s
        self.stats["sessions_opened"] += 1
        ok = P.HelloOk(sid, P.VERSION, h.max_requests, d.n_out_max, d.vocab_size, d.max_ctx, self.max_frame,
                       int(self.idle_timeout * 1000), d.model_id, d.tokenizer_hash, d.info[:P.MAX_STR],
                       P.HELLO_OK_FIXED_ROUNDS if getattr(d, "fixed_rounds", False) else 0)
        return s, ok

    def close_session(self, s: Session) -> None:
        with self.lock:
            self._release(s)

    def _release(self, s: Session) -> bool:
        s.closed = True
        if self.sessions.pop(s.id, None) is None:
            return False
        self.free_rows.extend(s.free_rows)
        self.free_rows.extend(r.row for r in s.requests.values())
        s.free_rows, s.requests = [], {}
        self.stats["sessions_closed"] += 1
        if self.prefetcher is not None:
            self.prefetcher.forget_session(s.id)
        with self._freed:
            self._freed_count += 1
            self._freed.notify_all()
        return True

    def _reclaim(self, need: int) -> list[tuple[Session, str]]:
        """Free at least `need` rows from sessions idle past the row lease, least recently active first
        (under the lock). Returns them with the reason: the caller has the server tell them SESSION_EXPIRED
        and close their connections."""
        now = time.monotonic()
        idle = sorted((s.last_step, s.id) for s in self.sessions.values()
                      if not s.busy and now - s.last_step >= self.row_lease)
        if sum(len(self.sessions[sid].free_rows) + len(self.sessions[sid].requests) for _, sid in idle) < need:
            return []  # reclaiming cannot make room: leave everyone's rows alone
        out = []
        for last, sid in idle:
            s = self.sessions[sid]
            held = len(s.free_rows) + len(s.requests)
            self._release(s)
            need -= held
            self.stats["sessions_reclaimed"] += 1
            msg = f"no STEP for {now - last:.1f} s (row lease {self.row_lease:g} s): its rows went to a new session"
            log.warning("session %016x (%s) reclaimed: %s", sid, s.client_name, msg)
            out.append((s, msg))
            if need <= 0:
                break
        return out

    # ---- STEP ----------------------------------------------------------------------------------

    def _drop(self, s: Session, rid: int) -> None:
        st = s.requests.pop(rid, None)
        if st is not None:
            s.free_rows.append(st.row)
            if self.prefetcher is not None:  # its branch state too: the rounds that end it may carry no table
                self.prefetcher.forget_request(s.id, rid, st.row)

    def _take_row(self, s: Session, in_frame: set[int]) -> int | None:
        if not s.free_rows:
            idle = [(st.last_used, rid) for rid, st in s.requests.items() if rid not in in_frame]
            if not idle:
                return None
            self._drop(s, min(idle)[1])  # least recently used request outside this frame
            self.stats["evictions"] += 1
        return s.free_rows.pop()

    def step(self, s: Session, blocks: list[P.Block]) -> StepResult:
        s.busy = True  # before the lock: a session waiting for the drafter is not idle
        s.last_step = time.monotonic()
        t_enter = time.perf_counter()
        t_locked = [t_enter]
        try:
            return self._step_locked(s, blocks, t_locked)
        finally:
            s.busy = False
            dt = time.perf_counter() - t_enter
            if 0 < self.slow_step_s < dt:
                self._report_slow(blocks, dt, t_locked[0] - t_enter)

    def _report_slow(self, blocks: list[P.Block], dt: float, waited: float) -> None:
        self.stats["slow_steps"] += 1
        what = getattr(self.drafter, "last_run", None)
        lens = [len(b.tokens) for b in blocks]
        log.warning("slow STEP: %.1f ms (%.1f ms waiting for the drafter), %d blocks, tokens per block %s, "
                    "%d drafts%s", dt * 1e3, waited * 1e3, len(blocks), lens if len(lens) <= 16 else
                    f"{min(lens)}-{max(lens)}", max((b.n_out for b in blocks), default=0),
                    f"; drafter: {what}" if what else "")

    def _step_locked(self, s: Session, blocks: list[P.Block], t_locked: list[float]) -> StepResult:
        with self.lock:
            t_locked[0] = time.perf_counter()
            if s.closed:
                raise Refusal(P.SESSION_EXPIRED, "this session's rows were reclaimed")
            long = any(len(b.tokens) > LONG_EXTENSION for b in blocks)
            if long and len(self.sessions) > 1 and self.prefill_slice_ms >= 0:
                frame = self._plan_frame(s, blocks)
            else:
                t0 = time.perf_counter()
                r = self._step(s, blocks)
                if not long:  # the budget of a slice: what an ordinary STEP costs
                    self._step_times.append(time.perf_counter() - t0)
                return r
        self._prefill_in_slices(s, frame)
        with self.lock:
            return self._finish_frame(s, blocks, frame)

    def _slice_budget_s(self) -> float:
        if self.prefill_slice_ms > 0:
            return self.prefill_slice_ms / 1000
        if not self._step_times:
            return 0.002
        times = sorted(self._step_times)
        # one ordinary STEP: a STEP arriving during a slice waits at most about its own cost (p99 ~2x, median
        # ~1.5x what it costs alone), and the prefill still gets half the drafter while others are active
        return max(2e-4, times[len(times) // 2])

    def _prefill_in_slices(self, s: Session, frame) -> None:
        """Extend every long job of a planned frame up to its last token, one slice per lock hold (the lock
        goes to the next waiting session in between); the frame's final step then drafts as usual."""
        planned = frame[1]
        for _, _, _, _, _, job in planned:
            while len(job.tokens) > LONG_EXTENSION:
                n = int(min(len(job.tokens) - 1, max(MIN_SLICE_TOKENS, self._slice_tokens)))
                with self.lock:
                    if frame[2] is not None:
                        return  # the drafter failed on an earlier slice
                    t0 = time.perf_counter()
                    try:
                        self.drafter.run([Job(job.row, job.keep, job.tokens[:n])], 0)
                    except Exception as exc:  # the frame's DRAFTER_ERROR (StepFailed: INTERNAL), as in _step
                        frame[2] = exc
                        return
                    dt = time.perf_counter() - t0
                    self.stats["prefill_slices"] += 1
                job.keep += n
                job.tokens = job.tokens[n:]
                # next slice: as many tokens as fit the budget at this slice's rate; growing by at most 1.25x a
                # slice (attention makes the cost grow with the position and superlinearly with the length)
                want = n * self._slice_budget_s() / max(dt, 1e-6)
                self._slice_tokens = min(MAX_SLICE_TOKENS, max(MIN_SLICE_TOKENS, min(1.25 * n, want)))

    def _step(self, s: Session, blocks: list[P.Block]) -> StepResult:
        return self._finish_frame(s, blocks, self._plan_frame(s, blocks))

    def _plan_frame(self, s: Session, blocks: list[P.Block]) -> list:
        """[t0, planned, error, status]: every block validated, rows taken, jobs built (under the lock)."""
        t0 = time.perf_counter()
        s.tick += 1
        s.steps += 1
        status = np.zeros(len(blocks), np.uint16)
        in_frame = {b.request_id for b in blocks}
        seen: set[int] = set()
        planned: list[tuple] = []  # block, job index, state, window, new ctx_len, job
        for i, b in enumerate(blocks):
            code, plan = self._plan(s, b, seen, in_frame)
            seen.add(b.request_id)
            status[i] = code
            if plan is not None:
                st, job, window = plan
                planned.append((i, len(planned), st, window, b.position + len(b.tokens), job))
        return [t0, planned, None, status]

    def _finish_frame(self, s: Session, blocks: list[P.Block], frame: list) -> StepResult:
        t0, planned, failed, status = frame
        d = self.drafter
        B = len(blocks)
        counts = np.zeros(B, np.uint16)
        width = max(1, max(b.n_out for b in blocks))
        drafts = np.zeros((B, width), np.int32)
        confs = np.zeros((B, width), np.float32)
        jobs: list[Job] = [p[5] for p in planned]
        n_steps = max((p[3] for p in planned), default=0)
        if jobs:
            try:
                if failed is not None:
                    raise failed
                if getattr(d, "windows", False) is None:  # worker/prefetch.HitDrafter: each job's draft count
                    d.windows = [p[3] for p in planned]
                out_d, out_c = d.run(jobs, n_steps)
            except StepFailed:
                self.stats["drafter_errors"] += 1
                for i, *_ in planned:
                    self._drop(s, blocks[i].request_id)
                raise
            except Exception as exc:  # the drafter's failure is this frame's, not the server's
                log.exception("drafter failed on a STEP of session %016x", s.id)
                self.stats["drafter_errors"] += 1
                for i, *_ in planned:
                    status[i] = P.DRAFTER_ERROR
                    self._drop(s, blocks[i].request_id)
                planned = []
                del exc
            # the confidence stop trims each block at its first low-confidence draft (drafters that ran every
            # step included); a block with fewer drafts than asked is PARTIAL
            keep = stop_counts(out_c, [p[5].min_conf for p in planned], [p[3] for p in planned]) if planned else []
            for i, j, st, _, new_len, _ in planned:
                b = blocks[i]
                m = int(keep[j])
                drafts[i, :m] = out_d[j, :m]
                confs[i, :m] = out_c[j, :m]
                counts[i] = m
                status[i] = P.OK if m == b.n_out else P.PARTIAL
                # the row's KV holds at least the first m - 1 drafts: the next round's reuse stays within those
                st.ctx_len, st.drafts, st.last_used = new_len, out_d[j, :m].copy(), s.tick
                if b.flags & P.FLAG_END:
                    self._drop(s, b.request_id)
        self.stats["steps"] += 1
        self.stats["blocks"] += B
        self.stats["refused_blocks"] += int((status >= 16).sum())
        rids = np.array([b.request_id for b in blocks], np.uint64)
        gens = np.array([b.generation for b in blocks], np.uint32)
        return StepResult(rids, gens, status, counts, drafts, confs, int((time.perf_counter() - t0) * 1e6))

    def _plan(self, s: Session, b: P.Block, seen: set[int], in_frame: set[int]):
        """(status, None) for a refused or release-only block, (OK, (state, job, window)) otherwise."""
        d = self.drafter
        toks = b.tokens
        if b.flags & ~P.KNOWN_BLOCK_FLAGS or b.request_id in seen:
            return P.BAD_ENTRY, None
        st = s.requests.get(b.request_id)
        if st is not None and b.generation < st.generation:
            return P.STALE_GENERATION, None
        if b.flags & P.FLAG_END and len(toks) == 0 and b.n_out == 0:  # release only
            self._drop(s, b.request_id)
            return P.OK, None
        if len(toks) == 0 or int(toks.min()) < 0 or int(toks.max()) >= d.vocab_size:
            return P.BAD_ENTRY, None
        new_len = b.position + len(toks)
        if b.n_out > s.n_out_max or new_len > d.max_ctx:
            return P.OVER_LIMITS, None
        if st is None or b.generation > st.generation:
            if st is not None:
                self._drop(s, b.request_id)  # a new incarnation: the old state is gone either way
            if b.position != 0:
                return P.UNKNOWN_REQUEST, None
            row = self._take_row(s, in_frame)
            if row is None:
                return P.OVER_LIMITS, None
            st = s.requests[b.request_id] = RequestState(b.generation, row)
            keep, new = 0, toks
        else:
            if b.position > st.ctx_len:
                return P.POSITION_GAP, None
            c = 0
            if b.position == st.ctx_len and len(st.drafts) > 1:
                # accepted drafts whose KV the row still holds need no recompute
                m = min(len(st.drafts) - 1, len(toks) - 1)
                eq = toks[:m] == st.drafts[:m]
                c = m if eq.all() else int(np.argmin(eq))
            keep, new = b.position + c, toks[c:]
        st.last_used = s.tick
        window = min(b.n_out, d.max_ctx - new_len)
        return P.OK, (st, Job(st.row, keep, np.array(new, np.int32), float(np.float32(b.min_conf))), window)
