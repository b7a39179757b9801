"""Continuous batching: the engine's step loop on one thread, requests joining and leaving it.

The engine is not thread-safe and does not need to be: only the scheduler thread touches it. The
HTTP side hands jobs in (`submit`) and asks for cancellations (`cancel`) through a locked inbox;
the thread takes them at a step boundary, so a request joins the running batch at the next step
(prefilled into a free KV row, its first token sent right after its prefill) and leaves it when it
finishes, hits a stop string, or its client goes away. A cancelled request's KV row is freed at
once and the drafter is told to forget it (an END with the next round). What a step produced goes
back to each job's asyncio queue through the event loop's thread-safe call.

Admission is bounded: at most max_batch requests run and `max_queue` wait for a row (in the inbox
or the engine's waiting queue); one more is refused with 429 before it costs anything.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftrelay import kernels
from draftrelay.engine.depth import BatchDepthPolicy
from draftrelay.engine.engine import Engine
from draftrelay.engine.request import Request, SamplingParams

from .metrics import ServeMetrics
from .protocol import ApiError, GenRequest
from .textstream import TextStream

log = logging.getLogger("draftrelay.serve")

SEED_MASK = (1 << 63) - 1
# the speculation cache's wait times kept per kind (hit, miss): its wait figures describe the recent steps
WAIT_WINDOW = 4096


@dataclass
class Event:
    kind: str  # "text" | "done" | "error"
    text: str = ""
    finish_reason: str = ""
    usage: dict | None = None
    error: ApiError | None = None


@dataclass
class Job:
    gen: GenRequest
    loop: asyncio.AbstractEventLoop
    stream: TextStream
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_arrive: float = field(default_factory=time.perf_counter)
    t_taken: float = 0.0  # the engine thread took it from the inbox
    req: Request | None = None
    cancelled: bool = False
    finished: bool = False
    n_seen: int = 0  # output tokens handled
    t_last: float = 0.0
    # spec-decode figures already counted into the metrics
    seen_steps: int = 0
    seen_tries: int = 0
    seen_hits: list[int] = field(default_factory=list)

    def push(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
            pass


def usage_of(job: Job, cache: bool = False) -> dict:
    """OpenAI usage plus this request's speculative figures (vLLM's spec-decode quantities); cache: with
    the speculation cache's lookups and hits of this request (`spec_cache`)."""
    r = job.req
    prompt = len(job.gen.prompt_ids)
    out = len(r.output) if r is not None else 0
    spec = {"num_drafts": len(r.kept) if r else 0,
            "num_draft_tokens": sum(r.pos_tries) if r else 0,
            "num_accepted_tokens": sum(r.kept) if r else 0,
            "num_accepted_tokens_per_pos": list(r.pos_hits) if r else [],
            "rounds": {k: r.rounds.get(k, 0) for k in ("ok", "failed", "watchdog", "target_only")} if r
            else {"ok": 0, "failed": 0, "watchdog": 0, "target_only": 0}}
    if cache:
        spec["spec_cache"] = {k: r.cache.get(k, 0) if r else 0 for k in ("lookups", "hits")}
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out, "spec_decode": spec}


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServeMetrics, max_queue: int) -> None:
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.cv = threading.Condition()
        self.inbox: deque[Job] = deque()
        self.cancels: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}  # engine request id -> job, while in the engine
        self.n_waiting = 0  # jobs without a KV row (inbox + engine's waiting queue)
        self.n_in = 0  # jobs submitted and not finished
        self.n_running = 0
        self.rows_free = engine.cfg.max_batch
        self.handoff: dict = {"mode": "off"}  # the last snapshot of rounds.stats() (thread: scheduler)
        self._t_handoff = 0.0
        self._stop = False
        self._warm: Callable[[], dict] | None = None
        self._warm_out: dict | BaseException = {}
        self._warm_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftrelay-engine", daemon=True)
        self._snapshot()

    # -- the HTTP side --------------------------------------------------------------------------------
    def start(self, warm: Callable[[], dict] | None = None) -> dict:
        """Start the engine thread. warm: run first, on that thread, before any job (the warm-up:
        per-thread state such as CUDA's BLAS handles and workspaces is then the serving thread's
        own); start returns its result once it is done, or raises what it raised."""
        self._warm, self._warm_out = warm, {}
        done = threading.Event()
        self._warm_done = done
        self._thread.start()
        if warm is None:
            return {}
        done.wait()
        if isinstance(self._warm_out, BaseException):
            raise self._warm_out
        return self._warm_out

    def stop(self, timeout: float = 30.0) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self.cv:
            if self._stop:
                raise ApiError(503, "the server is shutting down", etype="server_error", code="shutting_down")
            if self.n_in >= self.engine.cfg.max_batch + self.max_queue:
                self.metrics.labels(self.metrics.request_rejected, "queue_full").inc()
                raise ApiError(429, f"the queue is full: {self.n_waiting} requests are waiting for one of "
                                    f"{self.engine.cfg.max_batch} KV rows (--max-queue {self.max_queue}); "
                                    "retry later", etype="server_overloaded", code="queue_full")
            self.n_waiting += 1
            self.n_in += 1
            self.inbox.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: stop the request at the next step boundary."""
        with self.cv:
            if not job.finished:
                self.cancels.append(job)
                self.cv.notify()

    def status(self) -> dict:
        with self.cv:
            return {"running": self.n_running, "waiting": self.n_waiting, "kv_rows_free": self.rows_free,
                    "kv_rows": self.engine.cfg.max_batch}

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        if self._warm is not None:
            try:
                self._warm_out = self._warm()
            except BaseException as exc:  # handed to start(), which raises it on the caller's thread
                self._warm_out = exc
                self._stop = True
            finally:
                self._warm_done.set()
            self._snapshot()
        while True:
            with self.cv:
                while not (self.inbox or self.cancels or self._stop or eng.has_work()):
                    self.cv.wait()
                if self._stop:
                    break
                new, self.inbox = list(self.inbox), deque()
                gone, self.cancels = list(self.cancels), deque()
            t_taken = time.perf_counter()
            for job in new:
                job.t_taken = t_taken
                self._admit(job)
            for job in gone:
                self._cancel(job, "abort")
            if gone and not eng.has_work():
                settle_cache(eng)
            try:
                if eng.waiting and eng.free_rows:
                    eng.prefill_waiting()  # the first token goes out now, not after the next decode step
                    self._harvest()
                if eng.running:
                    self._step()
            except Exception:
                log.exception("engine step failed: the running requests are ended with an error")
                self._fail_all(ApiError(500, "the engine failed on this request's step", etype="server_error"))
            self._snapshot()
        self._fail_all(ApiError(503, "the server is shutting down", etype="server_error", code="shutting_down"))

    def _step(self) -> None:
        """One engine step and its hand-over; with the per-batch depth policy, the batch's size before
        it and, after it, the step's wall time and tokens per row (what the policy checks its
        cost model against)."""
        eng = self.engine
        depth = eng.depth if isinstance(eng.depth, BatchDepthPolicy) else None
        if depth is None:
            eng.step()
            self._harvest()
            return
        live = [r for r in eng.running if not r.done]
        depth.batch = len(live)
        # a request whose first decode step this is: its round carries its prompt to the drafter
        depth.catch_up = any(len(r.output) == 1 for r in live)
        n0 = sum(len(r.output) for r in live)
        t0 = time.perf_counter()
        eng.step()
        self._harvest()
        if live:
            depth.observe_step(time.perf_counter() - t0, (sum(len(r.output) for r in live) - n0) / len(live))

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._count_waiting(-1, -1)
            return
        try:
            req = self.engine.add_request(job.gen.prompt_ids, job.gen.params)
        except ValueError as exc:  # parse_request checks the same limits: this is a safety net
            self._count_waiting(-1, -1)
            job.finished = True
            job.push(Event("error", error=ApiError(400, str(exc))))
            return
        if job.gen.seeded and job.gen.params.temperature > 0:
            # the engine seeds by (seed, request id); a client's seed must give the same sample
            # whatever ran before it, so the generator is seeded by the seed alone
            req.gen = torch.Generator(device=self.engine.device).manual_seed(job.gen.params.seed & SEED_MASK)
        job.req = req
        self.jobs[req.id] = job

    def _cancel(self, job: Job, reason: str) -> None:
        if job.finished:
            return
        if job.req is None:  # still in the inbox of this very iteration: _admit skips it
            job.cancelled = True
            return
        if job.req.row < 0:
            self._count_waiting(-1)
        self.engine.cancel(job.req)
        self._end(job, reason)

    def _end(self, job: Job, reason: str) -> None:
        job.finished = True
        self.jobs.pop(job.req.id, None)
        self._count_waiting(0, -1)
        m = self.metrics
        m.labels(m.request_success, reason).inc()
        m.labels(m.e2e).observe(time.perf_counter() - job.t_arrive)
        job.push(Event("done", finish_reason=reason, usage=usage_of(job, self.engine.spec_cache is not None)))

    def _harvest(self) -> None:
        """Hand each job what the last prefill or step produced; end the finished ones."""
        eng, m = self.engine, self.metrics
        now = time.perf_counter()
        for job in list(self.jobs.values()):
            r = job.req
            if r.row >= 0 and job.n_seen == 0 and r.output:
                self._count_waiting(-1)
                m.labels(m.prompt_tokens).inc(len(r.prompt))
            n = len(r.output)
            if n == job.n_seen and not r.done:
                continue
            new = r.output[job.n_seen:n]
            m.labels(m.generation_tokens).inc(len(new))
            if job.n_seen == 0:
                m.labels(m.ttft).observe(now - job.t_arrive)
                m.labels(m.queue_time).observe(job.t_taken - job.t_arrive)
                m.labels(m.prefill_time).observe(now - job.t_taken)
            elif new:
                m.labels(m.itl).observe(now - job.t_last)
            job.n_seen, job.t_last = n, now
            self._count_spec(job)
            if r.done and r.finish_reason == "stop" and new and new[-1] in r.params.stop_token_ids:
                new = new[:-1]  # the end-of-sequence token is not part of the text
            text = job.stream.add(new, final=r.done)
            if text:
                job.push(Event("text", text))
            if job.stream.stopped and not r.done:
                eng.cancel(r)  # a stop string: the row is freed now, the drafter forgets it
                r.finish_reason = "stop"
            if r.done:
                self._end(job, "stop" if job.stream.stopped else r.finish_reason)
        eng.finished.clear()  # the jobs hold their requests; the engine need not keep them
        if len(eng.timing["step"]) > 10_000:  # a server runs for ever: bound the step timers
            eng.reset_metrics()
        sc = eng.spec_cache
        if sc is not None and len(sc.wait_hit_s) + len(sc.wait_miss_s) > 2 * WAIT_WINDOW:
            # and the cache's wait times (one per step; stats() takes their medians at every snapshot)
            sc.wait_hit_s[:-WAIT_WINDOW] = []
            sc.wait_miss_s[:-WAIT_WINDOW] = []

    def _count_spec(self, job: Job) -> None:
        """Add what the request's last step verified and accepted to the spec-decode counters."""
        r, m = job.req, self.metrics
        new_steps = r.kept[job.seen_steps:]
        if new_steps:
            m.labels(m.num_drafts).inc(len(new_steps))
            m.labels(m.num_accepted).inc(sum(new_steps))
            job.seen_steps = len(r.kept)
        tries = sum(r.pos_tries)
        if tries > job.seen_tries:
            m.labels(m.num_draft_tokens).inc(tries - job.seen_tries)
            job.seen_tries = tries
        for j, hits in enumerate(r.pos_hits):
            old = job.seen_hits[j] if j < len(job.seen_hits) else 0
            if hits > old:
                m.labels(m.accepted_per_pos, str(j)).inc(hits - old)
        job.seen_hits = list(r.pos_hits)

    def _fail_all(self, err: ApiError) -> None:
        for job in list(self.jobs.values()):
            try:
                self.engine.cancel(job.req)
            except ValueError:
                pass
            job.finished = True
            self.jobs.pop(job.req.id, None)
            job.push(Event("error", error=err))
        with self.cv:
            left, self.inbox = list(self.inbox), deque()
            self.n_waiting = self.n_in = 0
        for job in left:
            job.finished = True
            job.push(Event("error", error=err))

    def _count_waiting(self, d: int, d_in: int = 0) -> None:
        with self.cv:
            self.n_waiting += d
            self.n_in += d_in

    def _snapshot(self) -> None:
        eng = self.engine
        now = time.perf_counter()
        # the hand-off counters for /metrics, read here (the engine's thread) at most 4 times a second;
        # before the gauges: once /health says the engine is idle, /metrics has its counters of then
        if eng.rounds is not None and (now - self._t_handoff > 0.25 or not eng.has_work()):
            st = eng.rounds.stats()
            if eng.spec_cache is not None:  # rendered as draftrelay_spec_cache_* (handoff.metrics)
                st["spec_cache"] = eng.spec_cache.stats()
            self.handoff = st
            self._t_handoff = now
        running = len(eng.running)
        with self.cv:
            self.n_running, self.rows_free = running, len(eng.free_rows)
            waiting = self.n_waiting
        m = self.metrics
        m.labels(m.running).set(running)
        m.labels(m.waiting).set(waiting)
        m.labels(m.rows_free).set(len(eng.free_rows))


def settle_cache(eng: Engine) -> None:
    """The engine went idle by a cancellation: collect the round a speculation-cache step left in flight
    (a step that finishes the last request does so itself), so its result lands now, not whenever the
    next request comes, and nothing of the cancelled requests is left pending on the engine's side."""
    if eng.spec_cache is not None and eng.spec_cache.active and eng.rounds is not None:
        eng.spec_cache.settle(eng)


SWEEP_ALL = 64  # prefill lengths 1..64 one by one, then every SWEEP_STEP up to the prefill chunk
SWEEP_STEP = 16


def sweep_lengths(chunk: int, max_len: int) -> list[int]:
    """The prompt lengths of the warm-up's prefill sweep: every length up to SWEEP_ALL, then every
    SWEEP_STEP-th up to the engine's prefill chunk (a longer prompt runs in chunks of that size and
    one shorter remainder), within max_len - 1 (one output token must fit)."""
    top = min(chunk, max_len - 1)
    out = list(range(1, min(SWEEP_ALL, top) + 1))
    out += list(range(SWEEP_ALL + SWEEP_STEP, top + 1, SWEEP_STEP))
    if top > out[-1]:
        out.append(top)
    return out


def prefill_sweep(engine: Engine, prompt: Callable, params: Callable) -> dict:
    """Prefill a one-token request at every sweep_lengths length: a GPU's GEMM library picks its
    kernel by the row count, and a kernel's first launch loads its module (CUDA's lazy loading);
    a prompt of a length no warm-up step had would pay that during its TTFT. Returns the slowest
    lengths' first and second prefill (a first-use cost shows as first >> second)."""
    lens = sweep_lengths(engine.cfg.prefill_chunk, engine.cfg.max_len)
    t0 = time.perf_counter()
    took = []
    for i, n in enumerate(lens):
        p = prompt(n, 1000 + i)
        t = time.perf_counter()
        engine.generate([p], params(p, 1))
        took.append((time.perf_counter() - t, n))
    slow = sorted(took, reverse=True)[:4]
    again = []
    for _, n in slow:
        p = prompt(n, 2000 + n)
        t = time.perf_counter()
        engine.generate([p], params(p, 1))
        again.append(time.perf_counter() - t)
    ms = sorted(1e3 * t for t, _ in took)
    return {"lengths": len(lens), "seconds": time.perf_counter() - t0, "median_ms": ms[len(ms) // 2],
            "slowest": [{"tokens": n, "first_ms": 1e3 * t, "again_ms": 1e3 * a}
                        for (t, n), a in zip(slow, again, strict=True)]}


def probe_prompt(n: int, vocab: int, salt: int = 0) -> list[int]:
    """n tokens of a fixed spread over the vocabulary (salt varies them): the prompts serve warms up and
    times the worker's rounds with, no tokenizer needed."""
    return [(i * 7919 + salt * 104729 + 13) % vocab for i in range(n)]


def warm_up(engine: Engine, max_model_len: int, settle_s: float = 20.0, long_prompt: int = 0,
            progress: Callable[[str], None] | None = None) -> dict:
    """Run every path a first request can take before the server accepts one: prefill of a short
    and of a long prompt (several chunks), decode steps of width 1 and verify steps of width k+1 at
    every batch size from 1 to max_batch, the drafter's catch-up rounds on a prompt longer than one
    round carries (where the context allows one), greedy and sampled acceptance; then until a round
    succeeds again (at most settle_s). Returns what ran.

    The long prompts are the longest the context allows (long_prompt > 0: at most that many
    tokens): one of max_model_len - 1 tokens, prefilled only, so the largest activations, attention
    masks and KV reads a request can need have been allocated once; one a few tokens shorter whose
    decode and verify steps run over that long a context while the drafter catches up on it. A first
    request of any length then pays no first-use cost, only its own work.

    progress: called with a line as each part starts (serve prints it: on a CPU the warm-up of a
    reference model's few-thousand-token context takes minutes, 651 s at 8 rows)."""
    cfg, V = engine.cfg, engine.vocab
    k = cfg.n_draft

    def prompt(n: int, salt: int) -> list[int]:  # at least one token of output must fit
        return probe_prompt(max(1, min(n, max_model_len - 1)), V, salt)

    def params(p: list[int], n: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=max(1, min(n, max_model_len - len(p))), **kw)

    # output tokens of the long request: one per catch-up round, then a few verify steps
    n_out = -(-max_model_len // cfg.max_round_tokens) + 2 * k + 2
    long_len = max(1, max_model_len - n_out)
    if long_prompt > 0:
        long_len = min(long_len, long_prompt)
    rounds_to_sync = -(-long_len // cfg.max_round_tokens)
    cache = engine.spec_cache if engine.spec_cache is not None and engine.spec_cache.active else None
    cache0 = _cache_counts(cache)
    t0 = time.perf_counter()
    say = progress or (lambda line: None)
    lone = prompt(8, 1)
    say("1/5 a lone request")
    engine.generate([lone], params(lone, 2 * k + 4))  # batch of one: what a first lone request does
    a, b, c = prompt(24, 2), prompt(16, 3), prompt(long_len, 4)
    batch = [(a, params(a, 2 * k + 4)),
             (b, params(b, 2 * k + 4, temperature=0.8, top_k=20, top_p=0.9, seed=1)),
             (c, params(c, rounds_to_sync + 2 * k + 2))]
    say(f"2/5 a batch of three, one of a {long_len}-token prompt decoded")
    engine.generate([p for p, _ in batch], [s for _, s in batch])
    # The longest prompt a request may have (one output token fits): its prefill makes the largest
    # allocations a prefill can (a host allocator hands a size it has not had back as fresh pages,
    # which cost faults on first touch; a GPU's caching allocator grows a segment)
    full = prompt(min(max_model_len - 1, long_prompt) if long_prompt > 0 else max_model_len - 1, 5)
    say(f"3/5 a prefill of {len(full)} tokens")
    engine.generate([full], params(full, 1))
    say("4/5 prefills of short prompt lengths")
    sweep = prefill_sweep(engine, prompt, params)
    # Every batch size from max_batch down to 1: as many short requests as there are rows, each
    # ending at least k + 2 tokens after the one before, so one leaves the batch at a time. The
    # drafter then has run its draft step at each batch size (a GPU worker captures a graph per
    # size on first use; its --warm-graphs covers n = k at every context, this also the shorter
    # drafts of requests near their end), and the engine has decoded at each padded size.
    n = cfg.max_batch
    stagger = [prompt(5 + 3 * i, 10 + i) for i in range(n)]
    say(f"5/5 every batch size from {n} to 1" + (", then the speculation cache's paths" if cache is not None else ""))
    engine.generate(stagger, [params(p, 2 * k + 4 + i * (k + 2)) for i, p in enumerate(stagger)])
    cancelled = _warm_cache(engine, cache, prompt, params, settle_s) if cache is not None else 0
    # A slow drafter (a loaded CPU) may have missed deadlines on the long prompt and opened the
    # worker client's breaker; the server is ready once a round succeeds again.
    healthy = engine.rounds is None
    t_settle = time.perf_counter()
    while not healthy and time.perf_counter() - t_settle < settle_s:
        (r,) = engine.generate([lone], params(lone, 2 * k + 4))
        healthy = r.rounds.get("ok", 0) > 0 and not r.rounds.get("failed", 0) and not r.rounds.get("watchdog", 0)
        if not healthy:
            time.sleep(0.2)
    done = {"seconds": time.perf_counter() - t0, "long_prompt": len(full), "long_decoded": long_len,
            "batch_sizes": n, "prefill_sweep": sweep,
            "catch_up_rounds": long_len > cfg.max_round_tokens and engine.rounds is not None,
            "rounds_healthy": healthy}
    if cache is not None:  # the cache's paths the warm-up went through (counts over the warm-up)
        done["spec_cache"] = {**{k: v - cache0[k] for k, v in _cache_counts(cache).items()},
                              "cancelled_in_flight": cancelled}
    planned = kernels.plan_stats()
    if planned is not None:  # this process's kernel planning (engine start's captures and this warm-up)
        done["kernel_plan"] = planned.summary()
    engine.reset_metrics()
    return done


def _cache_counts(cache) -> dict:
    st = cache.stats() if cache is not None else {}
    return {k: st.get(k, 0) for k in ("lookups", "hits", "fast_steps", "waited_steps")}


def _warm_cache(engine: Engine, cache, prompt: Callable, params: Callable, settle_s: float) -> int:
    """The speculation cache's paths a client's request can take beyond what the batches above ran
    (hits and misses, verifies with and without a wait, a round settled by the next step or by the
    step that finished the batch): a request cancelled while its round is in flight beside one that
    goes on (the next step settles that round, carries the END, and the table follows the other
    row), and one cancelled alone, which leaves the engine idle with a round in flight
    (settle_cache, what the scheduler does then). Where no verify started without a wait, up to three
    lone requests more (at most settle_s; a drafter that does not follow the warm-up's prompts never
    hits, e.g. a replayed trace's). Returns the requests cancelled with a round in flight."""
    k = engine.cfg.n_draft
    t_end = time.perf_counter() + settle_s
    cancelled = 0
    for i, n in enumerate((2, 1)):
        reqs = [engine.add_request(p, params(p, 6 * k + 8))
                for p in (prompt(12 + 5 * j, 40 + 2 * i + j) for j in range(n))]
        while engine.has_work():
            fast = cache.stats()["fast_steps"]
            engine.step()
            if cache.stats()["fast_steps"] > fast and not reqs[0].done:  # its round is in flight now
                engine.cancel(reqs[0])
                cancelled += 1
                break
        if not engine.has_work():
            settle_cache(engine)
        while engine.has_work():
            engine.step()
    for i in range(3):  # no verify without a wait yet (tables late on a busy CPU): a few lone requests more
        if cache.stats()["fast_steps"] or time.perf_counter() > t_end:
            break
        p = prompt(10, 60 + i)
        engine.generate([p], params(p, 4 * k + 4))
    return cancelled
