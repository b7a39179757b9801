"""Drafter backends of the worker: the Llama-family model (HF dir, built-in tiny, random shapes) and a
deterministic test drafter. All expose the same small interface the sessions use:

    run(jobs, n_steps) -> (drafts int32 [B, n_steps], confidences float32 [B, n_steps])

where each job is (cache row, keep, new tokens): roll the row back to `keep` tokens, append the new
tokens, then draft n_steps greedy tokens, feeding each draft back in (so the row's KV holds the
first n_steps - 1 drafts afterwards; the next round keeps those the client accepted).

The confidence stop (Job.min_conf > 0): a job's drafts end after the first one whose confidence (the
drafter's probability of its own greedy token) is below min_conf; `draft_stop.stop_counts` is the rule, and the
session applies it to whatever a drafter returns, so a drafter that always runs n_steps (static shapes,
CUDA graphs, TP2, replay) answers the same drafts as one that stops. The eager, lean and test drafters
also stop computing: once every job of the STEP has stopped, they return fewer columns than n_steps
(at least one), and each row's KV then holds the context and the drafts fed back before the stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from draftrelay.capture import GraphCapture, kv_bucket, kv_buckets
from draftrelay.wire.protocol import tokenizer_hash_of_dir
from draftrelay.worker.draft_stop import all_stopped

log = logging.getLogger("draftrelay.worker")

PAD_LIMIT = 16  # extensions up to this many tokens are batched in one padded forward
PREFILL_CHUNK = 512  # longer extensions (first-round prompts) run alone, in chunks of this size
BATCHED_HEAD = 256  # extensions up to this long (catch-up, short prompts) are prefilled together, padded
STATIC_MODES = ("static", "graph")  # the modes that run static-shape steps ("graph": captured), built by warm()


@dataclass
class Job:
    row: int
    keep: int
    tokens: np.ndarray  # int32 [n >= 1]
    min_conf: float = 0.0  # the confidence stop (0: off), a float32 value (the wire's)


class Drafter:
    model_id: str = ""
    vocab_size: int = 0
    tokenizer_hash: str = ""
    max_ctx: int = 0
    n_rows: int = 0
    n_out_max: int = 8
    info: str = ""
    # whether run() computes every asked draft whatever the confidence stop then keeps (the worker's HELLO_OK
    # says so: wire.protocol.HELLO_OK_FIXED_ROUNDS); False for a drafter that stops computing where it stops
    fixed_rounds: bool = False

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class TestDrafter(Drafter):
    """Deterministic drafter for tests: each draft is a function of the whole context so far.

    next(ctx) = (31 * ctx[-1] + 17 * len(ctx) + sum(ctx)) % vocab; confidence a fixed hash of it.
    A worker that keeps a rejected token or drops an accepted one drafts something else, so
    rollback mistakes show up. `slow_token` makes a step sleep `delay_ms` (timeouts), and
    `fail_token` makes it raise (DRAFTER_ERROR), both only when that token is sent.
    """

    def __init__(self, vocab_size: int = 1000, n_rows: int = 16, max_ctx: int = 4096, n_out_max: int = 8,
                 slow_token: int = -1, delay_ms: float = 0.0, fail_token: int = -1):
        self.vocab_size, self.n_rows, self.max_ctx, self.n_out_max = vocab_size, n_rows, max_ctx, n_out_max
        self.model_id, self.tokenizer_hash, self.info = f"test-drafter-v{vocab_size}", "test-tokenizer", "test cpu"
        self.slow_token, self.delay_ms, self.fail_token = slow_token, delay_ms, fail_token
        self.hist = np.zeros((n_rows, max_ctx + n_out_max + PAD_LIMIT), np.int64)
        self.lengths = np.zeros(n_rows, np.int64)

    @staticmethod
    def next_token(ctx: np.ndarray, vocab: int) -> tuple[int, float]:
        t = int((31 * int(ctx[-1]) + 17 * len(ctx) + int(ctx.sum())) % vocab)
        return t, ((t * 2654435761 + len(ctx)) % 1000 + 1) / 1001.0

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        drafts = np.zeros((len(jobs), n_steps), np.int32)
        confs = np.zeros((len(jobs), n_steps), np.float32)
        for j in jobs:
            if self.fail_token >= 0 and (j.tokens == self.fail_token).any():
                raise RuntimeError(f"test drafter: fail token {self.fail_token} seen")
            if self.slow_token >= 0 and (j.tokens == self.slow_token).any():
                time.sleep(self.delay_ms / 1000.0)
        ran = 0
        for b, j in enumerate(jobs):
            if not 0 <= j.keep <= self.lengths[j.row]:
                raise ValueError(f"row {j.row}: keep {j.keep} beyond its length {self.lengths[j.row]}")
            n = j.keep + len(j.tokens)
            self.hist[j.row, j.keep:n] = j.tokens
            thr = np.float32(j.min_conf)
            for s in range(n_steps):
                t, c = self.next_token(self.hist[j.row, :n], self.vocab_size)
                drafts[b, s], confs[b, s] = t, c
                ran = max(ran, s + 1)
                if thr > 0 and confs[b, s] < thr:  # the confidence stop: this draft is the job's last
                    break
                if s < n_steps - 1:
                    self.hist[j.row, n] = t
                    n += 1
            self.lengths[j.row] = n
        if any(j.min_conf > 0 for j in jobs):  # the steps any job ran (at least one where n_steps is)
            return drafts[:, :ran], confs[:, :ran]
        return drafts, confs


# ~0.5B / ~1.5B drafter shapes for benchmarks at random weights (timing does not depend on values);
# the 7B shape is a bandwidth-bound drafter (15 GB of bf16 weights) for the TP2 measurement
SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                         intermediate_size=4864, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         max_position_embeddings=32768, qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                         intermediate_size=8960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         max_position_embeddings=32768, qkv_bias=True),
    "qwen2.5-7b": dict(vocab_size=151936, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                       intermediate_size=18944, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=32768, qkv_bias=True),
}


T_BUCKETS = (1, 2, 4, 8, PAD_LIMIT)


def steady_state_keys(n_steps_list: list[int], max_batch: int, max_len: int,
                      max_kv: int = 0, min_kv: int = 0) -> list[tuple[int, int, int, int]]:
    """Every static-step key (requests, T bucket, n_steps, kv bucket) that a steady state with n_out in
    n_steps_list can use: a round then sends at most n_steps + 1 tokens per request. max_kv > 0: only
    the kv buckets a context of max_kv tokens needs (longer contexts are captured on first use); min_kv >
    0: none below the bucket of a min_kv-token context (one request whose prompt is that long: its rows
    never hold fewer)."""
    kvs = kv_buckets(max_len)
    if max_kv > 0:
        kvs = kvs[:next((i for i, kv in enumerate(kvs) if kv >= max_kv), len(kvs) - 1) + 1]
    if min_kv > 0:
        kvs = [kv for kv in kvs if kv >= kv_bucket(min(min_kv, max_len), max_len)] or kvs[-1:]
    keys = []
    for n in n_steps_list:
        t_max = next((t for t in T_BUCKETS if t >= n + 1), PAD_LIMIT)
        for b in range(1, max_batch + 1):
            for t in (t for t in T_BUCKETS if t <= t_max):
                keys += [(b, t, n, kv) for kv in kvs]
    return keys


def build_keys(keys: list[tuple[int, int, int, int]], build, progress=None) -> None:
    """build(key) for each key in order; progress(done, total), if given, before the first and after each."""
    if progress is not None and keys:
        progress(0, len(keys))
    for i, key in enumerate(keys, 1):
        build(key)
        if progress is not None:
            progress(i, len(keys))


class LlamaDrafter(Drafter):
    """Greedy drafting with draftrelay.model.Transformer.

    mode "eager": plain forwards, shapes as they come (the reference).
    mode "lean" (CPU; the default there): the same ops as eager on the same shapes, equal bit for bit,
    without the general forward's per-call host work (worker/lean.py).
    mode "static": the whole draft step (padded extension + n_steps-1 decodes + argmax/confidence)
    with static shapes and no host sync: keys of (requests, padded T, n_steps, kv bucket), attention
    over the first kv positions of each row (capture.kv_bucket, masked). mode "graph" (CUDA):
    the static step captured once per key as one CUDA graph, replayed with one H2D copy of the
    packed inputs and one D2H copy of the drafts.
    Frames with a long extension (a first-round prompt) always run eagerly.
    """

    def __init__(self, model, n_rows: int, max_ctx: int, n_out_max: int, model_id: str, tokenizer_hash: str,
                 mode: str = "eager", quant: str = "none"):
        import torch

        from draftrelay import cpu_linear
        from draftrelay.worker import lean

        self.torch = torch
        self.model = model
        cpu_linear.prepare(model)  # before the worker times its STEP
        cfg = model.cfg
        if mode not in ("eager", "lean", "static", "graph"):
            raise ValueError(f"drafter mode {mode!r}: eager, lean, static or graph")
        if mode == "graph" and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the drafter on a CUDA device")
        if mode == "lean" and not lean.supports(model):
            raise ValueError("drafter mode 'lean' needs a CPU model on the plain path without q/k norms")
        from draftrelay.worker import quant as Q

        if quant not in Q.QUANTS:
            raise ValueError(f"drafter quant {quant!r}: one of {', '.join(Q.QUANTS)}")
        if quant != "none" and mode != "lean":
            raise ValueError(f"drafter quant {quant!r} runs in the lean loop (a CPU drafter), not in mode {mode!r}")
        missing = Q.available(quant) if quant != "none" else ""
        if missing:
            raise ValueError(f"drafter quant {quant!r}: {missing}")
        self.mode = mode
        self.max_ctx = min(max_ctx, cfg.max_position_embeddings)
        self.n_rows, self.n_out_max, self.vocab_size = n_rows, n_out_max, cfg.vocab_size
        self.model_id, self.tokenizer_hash = model_id, tokenizer_hash
        # slack behind max_ctx: padded extensions and drafts past a partial window land there;
        # one extra row (index n_rows) is scratch for graph warm-up
        self.cache = model.new_cache(n_rows + 1, self.max_ctx + max(PAD_LIMIT, n_out_max) + 1)
        self._static: dict[tuple[int, int, int], object] = {}
        self._capture: GraphCapture | None = None  # made at the first capture, on the model's GPU
        self._lean = lean.LeanSteps(model, self.cache, quant=quant) if mode == "lean" else None
        self.info = (f"llama {cfg.n_layers}L d{cfg.hidden_size} {cfg.n_params() / 1e6:.1f}M params, "
                     f"{model.device} {str(model.dtype).replace('torch.', '')}, {mode}"
                     + (f", {quant} products" if quant != "none" else "")
                     + _int8_layers_info(getattr(model, "int8_layers", None))
                     + (", int8 head" if getattr(model, "int8_head", None) is not None else ""))

    def _on_model_gpu(self):
        # the server calls from its own threads, whose current CUDA device is GPU 0 whatever the
        # model's: side streams, pools and captures must be made on the model's GPU (a capture on
        # another device's stream records an EMPTY graph, whose replays leave stale drafts behind)
        dev = self.model.device
        return self.torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    # a CPU worker's main thread runs the steps (worker/mainthread.py says why); None: the caller's thread
    calls = None
    _extended = 0  # jobs the latest run extended eagerly before its static step
    _path = ""  # the path the latest run took (lean, static, graph, eager)
    _last: tuple = ()  # (seconds, graphs built, kernel shapes planned) of the latest run

    @property
    def fixed_rounds(self) -> bool:
        """The static steps (and their CUDA graphs) draft n_steps for every job; eager and lean stop."""
        return self.mode in STATIC_MODES

    @property
    def last_run(self) -> str:
        """What the latest run did and cost, for the worker's slow-STEP report (WorkerCore): a first-use
        graph capture or kernel measurement costs far more than a round's budget. Formatted only when
        asked: the facts are kept on every run, the text only for a slow one."""
        if not self._last:
            return ""
        seconds, graphs, planned = self._last
        path = f"{self._path} ({self._extended} extended eagerly first)" if self._extended else self._path
        return f"{seconds * 1e3:.1f} ms {path}, {graphs} graphs built, {planned} kernel shapes planned"

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        if self.calls is not None:
            return self.calls.call(self._run_here, jobs, n_steps)
        return self._run_here(jobs, n_steps)

    def _run_here(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        graphs, planned, t0 = len(self._static), _planned(), time.perf_counter()
        self._extended = 0
        try:
            with self._on_model_gpu():
                return self._run(jobs, n_steps)
        finally:
            self._last = (time.perf_counter() - t0, len(self._static) - graphs, _planned() - planned)

    def plan_warm(self) -> None:
        """One eager one-token forward with the head on the scratch row (CUDA): the kernel planner then
        plans every product of the model at every row bucket (kernels.plan, whole shapes) at start,
        where a round's first use of a new batch size would otherwise measure inside the round and
        overrun its budget. Nothing to plan on a CPU."""
        if self.model.device.type == "cuda":
            self._plan_forward()

    def _plan_forward(self) -> None:
        torch = self.torch
        with self._on_model_gpu(), torch.inference_mode():
            dev = self.model.device
            ways = [{"logits_at": torch.zeros(1, dtype=torch.int64, device=dev)}]
            if getattr(self.model, "int8_head", None) is not None:  # a greedy pick reads the int8 head: its keys
                ways.append({"greedy": True})
            for kw in ways:
                self.cache.truncate(self.n_rows, 0)
                self.model(torch.zeros((1, 1), dtype=torch.int64, device=dev), torch.tensor([0]), self.cache,
                           torch.tensor([self.n_rows]), **kw)
            self.cache.truncate(self.n_rows, 0)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def warm(self, n_steps_list: list[int], max_batch: int, max_kv: int = 0, progress=None, min_kv: int = 0) -> int:
        """Build (capture) the static steps of every (requests <= max_batch, T bucket, n_steps, kv bucket)
        a steady state with n_out = n_steps can use (a round sends at most n_steps + 1 tokens), so the
        first rounds of a session do not pay for captures. Returns how many were built. progress(done,
        total), if given, is called before the first step and after each. The eager and lean modes run
        no static step: nothing to build."""
        if self.mode not in STATIC_MODES:
            return 0
        before = len(self._static)
        keys = steady_state_keys(n_steps_list, min(max_batch, self.n_rows), self.cache.max_len, max_kv, min_kv)
        with self._on_model_gpu():
            build_keys(keys, self._get_static, progress)
        return len(self._static) - before

    def _run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        if self._lean is not None and jobs and all(len(j.tokens) <= PAD_LIMIT for j in jobs):
            self._path = "lean"
            return self._lean.run(jobs, n_steps)
        if self.mode in STATIC_MODES and jobs and n_steps >= 1:
            self._path = self.mode
            jobs = self._fit_built(jobs, n_steps)
            key_count = len(self._static)
            try:
                return self._run_static(jobs, n_steps)
            except Exception:
                if len(self._static) != key_count or self.mode != "graph":
                    raise  # a failure of an already built step is the frame's DRAFTER_ERROR
                # building (capturing) a new step failed: serve eagerly from now on rather than fail every round
                log.exception("CUDA graph capture failed; the drafter falls back to eager mode")
                self.mode, self._static = "eager", {}
                self.info = self.info.replace(", graph", ", eager (graph capture failed)")
        self._path = "eager"
        return self._run_eager(jobs, n_steps)

    def _fit_built(self, jobs: list[Job], n_steps: int) -> list[Job]:
        """The frame's jobs, fitted to a static step the worker built at start where they would need
        one it never built: a request catching up after plain steps or sending its prompt sends more
        tokens than a steady round (at most n_steps + 1), and its T bucket (or, beyond PAD_LIMIT, the
        eager path) is not among the captured steps. Such jobs are extended eagerly first
        (_extend_heads) down to a steady round's size. A frame of steady shapes is left as it is (a
        step it lacks is built once, then kept)."""
        B, keep = len(jobs), max(j.keep for j in jobs)
        longest = max(len(j.tokens) for j in jobs)
        if longest <= PAD_LIMIT:
            T = next(t for t in T_BUCKETS if t >= longest)
            n = self._built_steps(B, T, n_steps, keep)
            if (B, T, n, kv_bucket(keep + T + n, self.cache.max_len)) in self._static:
                return jobs
        n = self._built_steps(B, 1, n_steps, keep)  # the steps a steady round of this frame would run
        limit = next((t for t in T_BUCKETS if t >= n + 1), PAD_LIMIT)
        return jobs if longest <= limit else self._extend_heads(jobs, limit)

    def _extend_heads(self, jobs: list[Job], limit: int) -> list[Job]:
        """Extend each job longer than `limit` tokens eagerly by all its tokens but the last, and return
        the jobs with those cut to their last token: the draft step that follows is then a static one,
        whose graphs the worker captured at start. (Drafting a frame with a job beyond PAD_LIMIT eagerly,
        as a whole, cost 60-150 ms for one request catching up on 17-30 tokens and 0.4-1 s for sixteen
        on the H200 with the 0.5B drafter: the draft steps' eager forwards, not the prefill; each such
        round overran its budget.) The heads up to BATCHED_HEAD tokens run as one right-padded forward
        (causal: the padding is never attended to, and the rows are cut back after it); longer ones
        alone, in PREFILL_CHUNK chunks."""
        model, cache = self.model, self.cache
        heads = [j for j in jobs if len(j.tokens) > limit]
        self._extended = len(heads)
        T = max((len(j.tokens) - 1 for j in heads if len(j.tokens) - 1 <= BATCHED_HEAD), default=0)
        batched = [j for j in heads if len(j.tokens) - 1 <= BATCHED_HEAD and j.keep + T <= cache.max_len]
        # on the plain path (no fused kernels): at these shapes it is the faster eager forward (H200, 0.5B:
        # 10.5-14.9 ms against 14-22 ms, benchmarks/eager_forward.py), and it compiles nothing for a row
        # count the start-up never ran. Its K/V equal the fused path's within bf16 rounding (drafts only).
        fast, model.fast = model.fast, False
        try:
            self._extend(heads, batched, T)
        finally:
            model.fast = fast
        return [Job(j.row, j.keep + len(j.tokens) - 1, j.tokens[-1:], j.min_conf) if len(j.tokens) > limit
                else j for j in jobs]

    def _extend(self, heads: list[Job], batched: list[Job], T: int) -> None:
        torch, model, cache = self.torch, self.model, self.cache
        dev = model.device
        with torch.inference_mode():
            for j in heads:
                cache.truncate(j.row, j.keep)
            if batched:
                toks = np.zeros((len(batched), T), np.int64)
                for b, j in enumerate(batched):
                    toks[b, :len(j.tokens) - 1] = j.tokens[:-1]
                model(torch.from_numpy(toks).to(dev), torch.tensor([j.keep for j in batched]), cache,
                      torch.tensor([j.row for j in batched]),
                      logits_at=torch.zeros(len(batched), dtype=torch.int64, device=dev))
                for j in batched:
                    cache.truncate(j.row, j.keep + len(j.tokens) - 1)  # forget the padding
            for j in heads:
                if any(j is b for b in batched):
                    continue
                toks = torch.from_numpy(j.tokens[:-1].astype(np.int64)).to(dev)
                for s in range(0, len(toks), PREFILL_CHUNK):
                    model(toks[s:s + PREFILL_CHUNK][None], torch.tensor([j.keep + s]), cache, torch.tensor([j.row]),
                          last_only=True)

    # ---- eager ---------------------------------------------------------------------------------------

    def _run_eager(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        torch, model, cache = self.torch, self.model, self.cache
        dev = model.device
        if dev.type == "cuda" and n_steps >= 1 and any(len(j.tokens) > PAD_LIMIT for j in jobs):
            # on a GPU, prompts and catch-ups extended as the captured path extends them (_extend_heads),
            # so the eager drafter (the reference the graphs are checked against) computes what they
            # compute. Not on a CPU: there the extension costs a forward more than one prefill with the
            # logits at its end (~60 ms for the 0.5B), and the lean loop's long frames come here.
            jobs = self._extend_heads(jobs, next((t for t in T_BUCKETS if t >= n_steps + 1), PAD_LIMIT))
        with torch.inference_mode():
            for j in jobs:
                cache.truncate(j.row, j.keep)
            # with an int8 head the picks come from the greedy forwards, which read it (head_logits' qhead), as
            # the captured step's do; the logits path reads the bf16 head, so an eager reference built on the
            # logits would check the graphs' int8 picks against the bf16 head's
            greedy = getattr(model, "int8_head", None) is not None
            last = [None] * len(jobs)  # (token, confidence) after each job's last new token
            short = [i for i, j in enumerate(jobs) if len(j.tokens) <= PAD_LIMIT]
            if short:
                T = max(len(jobs[i].tokens) for i in short)
                if dev.type == "cuda":
                    # padded to the captured step's T bucket, as the graphs pad: the products then have the
                    # graph's row counts and so the plan's same kernels (five tokens of three requests are
                    # 15 rows on the skinny GEMM, padded to 8 each 24 rows on cuBLAS: another rounding,
                    # and a near-tie draft flipped in 17 % of the GPU draft check's request-rounds)
                    T = next(t for t in T_BUCKETS if t >= T)
                toks = np.zeros((len(short), T), np.int64)  # right padding: causal, so it never leaks back
                for b, i in enumerate(short):
                    toks[b, :len(jobs[i].tokens)] = jobs[i].tokens
                rows = [jobs[i].row for i in short]
                at = torch.tensor([len(jobs[i].tokens) - 1 for i in short], device=dev)
                tok, conf = _pick(model(torch.from_numpy(toks).to(dev), torch.tensor([jobs[i].keep for i in short]),
                                        cache, torch.tensor(rows), logits_at=at, greedy=greedy), greedy)
                for b, i in enumerate(short):
                    last[i] = tok[b], conf[b]
                    cache.truncate(jobs[i].row, jobs[i].keep + len(jobs[i].tokens))  # forget the padding
            for i, j in enumerate(jobs):
                if len(j.tokens) <= PAD_LIMIT:
                    continue
                toks = torch.from_numpy(j.tokens.astype(np.int64)).to(dev)
                for s in range(0, len(toks), PREFILL_CHUNK):
                    chunk = toks[s:s + PREFILL_CHUNK][None]
                    out = model(chunk, torch.tensor([j.keep + s]), cache, torch.tensor([j.row]), last_only=True,
                                greedy=greedy)
                tok, conf = _pick(out, greedy)
                last[i] = tok[0], conf[0]
            if n_steps == 0 or not jobs:
                return np.zeros((len(jobs), 0), np.int32), np.zeros((len(jobs), 0), np.float32)
            tok, conf = torch.stack([t for t, _ in last]), torch.stack([c for _, c in last])
            rows = torch.tensor([j.row for j in jobs])
            pos = [j.keep + len(j.tokens) for j in jobs]
            out_t, out_c = [], []
            pending = np.array([j.min_conf for j in jobs], np.float32)  # the confidence stop, per job
            stopping = bool(pending.any())
            for s in range(n_steps):
                out_t.append(tok)
                out_c.append(conf)
                if stopping and all_stopped(out_c[-1].float().cpu().numpy(), pending):
                    break  # every job's stop fired: its drafts end here (the rows hold drafts up to s - 1)
                if s < n_steps - 1:
                    tok, conf = _pick(model(tok[:, None], torch.tensor([p + s for p in pos]), cache, rows,
                                            greedy=greedy), greedy)
            drafts = torch.stack(out_t, 1).to(torch.int32).cpu().numpy()
            confs = torch.stack(out_c, 1).float().cpu().numpy()
        return drafts, confs

    # ---- static shapes / CUDA graphs ------------------------------------------------------------------

    def _static_step(self, g) -> None:
        """Everything of one draft step from g's input buffers into g's output buffers, no host sync.
        Each forward ends in its greedy pick (Transformer.forward(greedy=True): one fused kernel pair on
        the fast path, the logits' argmax and softmax otherwise)."""
        from draftrelay.model import positions_ahead
        torch, model, cache = self.torch, self.model, self.cache
        B, T, n_steps, kv = g.key  # attention spans the first kv positions of the rows (masked)
        tokens, start, rows, last = g.tokens, g.start, g.rows, g.last
        # the fed-back drafts' positions (from the first draft's on), all before the first forward
        pos = positions_ahead(start + last + 1, n_steps - 1) if n_steps > 1 else None
        tok, conf = model(tokens, start, cache, rows, kv_len=kv, logits_at=last, greedy=True)
        out_t, out_c = [], []
        for s in range(n_steps):
            out_t.append(tok)
            out_c.append(conf)
            if s < n_steps - 1:
                tok, conf = model(tok[:, None], pos[s], cache, rows, kv_len=kv, greedy=True)
        g.out_tok.copy_(torch.stack(out_t, 1))
        g.out_conf.copy_(torch.stack(out_c, 1))

    def _get_static(self, key: tuple[int, int, int, int]):
        g = self._static.get(key)
        if g is not None:
            return g
        torch, dev = self.torch, self.model.device
        B, T, n_steps, _ = key
        g = type("StaticStep", (), {})()
        g.key = key
        n_in = B * T + 3 * B
        g.inbuf = torch.zeros(n_in, dtype=torch.int64, device=dev)  # packed inputs: one H2D copy per step
        g.host = torch.zeros(n_in, dtype=torch.int64, pin_memory=dev.type == "cuda")
        g.tokens = g.inbuf[:B * T].view(B, T)
        g.start, g.rows, g.last = (g.inbuf[B * T + i * B:B * T + (i + 1) * B] for i in range(3))
        # drafts (int32) and confidences (fp32 bits) side by side in one buffer: one D2H copy per step
        g.out = torch.zeros(B, 2 * n_steps, dtype=torch.int32, device=dev)
        g.out_tok, g.out_conf = g.out[:, :n_steps], g.out[:, n_steps:].view(torch.float32)
        g.host_out = torch.zeros(B, 2 * n_steps, dtype=torch.int32, pin_memory=dev.type == "cuda")
        g.graph = None
        if self.mode == "graph":
            # the graph holds the step's two copies itself: one launch and one synchronize a STEP, two
            # host API calls fewer (0.01-0.02 ms a STEP on the hosts measured, benchmarks/step_host.py). The
            # copy nodes read the pinned buffers when replayed, so each replay takes its own run's packing.
            g.host.numpy()[B * T + B:B * T + 2 * B] = self.n_rows  # warm-up writes only into the scratch row
            if self._capture is None:
                self._capture = GraphCapture(dev)

            def step() -> None:
                g.inbuf.copy_(g.host, non_blocking=True)
                self._static_step(g)
                g.host_out.copy_(g.out, non_blocking=True)
            with torch.inference_mode():
                self._capture.warm(step)  # kernels chosen and allocated outside capture
                g.graph, _ = self._capture.capture(step)
        self._static[key] = g
        return g

    def _run_static(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        torch, cache = self.torch, self.cache
        B = len(jobs)
        T = next(t for t in T_BUCKETS if t >= max(len(j.tokens) for j in jobs))
        asked = n_steps
        n_steps = self._built_steps(B, T, n_steps, max(j.keep for j in jobs))
        kv = kv_bucket(max(j.keep for j in jobs) + T + n_steps, self.cache.max_len)
        g = self._get_static((B, T, n_steps, kv))
        host = g.host.numpy()
        host[:] = 0
        for b, j in enumerate(jobs):
            cache.truncate(j.row, j.keep)
            host[b * T:b * T + len(j.tokens)] = j.tokens
            host[B * T + b] = j.keep
            host[B * T + B + b] = j.row
            host[B * T + 2 * B + b] = len(j.tokens) - 1
        with torch.inference_mode():
            if g.graph is not None:
                g.graph.replay()  # its copies inside (_get_static)
            else:
                g.inbuf.copy_(g.host, non_blocking=True)
                self._static_step(g)
                g.host_out.copy_(g.out, non_blocking=True)
            if g.out.device.type == "cuda":
                torch.cuda.current_stream(g.out.device).synchronize()
            out = g.host_out.numpy()
            drafts = out[:, :asked].copy()
            confs = out[:, n_steps:n_steps + asked].view(np.float32).copy()
        for j in jobs:  # the same row lengths the eager path leaves: context + first asked-1 drafts
            cache.lens[j.row] = j.keep + len(j.tokens) + asked - 1
        return drafts, confs

    def _built_steps(self, B: int, T: int, n_steps: int, keep: int) -> int:
        """n_steps, or where its step was never built (a request's last rounds ask fewer drafts than the
        worker captured at start) the fewest more steps already built for this batch and T: drafting a
        few more and returning the first n_steps (greedy: the same drafts) costs a forward or two, a
        capture in the round some 70-100 ms (H200, 0.5B). Only where those steps fit the rows. (Static
        mode, a CPU test vehicle, does the same, so CPU tests cover it.)"""
        max_len = self.cache.max_len
        if (B, T, n_steps, kv_bucket(keep + T + n_steps, max_len)) in self._static:
            return n_steps
        for n in range(n_steps + 1, self.n_out_max + 1):
            if keep + T + n <= max_len and (B, T, n, kv_bucket(keep + T + n, max_len)) in self._static:
                return n
        return n_steps


def _int8_layers_info(layers: list | None) -> str:
    """The drafter info's words for a model's int8 layer copies (int8_layers.py): what they add to the bf16
    weights kept beside them."""
    if layers is None:
        return ""
    from draftrelay.int8_layers import nbytes
    return f", int8 layer products (+{nbytes(layers) / 1e6:.0f} MB)"


def _pick(out, greedy: bool) -> tuple:
    """A forward's output at one position per row -> (token [B], confidence [B]): greedy forwards return them,
    else the logits [B, 1, V] give them as the greedy pick defines them (argmax, ties to the lower id; its
    softmax probability)."""
    if greedy:
        return out
    logits = out[:, -1].float()
    tok = logits.argmax(-1)
    return tok, logits.softmax(-1).gather(-1, tok[:, None])[:, 0]


def _planned() -> int:
    """Kernel shapes this process has measured or checked so far (0 before the Triton kernels load)."""
    from draftrelay.kernels import plan_stats

    st = plan_stats()
    return 0 if st is None else st.measured + st.from_seed


def load_drafter(spec: str, *, device: str = "cpu", dtype: str = "auto", n_rows: int = 16, max_ctx: int = 4096,
                 n_out_max: int = 8, seed: int | None = None, model_id: str = "", test_vocab: int = 1000,
                 slow_token: int = -1, delay_ms: float = 0.0, fail_token: int = -1, mode: str = "auto",
                 quant: str = "none", draft_vocab: str = "", head_int8: bool = False) -> Drafter:
    """`tiny` (the drafter half of model.tiny_pair), `test` (TestDrafter), `random:SHAPE`
    (SHAPES at seeded random weights), a local HF model directory, a GGUF file, or (benchmarks only)
    `replay:TRACE.json:INNER` / `replay:TRACE.json:emulated=COST.json` (draftrelay.replay).
    quant "int8" / "int4": the layers' products on int8 / int4 weights (worker/quant.py: a CPU drafter in the
    lean loop; int8 on a CUDA drafter: int8_layers.py, the fast path's int8 tiles). draft_vocab: the head
    restricted to a draft vocabulary (draft_vocab.DraftVocab.parse: N
    for ids 0..N-1, FILE.npy[:N] for a ranking file's first N; '' the whole head); a replay drafter
    restricts its trace's drafts to the same ids (replay.Trace.restricted). head_int8 (a CUDA drafter): its
    greedy forwards read the head (the draft vocabulary's rows, if any) as int8 (int8_head.py)."""
    if head_int8 and spec == "test":
        raise ValueError(f"--head-int8: for a CUDA drafter with a head (the fast path's int8 tile), not {spec!r}")
    if draft_vocab and spec == "test":
        raise ValueError(f"--draft-vocab {draft_vocab}: the 'test' drafter has no head to restrict")
    # a replay drafter passes quant to its INNER drafter (whose forward it times); an emulated one has none
    if quant != "none" and (spec == "test" or spec.startswith("replay:") and ":emulated=" in spec):
        raise ValueError(f"--quant {quant}: the {spec.split(':')[0]!r} drafter has no weights to quantize")
    if spec == "test":
        return TestDrafter(test_vocab, n_rows, max_ctx, n_out_max, slow_token, delay_ms, fail_token)
    if spec.startswith("replay:"):  # benchmarks only, asked for by name (draftrelay.replay says why)
        from draftrelay.replay import load_replay_drafter

        return load_replay_drafter(spec, lambda inner: load_drafter(
            inner, device=device, dtype=dtype, n_rows=n_rows, max_ctx=max_ctx, n_out_max=n_out_max, seed=seed,
            model_id=model_id, mode=mode, quant=quant, draft_vocab=draft_vocab, head_int8=head_int8), n_rows=n_rows,
            max_ctx=max_ctx,
            n_out_max=n_out_max, model_id=model_id, draft_vocab=draft_vocab)
    import torch

    from draftrelay import model as M
    from draftrelay.checkpoint import hf

    dev = torch.device(device)
    gpu_int8 = quant == "int8" and dev.type == "cuda"  # the fast path's int8 tiles, not the lean loop's
    if quant not in ("none", "int8") and dev.type == "cuda":
        raise ValueError(f"--quant {quant}: for a CPU drafter (its lean loop), not {device!r}; a CUDA drafter "
                         "takes --quant int8")
    lean_quant = "none" if gpu_int8 else quant
    if head_int8 and dev.type != "cuda":
        raise ValueError(f"--head-int8: for a CUDA drafter with a head (the fast path's int8 tile), not {spec!r} "
                         f"on {device!r}")
    asked = mode

    def mode_for(net) -> str:  # auto: CUDA graphs on a GPU, the lean loop on a CPU where it applies
        if asked != "auto":
            return asked
        from draftrelay.worker import lean

        return "graph" if dev.type == "cuda" else "lean" if lean.supports(net) else "eager"

    def restricted(net):  # before LlamaDrafter: the lean loop and the graphs take the head as it is then
        from draftrelay.draft_vocab import DraftVocab

        net.draft_vocab = DraftVocab.parse(draft_vocab, net.cfg.vocab_size)
        if head_int8:  # the copy made now, eagerly (never inside a capture), of the head as restricted
            from draftrelay.int8_head import Int8Head

            net.int8_head = Int8Head()
            net.int8_head.of(net.head_weight())
        if gpu_int8:  # the layers' copies, made now (before any forward or capture)
            from draftrelay.int8_layers import quantize_layers

            net.int8_layers = quantize_layers(net)
        return net

    if dtype == "auto":
        from draftrelay.checkpoint.hf import default_dtype

        tdtype = default_dtype(dev)
    else:
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if spec == "tiny":
        s = M.TINY_SEED if seed is None else seed
        _, net = M.tiny_pair(s, device=dev, dtype=tdtype)
        net = restricted(net)
        return LlamaDrafter(net, n_rows, max_ctx, n_out_max, model_id or M.tiny_model_id(s), M.TINY_TOKENIZER_ID,
                            mode_for(net), lean_quant)
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        cfg = M.ModelConfig(**SHAPES[name], name=name)
        net = restricted(M.Transformer.random(cfg, seed=seed or 0, device=dev, dtype=tdtype, draw_on="device"))
        return LlamaDrafter(net, n_rows, max_ctx, n_out_max, model_id or f"random-{name}-s{seed or 0}", "",
                            mode_for(net), lean_quant)
    if spec.lower().endswith(".gguf") and not os.path.isdir(spec):
        from draftrelay.checkpoint import gguf

        ck = gguf.read_gguf(spec)
        net = restricted(gguf.load_gguf(spec, device=dev, dtype=None if dtype == "auto" else tdtype, checkpoint=ck))
        mid = model_id or os.path.basename(os.path.abspath(spec))
        return LlamaDrafter(net, n_rows, max_ctx, n_out_max, mid, ck.vocab.digest(), mode_for(net), lean_quant)
    if not os.path.isdir(spec):
        raise M.ModelError(f"--model {spec!r}: not 'tiny', 'test', 'random:SHAPE', an existing directory, "
                           "nor a .gguf file")
    net = restricted(hf.load_hf_dir(spec, device=dev, dtype=None if dtype == "auto" else tdtype))
    mid = model_id or os.path.basename(os.path.abspath(spec))
    return LlamaDrafter(net, n_rows, max_ctx, n_out_max, mid, tokenizer_hash_of_dir(spec), mode_for(net), lean_quant)
