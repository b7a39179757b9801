"""The one Llama-family decoder used by both sides: the engine's target and the worker's drafter.

RMSNorm, RoPE (plain, 'linear' or 'llama3' scaling), grouped-query attention, SwiGLU MLP, tied or
untied head, optional q/k/v bias (Qwen2-style checkpoints). Module definitions only: reading and
writing checkpoints (HF directories, GGUF files) is draftrelay.checkpoint's.

One call, `Transformer.forward(tokens[B,T], start_pos[B], cache, rows[B])`, serves prefill chunks,
1-token decode and verification of k+1 tokens: it writes K/V of the T new tokens at positions
start_pos[b] .. start_pos[b]+T-1 of cache row rows[b] and lets each of them attend to everything
before it in that row. Rows of one batch may sit at different lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftrelay import cpu_linear
from draftrelay.memory import check_fits

if TYPE_CHECKING:
    from draftrelay.draft_vocab import DraftVocab
    from draftrelay.int8_head import Int8Head
    from draftrelay.int8_layers import LayerInt8

TINY_SEED = 0  # the built-in tiny pair's default seed: engine and worker must use the same one
TINY_TOKENIZER_ID = "bytes-256"  # the tiny models' vocabulary is the 256 byte values


class ModelError(ValueError):
    """A model directory, config or weight file is unusable; the message says what and where."""


# ----------------------------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    qkv_bias: bool = False  # Qwen2 checkpoints carry biases on q/k/v (not on o)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelError(f"config field '{f}' must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ModelError(f"config field 'rope_theta' must be a positive number, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ModelError(f"config field 'rms_norm_eps' must be a positive number, got {self.rms_norm_eps!r}")
        _check_rope_scaling(self.rope_scaling)

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        d, h, kv, hd, i, v = (self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim,
                              self.intermediate_size, self.vocab_size)
        per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * i + 2 * d
        if self.qk_norm:
            per_layer += 2 * hd
        if self.qkv_bias:
            per_layer += h * hd + 2 * kv * hd
        return v * d * (1 if self.tie_word_embeddings else 2) + self.n_layers * per_layer + d

    def replace(self, **kw) -> ModelConfig:
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        vals.update(kw)
        return ModelConfig(**vals)


def _check_rope_scaling(s: dict | None) -> None:
    if s is None:
        return
    if not isinstance(s, dict):
        raise ModelError(f"rope_scaling must be an object or null, got {s!r}")
    kind = s.get("rope_type", s.get("type"))
    if kind not in ("linear", "llama3"):
        raise ModelError(f"rope_scaling type {kind!r} is not supported (supported: 'linear', 'llama3')")
    keys = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                         if kind == "llama3" else [])
    for k in keys:
        v = s.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ModelError(f"rope_scaling ({kind}) field '{k}' must be a positive number, got {v!r}")
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ModelError("rope_scaling (llama3): high_freq_factor must exceed low_freq_factor")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with the config's scaling applied (as HF does)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    kind = s.get("rope_type", s.get("type"))
    factor = float(s["factor"])
    if kind == "linear":  # positions divided by factor == frequencies divided by factor
        return inv / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


# ----------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """K/V for up to `max_batch` sequences (rows) of up to `max_len` tokens each.

    `lengths[row]` (host int64) is how many positions of the row hold valid K/V. `forward` appends
    and advances it; `truncate(row, n)` rolls a row back to n tokens (the accepted length) — the
    stale entries behind it are simply overwritten later, causality masks them meanwhile.
    Layout [layer, row, kv head, position, dim]: a row's keys read back as [kv head, L, dim] with no
    transpose, so the attention GEMMs take them in place instead of copying the whole slice first.
    """

    def __init__(self, cfg: ModelConfig, max_batch: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if max_batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs max_batch > 0 and max_len > 0, got {max_batch}, {max_len}")
        shape = (cfg.n_layers, max_batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        # before the zero fill touches its pages: a CPU cache beyond the free memory would swap the host
        # or wake the OOM killer rather than fail (draftrelay/memory.py)
        check_fits(max_batch * max_len * self.position_bytes(cfg, dtype), torch.device(device),
                   f"KV cache of {max_batch} rows x {max_len} positions ({cfg.name or 'model'})",
                   "fewer rows or positions: serve --max-batch / --max-model-len, worker --rows / --max-ctx")
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(max_batch, dtype=torch.int64)
        # the same memory as a numpy array, for the per-row reads and writes of hot paths (a worker's
        # STEP packs each job with one): numpy indexing costs ~0.1 us where a torch scalar index costs
        # 1-2 us here and several times that on a slow host, per job and per round
        self.lens = self.lengths.numpy()
        self.max_batch, self.max_len = max_batch, max_len

    @staticmethod
    def position_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of K and V one position of one row holds."""
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize

    def truncate(self, row: int, length: int) -> None:
        cur = int(self.lens[row])
        if not 0 <= length <= cur:
            raise ValueError(f"truncate row {row} to {length}: must be within [0, {cur}]")
        self.lens[row] = length

    def reset(self, row: int) -> None:
        self.lens[row] = 0

    def release(self) -> None:
        """Give the K/V memory back now (an engine's close): whatever still holds this cache (a
        benchmark's reference, a cycle not yet collected) then holds no device memory, and any later
        use fails at once on the empty tensors instead of reading stale keys."""
        self.k = self.k.new_empty(0)
        self.v = self.v.new_empty(0)
        self.lengths.zero_()

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


# ----------------------------------------------------------------------------------------------
# layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalise in fp32, round to the activation dtype, then scale. F.rms_norm is
    that formula (it upcasts half-precision input itself; equal bits on the CPU, fp32 and bf16) in one
    fused kernel on a GPU instead of seven: decode steps are bound by their kernel count."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)  # bf16 in: computed in fp32, rounded once


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,T,H,D]; cos and *signed* sin [B,T,1,D] from step_tables. HF's rotate-half layout (the
    checkpoints' q/k are permuted for it): HF's (-x2) * sin is x2 * (-sin), exactly, without a neg
    kernel per layer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def step_tables(start_pos: torch.Tensor, T: int, kv_len: int, n_rep: int, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layer of one forward shares: positions [B,T], RoPE cos and signed sin [B,T,1,D]
    (fp32 angles, like HF), and the blocked mask [B,1,n_rep*T,L] (True: key not visible; causal over
    each row's own positions, repeated for the n_rep query heads of a kv head)."""
    dev = start_pos.device
    B = start_pos.shape[0]
    pos = start_pos[:, None] + torch.arange(T, device=dev)[None, :]
    ang = pos.float()[..., None] * inv_freq
    sin = ang.sin()
    cos = torch.cat((ang, ang), dim=-1).cos().to(dtype)[:, :, None, :]
    sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None, :]
    blocked = torch.arange(kv_len, device=dev)[None, None, :] > pos[:, :, None]  # [B, T, L]
    blocked = blocked[:, None, None].expand(B, 1, n_rep, T, kv_len).reshape(B, 1, n_rep * T, kv_len)
    return pos, cos, sin, blocked


def to_device(x, dev: torch.device) -> torch.Tensor:
    """Host values (a list or a CPU tensor) onto `dev` without waiting for its stream. A plain
    (blocking) host-to-device copy synchronizes the stream first; in async rounds that stream is parked
    on the round, so the host would stop enqueuing the verify until the round ends, the very overlap
    async rounds are for. Pinned memory and non_blocking make it an ordinary enqueued copy."""
    t = torch.as_tensor(x)
    if t.device == dev or t.device.type != "cpu" or dev.type == "cpu":
        return t.to(dev)
    if dev.type == "cuda":
        t = t.pin_memory()  # torch keeps the pinned block alive until the copy has run
    return t.to(dev, non_blocking=True)


DECODE_ROWS = 64  # query rows per kv head up to which attend() takes the explicit decode path
# From SPLIT_KV keys on, the decode path's probs @ V runs as one batched GEMM over chunks of
# SPLIT_CHUNK keys plus an fp32 sum of the partials (the split-K of flash-decoding, in plain torch).
# Tests and benchmarks may change them (a captured graph keeps the choice it was captured with).
SPLIT_KV = 8192
SPLIT_CHUNK = 2048


def attend(qg: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Masked attention, qg [B, n_kv, R, D] over keys/vals [B, n_kv, L, D], blocked [B, 1, R, L] (True:
    not visible) -> [B, n_kv, R, D].

    Decode and verify steps have few query rows (R = n_rep * T) and a long L. SDPA's masked CUDA
    kernel spreads its work over (batch, head, query block) only, so one row at 128K keys ran on a
    handful of SMs (a 7B verify took 134 ms at 128K on an H200). Up to DECODE_ROWS rows the product
    is written out instead, as HF's eager attention does (scores in the activation dtype, softmax in
    fp32): two GEMMs that cuBLAS spreads over L, bandwidth-bound on the KV. Prefill chunks keep SDPA.
    """
    if qg.shape[-2] > DECODE_ROWS:
        return F.scaled_dot_product_attention(qg, keys, vals, attn_mask=~blocked)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (qg.shape[-1] ** -0.5)
    scores = scores.masked_fill(blocked, float("-inf"))  # every row sees key 0: never all -inf
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals.dtype)
    L = vals.shape[-2]
    if L < SPLIT_KV:
        return torch.matmul(probs, vals)
    # probs @ V has a tiny output (R x D per kv head) and a long reduction (L): as one GEMM it gets
    # a handful of thread blocks per head that each stream all of L. Chunks of the reduction give
    # every SM work; the partials (fp32-accumulated, one rounding each) are summed in fp32.
    S = L // SPLIT_CHUNK
    M = S * SPLIT_CHUNK
    p = probs[..., :M].unflatten(-1, (S, SPLIT_CHUNK)).transpose(-3, -2)  # [B, n_kv, S, R, C]
    v = vals[:, :, :M].unflatten(2, (S, SPLIT_CHUNK))  # [B, n_kv, S, C, D]
    out = torch.matmul(p, v).float().sum(2)
    if M < L:
        out += torch.matmul(probs[..., M:], vals[:, :, M:]).float()
    return out.to(vals.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on a CPU, the library and row blocks cpu_linear chose for a product of x's rows."""
    if x.device.type != "cpu" or x.dim() < 2:
        return F.linear(x, w, b)
    return cpu_linear.linear(x, w, b)


class Proj(NamedTuple):
    """One HF projection (q_proj, gate_proj, ...) as views into our fused weight: loading, saving and
    the TP split see HF's tensors; the forward runs one GEMM for all of them."""
    weight: torch.Tensor
    bias: torch.Tensor | None


def _rows(lin: nn.Linear, a: int, b: int) -> Proj:
    return Proj(lin.weight[a:b], None if lin.bias is None else lin.bias[a:b])


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the forward uses them: the whole layer (Block.weights) or one
    tensor-parallel rank's slices of it (worker.tp), which then holds n_heads / n_kv of its own."""
    ln1: torch.Tensor
    wqkv: torch.Tensor  # rows q | k | v: one GEMM
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    wgu: torch.Tensor  # rows gate | up: one GEMM
    wd: torch.Tensor
    n_heads: int
    n_kv: int
    q_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm of q and k before RoPE
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    q8: LayerInt8 | None = None  # int8 copies of the four products (int8_layers.py): read on the fast path only


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nk = cfg.n_heads * hd, cfg.n_kv_heads * hd
        self.qkv = nn.Linear(d, self.nq + 2 * self.nk, bias=cfg.qkv_bias)  # rows: q | k | v
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)

    @property
    def q_proj(self) -> Proj:
        return _rows(self.qkv, 0, self.nq)

    @property
    def k_proj(self) -> Proj:
        return _rows(self.qkv, self.nq, self.nq + self.nk)

    @property
    def v_proj(self) -> Proj:
        return _rows(self.qkv, self.nq + self.nk, self.nq + 2 * self.nk)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ni = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.ni, bias=False)  # rows: gate | up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    @property
    def gate_proj(self) -> Proj:
        return _rows(self.gate_up, 0, self.ni)

    @property
    def up_proj(self) -> Proj:
        return _rows(self.gate_up, self.ni, 2 * self.ni)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def weights(self) -> LayerWeights:
        a, m = self.self_attn, self.mlp
        return LayerWeights(self.input_layernorm.weight, a.qkv.weight, a.qkv.bias, a.o_proj.weight,
                            self.post_attention_layernorm.weight, m.gate_up.weight, m.down_proj.weight,
                            self.cfg.n_heads, self.cfg.n_kv_heads,
                            *((a.q_norm.weight, a.k_norm.weight, self.cfg.rms_norm_eps) if self.cfg.qk_norm else ()))


# ----------------------------------------------------------------------------------------------
# the forward: one decoder for the one-card model and every tensor-parallel rank


@dataclass
class StepState:
    """What every layer of one forward shares (built once per forward by `step_state`)."""
    B: int
    T: int
    kv_len: int
    start: torch.Tensor  # [B] int64 on the device
    rows: slice | torch.Tensor  # cache rows: a slice is read in place, a tensor gathered
    widx: torch.Tensor | None  # [B, 1] write index of each row (into the slice, or the cache); plain path
    pos: torch.Tensor | None  # [B, T]; plain path
    inv_freq: torch.Tensor
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # cos, sin, blocked (plain attention)
    kernels: object | None  # draftrelay.kernels backend module (fast path), or None (plain path)
    rows_t: torch.Tensor | None  # [B] rows as a tensor (what the fused kernels index)
    fast_attn: bool  # this forward's attention runs the fused kernels (decode and verify shapes)


def step_state(start: torch.Tensor, T: int, kv_len: int, rows: slice | torch.Tensor, n_rep: int,
               inv_freq: torch.Tensor, dtype: torch.dtype, fast: bool) -> StepState:
    dev = start.device
    B = start.shape[0]
    kern = rows_t = None
    fast_attn = False
    if fast:
        from draftrelay import kernels
        kern = kernels.backend(dev)
        rows_t = torch.arange(rows.start, rows.stop, device=dev) if isinstance(rows, slice) else rows
        fast_attn = n_rep * T <= DECODE_ROWS
    if fast_attn:  # the kernels take the positions from start: no tables, masks or write indices
        pos = widx = tables = None
    else:
        pos, cos, sin, blocked = step_tables(start, T, kv_len, n_rep, inv_freq, dtype)
        tables = (cos, sin, blocked)
        widx = torch.arange(B, device=dev)[:, None] if isinstance(rows, slice) else rows[:, None]
    return StepState(B, T, kv_len, start, rows, widx, pos, inv_freq, tables, kern, rows_t, fast_attn)


def attention(qkv: torch.Tensor, w: LayerWeights, st: StepState, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
    """qkv [B, T, (n_heads + 2 n_kv) * D] -> the attention heads' outputs [B, T, n_heads * D] (before
    o_proj), writing the T new K/V into the layer's cache ck / cv ([rows, n_kv, len, D]) at their positions."""
    B, T = st.B, st.T
    H, HK = w.n_heads, w.n_kv
    D = ck.shape[-1]
    if w.q_norm is not None:  # Qwen3: q and k normalised per head first (both paths see the normed qkv)
        q = rms_norm(qkv[..., :H * D].reshape(B, T, H, D), w.q_norm, w.qk_eps).reshape(B, T, H * D)
        k = rms_norm(qkv[..., H * D:(H + HK) * D].reshape(B, T, HK, D), w.k_norm, w.qk_eps).reshape(B, T, HK * D)
        qkv = torch.cat((q, k, qkv[..., (H + HK) * D:]), -1)
    if st.fast_attn:
        # RoPE, the K/V write and the attention: one kernel for one token per row and a chunk of keys
        return st.kernels.rope_attention(qkv.contiguous(), st.start, st.inv_freq, H, HK, ck, cv, st.rows_t,
                                         st.kv_len).view(B, T, H * D)
    cos, sin, blocked = st.tables
    # q and k are neighbours in qkv: RoPE runs once over both (elementwise, the same values)
    qk = apply_rope(qkv[..., :(H + HK) * D].view(B, T, H + HK, D), cos, sin)
    q, k = qk[:, :, :H], qk[:, :, H:]
    v = qkv[..., (H + HK) * D:].view(B, T, HK, D)
    # write the new K/V into each sequence's row at its own positions, then read the rows back:
    # a contiguous run of rows (a slice) is read in place, scattered rows are gathered (a copy)
    rows = st.rows
    if isinstance(rows, slice):
        ck, cv = ck[rows], cv[rows]
    ck[st.widx, :, st.pos] = k.to(ck.dtype)  # indices apart around a slice: the target is [B, T, n_kv, D], as k
    cv[st.widx, :, st.pos] = v.to(cv.dtype)
    if isinstance(rows, slice):
        keys, vals = ck[:, :, :st.kv_len], cv[:, :, :st.kv_len]
    else:
        keys, vals = ck[rows, :, :st.kv_len], cv[rows, :, :st.kv_len]
    keys, vals = keys.to(q.dtype), vals.to(q.dtype)  # [B, n_kv, L, D]
    # GQA without repeating K/V: the n_rep query heads of one kv head become n_rep*T query rows
    qg = q.transpose(1, 2).reshape(B, HK, (H // HK) * T, D)
    out = attend(qg, keys, vals, blocked)  # [B, n_kv, n_rep*T, D]
    return out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, -1)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None, st: StepState,
                q: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, add_norm's output @ w^T + b): on the fast path one kernel for decode and verify rows
    (the norm computed where the product reads it), else add_norm then the GEMM. q: w's int8 copy (q, row
    scales), read on the fast path where the backend has an int8 tile for the rows (else w)."""
    K = st.kernels
    if K is not None and K.use_norm_linear(st.B * st.T, w):
        got = None if q is None else K.int8_norm_linear(x, delta, weight, eps, *q, b)
        return got if got is not None else K.norm_linear(x, delta, weight, eps, w, b)
    x, h = add_norm(x, delta, weight, eps, st)
    return x, linear(h, w, b)


def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             st: StepState) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight): the residual add and the next norm (one fused kernel on
    the fast path). delta may be fp32 (a TP all-reduce's sum); it is rounded to x's dtype first."""
    if st.kernels is not None:
        return st.kernels.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x = x + delta.to(x.dtype)
    return x, rms_norm(x, weight, eps)


def mlp_act(gu: torch.Tensor, st: StepState) -> torch.Tensor:
    """SwiGLU's activations silu(gate) * up from the gate|up product (before down_proj)."""
    if st.kernels is not None:
        return st.kernels.silu_mul(gu)
    n = gu.shape[-1] // 2
    return F.silu(gu[..., :n]) * gu[..., n:]


RowLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def attn_half(x: torch.Tensor, red: torch.Tensor | None, w: LayerWeights, st: StepState, ck: torch.Tensor,
              cv: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first half: the previous product `red` added to the residual stream x, the input norm,
    attention -> (x, the input of o_proj)."""
    x, qkv = norm_linear(x, red, w.ln1, eps, w.wqkv, w.bqkv, st, None if w.q8 is None else w.q8.wqkv)
    return x, attention(qkv, w, st, ck, cv)


def mlp_half(x: torch.Tensor, red: torch.Tensor, w: LayerWeights, st: StepState,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's second half: o_proj's product added, the post-attention norm, SwiGLU -> (x, the input
    of down_proj)."""
    x, gu = norm_linear(x, red, w.ln2, eps, w.wgu, None, st)
    return x, mlp_act(gu, st)


def fast_linear(K, x: torch.Tensor, w: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x @ w^T on the fast path's backend K: through w's int8 copy q (q, row scales) where K has an int8 tile
    for the rows (int8_linear's None where not), else through w."""
    got = None if q is None else K.int8_linear(x, *q)
    return K.linear(x, w) if got is None else got


def out_product(o: torch.Tensor, w: LayerWeights, st: StepState) -> torch.Tensor:
    """o_proj's product on one card (the skinny GEMM or cuBLAS on the fast path, as measured; through the
    layer's int8 copy where it has one and the backend a tile for the rows)."""
    if st.kernels is None:
        return linear(o, w.wo)
    return fast_linear(st.kernels, o, w.wo, None if w.q8 is None else w.q8.wo)


def mlp_down(x: torch.Tensor, red: torch.Tensor, w: LayerWeights, st: StepState,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's second half on one card, down_proj included: (x, down_proj's product). The same values
    as mlp_half then the product; on the fast path SiLU * up is computed where the gate|up product is
    stored (kernels.norm_mlp, decode and verify rows) or where the down product reads it
    (kernels.act_linear), not by a launch of its own."""
    K = st.kernels
    if K is not None and K.use_norm_linear(st.B * st.T, w.wgu):  # the int8 copies where the backend has tiles
        q8 = (None, None) if w.q8 is None else (w.q8.wgu, w.q8.wd)
        return K.norm_mlp(x, red, w.ln2, eps, w.wgu, w.wd, *q8)
    x, gu = norm_linear(x, red, w.ln2, eps, w.wgu, None, st)
    if K is None:
        return x, linear(mlp_act(gu, st), w.wd)
    return x, K.act_linear(gu, w.wd)


def head_logits(x: torch.Tensor, red: torch.Tensor, st: StepState, final_norm: torch.Tensor, head: torch.Tensor,
                eps: float, last_only: bool = False, logits_at: torch.Tensor | None = None,
                greedy: bool = False, argmax_only: bool = False, vocab: DraftVocab | None = None,
                qhead: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The last product added, the positions wanted picked, the final norm and the head -> fp32 logits
    [B, T, V] ([B, 1, V] with last_only or logits_at [B]). greedy (one position per row: last_only,
    logits_at or T = 1): (argmax [B], its softmax probability [B]) instead of the logits, computed from
    the head's output as the logits would give them (kernels.greedy_pick). argmax_only: the argmax of
    every position's logits instead, int64 [B, T] (or [B, 1]); on the plain CPU path screened through an
    int8 copy of the head (greedy_head: a fraction of the head's bytes read, the same argmax).
    vocab: `head` holds only a draft vocabulary's rows (draft_vocab.py): picks map back to token ids,
    logits come back at the vocabulary's width with -inf outside it. qhead (greedy on the fast path): the
    head's int8 copy (q, row scales; int8_head.py), read where the backend has a tile for the rows
    (kernels' int8_norm_linear / int8_linear return None where not: the bf16 head then)."""
    if vocab is not None and not greedy:
        out = head_logits(x, red, st, final_norm, head, eps, last_only, logits_at, argmax_only=argmax_only)
        return vocab.token(out) if argmax_only else vocab.widen(out)
    K = st.kernels
    if argmax_only and K is None:
        x = x + red.to(x.dtype)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[torch.arange(st.B, device=x.device), logits_at][:, None]
        h = rms_norm(x, final_norm, eps)
        from draftrelay.greedy_head import head_argmax
        return head_argmax(h.reshape(-1, h.shape[-1]), head, linear).view(h.shape[:-1])
    qhead = qhead if greedy and K is not None else None
    if K is not None and st.T == 1:  # one position per row: nothing to pick (logits_at can only be 0)
        got = None if qhead is None else K.int8_norm_linear(x, red, final_norm, eps, *qhead)
        if got is not None:
            out = got[1]
        elif K.use_norm_linear(st.B, head):  # the add and the final norm inside the head's product
            _, out = K.norm_linear(x, red, final_norm, eps, head, None)
        else:
            _, x = K.add_rms_norm(x, red, final_norm, eps)
            out = K.linear(x.contiguous(), head)
    else:
        if K is not None:  # the add fused into the norm; the norm is per row, so rows are picked after it
            _, x = K.add_rms_norm(x, red, final_norm, eps)
        else:
            x = x + red.to(x.dtype)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[torch.arange(st.B, device=x.device), logits_at][:, None]
        if K is not None:
            out = fast_linear(K, x.contiguous(), head, qhead)
        else:
            out = linear(rms_norm(x, final_norm, eps), head)
    if argmax_only:
        return out.float().argmax(-1)
    if greedy:
        if out.shape[1] != 1:
            raise ValueError(f"greedy picks one position per row, got {out.shape[1]}")
        from draftrelay.kernels import reference
        # a draft vocabulary's columns mapped to their ids inside the pick (no launch of its own)
        return (K or reference).greedy_pick(out[:, 0], None if vocab is None else vocab.ids_on(out.device))
    return out.float()


def embedding(tokens: torch.Tensor, weight: torch.Tensor, st: StepState) -> torch.Tensor:
    """The forward's first step: the fast path's embedding kernel (part of the PDL chain) or F.embedding."""
    return F.embedding(tokens, weight) if st.kernels is None else st.kernels.embedding(tokens, weight)


def positions_ahead(first: torch.Tensor, n: int) -> torch.Tensor:
    """first [B] -> [n, B], row s = first + s: the positions of a drafting loop's forwards, made before its
    first forward (one launch) rather than one add between each two forwards, where a torch launch would
    break the fast path's PDL chain. Each row is contiguous (what the kernels take as start)."""
    return first[None, :] + torch.arange(n, device=first.device, dtype=first.dtype)[:, None]


def decoder(tokens: torch.Tensor, embed: torch.Tensor, layers: Sequence[LayerWeights], k: torch.Tensor,
            v: torch.Tensor, st: StepState, eps: float, final_norm: torch.Tensor, head: torch.Tensor,
            last_only: bool = False, logits_at: torch.Tensor | None = None,
            greedy: bool = False, argmax_only: bool = False,
            vocab: DraftVocab | None = None,
            qhead: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The decoder stack on one card: embedding, the layers (k / v: caches [L, rows, n_kv, len, D]), the
    head (vocab: a draft vocabulary's rows only, see head_logits; qhead: its int8 copy for greedy picks).
    `decoder_steps` is the same stack for a tensor-parallel rank."""
    x, red = embedding(tokens, embed, st), None
    for i, w in enumerate(layers):
        x, o = attn_half(x, red, w, st, k[i], v[i], eps)
        red = out_product(o, w, st)
        x, red = mlp_down(x, red, w, st, eps)
    return head_logits(x, red, st, final_norm, head, eps, last_only, logits_at, greedy, argmax_only, vocab, qhead)


def decoder_steps(tokens: torch.Tensor, embed: torch.Tensor, layers: Sequence[LayerWeights], k: torch.Tensor,
                  v: torch.Tensor, st: StepState, eps: float, row_linear: RowLinear,
                  final_norm: torch.Tensor, head: torch.Tensor | None, last_only: bool = False,
                  logits_at: torch.Tensor | None = None) -> Generator[None, None, torch.Tensor | None]:
    """`decoder` for one tensor-parallel rank: a generator that yields after each row-parallel product
    (its caller launches the peers' ops in between). row_linear(x, w): the rank's partial product of
    o_proj / down_proj, all-reduced. head None: no head (prefill chunks that only extend the cache)."""
    x, red = embedding(tokens, embed, st), None
    for i, w in enumerate(layers):
        x, o = attn_half(x, red, w, st, k[i], v[i], eps)
        red = row_linear(o, w.wo)
        yield
        x, a = mlp_half(x, red, w, st, eps)
        red = row_linear(a, w.wd)
        yield
    if head is None:
        return None
    return head_logits(x, red, st, final_norm, head, eps, last_only, logits_at)


def run_to_end(gen: Generator[None, None, object]) -> object:
    """Drive a generator with nothing to interleave: its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


class Transformer(nn.Module):
    """Parameter names are the HF names without the leading 'model.' (lm_head keeps its name)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # fp32 RoPE frequencies kept outside the module's buffers so .to(bf16) never rounds them
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        # the fused-kernel forward (draftrelay.kernels): True, False, or None = on where Triton runs
        # (CUDA); on a CPU "on" runs the same structure with the kernels' plain-torch definitions
        self.fast: bool | None = None
        # a drafter's head restricted to a draft vocabulary (draft_vocab.py); None: the whole head
        self.draft_vocab: DraftVocab | None = None
        # a GPU drafter's head read as int8 by its greedy forwards (int8_head.py; worker --head-int8); None: bf16
        self.int8_head: Int8Head | None = None
        # a GPU drafter's layer products read as int8 on the fast path (int8_layers.py; worker --quant int8 on
        # CUDA): one LayerInt8 per layer, or None (bf16)
        self.int8_layers: list[LayerInt8] | None = None

    def head_weight(self) -> torch.Tensor:
        """The head the forward multiplies by: the (tied or untied) head, or its draft vocabulary's rows."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return w if self.draft_vocab is None else self.draft_vocab.head(w)

    def fast_path(self) -> bool:
        if self.fast is None:
            from draftrelay.kernels import triton_available
            return triton_available(self.device)
        return bool(self.fast)

    def layer_weights(self) -> list[LayerWeights]:
        """Each layer's tensors as the forward takes them, with its int8 copies (q8) where int8_layers is set."""
        ws = [blk.weights() for blk in self.layers]
        if self.int8_layers is None:
            return ws
        if len(self.int8_layers) != len(ws):
            raise ModelError(f"int8_layers holds {len(self.int8_layers)} layers' copies, the model {len(ws)} layers")
        return [w._replace(q8=q) for w, q in zip(ws, self.int8_layers, strict=True)]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, max_batch, max_len, self.device, self.dtype)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: KVCache, rows: torch.Tensor,
                kv_len: int | None = None, last_only: bool = False,
                logits_at: torch.Tensor | None = None, greedy: bool = False,
                argmax_only: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B,T] at positions start_pos[b].. of cache rows rows[b] -> float32 logits [B,T,V].

        rows: a [B] tensor of cache rows, or a slice(r0, r0 + B) of consecutive rows (read in
        place, no gather copy: the fast path for long contexts; eager calls detect it themselves).
        Eager use (kv_len=None): checks the positions on the host and advances cache.lengths.
        Graph capture: pass a static kv_len (>= every start_pos+T); nothing syncs and the caller
        keeps cache.lengths itself. last_only: logits of the last position only ([B,1,V]);
        logits_at [B]: logits of position logits_at[b] of each row only ([B,1,V]; right-padded rows).
        greedy (with last_only, logits_at or T = 1): (argmax int64 [B], its softmax probability fp32 [B])
        of that position instead of the logits (the drafting loop's pick, fused on the fast path).
        argmax_only: the argmax of every position's logits, int64 [B,T] (or [B,1]), instead of the
        logits (a greedy verify; on the plain CPU path the head is screened, greedy_head.py).
        """
        dev = self.device
        eager = kv_len is None
        tokens = to_device(tokens, dev)
        B, T = tokens.shape
        if isinstance(rows, slice):
            if rows.stop - rows.start != B or rows.step not in (None, 1):
                raise ValueError(f"rows {rows}: a slice of rows must cover exactly {B} consecutive rows")
            rw = list(range(rows.start, rows.stop))
        elif eager:  # host copies for the checks, taken before the device copy (no sync for host inputs)
            rw = torch.as_tensor(rows).tolist()
            if rw and rw == list(range(rw[0], rw[0] + len(rw))):
                rows = slice(rw[0], rw[0] + len(rw))
        if eager:
            sp = torch.as_tensor(start_pos).tolist()
        start_pos = to_device(start_pos, dev).long()
        if not isinstance(rows, slice):
            rows = to_device(rows, dev).long()
        if eager:
            if len(sp) != B or len(rw) != B:
                raise ValueError(f"start_pos and rows need {B} entries, got {len(sp)} and {len(rw)}")
            if len(set(rw)) != B:
                raise ValueError(f"rows must be distinct within one forward, got {rw}")
            for s, r in zip(sp, rw, strict=True):
                if not 0 <= r < cache.max_batch:
                    raise ValueError(f"cache row {r} out of range [0, {cache.max_batch})")
                if not 0 <= s <= int(cache.lengths[r]):
                    raise ValueError(f"row {r}: start position {s} leaves a gap (row holds {int(cache.lengths[r])})")
                if s + T > cache.max_len:
                    raise ValueError(f"row {r}: positions up to {s + T} exceed the cache's max_len {cache.max_len}")
            kv_len = max(sp) + T
        inv = self._inv_freq.get(dev)
        if inv is None:
            inv = self._inv_freq[dev] = rope_inv_freq(self.cfg).to(dev)
        st = step_state(start_pos, T, kv_len, rows, self.cfg.n_rep, inv, self.dtype, self.fast_path())
        logits_at = None if logits_at is None else to_device(logits_at, dev)
        head = self.head_weight()
        qhead = self.int8_head.of(head) if self.int8_head is not None and greedy and st.kernels is not None else None
        logits = decoder(tokens, self.embed_tokens.weight, self.layer_weights(), cache.k, cache.v, st,
                         self.cfg.rms_norm_eps, self.norm.weight, head, last_only, logits_at, greedy,
                         argmax_only, self.draft_vocab, qhead)
        if eager:
            for s, r in zip(sp, rw, strict=True):
                cache.lengths[r] = s + T
        return logits

    # ---- weights ---------------------------------------------------------------------------

    def named_hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Our weights under HF's module names (without the 'model.' prefix), in HF's order; the fused
        projections as views of their rows (writing into a view writes the fused weight)."""
        fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
        out = []
        for name, p in self.named_parameters():
            module, _, leaf = name.rpartition(".")  # e.g. layers.3.self_attn.qkv, weight
            parent, _, fused_name = module.rpartition(".")
            if fused_name not in fused:
                out.append((name, p))
            elif leaf == "weight":  # biases go with their weights, in HF's order (q.weight, q.bias, k...)
                for part in fused[fused_name]:
                    proj = getattr(self.get_submodule(parent), part)
                    out.append((f"{parent}.{part}.weight", proj.weight))
                    if proj.bias is not None:
                        out.append((f"{parent}.{part}.bias", proj.bias))
        return out

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, std: float = 0.02, embed_std: float | None = None,
               draw_on: str = "cpu") -> Transformer:
        """Seeded random weights in fp32, drawn on the CPU so every device gets the same values
        (draw_on="device": drawn by the device's generator instead, much faster for large shapes)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        gdev = torch.device(device) if draw_on == "device" else torch.device("cpu")
        g = torch.Generator(device=gdev).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_hf_tensors():  # HF's tensors in HF's order: the same draws per seed
                if name.endswith(("layernorm.weight", "_norm.weight")) or name == "norm.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    s = embed_std if (embed_std is not None and name == "embed_tokens.weight") else std
                    p.copy_(torch.randn(p.shape, generator=g, device=gdev) * s)
        return model.eval()


# ----------------------------------------------------------------------------------------------
# the built-in tiny pair


def tiny_config(n_layers: int = 4) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=176, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       max_position_embeddings=4096, name="tiny")


TINY_DRAFTER_LAYERS = 1
TINY_DEEP_SCALE = 0.1


def tiny_pair(seed: int = TINY_SEED, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[Transformer, Transformer]:
    """(target, drafter): a 4-layer target and a 1-layer drafter that agree often, not always.

    The drafter is the target's first layer with the same embedding, final norm and head. The
    target's three deeper layers write into the residual stream with their output projections
    (o_proj, down_proj) scaled by TINY_DEEP_SCALE, so they nudge rather than replace what layer 0
    computed: the argmaxes agree on ~75-85 % of positions (tests/test_model.py checks > 50 %), so
    the demo shows a real, partial acceptance rate instead of 0 % (two unrelated random models)
    or 100 % (identical ones). The untied head with std 1 makes the logits peaked (top-1 prob
    ~0.75), and the embedding std (0.3) is small enough that the output is not just a function
    of the current token (a tied head would echo the input token forever).
    """
    cfg = tiny_config()
    target = Transformer.random(cfg, seed=seed, device="cpu", std=0.08, embed_std=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(1.0 / 0.08)
        for layer in target.layers[TINY_DRAFTER_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(TINY_DEEP_SCALE)
            layer.mlp.down_proj.weight.mul_(TINY_DEEP_SCALE)
    drafter = Transformer.random(cfg.replace(n_layers=TINY_DRAFTER_LAYERS, name="tiny-drafter"), seed=seed)
    drafter.load_state_dict({k: v.clone() for k, v in target.state_dict().items() if k in drafter.state_dict()})
    target.cfg.name = "tiny-target"
    return target.to(device=device, dtype=dtype).eval(), drafter.to(device=device, dtype=dtype).eval()


def tiny_model_id(seed: int = TINY_SEED, role: str = "drafter") -> str:
    return f"tiny-{role}-s{seed}"
