"""The tensor-parallel drafter (TP2, written for N ranks): the same `run(jobs, n_steps)` as LlamaDrafter,
the model split over N GPUs driven by this one process, joined by the P2P collectives (docs/TP2.md).

Split (Megatron-style): attention by kv-head groups (q/k/v column-parallel, o row-parallel), the MLP by
channels (gate/up column-parallel, down row-parallel), the vocabulary head by output columns with rank
0 holding the lowest ids. Embedding, norms and RoPE are replicated. Per layer two all-reduces (after o,
after down) of fp32 partial sums, rounded once; per drafted position one argmax exchange (ties to the
lower id, as on one card). The softmax denominators of all positions are summed in one all-reduce at
the end of the step (the confidence is 1 / sum exp(logit - max)). Every shard is an exact slice of the
full tensor; the replicated state is the same on every rank because every rank gets the same bits
from the collectives and runs the same kernels on the same shapes.

Modes (`tp_mode`):
  pair     - P2PGroup, rank r on cuda:r (the real thing; graphs per (requests, n_out, ...) and rank)
  emulate  - EmulatedGroup, every rank on one device or the CPU: the same bits as the pair
  solo     - rank 0 alone with stand-in collectives (identity): times one rank's share of the work
  world 1  - the same code unsplit (stand-in collectives are then exact)

One controller thread drives all ranks: each rank's step is a generator that yields after launching a
collective, and the driver advances the ranks in turn (op k of every rank before op k+1 of any), so a
rank never waits on the host for a peer that has not been launched. A CUDA graph records one rank's
generator alone (capture only records); a step replays every rank's graph.

Failure: a collective error (timeout, cancel, invalid id, a rank that never joined) or any error in the
middle of a step fails the step with StepFailed (the server answers INTERNAL and the frame's requests
are dropped, so the client resends them from position 0); the group is cancelled and reset (drained)
before the next step. `max_failures` failed steps in a row call `on_fatal` (the CLI then exits nonzero
for its supervisor). Drafts are returned only after every rank's error word read clean and all ranks
produced the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from draftrelay.capture import GraphCapture, kv_bucket
from draftrelay.model import (
    LayerWeights,
    ModelConfig,
    Transformer,
    decoder_steps,
    rope_inv_freq,
    run_to_end,
    step_state,
)
from draftrelay.p2p import MAX_RANKS, EmulatedGroup, P2PError, P2PGroup, StandInGroup
from draftrelay.worker.core import StepFailed
from draftrelay.worker.drafters import (
    PAD_LIMIT,
    PREFILL_CHUNK,
    T_BUCKETS,
    Drafter,
    Job,
    build_keys,
    steady_state_keys,
)

log = logging.getLogger("draftrelay.worker")

TP_MODES = ("pair", "emulate", "solo")
TILE = 128  # cuts of the MLP channels and the vocabulary fall on multiples of this (a GEMM tile)


def split_points(n: int, world: int, align: int = TILE) -> list[int]:
    """world + 1 cut points of [0, n): as even as possible, inner cuts on multiples of `align` when the
    parts are large (>= 8 tiles each), plain even cuts otherwise."""
    a = align if n // world >= 8 * align else 1
    cuts = [0] + [round(n * r / world / a) * a for r in range(1, world)] + [n]
    if any(hi <= lo for lo, hi in zip(cuts, cuts[1:], strict=False)):
        raise ValueError(f"cannot split {n} into {world} non-empty parts")
    return cuts


def check_split(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError naming what does not divide (heads are split by whole kv-head groups)."""
    if not 1 <= world <= MAX_RANKS:
        raise ValueError(f"tp {world}: must be 1..{MAX_RANKS}")
    if cfg.qk_norm:
        raise ValueError(f"{cfg.name or 'model'}: q/k norms (Qwen3) are not implemented by the TP drafter")
    if cfg.n_kv_heads % world:
        raise ValueError(f"{cfg.name or 'model'}: n_kv_heads {cfg.n_kv_heads} is not divisible by tp {world}")
    for what, n in (("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n < world:
            raise ValueError(f"{cfg.name or 'model'}: {what} {n} is smaller than tp {world}")


@dataclass
class LayerShard:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor  # [(q + 2 kv heads of the rank) * hd, d]: column-parallel rows q | k | v, one GEMM
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [d, q heads of the rank * hd]         row-parallel (columns of the HF weight)
    wgu: torch.Tensor  # [2 * channels of the rank, d]: rows gate | up, one GEMM
    wd: torch.Tensor  # [d, channels of the rank]
    nq: int  # q rows of the rank (hq * hd)
    nk: int  # k rows (= v rows) of the rank
    ni: int  # MLP channels of the rank

    # HF's projections of the rank, as views (the shard tests compare them with the full tensors)
    wq = property(lambda self: self.wqkv[:self.nq])
    wk = property(lambda self: self.wqkv[self.nq:self.nq + self.nk])
    wv = property(lambda self: self.wqkv[self.nq + self.nk:])
    bq = property(lambda self: None if self.bqkv is None else self.bqkv[:self.nq])
    bk = property(lambda self: None if self.bqkv is None else self.bqkv[self.nq:self.nq + self.nk])
    bv = property(lambda self: None if self.bqkv is None else self.bqkv[self.nq + self.nk:])
    wg = property(lambda self: self.wgu[:self.ni])
    wu = property(lambda self: self.wgu[self.ni:])

    def weights(self, head_dim: int) -> LayerWeights:
        """The layer as model.decoder takes it (this rank's heads and channels)."""
        return LayerWeights(self.ln1, self.wqkv, self.bqkv, self.wo, self.ln2, self.wgu, self.wd,
                            self.nq // head_dim, self.nk // head_dim)


@dataclass
class RankShard:
    rank: int
    device: torch.device
    heads: tuple[int, int]  # query heads [h0, h1)
    kv_heads: tuple[int, int]
    channels: tuple[int, int]  # MLP channels [c0, c1)
    vocab: tuple[int, int]  # vocabulary ids [v0, v1)
    embed: torch.Tensor  # replicated [V, d]
    norm: torch.Tensor  # replicated
    head: torch.Tensor  # [v1 - v0, d]: rows of the (tied or untied) head, a view of `embed` when tied
    layers: list[LayerShard]
    inv_freq: torch.Tensor
    k: torch.Tensor | None = None  # draft KV [L, rows, kv heads of the rank, len, hd]
    v: torch.Tensor | None = None
    weights: list[LayerWeights] | None = None  # `layers` as model.decoder takes them

    def nbytes(self) -> dict[str, int]:
        seen, weights = set(), 0
        tensors = [self.embed, self.norm, self.head] + [t for ly in self.layers for t in vars(ly).values()
                                                         if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                weights += t.untyped_storage().nbytes()
        kv = 0 if self.k is None else self.k.numel() * self.k.element_size() * 2
        return {"weights": weights, "kv": kv}


def shard_model(model: Transformer, world: int, rank: int, device: torch.device | str) -> RankShard:
    """Rank `rank`'s weights: exact row / column slices of the full tensors (copied to `device`)."""
    cfg = model.cfg
    check_split(cfg, world)
    if model.draft_vocab is not None:
        raise ValueError(f"{cfg.name or 'model'}: a draft vocabulary ({model.draft_vocab}) runs on one card, not "
                         f"split over tp {world}")
    dev = torch.device(device)
    hd, rep = cfg.head_dim, cfg.n_rep
    kv_r = cfg.n_kv_heads // world
    k0, k1 = rank * kv_r, (rank + 1) * kv_r
    h0, h1 = k0 * rep, k1 * rep  # query head h reads kv head h // n_rep: a rank owns whole groups
    cc = split_points(cfg.intermediate_size, world)
    vc = split_points(cfg.vocab_size, world)
    c0, c1, v0, v1 = cc[rank], cc[rank + 1], vc[rank], vc[rank + 1]

    def rows(t, a, b):  # column-parallel: output features a..b (rows of an HF [out, in] weight)
        return None if t is None else t.detach()[a:b].to(dev, copy=True).contiguous()

    def cols(t, a, b):  # row-parallel: input features a..b
        return t.detach()[:, a:b].to(dev, copy=True).contiguous()

    layers = []
    for blk in model.layers:
        at, mlp = blk.self_attn, blk.mlp
        q, k, v = ((at.q_proj, h0 * hd, h1 * hd), (at.k_proj, k0 * hd, k1 * hd), (at.v_proj, k0 * hd, k1 * hd))
        layers.append(LayerShard(
            ln1=blk.input_layernorm.weight.detach().to(dev, copy=True),
            ln2=blk.post_attention_layernorm.weight.detach().to(dev, copy=True),
            wqkv=torch.cat([rows(p.weight, a, b) for p, a, b in (q, k, v)]),
            bqkv=None if at.qkv.bias is None else torch.cat([rows(p.bias, a, b) for p, a, b in (q, k, v)]),
            wo=cols(at.o_proj.weight, h0 * hd, h1 * hd),
            wgu=torch.cat([rows(mlp.gate_proj.weight, c0, c1), rows(mlp.up_proj.weight, c0, c1)]),
            wd=cols(mlp.down_proj.weight, c0, c1),
            nq=(h1 - h0) * hd, nk=(k1 - k0) * hd, ni=c1 - c0,
        ))
    embed = model.embed_tokens.weight.detach().to(dev, copy=True)
    head = embed[v0:v1] if model.lm_head is None else rows(model.lm_head.weight, v0, v1)
    return RankShard(rank, dev, (h0, h1), (k0, k1), (c0, c1), (v0, v1), embed,
                     model.norm.weight.detach().to(dev, copy=True), head, layers, rope_inv_freq(cfg).to(dev),
                     weights=[ly.weights(hd) for ly in layers])


class _Static:
    """Buffers (per rank) and graphs of one (requests, padded tokens, n_steps, kv bucket) key."""

    def __init__(self, key, shards: list[RankShard], pin: bool):
        B, T, n_steps, _ = key
        self.key = key
        n_in = B * T + 3 * B
        self.host = torch.zeros(n_in, dtype=torch.int64, pin_memory=pin)
        self.inbuf = [torch.zeros(n_in, dtype=torch.int64, device=s.device) for s in shards]
        self.out_tok = [torch.zeros(B, n_steps, dtype=torch.int64, device=s.device) for s in shards]
        self.out_conf = [torch.zeros(B, n_steps, dtype=torch.float32, device=s.device) for s in shards]
        self.graphs: list = []

    def inputs(self, r: int):
        B, T = self.key[:2]
        buf = self.inbuf[r]
        return (buf[:B * T].view(B, T), buf[B * T:B * T + B], buf[B * T + B:B * T + 2 * B],
                buf[B * T + 2 * B:B * T + 3 * B])


class TPDrafter(Drafter):
    """Greedy drafting with the model split over `world` ranks (see the module docstring).

    mode "static": the static-shape step (as LlamaDrafter's) run by the controller in lockstep, no
    graphs ("eager" is accepted as the same thing). mode "graph" (CUDA, pair/solo/world 1): the step
    captured per rank as one CUDA graph per key; a step replays every rank's graph.
    """

    fixed_rounds = True  # static steps (or their graphs) only: every asked draft is computed

    def __init__(self, model: Transformer, world: int, tp_mode: str, n_rows: int, max_ctx: int, n_out_max: int,
                 model_id: str, tokenizer_hash: str, mode: str = "static", devices: list | None = None,
                 timeout_ms: float = 1000.0, max_failures: int = 3, fail_token: int = -1):
        cfg = model.cfg
        check_split(cfg, world)
        if tp_mode not in TP_MODES:
            raise ValueError(f"tp mode {tp_mode!r}: one of {', '.join(TP_MODES)}")
        mode = "static" if mode == "eager" else mode
        if mode not in ("static", "graph"):
            raise ValueError(f"drafter mode {mode!r}: eager/static or graph")
        if tp_mode == "pair" and world < 2:
            raise ValueError("tp mode 'pair' needs tp >= 2")
        home = model.device
        if devices is None:
            devices = [torch.device("cuda", r) for r in range(world)] if tp_mode == "pair" else [home] * world
        devices = [torch.device(d) for d in devices]
        if tp_mode == "pair":
            n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if any(d.type != "cuda" for d in devices) or n_gpu < world:
                raise ValueError(f"tp {world} in mode 'pair' needs {world} CUDA devices, found {n_gpu} "
                                 "(mode 'emulate' runs every rank on one device or the CPU)")
        if mode == "graph" and (tp_mode == "emulate" and world > 1 or devices[0].type != "cuda"):
            raise ValueError("CUDA graphs need tp mode 'pair' or 'solo' (or tp 1) on CUDA devices; "
                             "'emulate' runs in lockstep without graphs")
        self.cfg, self.world, self.tp_mode, self.mode = cfg, world, tp_mode, mode
        self.max_ctx = min(max_ctx, cfg.max_position_embeddings)
        self.n_rows, self.n_out_max, self.vocab_size = n_rows, n_out_max, cfg.vocab_size
        self.model_id, self.tokenizer_hash = model_id, tokenizer_hash
        self.dtype = model.dtype
        self.fast = model.fast_path()  # the fused kernels (draftrelay.kernels) where the model uses them
        self.max_len = self.max_ctx + max(PAD_LIMIT, n_out_max) + 1  # as LlamaDrafter; row n_rows is scratch
        self.lengths = np.zeros(n_rows + 1, np.int64)
        ranks = [0] if tp_mode == "solo" else list(range(world))
        self.shards = [shard_model(model, world, r, devices[r]) for r in ranks]
        kv_r = cfg.n_kv_heads // world
        for s in self.shards:
            shape = (cfg.n_layers, n_rows + 1, kv_r, self.max_len, cfg.head_dim)  # as model.KVCache
            s.k = torch.zeros(shape, device=s.device, dtype=self.dtype)
            s.v = torch.zeros(shape, device=s.device, dtype=self.dtype)
        d = cfg.hidden_size
        if tp_mode == "pair":
            self.group = P2PGroup([s.device for s in self.shards], timeout_ms=timeout_ms,
                                  max_bytes=max(2 << 20, PREFILL_CHUNK * d * 4))
        elif tp_mode == "emulate" and world > 1:
            self.group = EmulatedGroup(world)
        else:
            self.group = StandInGroup()
        cuda = self.shards[0].device.type == "cuda"
        if not cuda:
            self.streams = [None] * len(ranks)
        elif tp_mode == "pair":  # one stream per GPU: each rank's launches queue independently
            self.streams = [torch.cuda.Stream(device=s.device) for s in self.shards]
        else:  # ranks sharing a device share one stream (the emulation reads peers' tensors in order)
            self.streams = [torch.cuda.Stream(device=devices[0])] * len(ranks)
        self.f32_partials = self.dtype == torch.float32 or (cuda and _mm_f32_out_works(self.shards[0].device))
        self._static: dict[tuple, _Static] = {}
        self._captures: list[GraphCapture] = []
        self._pool_threads = (ThreadPoolExecutor(world - 1, thread_name_prefix="tp-launch")
                              if tp_mode == "pair" and mode == "graph" else None)
        self.settle_log: list[dict] = []
        self.max_failures, self.failures_in_a_row, self.failed_steps = max_failures, 0, 0
        self.on_fatal: Callable[[str], None] | None = None
        self.fail_token = fail_token  # tests: a step whose jobs hold this token skips the last rank
        self.skip_last_rank_once = False  # probes: the next step launches no work on the last rank
        if cuda:  # the weights and zeroed caches were made on the default streams; the ranks use their own
            for s in self.shards:
                torch.cuda.synchronize(s.device)
        where = "+".join(str(s.device) for s in self.shards)
        self.info = (f"llama {cfg.n_layers}L d{cfg.hidden_size} {cfg.n_params() / 1e6:.1f}M params, tp{world} "
                     f"{tp_mode} {where} {str(self.dtype).replace('torch.', '')}, {mode}")

    # ---- the per-rank math (generators: each `yield` follows a collective launch) ---------------------

    def _partial(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's partial sum in fp32 (the all-reduce rounds the total once)."""
        if x.dtype == torch.float32:
            return F.linear(x, w)
        if self.f32_partials:
            out = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
            return out.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)  # no fp32-output GEMM here: bf16 partials (summed in fp32, rounded once)

    def _forward(self, r: int, tokens, start, rows, kv_len: int, logits_at=None, head: bool = True):
        """Rank r's share of Transformer.forward: the same layers (model.decoder_steps) with this rank's
        weight slices, its partial products all-reduced (static: nothing syncs). Returns fp32 logits of
        the rank's vocabulary columns [B, V_r] at logits_at (or the last position), or None (head=False)."""
        s, c = self.shards[r], self.cfg

        def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return self.group.all_reduce(r, self._partial(x, w))

        st = step_state(start, tokens.shape[1], kv_len, rows, c.n_rep, s.inv_freq, self.dtype, self.fast)
        out = yield from decoder_steps(tokens, s.embed, s.weights, s.k, s.v, st, c.rms_norm_eps, row_linear,
                                       s.norm, s.head if head else None, logits_at is None, logits_at)
        return None if out is None else out[:, 0]  # [B, V_r]

    def _step(self, r: int, st: _Static) -> Iterator[None]:
        """Rank r's whole draft step from st's input buffers into st's outputs: extension, n_steps
        argmaxes (exchanged), n_steps - 1 one-token forwards, one all-reduce of the softmax sums."""
        B, T, n_steps, kv = st.key
        s, g = self.shards[r], self.group
        tokens, start, rows, last = st.inputs(r)
        logits = yield from self._forward(r, tokens, start, rows, kv, logits_at=last)
        pos = start + last + 1  # position of the first draft
        toks, sums = [], []
        for j in range(n_steps):
            v, i, _ = g.shard_argmax(r, logits, offset=s.vocab[0])
            gv, gi, _ = g.argmax_exchange(r, v, i, vocab=self.vocab_size)
            yield
            # a refused exchange writes nothing: keep a garbage id in range (the step fails on the error
            # word afterwards; an out-of-range embedding index would kill the device instead)
            tok = gi.clamp(0, self.vocab_size - 1)
            toks.append(tok)
            sums.append(torch.exp(logits - gv[:, None]).sum(-1))
            if j < n_steps - 1:
                logits = yield from self._forward(r, tok[:, None], pos + j, rows, kv)
        total = g.all_reduce(r, torch.stack(sums, 1).contiguous())
        yield
        st.out_tok[r].copy_(torch.stack(toks, 1))
        st.out_conf[r].copy_(1.0 / total)  # softmax at the argmax: exp(0) / sum

    def _prefill(self, r: int, j: Job, upto: int) -> Iterator[None]:
        """Rank r: append tokens[:upto] of a long job in chunks (no head)."""
        s = self.shards[r]
        for a in range(0, upto, PREFILL_CHUNK):
            chunk = torch.from_numpy(j.tokens[a:min(a + PREFILL_CHUNK, upto)].astype(np.int64)).to(s.device)[None]
            start = torch.tensor([j.keep + a], device=s.device)
            rows = torch.tensor([j.row], device=s.device)
            yield from self._forward(r, chunk, start, rows, j.keep + a + chunk.shape[1], head=False)

    # ---- driving the ranks ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _ctx(self, r: int) -> Iterator[None]:
        """Rank r's device and stream current (nothing on the CPU)."""
        if self.streams[r] is None:
            yield
            return
        with torch.cuda.device(self.shards[r].device), torch.cuda.stream(self.streams[r]):
            yield

    def _lockstep(self, make: Callable[[int], Iterator[None]]) -> None:
        """Advance every rank's generator one collective at a time, rank 0 first."""
        ranks = range(len(self.shards))
        if self.skip_last_rank_once and len(self.shards) > 1:
            ranks = range(len(self.shards) - 1)  # fault injection: the last rank never launches
        gens = {r: make(r) for r in ranks}
        pending = getattr(self.group, "pending", None)
        while gens:
            for r in list(gens):
                with self._ctx(r):
                    try:
                        next(gens[r])
                    except StopIteration:
                        del gens[r]
            if pending is not None and pending():  # emulation: a peer missed a collective
                raise P2PError("a rank did not join a collective (emulated peer timeout)")

    def _get_static(self, key) -> _Static:
        st = self._static.get(key)
        if st is not None:
            return st
        st = _Static(key, self.shards, pin=self.streams[0] is not None)
        if self.streams[0] is not None:  # its buffers were zeroed on the default streams
            for s in self.shards:
                torch.cuda.synchronize(s.device)
        if self.mode == "graph":
            for r in range(len(self.shards)):
                st.inbuf[r].copy_(self._scratch_inputs(key))
            with torch.inference_mode():
                self._lockstep(lambda r: self._step(r, st))  # warm-up: kernels chosen and allocated first
                for s in self.streams:
                    s.synchronize()
                self._check_group()
                if not self._captures:  # each rank captures on (and replays from) its own stream
                    self._captures = [GraphCapture(s.device, self.streams[r]) for r, s in enumerate(self.shards)]
                try:
                    for r in range(len(self.shards)):  # capture records one rank alone: no partner needed
                        gr, _ = self._captures[r].capture(lambda r=r: run_to_end(self._step(r, st)))
                        st.graphs.append(gr)
                except Exception:  # serve in lockstep without graphs rather than fail every round
                    log.exception("tp%d: CUDA graph capture failed; the drafter falls back to static mode", self.world)
                    st.graphs = []
                    self.mode = "static"
                    self.info = self.info.replace(", graph", ", static (graph capture failed)")
                if st.graphs and len(self.shards) > 1:
                    self._settle(st)
        self._static[key] = st
        return st

    def _replay(self, st: _Static, ranks, copy_inputs: bool) -> list[float]:
        """Launch the ranks' graphs; returns the host seconds of each launch. The pair launches ranks
        1.. from their own threads and rank 0 from this one: launching a large graph blocks the host
        while the GPU cannot take more work, and rank 0's GPU waits in its first collective for the
        peer's graph, so sequential launches would deadlock until the collective times out."""
        def one(r: int) -> float:
            with torch.inference_mode(), self._ctx(r):
                t0 = time.perf_counter()
                if copy_inputs:
                    st.inbuf[r].copy_(st.host, non_blocking=True)
                st.graphs[r].replay()
                return time.perf_counter() - t0

        if self._pool_threads is None:
            return [one(r) for r in ranks]
        futs = [self._pool_threads.submit(one, r) for r in ranks if r != 0]
        first = [one(0)] if 0 in ranks else []
        return first + [f.result() for f in futs]

    def _settle(self, st: _Static) -> None:
        """The first replay of fresh graphs (on the scratch inputs of the capture), checked; one retry,
        then the drafter gives up on graphs (static lockstep). settle_log keeps what happened."""
        for _attempt in range(2):
            t = self._replay(st, range(len(self.shards)), copy_inputs=False)
            for s in self.streams:
                s.synchronize()
            errs = self.group.errors()
            self.settle_log.append({"key": list(st.key), "threads": self._pool_threads is not None,
                                    "launch_s": [round(x, 6) for x in t], "errors": errs})
            if not any(errs):
                return
            log.warning("tp%d: first replay of %s failed (%s, launches %s s)", self.world, st.key, errs, t)
            self._recover([])
        log.error("tp%d: graphs of %s do not replay; the drafter falls back to static mode", self.world, st.key)
        st.graphs = []
        self.mode = "static"
        self.info = self.info.replace(", graph", ", static (graph replay failed)")

    def _scratch_inputs(self, key) -> torch.Tensor:
        B, T = key[:2]
        x = torch.zeros(B * T + 3 * B, dtype=torch.int64)
        x[B * T + B:B * T + 2 * B] = self.n_rows  # warm-up and capture write only into the scratch row
        return x

    def warm(self, n_steps_list: list[int], max_batch: int, max_kv: int = 0, progress=None, min_kv: int = 0) -> int:
        """As LlamaDrafter.warm: build every key a steady state with n_out in n_steps_list can use."""
        if self.mode != "graph":
            return 0
        before = len(self._static)
        keys = steady_state_keys(n_steps_list, min(max_batch, self.n_rows), self.max_len, max_kv, min_kv)
        build_keys(keys, self._get_static, progress)
        return len(self._static) - before

    def _check_group(self) -> None:
        errs = self.group.errors()
        if any(errs):
            raise P2PError(f"collective error words {errs}", errs)

    # ---- the Drafter interface -------------------------------------------------------------------------

    def run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        for j in jobs:  # bad input is the frame's DRAFTER_ERROR, before anything is launched
            if not 0 <= j.keep <= self.lengths[j.row]:
                raise ValueError(f"row {j.row}: keep {j.keep} beyond its length {self.lengths[j.row]}")
        if not jobs or n_steps == 0:
            for j in jobs:  # nothing drafted: only extend (eager, no head)
                self._guarded(lambda j=j: self._extend_only(j), jobs)
            return np.zeros((len(jobs), n_steps), np.int32), np.zeros((len(jobs), n_steps), np.float32)
        if self.fail_token >= 0 and any((j.tokens == self.fail_token).any() for j in jobs):
            self.skip_last_rank_once = True
        out = self._guarded(lambda: self._run(jobs, n_steps), jobs)
        self.failures_in_a_row = 0
        return out

    def _guarded(self, fn, jobs: list[Job]):
        try:
            with torch.inference_mode():
                return fn()
        except Exception as exc:
            self._recover(jobs)
            self.failed_steps += 1
            self.failures_in_a_row += 1
            msg = (f"tp{self.world} step failed ({self.failures_in_a_row} in a row): {type(exc).__name__}: {exc}")
            log.error("%s", msg)
            if self.failures_in_a_row >= self.max_failures and self.on_fatal is not None:
                self.on_fatal(msg)
            raise StepFailed(msg) from exc
        finally:
            self.skip_last_rank_once = False

    def _recover(self, jobs: list[Job]) -> None:
        """Cancel parked waits, drain every rank (bounded) and clear the collectives' state; the jobs'
        rows are forgotten (the core drops their requests; the client resends them from position 0)."""
        try:
            self.group.cancel()
            if isinstance(self.group, P2PGroup):
                self.group.reset(streams=[s for s in self.streams if s is not None])
            else:
                self.group.reset()
        except Exception:
            log.exception("tp%d: resetting the collectives failed", self.world)
        for j in jobs:
            self.lengths[j.row] = 0

    def _extend_only(self, j: Job) -> None:
        self.lengths[j.row] = j.keep
        self._lockstep(lambda r: self._prefill(r, j, len(j.tokens)))
        self.lengths[j.row] = j.keep + len(j.tokens)

    def _run(self, jobs: list[Job], n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        # a long extension (a first-round prompt) is prefilled in chunks first, all but its last
        # PAD_LIMIT tokens; what is left of every job then fits the static step
        short = []
        for j in jobs:
            self.lengths[j.row] = j.keep
            n = len(j.tokens) - PAD_LIMIT
            if n > 0:
                self._lockstep(lambda r, j=j, n=n: self._prefill(r, j, n))
                j = Job(j.row, j.keep + n, j.tokens[n:])
            short.append(j)
        B = len(short)
        T = next(t for t in T_BUCKETS if t >= max(len(j.tokens) for j in short))
        kv = kv_bucket(max(j.keep for j in short) + T + n_steps, self.max_len)
        st = self._get_static((B, T, n_steps, kv))
        host = st.host.numpy()
        host[:] = 0
        for b, j in enumerate(short):
            host[b * T:b * T + len(j.tokens)] = j.tokens
            host[B * T + b] = j.keep
            host[B * T + B + b] = j.row
            host[B * T + 2 * B + b] = len(j.tokens) - 1
        if st.graphs:
            ranks = range(len(self.shards) - 1 if self.skip_last_rank_once else len(self.shards))
            self._replay(st, ranks, copy_inputs=True)
        else:
            for r in range(len(self.shards)):
                with self._ctx(r):
                    st.inbuf[r].copy_(st.host, non_blocking=st.host.is_pinned())
            self._lockstep(lambda r: self._step(r, st))
        toks = []
        for r in range(len(self.shards)):
            with self._ctx(r):
                toks.append(st.out_tok[r].cpu())  # waits for rank r's stream
        with self._ctx(0):
            confs = st.out_conf[0].cpu().numpy()
        self._check_group()
        if any(not torch.equal(toks[0], t) for t in toks[1:]):
            raise P2PError(f"ranks drafted different tokens: {[t.tolist() for t in toks]}")
        for j in short:  # the same row lengths as LlamaDrafter: context + first n_steps - 1 drafts
            self.lengths[j.row] = j.keep + len(j.tokens) + n_steps - 1
        return toks[0].numpy().astype(np.int32), confs

    def forward_logits(self, jobs: list[Job], kv_len: int | None = None) -> torch.Tensor:
        """Tests and probes: extend each job's row (right-padded, one forward in lockstep, no draft) and
        return the full-vocabulary fp32 logits at each job's last token, [B, V] on the CPU (the ranks'
        column shards side by side). Every rank is needed (not 'solo')."""
        if self.tp_mode == "solo" and self.world > 1:
            raise ValueError("forward_logits needs every rank (not 'solo')")
        short = []
        with torch.inference_mode():
            for j in jobs:  # as in a step: all but the last PAD_LIMIT tokens of a long job in chunks first
                n = len(j.tokens) - PAD_LIMIT
                if n > 0:
                    self._lockstep(lambda r, j=j, n=n: self._prefill(r, j, n))
                    j = Job(j.row, j.keep + n, j.tokens[n:])
                short.append(j)
        jobs = short
        B, T = len(jobs), max(len(j.tokens) for j in jobs)
        kv = kv_len or max(j.keep for j in jobs) + T
        toks = np.zeros((B, T), np.int64)
        for b, j in enumerate(jobs):
            toks[b, :len(j.tokens)] = j.tokens
        out: list = [None] * len(self.shards)

        def rank(r: int) -> Iterator[None]:
            dev = self.shards[r].device
            t = [torch.from_numpy(toks).to(dev), torch.tensor([j.keep for j in jobs], device=dev),
                 torch.tensor([j.row for j in jobs], device=dev),
                 torch.tensor([len(j.tokens) - 1 for j in jobs], device=dev)]
            out[r] = yield from self._forward(r, t[0], t[1], t[2], kv, logits_at=t[3])

        with torch.inference_mode():
            self._lockstep(rank)
            self._check_group()
        for j in jobs:
            self.lengths[j.row] = j.keep + len(j.tokens)
        return torch.cat([o.cpu() for o in out], dim=1)

    def close(self) -> None:
        self._static.clear()
        self.group.close()
        if self._pool_threads is not None:
            self._pool_threads.shutdown()


def _mm_f32_out_works(dev: torch.device) -> bool:
    """torch.mm(bf16, bf16, out_dtype=float32) (fp32 partial sums straight from the GEMM) on this build."""
    try:
        a = torch.ones(2, 2, device=dev, dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def load_tp_drafter(spec: str, tp: int, tp_mode: str, *, device: str = "cpu", dtype: str = "auto", n_rows: int = 16,
                    max_ctx: int = 4096, n_out_max: int = 8, seed: int | None = None, model_id: str = "",
                    mode: str = "auto", fail_token: int = -1, timeout_ms: float = 1000.0) -> TPDrafter:
    """The same model specs as drafters.load_drafter ('tiny', 'random:SHAPE', an HF directory), split
    over `tp` ranks. pair: ranks on cuda:0..tp-1 (the full model is staged on cuda:0, then dropped)."""
    from draftrelay.worker.drafters import load_drafter

    if spec == "test":
        raise ValueError("--tp needs a Llama-family model ('tiny', 'random:SHAPE' or a directory), not 'test'")
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp mode {tp_mode!r}: one of {', '.join(TP_MODES)}")
    if not 1 <= tp <= MAX_RANKS:
        raise ValueError(f"tp {tp}: must be 1..{MAX_RANKS}")
    if tp_mode == "pair":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpu < tp:
            raise ValueError(f"tp {tp} in mode 'pair' needs {tp} CUDA devices, found {n_gpu} "
                             "(mode 'emulate' runs every rank on one device or the CPU)")
        device = "cuda:0"
    one = load_drafter(spec, device=device, dtype=dtype, n_rows=1, max_ctx=1, n_out_max=n_out_max, seed=seed,
                       model_id=model_id, mode="eager")  # only for its model and identity
    model = one.model
    check_split(model.cfg, tp)
    if mode == "auto":
        mode = "graph" if model.device.type == "cuda" and (tp_mode != "emulate" or tp == 1) else "static"
    d = TPDrafter(model, tp, tp_mode, n_rows, max_ctx, n_out_max, one.model_id, one.tokenizer_hash, mode=mode,
                  timeout_ms=timeout_ms, fail_token=fail_token)
    del one, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return d
