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
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from draftrelay.handoff.region import RoundRequest, RoundResult, Status
from draftrelay.handoff.rounds import HandoffConfig, SyncRounds, open_rounds
from draftrelay.model import Transformer, to_device

from .sampling import accept_greedy, accept_sampled, probs_from_logits, sample_from

MODES = ("off", "sync", "async")


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0  # nucleus sampling (1: off)
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


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

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("max_batch", "max_len", "prefill_chunk", "max_round_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.n_draft <= 64:
            raise ValueError(f"n_draft must be within [0, 64], got {self.n_draft}")


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    row: int = -1
    done: bool = False
    finish_reason: str = ""
    # drafter bookkeeping: what the drafter holds (position of the next block) and its incarnation
    generation: int = 1
    synced: int = 0
    restarts: int = 0  # restarts in a row without a draft
    no_drafts: bool = False  # the drafter returned nothing even after restarts: stop asking
    # metrics
    t_arrive: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    step_s: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # drafts kept, per step that had drafts
    pos_tries: list[int] = field(default_factory=list)
    pos_hits: list[int] = field(default_factory=list)
    rounds: Counter = field(default_factory=Counter)  # ok / failed / watchdog / target_only
    gen: torch.Generator | None = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, a: int, b: int) -> list[int]:
        """(prompt + output)[a:b] without building the whole sequence (long prompts)."""
        P = len(self.prompt)
        if b <= P:
            return self.prompt[a:b]
        if a >= P:
            return self.output[a - P:b - P]
        return self.prompt[a:] + self.output[:b - P]

    def metrics(self) -> dict:
        steps = self.step_s
        n_out = len(self.output)
        return {
            "id": self.id, "prompt_tokens": len(self.prompt), "output_tokens": n_out,
            "finish_reason": self.finish_reason,
            "ttft_s": self.t_first - self.t_arrive,
            "step_p50_ms": 1e3 * statistics.median(steps) if steps else 0.0,
            "steps": len(steps),
            "tokens_per_step": (n_out - 1) / len(steps) if steps else 0.0,
            "mean_accepted": float(np.mean(self.kept)) if self.kept else 0.0,
            "accept_rate_by_pos": [h / t if t else 0.0 for h, t in zip(self.pos_hits, self.pos_tries, strict=True)],
            "rounds": {k: self.rounds.get(k, 0) for k in ("ok", "failed", "watchdog", "target_only")},
            "generation": self.generation,
        }


def drafts_from_reply(buf: torch.Tensor, layout, n_req: int, width: int, vocab: int) -> torch.Tensor:
    """The [n_req, width] draft-token block of a reply slot's bytes (a uint8 tensor on any device),
    clamped into the vocabulary so stale or garbage bytes can never index outside the embedding."""
    cfg = layout.cfg
    raw = buf[layout.reply_drafts_off:layout.reply_drafts_off + 4 * cfg.max_requests * cfg.max_drafts]
    return raw.view(torch.int32).view(cfg.max_requests, cfg.max_drafts)[:n_req, :width].clamp(0, vocab - 1).long()


class LocalRounds:
    """In-process rounds around a round function (same interface as SyncRounds): for tests and
    for running a drafter inside the engine process. fn(t, requests, budget_s) -> [(drafts, conf)]."""

    mode = "local"
    refusal = ""

    def __init__(self, fn: Callable, max_drafts: int = 16) -> None:
        self.fn, self.max_drafts = fn, max_drafts
        self._t = 0
        self._results: dict[int, RoundResult] = {}
        self._by_status: Counter = Counter()

    def submit(self, requests: list[RoundRequest]) -> int:
        self._t += 1
        n, D = len(requests), self.max_drafts
        counts, drafts, conf = np.zeros(n, np.int32), np.zeros((n, D), np.int32), np.zeros((n, D), np.float32)
        for i, (d, c) in enumerate(self.fn(self._t, requests, 1.0)):
            counts[i] = len(d)
            drafts[i, :len(d)], conf[i, :len(d)] = d, c
        self._results[self._t] = RoundResult(self._t, Status.OK, counts, drafts, conf)
        return self._t

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult:
        res = self._results.pop(t)
        self._by_status[res.status.name.lower()] += 1
        return res

    def stats(self) -> dict:
        return {"mode": self.mode, "refusal": "", "rounds": sum(self._by_status.values()), **self._by_status}

    def close(self) -> None:
        pass


class Engine:
    def __init__(self, target: Transformer, cfg: EngineConfig, rounds=None, stream=None) -> None:
        cfg.validate()
        self.model, self.cfg = target, cfg
        self.device = target.device
        self.vocab = target.cfg.vocab_size
        # one spare row: the graph path pads batches with it (its contents are never read back)
        self.cache = target.new_cache(cfg.max_batch + 1, cfg.max_len)
        self.free_rows = list(range(cfg.max_batch))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._ends: list[RoundRequest] = []  # finished requests the drafter may forget
        self._next_id = 0
        self._own_rounds = False
        self.rounds = rounds
        # on a GPU the engine works on its own stream: a parked *default* stream would hold up others
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.Stream(device=self.device)
        self.stream = stream  # passed in: e.g. the stream CUDA rounds made elsewhere enqueue on
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the cache's zeroing
        if cfg.mode != "off" and rounds is None:
            h = dataclasses.replace(cfg.handoff or HandoffConfig(backend="cuda" if self.stream else "emulated"))
            h.vocab_size = self.vocab
            h.max_drafts = max(h.max_drafts, cfg.n_draft)
            h.max_requests = max(h.max_requests, cfg.max_batch)
            with self._on_stream():  # the CUDA hand-off enqueues on the current stream
                self.rounds = SyncRounds(h) if cfg.mode == "sync" else open_rounds(h)
            self._own_rounds = True
        self.graphs: dict[int, object] = {}  # verify width T -> DecodeGraphs
        if cfg.graphs:
            from .graphs import DecodeGraphs  # CUDA only

            widths = {1, cfg.n_draft + 1}  # plain decode steps and k+1 verifies
            with self._on_stream():
                for T in sorted(widths):
                    self.graphs[T] = DecodeGraphs(target, self.cache, cfg.max_batch, T, ring=cfg.slot_ring)
        self._use_rounds(self.rounds)
        self.wall_s = 0.0
        # where each decode step's time goes (seconds): submit = the engine thread's cost of starting
        # the round (sync: the whole round); wait = blocked in result(); verify = the verify forward
        # up to its logits on the host (on a GPU: launches + whatever did not overlap); host = the rest
        self.timing: dict[str, list[float]] = {k: [] for k in ("submit", "wait", "verify", "host", "step")}

    def _use_rounds(self, rounds) -> None:
        self.rounds = rounds
        self._round_mode = "off" if rounds is None else rounds.mode
        # CUDA async rounds: the verify reads its drafts on the GPU, from the reply buffer the
        # hand-off fills, and is enqueued right behind the parked wait (see _decode)
        self.device_drafts = (self.stream is not None and getattr(rounds, "mode", "") == "async"
                              and getattr(getattr(rounds, "stream", None), "name", "") == "cuda")

    def set_rounds(self, rounds) -> None:
        """Switch where drafts come from (None: target only) between requests, e.g. to decode the
        same prefilled prompts in several modes side by side. The caller keeps owning `rounds`."""
        if self.running or self.waiting:
            raise RuntimeError("set_rounds: requests are in flight")
        if self._own_rounds and self.rounds is not None:
            self.rounds.close()
        self._own_rounds = False
        self._ends.clear()
        self._use_rounds(rounds)

    @property
    def round_mode(self) -> str:
        """What actually runs: 'off', 'sync', 'async', or 'sync' after an async refusal."""
        return self._round_mode

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        params = params or SamplingParams()
        prompt = [int(x) for x in prompt]
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"prompt token outside the vocabulary [0, {self.vocab})")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be within (0, 1], got {params.top_p}")
        need = len(prompt) + params.max_tokens + self.cfg.n_draft + 1
        if need > self.cfg.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) + drafts "
                             f"({self.cfg.n_draft + 1}) = {need} exceeds the engine's max_len {self.cfg.max_len}")
        req = Request(self._next_id, prompt, params, t_arrive=time.perf_counter())
        self._next_id += 1
        if params.temperature > 0:
            req.gen = torch.Generator(device=self.device).manual_seed(params.seed * 1_000_003 + req.id)
        self.waiting.append(req)
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

    # -- one engine step ------------------------------------------------------------------------------
    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def step(self) -> None:
        with self._on_stream():
            self._step()

    def prefill_waiting(self) -> None:
        """Admit waiting requests into free rows: prefill, first token (TTFT)."""
        with torch.inference_mode(), self._on_stream():
            while self.waiting and self.free_rows:
                self._prefill(self.waiting.popleft())

    def resume(self, req: Request, n_output: int = 1) -> Request:
        """A new request that continues `req`'s row from its prompt and first `n_output` tokens
        (the KV of those is already in the row): benchmarks decode one prefill in several modes."""
        if req.row < 0 or req.row in self.free_rows or any(r.row == req.row for r in self.running):
            raise ValueError("resume: the request's row is not held (cancel it first, do not finish it)")
        new = Request(self._next_id, req.prompt, req.params, output=req.output[:n_output], row=req.row,
                      t_arrive=req.t_arrive, t_first=req.t_first)
        self._next_id += 1
        if req.gen is not None:
            new.gen = torch.Generator(device=self.device).manual_seed(req.params.seed * 1_000_003 + new.id)
        self.cache.lengths[req.row] = len(req.prompt) + n_output - 1
        self.running.append(new)
        return new

    def cancel(self, req: Request, keep_row: bool = False) -> None:
        """Stop a waiting or running request. The row is freed and the drafter told to forget the
        request (an END with the next round), unless keep_row leaves both reserved (for resume)."""
        req.done, req.finish_reason = True, req.finish_reason or "cancelled"
        if any(r is req for r in self.waiting):  # not prefilled yet: holds no row
            self.waiting.remove(req)
            return
        self.running.remove(req)
        if not keep_row:
            self.cache.reset(req.row)
            self.free_rows.append(req.row)
            self.free_rows.sort()
            if self.rounds is not None and req.synced:
                self._ends.append(RoundRequest(req.id, req.generation, req.synced, np.zeros(0, np.int32), 0))

    def release_row(self, row: int) -> None:
        self.cache.reset(row)
        if row not in self.free_rows:
            self.free_rows.append(row)
            self.free_rows.sort()

    def _step(self) -> None:
        while self.waiting and self.free_rows:
            self._prefill(self.waiting.popleft())
        live = [r for r in self.running if not r.done]
        if live:
            self._decode(live)
        for r in [r for r in self.running if r.done]:
            self._finish(r)

    def _prefill(self, req: Request) -> None:
        req.row = self.free_rows.pop(0)
        self.cache.reset(req.row)
        toks = torch.tensor(req.prompt, dtype=torch.long)
        rows = torch.tensor([req.row])
        C = self.cfg.prefill_chunk
        for c0 in range(0, len(req.prompt), C):  # chunked: bounded activation memory for long prompts
            chunk = toks[c0:c0 + C][None]
            logits = self.model(chunk, torch.tensor([c0]), self.cache, rows, last_only=True)
        first = self._sample_one(req, logits[0, -1])
        req.t_first = time.perf_counter()
        self.running.append(req)
        self._emit(req, [first])

    def _sample_one(self, req: Request, logits: torch.Tensor) -> int:
        p = req.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        return sample_from(probs_from_logits(logits, p.temperature, p.top_k, p.top_p), req.gen)

    def _emit(self, req: Request, tokens: list[int]) -> None:
        """Append tokens, stopping at a stop token or max_tokens (the rest is dropped)."""
        p = req.params
        for tok in tokens:
            req.output.append(tok)
            if tok in p.stop_token_ids:
                req.done, req.finish_reason = True, "stop"
                return
            if len(req.output) >= p.max_tokens:
                req.done, req.finish_reason = True, "length"
                return

    def _finish(self, req: Request) -> None:
        req.t_done = time.perf_counter()
        self.running.remove(req)
        self.cache.reset(req.row)
        self.free_rows.append(req.row)
        self.free_rows.sort()
        self.finished.append(req)
        if self.rounds is not None and req.synced:  # let the drafter free the request's KV
            self._ends.append(RoundRequest(req.id, req.generation, req.synced, np.zeros(0, np.int32), 0))

    def _n_out(self, req: Request) -> int:
        if req.no_drafts:
            return 0
        # never draft past max_tokens: the last token of a request is always the target's own
        return max(0, min(self.cfg.n_draft, req.params.max_tokens - len(req.output) - 1))

    def _decode(self, batch: list[Request]) -> None:
        t_step = time.perf_counter()
        tm = {"submit": 0.0, "wait": 0.0, "verify": 0.0}
        B = len(batch)
        lens = [r.seq_len for r in batch]
        wanted = [self._n_out(r) for r in batch] if self.rounds is not None else [0] * B
        M = self.cfg.max_round_tokens
        send = [r.tokens(r.synced, min(n, r.synced + M)) for r, n in zip(batch, lens, strict=True)]
        # a request whose drafter is still catching up on its context asks for no drafts yet
        n_out = [w if r.synced + len(x) == n else 0 for r, n, x, w in zip(batch, lens, send, wanted, strict=True)]
        res, t = None, 0
        if any(wanted):
            reqs = [RoundRequest(r.id, r.generation, r.synced, np.asarray(x, np.int32), n)
                    for r, x, n in zip(batch, send, n_out, strict=True)]
            room = max(0, self._round_capacity() - B)
            ends, self._ends = self._ends[:room], self._ends[room:]
            t0 = time.perf_counter()
            t = self.rounds.submit(reqs + ends)
            tm["submit"] = time.perf_counter() - t0
        # host work that does not depend on the drafts (overlaps the round in async mode)
        start = torch.tensor([n - 1 for n in lens], dtype=torch.long)  # the pending token's position
        rows = torch.tensor([r.row for r in batch], dtype=torch.long)
        pending = [r.output[-1] for r in batch]
        logits = used = None
        buf = self._reply_device_buffer(t) if t and self.device_drafts and any(n_out) else None
        if buf is not None:
            # enqueue the verify now: on the stream it runs as soon as the round is released
            t0 = time.perf_counter()
            logits, used = self._verify_on_device(pending, buf, 1 + max(n_out), start, rows)
            tm["verify"] += time.perf_counter() - t0
        drafts: list[list[int]] = [[] for _ in batch]
        if t:
            t0 = time.perf_counter()
            res = self.rounds.result(t)
            tm["wait"] = time.perf_counter() - t0
            drafts = self._take_drafts(batch, send, n_out, res)
        t0 = time.perf_counter()
        if logits is None:
            T = 1 + max(len(d) for d in drafts)
            tokens = torch.zeros(B, T, dtype=torch.long)
            for i, (p, d) in enumerate(zip(pending, drafts, strict=True)):
                tokens[i, 0] = p
                tokens[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
            logits = self._verify_forward(tokens, start, rows)  # [B, >=T, V]
        greedy = [r.params.temperature <= 0 for r in batch]
        argmax = logits.argmax(-1).tolist() if any(greedy) else None
        tm["verify"] += time.perf_counter() - t0
        if used is not None:  # the drafts the GPU verified must be the ones the host validated
            used = used.tolist()
            drafts = [d if used[i][:len(d)] == d else [] for i, d in enumerate(drafts)]
        for i, r in enumerate(batch):
            d = drafts[i]
            if greedy[i]:
                kept, nxt = accept_greedy(argmax[i][:len(d) + 1], d)
            else:
                p = probs_from_logits(logits[i, :len(d) + 1], r.params.temperature, r.params.top_k,
                                      r.params.top_p)
                kept, nxt = accept_sampled(p, d, r.gen)
            # roll the KV back to the accepted length: pending + kept drafts are now in the cache
            self._set_kv_len(r.row, int(start[i]) + 1 + kept)
            self._record(r, res, wanted[i], len(d), kept)
            self._emit(r, d[:kept] + [nxt])
        dt = time.perf_counter() - t_step
        for r in batch:
            r.step_s.append(dt)
        for k, v in tm.items():
            self.timing[k].append(v)
        self.timing["host"].append(dt - sum(tm.values()))
        self.timing["step"].append(dt)

    def _reply_device_buffer(self, rid: int) -> torch.Tensor | None:
        """The device copy (uint8) of the reply slot round `rid` lands in; None when the round is
        not on the stream (e.g. the proxy is being replaced: a zero-draft result, host path)."""
        fn = getattr(self.rounds, "reply_device_buffer", None)
        if fn is not None:
            return fn(rid)
        # AsyncRounds internals: slot -> (round id, stream round, n_out, event); one buffer per slot
        for slot, p in getattr(self.rounds, "_pending", {}).items():
            if p[0] == rid:
                return getattr(self.rounds._dst[slot], "dev", None)
        return None

    def _verify_on_device(self, pending: list[int], buf: torch.Tensor, T: int, start: torch.Tensor,
                          rows: torch.Tensor):
        """Verify forward fed from the GPU copy of a round's reply (CUDA async rounds). Returns
        (logits, the draft tokens the GPU used). A failed round leaves stale bytes there: they are
        clamped into the vocabulary and never accepted (the host's verdict sets the counts), and
        position 0 does not depend on them."""
        B = len(pending)
        dd = drafts_from_reply(buf, self.rounds.region.layout, B, T - 1, self.vocab)
        g = self.graphs.get(T) or self.graphs.get(self.cfg.n_draft + 1)
        if g is not None and g.fits(B, T):
            tokens = torch.zeros(B, 1, dtype=torch.long)
            tokens[:, 0] = torch.tensor(pending, dtype=torch.long)
            return g.run(tokens, start, rows, device_drafts=dd), dd
        tokens = torch.empty(B, T, dtype=torch.long, device=self.device)
        tokens[:, 0] = to_device(torch.tensor(pending, dtype=torch.long), self.device)
        tokens[:, 1:] = dd
        return self.model(tokens, start, self.cache, rows), dd

    def _round_capacity(self) -> int:
        h = getattr(self.rounds, "cfg", None)
        return h.max_requests if h is not None else self.cfg.max_batch

    def _take_drafts(self, batch, send, n_out, res: RoundResult) -> list[list[int]]:
        """Drafts usable for each request, and the drafter bookkeeping the round implies."""
        out = []
        for i, r in enumerate(batch):
            if not res.ok:  # failed / watchdog: target-only; resend from r.synced next round
                out.append([])
                continue
            c = int(res.counts[i])
            d = res.drafts[i, :min(c, n_out[i])]
            if len(d) and (d.min() < 0 or d.max() >= self.vocab):  # never trust a draft id
                d = d[:0]
            if n_out[i] and c == 0:
                # an OK round with nothing for this request: the drafter does not know it (new
                # session) or refused the block. Restart it from position 0 with a new generation;
                # after 3 restarts in a row without a single draft, stop asking.
                r.restarts += 1
                r.no_drafts = r.restarts > 3
                r.generation += 1
                r.synced = 0
            else:
                r.synced += len(send[i])
                if c:
                    r.restarts = 0
            out.append(d.tolist())
        return out

    def _record(self, r: Request, res: RoundResult | None, asked: int, offered: int, kept: int) -> None:
        if res is not None and asked:
            r.rounds["ok" if res.ok else ("watchdog" if res.status == Status.WATCHDOG else "failed")] += 1
        if res is not None and asked and offered == 0:
            r.rounds["target_only"] += 1
        if offered:
            r.kept.append(kept)
            while len(r.pos_tries) < offered:
                r.pos_tries.append(0)
                r.pos_hits.append(0)
            for j in range(offered):
                r.pos_tries[j] += 1
                r.pos_hits[j] += j < kept

    def _verify_forward(self, tokens: torch.Tensor, start: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        for width in sorted(self.graphs):  # the narrowest captured graph that fits
            if self.graphs[width].fits(B, T):
                return self.graphs[width].run(tokens, start, rows)
        return self.model(tokens, start, self.cache, rows)

    def _set_kv_len(self, row: int, n: int) -> None:
        # eager forwards advanced the row to start+T; graph replays did not touch lengths at all
        self.cache.lengths[row] = n

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self, requests: list[Request] | None = None) -> dict:
        reqs = self.finished if requests is None else requests
        per = [r.metrics() for r in reqs]
        out_tokens = sum(m["output_tokens"] for m in per)
        kept = [k for r in reqs for k in r.kept]
        tries = Counter()
        hits = Counter()
        for r in reqs:
            for j, (h, t) in enumerate(zip(r.pos_hits, r.pos_tries, strict=True)):
                tries[j] += t
                hits[j] += h
        rounds = Counter()
        for r in reqs:
            rounds.update(r.rounds)
        total = {
            "mode": self.cfg.mode, "round_mode": self.round_mode,
            "refusal": getattr(self.rounds, "refusal", "") if self.rounds is not None else "",
            "requests": len(per), "output_tokens": out_tokens, "wall_s": self.wall_s,
            "tokens_per_s": out_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s_mean": float(np.mean([m["ttft_s"] for m in per])) if per else 0.0,
            "step_p50_ms": statistics.median([m["step_p50_ms"] for m in per]) if per else 0.0,
            "mean_accepted": float(np.mean(kept)) if kept else 0.0,
            "tokens_per_step": (sum(m["output_tokens"] - 1 for m in per) / max(1, sum(m["steps"] for m in per))),
            "accept_rate_by_pos": [hits[j] / tries[j] for j in sorted(tries)],
            "rounds": {k: rounds.get(k, 0) for k in ("ok", "failed", "watchdog", "target_only")},
            "step_parts_p50_ms": {k: 1e3 * statistics.median(v) if v else 0.0 for k, v in self.timing.items()},
        }
        if self.rounds is not None:
            total["handoff"] = self.rounds.stats()
        return {"total": total, "requests": per}

    def reset_metrics(self) -> None:
        """Forget finished requests and timers (e.g. after a warm-up run)."""
        self.finished.clear()
        self.wall_s = 0.0
        for v in self.timing.values():
            v.clear()

    def close(self) -> None:
        if self.rounds is not None and self._own_rounds:
            self.rounds.close()
            # SyncRounds runs the round function in this process: end its worker session now (a
            # session reserves draft-KV rows on the worker until its connection closes)
            close_fn = getattr(getattr(self.rounds, "_fn", None), "close", None)
            if close_fn is not None:
                close_fn()
        self.rounds = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
