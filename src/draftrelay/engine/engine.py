"""The target-side engine: requests, KV rows, chunked prefill, batched speculative decode, metrics.

One decode step for the running batch (every request keeps one *pending* token: sampled, not yet
in the target's KV):

  1. round t: each request sends the tokens the drafter has not seen yet (the prompt on the first
     round, afterwards the tokens accepted since), at the position the drafter holds, with its
     generation number and how many drafts it wants (n_out);
       off   -> no round: a plain one-token decode step;
       sync  -> the engine thread does the round itself (SyncRounds: it waits on the network);
       async -> the round is only *enqueued* (AsyncRounds: the stream parks on a host flag, the
                proxy process does the round); the engine prepares the verify meanwhile;
  2. verify: one target forward over [pending, d1..dk] for every request (k+1 positions, rows
     padded to the longest draft);
  3. accept: greedy exact match, or lossless rejection sampling (sampling.py); the target KV is
     rolled back to the accepted length; the next pending token is the correction or the bonus.

A round that failed, timed out or was claimed by the watchdog carries zero drafts: that step is
target-only (logits of position 0 depend on the pending token and the KV only, never on drafts, so
a bad round can cost speed, never a token). After a failed round the next round resends from the
last position the drafter confirmed (the worker rolls back and extends); a request the drafter no
longer knows (new session after a reconnect: an OK round with zero drafts for it) is restarted
with a higher generation number from position 0.

The pieces, one module each: request.py (Request, SamplingParams), kv.py (KV rows taken and given
back), planner.py (what a round sends and asks; the drafter bookkeeping after it), verify.py (the
verify forward, host or device drafts, graphs or eager), sampling.py (the accept rule), metrics.py
(step timing, per-round records, totals), local_rounds.py (in-process rounds), spec_cache.py (the
speculation cache's step: branch drafts pre-drafted by the worker, the round off the critical path).
Drafts come from a draftrelay.round.Rounds: LocalRounds, or handoff.rounds' SyncRounds / AsyncRounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftrelay import cpu_linear
from draftrelay.handoff.rounds import HandoffConfig, SyncRounds, open_rounds
from draftrelay.model import Transformer
from draftrelay.round import Rounds

from .depth import DepthConfig, DepthPolicy
from .kv import KVRows
from .local_rounds import LocalRounds
from .metrics import StepClock, new_timing, record_round, speculation_warning, totals
from .planner import RoundPlanner
from .request import Request, SamplingParams
from .sampling import accept, first_token
from .spec_cache import SpecCache
from .threads import ThreadPolicy
from .verify import Verifier, VerifyInputs, drafts_from_reply

MODES = ("off", "sync", "async")


@dataclass
class EngineConfig:
    mode: str = "off"  # off | sync | async
    n_draft: int = 4  # k: drafts asked per request per round
    max_batch: int = 4  # concurrent requests (target KV rows)
    max_len: int = 2048  # tokens per KV row (prompt + output + k + 1)
    prefill_chunk: int = 512
    # tokens one request sends the drafter per round: a long prompt reaches the drafter over several
    # rounds (target-only steps meanwhile), so no round has to prefill 100K tokens within its deadline
    max_round_tokens: int = 4096
    graphs: bool = False  # CUDA graphs for the verify forward (GPU only, see graphs.py)
    slot_ring: bool = False  # two-slot decode-graph ring (only with graphs)
    handoff: HandoffConfig | None = None  # rounds to open when none are passed in
    # depth policy (depth.py): "auto" picks k in 0..n_draft per step from measured costs and acceptance;
    # "fixed" always asks n_draft
    depth: str = "fixed"
    round_costs_s: dict | None = None  # measured round seconds by depth (calibrate.py): the policy's start
    # the confidence stop (0: off): the worker ends a round's drafts after the first one whose drafter
    # probability is below this, so n_draft (or the depth policy's choice) is a cap; sent with every block
    # through the round spec ("draft_stop", wire/roundfn.py) of the rounds the engine opens
    draft_stop: float = 0.0
    # the worker's drafter computes every draft a round asks whatever the stop returns (CUDA graphs, static
    # steps, TP2, replay), so the depth policy books and prices a round at the depth it asked
    # (depth.DepthConfig.fixed_rounds); False: at the drafts it brought (a drafter that stops computing).
    # The worker says which in its HELLO_OK (wire.protocol.HELLO_OK_FIXED_ROUNDS)
    fixed_rounds: bool = False
    # the speculation cache (spec_cache.py): F branches pre-drafted per request, 0 = off (async rounds
    # with a worker only); spec_options: SpecCache keywords (branch_budget_ms, push_faults, log)
    spec_fanout: int = 0
    spec_options: dict = field(default_factory=dict)
    # CPU threads of the target's forward (threads.py): "auto" measures one thread against all of them
    # per step and runs the faster; N > 0 sets torch's count to N; 0 leaves torch's setting alone
    threads: int | str = 0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("max_batch", "max_len", "prefill_chunk", "max_round_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.n_draft <= 64:
            raise ValueError(f"n_draft must be within [0, 64], got {self.n_draft}")
        if self.depth not in ("fixed", "auto"):
            raise ValueError(f"depth must be 'fixed' or 'auto', got {self.depth!r}")
        if self.threads != "auto" and not (isinstance(self.threads, int) and self.threads >= 0):
            raise ValueError(f"threads must be 'auto' or a count >= 0, got {self.threads!r}")
        if not 0.0 <= self.draft_stop <= 1.0:  # also refuses NaN
            raise ValueError(f"draft_stop (confidence stop) must be within [0, 1] (0: off), got {self.draft_stop!r}")
        if not 0 <= self.spec_fanout <= 64:
            raise ValueError(f"spec_fanout (speculation-cache fan-out) must be within [0, 64], "
                             f"got {self.spec_fanout}")


class Engine:
    def __init__(self, target: Transformer, cfg: EngineConfig, rounds: Rounds | None = None, stream=None) -> None:
        cfg.validate()
        self.model, self.cfg = target, cfg
        self.device = target.device
        cpu_linear.prepare(target)  # the probe (if any) runs here, not inside a timed step
        self.vocab = target.cfg.vocab_size
        # one spare row: the graph path pads batches with it (its contents are never read back)
        self.cache = target.new_cache(cfg.max_batch + 1, cfg.max_len)
        self.kv = KVRows(self.cache, cfg.max_batch)
        self.planner = RoundPlanner(cfg.n_draft, cfg.max_round_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._next_id = 0
        # on a GPU the engine works on its own stream: a parked *default* stream would hold up others
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.Stream(device=self.device)
        self.stream = stream  # passed in: e.g. the stream CUDA rounds made elsewhere enqueue on
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the cache's zeroing
        self._own_rounds = cfg.mode != "off" and rounds is None
        self.spec_cache = SpecCache(cfg.spec_fanout, **cfg.spec_options) if cfg.spec_fanout else None
        try:
            self.rounds: Rounds | None = self._open_rounds() if self._own_rounds else rounds
        except BaseException:
            if self.spec_cache is not None:  # leave no table memfd behind
                self.spec_cache.shm.close()
            raise
        self.verifier = Verifier(target, self.cache, self._capture_graphs() if cfg.graphs else {}, cfg.n_draft)
        self.wall_s = 0.0
        self.closed = False
        self.timing = new_timing()  # where each decode step's time goes (see metrics.py)
        if self.spec_cache is not None:
            self.spec_cache.bind(self.rounds, self.vocab, self.device_drafts)
        self.depth: DepthPolicy | None = None
        self._new_depth_policy()
        self.threads = self._thread_policy()

    def _new_depth_policy(self) -> None:
        """A fresh policy for the current rounds (other rounds, other costs)."""
        on = self.cfg.depth == "auto" and self.cfg.n_draft > 0 and self.rounds is not None
        self.depth = DepthPolicy(self.cfg.n_draft, DepthConfig(fixed_rounds=self.cfg.fixed_rounds),
                                 round_costs=self.cfg.round_costs_s) if on else None

    def _thread_policy(self) -> ThreadPolicy | None:
        if self.device.type != "cpu":
            return None
        if self.cfg.threads == "auto":
            from .loading import default_threads

            n = default_threads()
            return ThreadPolicy(n) if n >= 2 else None
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        return None

    def _open_rounds(self) -> Rounds:
        h = dataclasses.replace(self.cfg.handoff or HandoffConfig(backend="cuda" if self.stream else "emulated"))
        h.vocab_size = self.vocab
        h.max_drafts = max(h.max_drafts, self.cfg.n_draft)
        h.max_requests = max(h.max_requests, self.cfg.max_batch)
        if self.cfg.draft_stop:
            h.round_spec = {**h.round_spec, "draft_stop": self.cfg.draft_stop}
        if self.spec_cache is not None:  # the proxy gets the table memfd and the fan-out
            h.round_spec = self.spec_cache.round_spec(h.round_spec, h.round_budget_ms)
        with self._on_stream():  # the CUDA hand-off enqueues on the current stream
            return SyncRounds(h) if self.cfg.mode == "sync" else open_rounds(h)

    def _capture_graphs(self) -> dict:
        from .graphs import DecodeGraphs  # CUDA only

        # plain decode steps and k+1 verifies; with the depth policy every width it may choose
        widths = set(range(1, self.cfg.n_draft + 2)) if self.cfg.depth == "auto" else {1, self.cfg.n_draft + 1}
        with self._on_stream():
            return {T: DecodeGraphs(self.model, self.cache, self.cfg.max_batch, T, ring=self.cfg.slot_ring)
                    for T in sorted(widths)}

    @property
    def graphs(self) -> dict:
        """Verify width T -> DecodeGraphs (empty without graphs)."""
        return self.verifier.graphs

    @graphs.setter
    def graphs(self, graphs: dict) -> None:
        self.verifier.graphs = graphs

    @property
    def free_rows(self) -> list[int]:
        return self.kv.free

    def set_rounds(self, rounds: Rounds | None) -> None:
        """Switch where drafts come from (None: target only) between requests, e.g. to decode the
        same prefilled prompts in several modes side by side. The caller keeps owning `rounds`."""
        if self.running or self.waiting:
            raise RuntimeError("set_rounds: requests are in flight")
        if self.spec_cache is not None:  # collect a round left in flight, then re-check the new rounds
            self.spec_cache.settle(self)
        if self._own_rounds and self.rounds is not None:
            self.rounds.close()
        self._own_rounds = False
        self.planner.forget_ends()
        self.rounds = rounds
        self._new_depth_policy()
        if self.spec_cache is not None:
            self.spec_cache.bind(rounds, self.vocab, self.device_drafts)

    @property
    def round_mode(self) -> str:
        """What actually runs: 'off', 'sync', 'async', or 'sync' after an async refusal."""
        return "off" if self.rounds is None else self.rounds.mode

    @property
    def device_drafts(self) -> bool:
        """CUDA async rounds: the verify reads its drafts on the GPU, from the reply buffer the
        hand-off fills, and is enqueued right behind the parked wait (see _decode)."""
        return self.rounds is not None and self.rounds.device_replies

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        if self.closed:
            raise RuntimeError("this engine is closed (its KV cache was given back): make a new Engine")
        params = params or SamplingParams()
        prompt = [int(x) for x in prompt]
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"prompt token outside the vocabulary [0, {self.vocab})")
        params.validate()  # fields may have been changed after construction
        ctx = self.model.cfg.max_position_embeddings
        if len(prompt) + params.max_tokens > ctx:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(prompt) + params.max_tokens} exceeds the model's context of {ctx} positions")
        need = len(prompt) + params.max_tokens + self.cfg.n_draft + 1
        if need > self.cfg.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) + drafts "
                             f"({self.cfg.n_draft + 1}) = {need} exceeds the engine's max_len {self.cfg.max_len}")
        req = self._new_request(prompt, params, t_arrive=time.perf_counter())
        self.waiting.append(req)
        return req

    def _new_request(self, prompt: list[int], params: SamplingParams, **kw) -> Request:
        req = Request(self._next_id, prompt, params, **kw)
        self._next_id += 1
        if params.temperature > 0:
            req.gen = torch.Generator(device=self.device).manual_seed(params.seed * 1_000_003 + req.id)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_step: Callable[[Engine], None] | None = None) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        t0 = time.perf_counter()
        while self.has_work():
            self.step()
            if on_step is not None:
                on_step(self)
        self.wall_s += time.perf_counter() - t0
        return reqs

    def cancel(self, req: Request | int, keep_row: bool = False) -> Request:
        """Stop a waiting or running request (by object or id): it leaves the queues, gives its KV row
        back (keep_row: a running request's row stays reserved, for resume) and the drafter is told to
        END it in a later round. Cancelled requests are not `finished`. Returns the request."""
        if isinstance(req, int):
            req = next((r for r in (*self.waiting, *self.running) if r.id == req), None) or req
            if isinstance(req, int):
                raise ValueError(f"cancel: no waiting or running request with id {req}")
        if any(r is req for r in self.waiting):
            self.waiting.remove(req)
        elif any(r is req for r in self.running):
            self.running.remove(req)
            if not keep_row:
                self.kv.release(req.row)
        else:
            raise ValueError(f"cancel: request {req.id} is not waiting or running")
        req.done, req.finish_reason = True, req.finish_reason or "cancelled"
        req.t_done = time.perf_counter()
        if self.rounds is not None:
            self.planner.end(req)
        return req

    def resume(self, req: Request, n_output: int = 1) -> Request:
        """A new request that continues `req`'s row from its prompt and first `n_output` tokens
        (the KV of those is already in the row): benchmarks decode one prefill in several modes."""
        if req.row < 0 or self.kv.is_free(req.row) or any(r.row == req.row for r in self.running):
            raise ValueError("resume: the request's row is not held (cancel it first, do not finish it)")
        new = self._new_request(req.prompt, req.params, output=req.output[:n_output], row=req.row,
                                t_arrive=req.t_arrive, t_first=req.t_first)
        self.kv.set_len(req.row, len(req.prompt) + n_output - 1)
        self.running.append(new)
        return new

    def release_row(self, row: int) -> None:
        """Give back a row a cancel(keep_row=True) left reserved."""
        self.kv.release(row)

    # -- one engine step ------------------------------------------------------------------------------
    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def step(self) -> None:
        """Admit what fits, one decode step for the running batch, retire what finished."""
        with self._on_stream():
            self._admit()
            live = [r for r in self.running if not r.done]
            if live:
                self._decode(live)
            for r in [r for r in self.running if r.done]:
                self._finish(r)

    def prefill_waiting(self) -> None:
        """Admit waiting requests into free rows: prefill, first token (TTFT)."""
        with torch.inference_mode(), self._on_stream():
            self._admit()

    def _admit(self) -> None:
        while self.waiting and self.kv:
            self._prefill(self.waiting.popleft())

    def _prefill(self, req: Request) -> None:
        req.row = self.kv.alloc()
        toks = torch.tensor(req.prompt, dtype=torch.long)
        rows = torch.tensor([req.row])
        C = self.cfg.prefill_chunk
        if self.threads is not None:  # the count that runs the plain decode faster now
            self.threads.apply(self.threads.best)
        for c0 in range(0, len(req.prompt), C):  # chunked: bounded activation memory for long prompts
            logits = self.model(toks[c0:c0 + C][None], torch.tensor([c0]), self.cache, rows, last_only=True)
        first = first_token(req.params.temperature, req.params.top_k, logits[0, -1], req.gen, req.params.top_p)
        req.t_first = time.perf_counter()
        self.running.append(req)
        req.emit([first])

    def _finish(self, req: Request) -> None:
        req.t_done = time.perf_counter()
        self.running.remove(req)
        self.kv.release(req.row)
        self.finished.append(req)
        if self.rounds is not None:  # let the drafter free the request's KV
            self.planner.end(req)

    def _decode(self, batch: list[Request]) -> None:
        """One speculative step: round t (off: none), verify k+1, accept, roll the KV back."""
        if self.spec_cache is not None and self.spec_cache.active:
            return self.spec_cache.decode(self, batch)  # the same step, the round off the critical path
        clock = StepClock(self.timing)
        k = self.depth.choose() if self.depth is not None else None
        plan = self.planner.plan(batch, drafting=self.rounds is not None and k != 0, k=k)
        t = res = early = None
        if plan.asks:
            with clock.part("submit"):
                t = self.rounds.submit(self.planner.blocks(plan, self.rounds.capacity or self.cfg.max_batch))
        inp = VerifyInputs.of(batch)  # host work that does not depend on the drafts (overlaps an async round)
        buf = None
        if t and self.device_drafts and any(plan.n_out):
            with clock.part("wait"):  # a host-parked round (HandoffConfig.park) is waited for in here
                buf = self.rounds.reply_device_buffer(t)
        if buf is not None:  # enqueue the verify now: on the stream it runs as soon as the round is released
            with clock.part("verify"):
                early = self.verifier.enqueue(inp, buf, self.rounds.reply_layout, plan.width)
        drafts: list[list[int]] = [[] for _ in batch]
        if t:
            with clock.part("wait"):
                res = self.rounds.result(t)
            drafts = self.planner.settle(plan, res, self.vocab)
        used = self._verify_and_accept(batch, inp, drafts, res, plan.wanted, clock, early, n_out=plan.n_out)
        if self.depth is not None:
            self._observe_depth(plan, k, used, clock)

    def _verify_and_accept(self, batch: list[Request], inp: VerifyInputs, drafts: list[list[int]], res,
                           asked: list[int], clock: StepClock, early=None,
                           n_out: list[int] | None = None) -> list[list[int]]:
        """Verify [pending, drafts] for the batch, accept, roll the KV back, book the step; returns the
        drafts verified. asked[i]: the drafts request i's round asked for (0: the round is booked
        elsewhere, or there is none); n_out[i]: what this round asked (the depth policy learns from it)."""
        width = 1 + max(len(d) for d in drafts)
        if self.threads is not None:
            self.threads.apply(self.threads.choose(width))
        t0 = time.perf_counter()
        with clock.part("verify"):
            v = self.verifier.verify(inp, drafts, early, argmax=any(r.params.temperature <= 0 for r in batch),
                                     logits=any(r.params.temperature > 0 for r in batch))
        if self.threads is not None:
            self.threads.observe(width, time.perf_counter() - t0)
        for i, r in enumerate(batch):
            d = v.drafts[i]
            am = v.argmax[i] if v.argmax is not None else None
            lg = v.logits[i] if v.logits is not None else None  # None: every request greedy (argmax only)
            kept, nxt = accept(r.params.temperature, r.params.top_k, lg, am, d, r.gen, r.params.top_p)
            self.kv.set_len(r.row, int(inp.start[i]) + 1 + kept)  # pending + kept drafts are now in the cache
            record_round(r, res, asked[i], len(d), kept)
            if self.depth is not None and n_out is not None and n_out[i]:
                self.depth.observe_accept(n_out[i], len(d), kept)
            r.emit(d[:kept] + [nxt])
        clock.stop(batch)
        return v.drafts

    def _observe_depth(self, plan, k: int, drafts: list[list[int]], clock: StepClock) -> None:
        p = clock.parts
        if plan.asks:  # timed at the drafts the round drafted (fewer than k where the confidence stop ended it)
            self.depth.observe_round(k, p["submit"] + p["wait"], max(len(x) for x in plan.send),
                                     drafted=max(len(d) for d in drafts))
        self._observe_verify_width(drafts, clock)
        self.depth.observe_host(self.timing["host"][-1])

    def _observe_verify_width(self, drafts: list[list[int]], clock: StepClock) -> None:
        """The depth policy's verify cost at this step's width (drafts: what the verify took)."""
        if self.threads is None or not self.threads.probing:  # a thread probe's verify is not the usual cost
            self.depth.observe_verify(1 + max(len(d) for d in drafts), clock.parts["verify"])

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self, requests: list[Request] | None = None) -> dict:
        total, per = totals(self.finished if requests is None else requests, self.timing, self.wall_s)
        total = {"mode": self.cfg.mode, "round_mode": self.round_mode,
                 "refusal": self.rounds.refusal if self.rounds is not None else "", **total}
        if self.rounds is not None:
            total["handoff"] = self.rounds.stats()
            total["speculation_warning"] = speculation_warning(total["rounds"], total["handoff"])
        if self.depth is not None:
            total["depth"] = self.depth.summary()
        if self.spec_cache is not None:
            total["spec_cache"] = self.spec_cache.stats()
        if self.threads is not None:
            total["threads"] = self.threads.summary()
        if self.device.type == "cpu":  # which library ran the fp32 products
            total["cpu_linear"] = cpu_linear.chosen()
        return {"total": total, "requests": per}

    def reset_metrics(self) -> None:
        """Forget finished requests and timers (e.g. after a warm-up run)."""
        self.finished.clear()
        self.wall_s = 0.0
        for v in self.timing.values():
            v.clear()

    def close(self) -> None:
        """Close the rounds the engine opened (their worker session included: a session reserves
        draft-KV rows on the worker until its connection closes) and give back its KV cache and graphs.
        The metrics stay readable; decoding after close fails."""
        if self.spec_cache is not None:  # collect the round in flight, free the table memory
            self.spec_cache.close(self)
            self.spec_cache = None
        if self.rounds is not None and self._own_rounds:
            self.rounds.close()
        self.rounds = None
        if self.threads is not None:  # torch's thread count as the engine found it
            self.threads.restore()
            self.threads = None
        # the KV cache and the graphs (15-30 GB at 7B shape) go now, not when the last reference to the
        # engine does: a closed engine kept alive by a caller (or a cycle frozen by gc.freeze) held its
        # GPU memory beside the next engine's, which then ran out of it
        self.verifier.graphs = {}
        self.cache.release()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MODES", "Engine", "EngineConfig", "LocalRounds", "Request", "SamplingParams", "drafts_from_reply"]
