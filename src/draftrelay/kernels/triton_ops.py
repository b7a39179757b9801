"""Triton kernels of the fast forward (CUDA): the same functions as `kernels.reference`, one launch
each instead of the plain forward's several per op.

  add_rms_norm      residual add + RMSNorm (+ weight), one pass over the row         (plain: 4 kernels)
  silu_mul          SiLU(gate) * up of the fused gate|up GEMM's output              (plain: 2)
  rope_kv_write     RoPE of q and k from positions (angles in-kernel), k and v stored (plain: ~12 with
                    into the cache rows at their positions, q written head-major      the step's tables)
  skinny_linear     the products of decode and verify rows (M <= 16): each program reads a few
                    weight rows once, fp32 multiply-and-sum (up to 8 rows, each row in turn against
                    the loaded tile) or tensor-core dots (the compact-rows tile: the prologue on the
                    real rows only, padded to 16); whole-K tiles, a K loop, or K split over
                    programs whose partials the last one of a column block sums (split-K in one
                    launch); optionally with add_rms_norm computed in the prologue (norm_linear) or
                    SiLU*up (act_linear, the down product); chosen against cuBLAS per shape (kernels.plan)
  greedy_pick       argmax and its softmax probability over the vocabulary: per-chunk (max, argmax,
                    sum exp) partials, merged by a one-program-per-row kernel     (plain: ~6)
  greedy_top        the same and the m most likely ids with their probabilities (the speculation
                    cache's candidates): per-chunk top m, merged per row            (plain: a top-k)
  decode_attention  flash-decoding: each program streams one key chunk of one (row, kv head) once, for
                    all n_rep * T query rows of that kv head (GQA without repeating K/V), online
                    softmax in fp32; long contexts split over many programs whose partials one combine
                    kernel merges. Reads only the keys each row has (start + T), not the whole bucket.
                                                                                   (plain: ~10)
  rope_attention    rope_kv_write + decode_attention in one launch for one token per row and one
                    chunk of keys: the new key rotated, stored, and attended from registers
Every kernel is launched with programmatic dependent launch where the card has it (PDL below).
Shapes and dtypes are the reference's; inputs must be contiguous where the reference's docstring says
"one GEMM's output" (they are in the forward).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from draftrelay import env_choice
from draftrelay.capture import gc_paused
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R

try:  # grid dependency control (programmatic dependent launch, Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the kernels launch without it (PDL False)
    gdc_launch_dependents = gdc_wait = None

log = logging.getLogger("draftrelay.kernels")

NEG_INF = tl.constexpr(float("-inf"))
BLOCK_N = 64  # keys per tile of the attention loop (split chunks)
# keys per tile when one program reads all of a row's keys (up to SINGLE_MAX), by (head dim, padded query
# rows), else BLOCK_N: larger tiles mean fewer dependent load rounds (the loop runs ceil(keys / tile)).
# Measured alone on the H200 (benchmarks/fast_forward.py, "attention"): head dim 64 with one token (the
# 0.5B drafter) 4.0 / 4.2 us at 128 keys and 10.4 / 15.6 us at 1,000 keys for 256 / 64 keys a tile; head
# dim 128 gained nothing from 128 and a 5-token verify lost (9.1 / 8.0 us), 256 there overflows shared memory
SINGLE_BLOCK: dict[tuple[int, int], int] = {(64, 16): 256}
SINGLE_MAX = 1024  # up to this many keys one program per (row, kv head) reads them all: no combine launch
# (keys per tile, warps) of a split attention's programs by (head dim, padded query rows), else (BLOCK_N, 4
# or 8 by the rows' size). Empty until measured: benchmarks/attention_tiles.py times the candidates at
# long contexts (a program's registers bound how many an SM holds: benchmarks/kernel_registers.py)
SPLIT_TILE: dict[tuple[int, int], tuple[int, int]] = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# partials merged a load by the combine kernel, by head dim: S_BLK x D fp32 values a program holds
COMBINE_BLOCK: dict[int, int] = {64: 64, 128: 32}
MIN_CHUNK = 256  # the smallest key chunk of a split (below it the combine costs more than it spreads)
# Programmatic dependent launch: each kernel lets the next one start while its last programs run, and the
# next one loads what no kernel writes (its weight tile) before it waits for the previous kernel's
# results (griddepcontrol.wait: all of that kernel done and visible). On a launch-bound forward the next
# kernel's start and first loads overlap the previous one's tail instead of following it. Hopper and
# later only; environment DRAFTRELAY_PDL=off (or PDL = False before a capture) launches them plainly.
PDL = env_choice("DRAFTRELAY_PDL", "on", ("on", "off")) == "on"
# The attention's first key tile is prefetched into L2 (prefetch.global.L2, a hint) right after the PDL
# wait, so that its HBM read overlaps loading and rotating q instead of following it (the tile's own loads
# come after the rotation and the new key's store). DRAFTRELAY_ATTN_PREFETCH=off leaves it out.
ATTN_PREFETCH = env_choice("DRAFTRELAY_ATTN_PREFETCH", "on", ("on", "off")) == "on"
# A skinny gate|up product stores silu(gate) * up itself (norm_mlp: its tile holds matching gate and up
# columns), so the down product reads the activations instead of computing them (a multiply-and-sum or
# compact-rows tile: again in every column block) or waiting for silu_mul's launch (a looped tile).
# DRAFTRELAY_SILU_EPILOGUE=off keeps act_linear's way.
SILU_EPILOGUE = env_choice("DRAFTRELAY_SILU_EPILOGUE", "on", ("on", "off")) == "on"


@functools.lru_cache(maxsize=8)
def _pdl_capable(device: torch.device) -> bool:
    return (device.type == "cuda" and not _INTERPRETED and gdc_wait is not None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _pdl(device: torch.device) -> bool:
    return PDL and _pdl_capable(device)


def _launch_kw(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _pdl_entry(PDL: tl.constexpr):
    """The entry of a kernel whose every input may be the previous kernel's output: let the next kernel
    launch now (its programs start loading what no kernel writes, such as weights, while this one runs),
    then wait until the previous kernel is done and its writes are visible, before any load."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _embedding_kernel(tok_ptr, w_ptr, o_ptr, V, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _pdl_entry(PDL)  # the token is the previous kernel's output (a drafting loop's pick): read only after the wait
    t = tl.load(tok_ptr + r).to(tl.int64)
    ok = (t >= 0) & (t < V)
    m = d < D
    row = tl.load(w_ptr + tl.where(ok, t, 0) * D + d, mask=m, other=0.0)  # (an id outside: row 0 read, not kept)
    tl.store(o_ptr + r * D + d, tl.where(ok, row, tl.zeros_like(row)), mask=m)


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.embedding as a kernel of the PDL chain: F.embedding's gather is a torch launch, which
    neither lets the first layer's product start early nor starts early itself, once a forward (in a
    drafting loop, between the previous forward's pick and this forward's first product)."""
    if P.MODE == "off":
        return R.embedding(tokens, weight)
    flat = tokens.reshape(-1)
    V, D = weight.shape
    out = torch.empty(*tokens.shape, D, device=weight.device, dtype=weight.dtype)
    if flat.numel() == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(D))
    pdl = _pdl(weight.device)
    _embedding_kernel[(flat.numel(), triton.cdiv(D, BLOCK))](flat, weight.contiguous(), out, V, D, BLOCK=BLOCK,
                                                             PDL=pdl, num_warps=4, **_launch_kw(pdl))
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, N, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    _pdl_entry(PDL)
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * N + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + row * N + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(h_ptr + row * N + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()  # rows are indexed as row * N (no-ops for the forward's own tensors)
    delta = None if delta is None else delta.contiguous()
    N = x.shape[-1]
    rows = x.numel() // N
    h = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    pdl = _pdl(x.device)
    _add_rms_norm_kernel[(rows,)](x, d, weight, xo, h, N, eps, HAS_DELTA=delta is not None,
                                  BLOCK=triton.next_power_of_2(N), PDL=pdl, num_warps=4 if N <= 2048 else 8,
                                  **_launch_kw(pdl))
    return xo, h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    _pdl_entry(PDL)
    g = tl.load(gu_ptr + row * 2 * n + offs, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * 2 * n + n + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * n + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    gu = gu.contiguous()
    n = gu.shape[-1] // 2
    rows = gu.numel() // (2 * n)
    out = torch.empty(*gu.shape[:-1], n, device=gu.device, dtype=gu.dtype)
    BLOCK = 1024
    pdl = _pdl(gu.device)
    _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](gu, out, n, BLOCK=BLOCK, PDL=pdl, num_warps=4, **_launch_kw(pdl))
    return out


@triton.jit
def _rope_kv_kernel(qkv_ptr, start_ptr, rows_ptr, inv_ptr, q_ptr, ck_ptr, cv_ptr,
                    T, HQ, HK, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, HALF: tl.constexpr,
                    PDL: tl.constexpr):
    bt = tl.program_id(0)
    h = tl.program_id(1)
    _pdl_entry(PDL)
    b = bt // T
    t = bt % T
    pos = (tl.load(start_ptr + b) + t).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    offs = tl.arange(0, HALF)
    src = qkv_ptr + bt.to(tl.int64) * ((HQ + 2 * HK) * 2 * HALF) + h * (2 * HALF)
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if h < HQ + HK:
        ang = pos.to(tl.float32) * tl.load(inv_ptr + offs)
        c = tl.cos(ang)
        s = tl.sin(ang)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        if h < HQ:
            dst = q_ptr + (bt.to(tl.int64) * HQ + h) * (2 * HALF)
        else:
            dst = ck_ptr + row * s_crow + (h - HQ) * s_chead + pos * s_cpos
    else:
        o1 = x1
        o2 = x2
        dst = cv_ptr + row * s_vrow + (h - HQ - HK) * s_vhead + pos * s_vpos
    tl.store(dst + offs, o1.to(dst.dtype.element_ty))
    tl.store(dst + HALF + offs, o2.to(dst.dtype.element_ty))


def rope_kv_write(qkv: torch.Tensor, start: torch.Tensor, inv_freq: torch.Tensor, n_heads: int, n_kv: int,
                  ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    B, T, _ = qkv.shape
    D = ck.shape[-1]
    if ck.stride(-1) != 1 or cv.stride(-1) != 1 or not qkv.is_contiguous():
        raise ValueError("rope_kv_write: qkv must be contiguous and the cache's last dim dense")
    if ck.dtype != qkv.dtype or cv.dtype != qkv.dtype:
        raise ValueError(f"rope_kv_write: cache dtype {ck.dtype} != activations {qkv.dtype}")
    q = torch.empty(B, T, n_heads, D, device=qkv.device, dtype=qkv.dtype)
    pdl = _pdl(qkv.device)
    _rope_kv_kernel[(B * T, n_heads + 2 * n_kv)](
        qkv, start, rows, inv_freq, q, ck, cv, T, n_heads, n_kv,
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        HALF=D // 2, PDL=pdl, num_warps=1, **_launch_kw(pdl))
    return q


@triton.jit
def _attn_tile(q, kb, vb, s_cpos, s_vpos, n0, hi, qpos, d, m_i, l_i, acc, scale,
               BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """One tile of BLOCK keys from n0 (those < hi) into the running max m_i, sum l_i and acc. K and V
    are loaded together (two loads in flight, not one after the scores)."""
    n = n0 + tl.arange(0, BLOCK)
    nm = n < hi
    k = tl.load(kb + n.to(tl.int64)[:, None] * s_cpos + d[None, :], mask=nm[:, None], other=0.0)
    v = tl.load(vb + n.to(tl.int64)[:, None] * s_vpos + d[None, :], mask=nm[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where((n[None, :] <= qpos[:, None]) & nm[None, :], s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing visible yet: no NaN
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _rotate(x_ptr, src, d, c, sn, HALF: tl.constexpr):
    """Head vectors at src[:, None] + d rotated by angles with cosines c and sines sn [D] (HF's
    rotate-half, the same expressions as _rope_kv_kernel: x1 c - x2 s | x2 c + x1 s), fp32."""
    x = tl.load(x_ptr + src[:, None] + d[None, :]).to(tl.float32)
    xp = tl.load(x_ptr + src[:, None] + ((d + HALF) % (2 * HALF))[None, :]).to(tl.float32)
    return tl.where((d < HALF)[None, :], x * c[None, :] - xp * sn[None, :], x * c[None, :] + xp * sn[None, :])


@triton.jit
def _rope_new_kv(q_ptr, inv_ptr, o_ptr, kb, vb, b, g, h, rvalid, d, start, H, n_kv, s_cpos, s_vpos,
                 D: tl.constexpr):
    """One token per row (q_ptr: the q|k|v product [B, 1, (H + 2 n_kv) * D]): the row's query rows of kv
    head g rotated to its position start ([R_PAD, D] in o_ptr's dtype, rows beyond rvalid zero), and its
    new key (rotated) and value ([D]), both stored into the cache row (kb, vb) at position start. The
    attention kernels' fused RoPE (_attn_kernel and the forked rows' kernel): rope_kv_write's values."""
    ang = start.to(tl.float32) * tl.load(inv_ptr + d % (D // 2))  # the row's one position, per dim
    c = tl.cos(ang)
    sn = tl.sin(ang)
    base = b.to(tl.int64) * ((H + 2 * n_kv) * D)
    q = _rotate(q_ptr, base + tl.where(rvalid, h, 0) * D, d, c, sn, D // 2)
    q = tl.where(rvalid[:, None], q, 0.0).to(o_ptr.dtype.element_ty)
    ksrc = base + (H + g) * D + tl.zeros([1], tl.int64)
    knew = tl.reshape(_rotate(q_ptr, ksrc, d, c, sn, D // 2), [D]).to(kb.dtype.element_ty)
    vnew = tl.load(q_ptr + ksrc + n_kv * D + d)
    tl.store(kb + start.to(tl.int64) * s_cpos + d, knew)
    tl.store(vb + start.to(tl.int64) * s_vpos + d, vnew)
    return q, knew, vnew


@triton.jit
def _attn_new_key(q, knew, vnew, m_i, l_i, acc, scale):
    """The online softmax over one more key held in registers (the new token's, after the cache's
    earlier keys): its score, then the step of a tile of one key."""
    s_new = tl.sum(q.to(tl.float32) * knew.to(tl.float32)[None, :], axis=1) * scale
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.exp(m_i - m_new)
    p_new = tl.exp(s_new - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new.to(vnew.dtype).to(tl.float32)[:, None] * vnew.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _prefetch_l2(ptrs, mask):
    """An L2 prefetch of the 128-byte line at each pointer where mask holds (a hint: nothing waits on it)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _attn_kernel(q_ptr, ck_ptr, cv_ptr, rows_ptr, start_ptr, o_ptr, acc_ptr, ml_ptr, inv_ptr,
                 T, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, chunk, n_split, scale,
                 REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 SINGLE: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr, ROPE: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr = False):
    """ROPE (one token per row, one chunk): q_ptr is the q|k|v product [B, 1, (H + 2 n_kv) * D]; the
    program rotates its kv head's q rows and the new key, stores the new key and value into the cache
    rows, attends over the cache's earlier keys and takes the new key from its registers (rope_kv_write
    and decode_attention in one launch; the same values)."""
    bg, sp, n_kv, b, g, start, row, lo, hi, r, rvalid, h, d, qo, qpos = _attn_program(
        rows_ptr, start_ptr, T, H, chunk, REP, R_PAD, D, PDL)
    kb = ck_ptr + row * s_crow + g * s_chead
    vb = cv_ptr + row * s_vrow + g * s_vhead
    if PREFETCH:  # the first tile's keys and values towards L2 now, while q (and the new key) load and rotate
        pn = lo + tl.arange(0, BLOCK)
        pm = pn < (tl.minimum(hi, start) if ROPE else hi)
        pl = tl.arange(0, (D + 63) // 64) * 64  # one pointer per 64 elements (a 128-byte line in bf16)
        _prefetch_l2(kb + pn.to(tl.int64)[:, None] * s_cpos + pl[None, :], pm[:, None])
        _prefetch_l2(vb + pn.to(tl.int64)[:, None] * s_vpos + pl[None, :], pm[:, None])
    if ROPE:
        q, knew, vnew = _rope_new_kv(q_ptr, inv_ptr, o_ptr, kb, vb, b, g, h, rvalid, d, start, H, n_kv,
                                     s_cpos, s_vpos, D)
        hi = tl.minimum(hi, start)  # the cache's earlier keys; the new one is added from registers below
    else:
        q = tl.load(q_ptr + qo[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
    m_i = tl.full([R_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D], tl.float32)
    if FIXED_TRIPS:  # Triton's interpreter (CPU development) takes no run-time loop bound: every tile
        for it in range(0, FIXED_TRIPS):  # of the chunk (FIXED_TRIPS = chunk // BLOCK), masked: the same
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    else:
        n_iter = (tl.maximum(hi - lo, 0) + BLOCK - 1) // BLOCK  # only the tiles the row has
        for it in range(0, n_iter):
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    if ROPE:
        m_i, l_i, acc = _attn_new_key(q, knew, vnew, m_i, l_i, acc, scale)
    _attn_store(o_ptr, acc_ptr, ml_ptr, acc, m_i, l_i, bg, sp, n_split, qo, r, rvalid, d, R_PAD, D, SINGLE)


@triton.jit
def _attn_program(rows_ptr, start_ptr, T, H, chunk, REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                  PDL: tl.constexpr):
    """Where an attention program works (the plain and the forked rows' kernels alike): its (row, kv head)
    bg = b * n_kv + g and key chunk sp, the row's cache row and start, the chunk's key range [lo, hi), and
    its query rows r (head g * REP + r // T, token r % T; rvalid: r < REP * T), their offsets qo into q and
    positions qpos. With PDL the next kernel may start its prologue now, and nothing is read before the
    producer is done."""
    bg = tl.program_id(0)
    sp = tl.program_id(1)
    _pdl_entry(PDL)
    n_kv = H // REP
    b = bg // n_kv
    g = bg % n_kv
    start = tl.load(start_ptr + b).to(tl.int32)
    row = tl.load(rows_ptr + b).to(tl.int64)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, start + T)  # no row has keys beyond start + T: they are never read
    r = tl.arange(0, R_PAD)
    rvalid = r < REP * T
    t = r % T
    h = g * REP + r // T
    d = tl.arange(0, D)
    qo = ((b * T + t).to(tl.int64) * H + h) * D
    qpos = start + t
    return bg, sp, n_kv, b, g, start, row, lo, hi, r, rvalid, h, d, qo, qpos


@triton.jit
def _attn_store(o_ptr, acc_ptr, ml_ptr, acc, m_i, l_i, bg, sp, n_split, qo, r, rvalid, d, R_PAD: tl.constexpr,
                D: tl.constexpr, SINGLE: tl.constexpr):
    """An attention program's result: the output rows where its chunk is the row's only one (SINGLE), else
    its partial (acc, running max m_i, sum l_i) for the combine kernel."""
    if SINGLE:
        o = acc / l_i[:, None]
        tl.store(o_ptr + qo[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
    else:
        part = (bg * n_split + sp).to(tl.int64)
        tl.store(acc_ptr + (part * R_PAD + r)[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + part * 2 * R_PAD + r, m_i)
        tl.store(ml_ptr + part * 2 * R_PAD + R_PAD + r, l_i)


@triton.jit
def _attn_combine_kernel(o_ptr, acc_ptr, ml_ptr, T, H, n_split,
                         REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, S_BLK: tl.constexpr,
                         PDL: tl.constexpr, FIXED_SPLIT: tl.constexpr = 0):
    """One program per (row, kv head) and query row merges that query row's partials of every key chunk,
    S_BLK chunks a load: a program per (row, kv head) merging its ~65-130 partials one after another
    spent ~40 us of dependent loads at 32K keys (more than the split attention itself), here it is
    cdiv(n_split, S_BLK) rounds over more programs. The running max and sum are rescaled once a block."""
    # n_split is a run-time loop bound, not a constexpr: the split count follows the context length (a
    # chunk per MIN_CHUNK keys up to the card's programs), so as a constexpr an eager decode compiled a new
    # combine kernel every MIN_CHUNK tokens of context, inside whatever step or round crossed the boundary.
    # FIXED_SPLIT: the same count as a constexpr, for Triton's interpreter (no run-time loop bounds there)
    bg = tl.program_id(0)
    r = tl.program_id(1)  # < REP * T: the grid has only the valid query rows
    _pdl_entry(PDL)
    n_kv = H // REP
    b = bg // n_kv
    g = bg % n_kv
    d = tl.arange(0, D)
    s = tl.arange(0, S_BLK)
    M = tl.full([1], NEG_INF, tl.float32)
    L = tl.zeros([1], tl.float32)
    A = tl.zeros([D], tl.float32)
    n = FIXED_SPLIT if FIXED_SPLIT else n_split
    for s0 in range(0, n, S_BLK):
        ok = s0 + s < n
        part = (bg * n + s0 + s).to(tl.int64)
        m_s = tl.load(ml_ptr + part * 2 * R_PAD + r, mask=ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + part * 2 * R_PAD + R_PAD + r, mask=ok, other=0.0)
        a_s = tl.load(acc_ptr + (part * R_PAD + r)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        M_new = tl.maximum(M, tl.max(m_s, axis=0))
        safe = tl.where(M_new == NEG_INF, 0.0, M_new)  # every chunk so far empty: weights 0, not NaN
        wa = tl.exp(M - safe)
        ws = tl.exp(m_s - safe)
        L = L * wa + tl.sum(l_s * ws, axis=0)
        A = A * wa + tl.sum(a_s * ws[:, None], axis=0)
        M = M_new
    t = r % T
    h = g * REP + r // T
    qo = ((b * T + t).to(tl.int64) * H + h) * D
    tl.store(o_ptr + qo + d, (A / L).to(o_ptr.dtype.element_ty))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32 on the tensor cores (IEEE: fp32 operands at full precision, as the interpreter tests run)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _dot_acc(acc, xv, w, IEEE: tl.constexpr):
    """acc [M_PAD, BLOCK_N] += xv [M_PAD, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T in fp32 (tensor cores). An int8
    tile (W_SCALE) is converted to the rows' dtype first: exact, |q| <= 127 fits bf16's 8 significant bits;
    the same dtype is no conversion at all."""
    return acc + _dot(xv, tl.trans(w.to(xv.dtype)), IEEE)


@triton.jit
def _silu_up(x_ptr, off, msk, K):
    """silu(gate) * up at gate offsets `off` of a gate | up row block (up K further), rounded as silu_mul."""
    g = tl.load(x_ptr + off, mask=msk, other=0.0)
    u = tl.load(x_ptr + off + K, mask=msk, other=0.0)
    gf = g.to(tl.float32)
    sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _normed(xv, nw, K, eps):
    """add_rms_norm's output of whole rows xv [R, BLOCK_K] (zeros past K), nw [BLOCK_K]."""
    xf = xv.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / K + eps)
    normed = (xf * rstd[:, None]).to(xv.dtype)
    return (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(xv.dtype)


@triton.jit
def _sum_rows(acc, w, x_ptr, d_ptr, xo_ptr, nw, m, M, k0, k_hi, K, eps, store,
              M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr, HAS_DELTA: tl.constexpr):
    """The multiply-and-sum tile: for each of the M_ROWS rows (static; those >= M masked) the row's
    slice k0 .. k0 + BLOCK_K (up to k_hi; PRO 1: the whole row, normed, x + delta stored when store;
    PRO 2: SiLU * up) times the loaded weight tile w [BLOCK_N, BLOCK_K], summed along K in fp32, into
    row i of acc [M_PAD, BLOCK_N]. The weight tile is read once for all rows."""
    kk = k0 + tl.arange(0, BLOCK_K)
    km = kk < k_hi
    wf = w.to(tl.float32)
    for i in tl.static_range(M_ROWS):
        msk = km & (kk * 0 + i < M)  # a tensor compare: i is static and M may be too (a 1 is specialised)
        if PRO == 2:
            xv = _silu_up(x_ptr, i * (2 * K) + kk, msk, K)
        else:
            xv = tl.load(x_ptr + i * K + kk, mask=msk, other=0.0)
        if PRO == 1:
            if HAS_DELTA:
                dv = tl.load(d_ptr + i * K + kk, mask=msk, other=0.0)
                xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
                if store:
                    tl.store(xo_ptr + i * K + kk, xv, mask=msk)
            xf = xv.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
            xv = ((xf * rstd).to(xv.dtype).to(tl.float32) * nw.to(tl.float32)).to(xv.dtype)
        r = tl.sum(wf * xv.to(tl.float32)[None, :], axis=1)
        acc += tl.where(m[:, None] == i, r[None, :], 0.0)
    return acc


@triton.jit
def _skinny_w(w_ptr, wrow, nm, k0, k_hi, BLOCK_K: tl.constexpr):
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + wrow + kk[None, :], mask=nm[:, None] & (kk < k_hi)[None, :], other=0.0)


@triton.jit
def _skinny_x(acc, w, x_ptr, m, mm, M, k0, k_hi, K, M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
              PRO: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr = False):
    """The rows' slice k0 .. k0 + BLOCK_K (SiLU * up computed for PRO 2) times the loaded weight tile.
    SWAP (a looped dot, no prologue): acc is [BLOCK_N, M_PAD], the weight tile the dot's first operand
    and the rows loaded transposed as its second, so that the tensor cores' 64-row side is the weight's
    (the rows padded to 16 are the narrow side) and Hopper can take the warp-group dot from shared memory."""
    if SWAP:
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + m.to(tl.int64)[None, :] * K + kk[:, None], mask=(kk < k_hi)[:, None] & mm[None, :],
                     other=0.0)
        acc += _dot(w.to(xt.dtype), xt, IEEE)  # an int8 tile converted as in _dot_acc
    elif DOT:
        kk = k0 + tl.arange(0, BLOCK_K)
        msk = mm[:, None] & (kk < k_hi)[None, :]
        if PRO == 2:
            xv = _silu_up(x_ptr, m.to(tl.int64)[:, None] * (2 * K) + kk[None, :], msk, K)
        else:
            xv = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + kk[None, :], mask=msk, other=0.0)
        acc = _dot_acc(acc, xv, w, IEEE)
    else:  # the multiply-and-sum rows make their own slice offsets
        acc = _sum_rows(acc, w, x_ptr, x_ptr, x_ptr, w, m, M, k0, k_hi, K, 0.0, False, M_ROWS, BLOCK_K, PRO, False)
    return acc


@triton.jit
def _skinny_step(acc, x_ptr, w_ptr, wrow, m, mm, nm, M, k0, k_hi, K, M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRO: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr = False):
    """One BLOCK_K slice of K (up to k_hi): the weight tile, the rows' slice, the product."""
    w = _skinny_w(w_ptr, wrow, nm, k0, k_hi, BLOCK_K)
    return _skinny_x(acc, w, x_ptr, m, mm, M, k0, k_hi, K, M_ROWS, BLOCK_K, PRO, DOT, IEEE, SWAP)


@triton.jit
def _rows_rstd(x_ptr, d_ptr, r, rm, K, eps, M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, K_TRIPS: tl.constexpr,
               HAS_DELTA: tl.constexpr):
    """1 / RMS of the compact rows r (those < M: rm) of x + delta over all of K, in K_TRIPS tiles of
    BLOCK_K (x + delta rounded as add_rms_norm rounds). Loads only: every tile's loads in flight at once."""
    ss = tl.zeros([M_ROWS], tl.float32)
    for it in tl.static_range(K_TRIPS):
        kk = it * BLOCK_K + tl.arange(0, BLOCK_K)
        msk = rm[:, None] & (kk < K)[None, :]
        xa = r.to(tl.int64)[:, None] * K + kk[None, :]
        xv = tl.load(x_ptr + xa, mask=msk, other=0.0)
        if HAS_DELTA:
            dv = tl.load(d_ptr + xa, mask=msk, other=0.0)
            xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
        xf = xv.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _rows_store_sum(x_ptr, d_ptr, xo_ptr, r, rm, K, BLOCK_K: tl.constexpr, K_TRIPS: tl.constexpr):
    """x + delta of the compact rows into xo (rounded as add_rms_norm rounds), in K_TRIPS tiles."""
    for it in tl.static_range(K_TRIPS):
        kk = it * BLOCK_K + tl.arange(0, BLOCK_K)
        msk = rm[:, None] & (kk < K)[None, :]
        xa = r.to(tl.int64)[:, None] * K + kk[None, :]
        xv = tl.load(x_ptr + xa, mask=msk, other=0.0)
        dv = tl.load(d_ptr + xa, mask=msk, other=0.0)
        tl.store(xo_ptr + xa, (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype), mask=msk)


@triton.jit
def _rows_load(x_ptr, d_ptr, nw_ptr, r, rm, k0, k_hi, K, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
               HAS_DELTA: tl.constexpr):
    """The compact rows' slice k0 .. k0 + BLOCK_K (up to k_hi) as loaded: (x or gate, delta or up, nw)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    km = kk < k_hi
    msk = rm[:, None] & km[None, :]
    if PRO == 2:  # gate | up as one load [M_ROWS, BLOCK_K, 2] (both in flight before any layout change)
        xa = (r.to(tl.int64)[:, None] * (2 * K) + kk[None, :])[:, :, None] + (tl.arange(0, 2) * K)[None, None, :]
        g, u = tl.split(tl.load(x_ptr + xa, mask=msk[:, :, None], other=0.0))
        return g, u, x_ptr
    xa = r.to(tl.int64)[:, None] * K + kk[None, :]
    xv = tl.load(x_ptr + xa, mask=msk, other=0.0)
    dv = xv
    nw = x_ptr
    if PRO == 1:
        if HAS_DELTA:
            dv = tl.load(d_ptr + xa, mask=msk, other=0.0)
        nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
    return xv, dv, nw


@triton.jit
def _rows_dot_step(acc, w, xv, dv, nw, rstd, M_PAD: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRO: tl.constexpr, HAS_DELTA: tl.constexpr, IEEE: tl.constexpr):
    """One BLOCK_K slice of the compact-rows dot tile from its loaded rows (_rows_load): the prologue
    (PRO 1: x + delta normed with the rows' rstd, times nw; PRO 2: SiLU(gate) * up) on the M_ROWS
    real rows only, rounded as add_rms_norm / silu_mul round, then the rows padded with zeros to M_PAD
    for the tensor-core dot with the weight tile w [BLOCK_N, BLOCK_K]."""
    if PRO == 2:
        gf = xv.to(tl.float32)
        sg = (gf / (1.0 + tl.exp(-gf))).to(xv.dtype)
        xv = (sg.to(tl.float32) * dv.to(tl.float32)).to(xv.dtype)
    if PRO == 1:
        if HAS_DELTA:
            xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
        xv = ((xv.to(tl.float32) * rstd[:, None]).to(xv.dtype).to(tl.float32)
              * nw.to(tl.float32)[None, :]).to(xv.dtype)
    if M_ROWS < M_PAD:  # the rows repeated to M_PAD, the copies zeroed: the dot's padded operand
        xv = tl.reshape(tl.broadcast_to(xv[None, :, :], [M_PAD // M_ROWS, M_ROWS, BLOCK_K]), [M_PAD, BLOCK_K])
        xv = tl.where((tl.arange(0, M_PAD) < M_ROWS)[:, None], xv, tl.zeros_like(xv))
    return _dot_acc(acc, xv, w, IEEE)


@triton.jit
def _skinny_kernel(x_ptr, d_ptr, nw_ptr, xo_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, s_ptr, M, N, K, KS, eps,
                   M_PAD: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRO: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr, K_UNROLL: tl.constexpr, SPLIT: tl.constexpr,
                   PDL: tl.constexpr, K_TRIPS: tl.constexpr = 0, SWAP: tl.constexpr = False,
                   SILU_OUT: tl.constexpr = False, W_SCALE: tl.constexpr = False):
    """y[M, N] = f(x)[M, K] @ W[N, K]^T (+ b). PRO 0: f(x) = x; 1: add_rms_norm's output (x + delta,
    normalised, times nw; K <= BLOCK_K, program 0 also writes x + delta); 2: silu(gate) * up of
    x = [M, 2K] (gate | up). DOT with K_UNROLL: the compact-rows dot tile (the prologue on the M_ROWS
    real rows, the norm's RMS over all of K in K_TRIPS tiles, then padded to M_PAD for the dot; any
    split). DOT: tensor-core dots over the rows padded to M_PAD >= 16 (SWAP, a looped dot with no
    prologue: the weight tile the dot's first operand, the accumulator [BLOCK_N, M_PAD]); else the
    multiply-and-sum tile over M_ROWS = M rows (a few). Each program reads its BLOCK_N weight rows
    once, over the K range program_id(1) * KS .. + KS (SPLIT ranges; SPLIT 1: all of K). With
    SPLIT > 1 each program stores its fp32 partial in ws, counts itself in cnt[column block]
    (acquire-release, GPU scope), and the one that brings the count to a multiple of SPLIT sums the
    SPLIT partials in range order and writes y: the same bits whichever finishes last, and the count
    is left a multiple of SPLIT for the next launch. PDL (programmatic dependent launch): the straight-line
    tiles (K_UNROLL: unrolled, compact-rows, or one tile) and the norm's whole-row tiles load their (first)
    weight tile before waiting for the previous kernel (no kernel writes weights), everything else after;
    the looped tiles wait first. SILU_OUT (W a gate | up weight, N = 2 n): each program's BLOCK_N weight
    rows are BLOCK_N / 2 gate rows and the up rows n further, and it writes silu(gate) * up [M, n] of its
    rounded outputs (_store_y): SwiGLU's activations without a launch of their own. W_SCALE: W is int8,
    converted where it is multiplied (to fp32 in the multiply-and-sum tile, to the rows' dtype before a
    dot: _dot_acc), and each output column is its sum times s[n] (the row's scale) before the bias and
    the one rounding (_store_y)."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    if SILU_OUT:  # the first half of the tile gate columns, the second the up columns of the same indices
        j = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        nm = pid * (BLOCK_N // 2) + j < N // 2
        n = pid * (BLOCK_N // 2) + j + (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * (N // 2)
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
    wrow = n.to(tl.int64)[:, None] * K
    m = tl.arange(0, M_PAD)
    mm = m < M
    if SWAP:  # the looped dot with the weight tile first: the accumulator transposed until the epilogue
        acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    if DOT and K_UNROLL:  # the compact-rows dot tile: the prologue on the M_ROWS rows, the range unrolled
        k_lo = tl.program_id(1) * KS
        k_hi = tl.minimum(k_lo + KS, K)
        r = tl.arange(0, M_ROWS)
        rm = r < M
        w0 = _skinny_w(w_ptr, wrow, nm, k_lo, k_hi, BLOCK_K)  # the first tile before the wait
        if PDL:
            gdc_wait()
        xv, dv, nw = _rows_load(x_ptr, d_ptr, nw_ptr, r, rm, k_lo, k_hi, K, BLOCK_K, PRO, HAS_DELTA)  # before
        rstd = tl.zeros([M_ROWS], tl.float32)  # the RMS pass's barriers, so that both loads are in flight
        if PRO == 1:  # every program takes the RMS over all of K (the rows are tiny)
            rstd = _rows_rstd(x_ptr, d_ptr, r, rm, K, eps, M_ROWS, BLOCK_K, K_TRIPS, HAS_DELTA)
        acc = _rows_dot_step(acc, w0, xv, dv, nw, rstd, M_PAD, M_ROWS, BLOCK_K, PRO, HAS_DELTA, IEEE)
        for it in tl.static_range(1, K_UNROLL):
            w = _skinny_w(w_ptr, wrow, nm, k_lo + it * BLOCK_K, k_hi, BLOCK_K)
            xv, dv, nw = _rows_load(x_ptr, d_ptr, nw_ptr, r, rm, k_lo + it * BLOCK_K, k_hi, K, BLOCK_K, PRO,
                                    HAS_DELTA)
            acc = _rows_dot_step(acc, w, xv, dv, nw, rstd, M_PAD, M_ROWS, BLOCK_K, PRO, HAS_DELTA, IEEE)
        if PRO == 1 and HAS_DELTA:
            if (pid == 0) & (tl.program_id(1) == 0):  # x + delta stored once, off the other programs' path
                _rows_store_sum(x_ptr, d_ptr, xo_ptr, r, rm, K, BLOCK_K, K_TRIPS)
    elif PRO == 1:
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        w = tl.load(w_ptr + wrow + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
        if PDL:
            gdc_wait()
        if DOT:
            msk = mm[:, None] & km[None, :]
            xa = m.to(tl.int64)[:, None] * K + kk[None, :]
            xv = tl.load(x_ptr + xa, mask=msk, other=0.0)
            if HAS_DELTA:
                dv = tl.load(d_ptr + xa, mask=msk, other=0.0)
                xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
                if pid == 0:
                    tl.store(xo_ptr + xa, xv, mask=msk)
            acc = _dot_acc(acc, _normed(xv, nw, K, eps), w, IEEE)
        else:
            acc = _sum_rows(acc, w, x_ptr, d_ptr, xo_ptr, nw, m, M, 0, K, K, eps, pid == 0, M_ROWS, BLOCK_K, PRO,
                            HAS_DELTA)
    else:
        k_lo = tl.program_id(1) * KS
        k_hi = tl.minimum(k_lo + KS, K)
        if K_UNROLL:  # the range's tiles as straight-line code: their loads are independent, issued ahead
            w0 = _skinny_w(w_ptr, wrow, nm, k_lo, k_hi, BLOCK_K)  # the first tile before the wait
            if PDL:
                gdc_wait()
            acc = _skinny_x(acc, w0, x_ptr, m, mm, M, k_lo, k_hi, K, M_ROWS, BLOCK_K, PRO, DOT, IEEE)
            for it in tl.static_range(1, K_UNROLL):
                acc = _skinny_step(acc, x_ptr, w_ptr, wrow, m, mm, nm, M, k_lo + it * BLOCK_K, k_hi, K, M_ROWS,
                                   BLOCK_K, PRO, DOT, IEEE)
        else:
            if PDL:
                gdc_wait()
            if FIXED_TRIPS:  # Triton's interpreter (CPU development) takes no run-time loop bound
                for it in range(0, FIXED_TRIPS):
                    acc = _skinny_step(acc, x_ptr, w_ptr, wrow, m, mm, nm, M, k_lo + it * BLOCK_K, k_hi, K, M_ROWS,
                                       BLOCK_K, PRO, DOT, IEEE, SWAP)
            else:
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    acc = _skinny_step(acc, x_ptr, w_ptr, wrow, m, mm, nm, M, k0, k_hi, K, M_ROWS, BLOCK_K, PRO,
                                       DOT, IEEE, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    out_mask = mm[:, None] & nm[None, :]
    if SPLIT > 1:
        wa = m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * M * N + wa, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the count (released with it)
        seen = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if seen % SPLIT == SPLIT - 1:  # the last of the column block: all partials are visible
            tot = tl.zeros([M_PAD, BLOCK_N], tl.float32)
            for sp in tl.static_range(SPLIT):
                tot += tl.load(ws_ptr + sp * M * N + wa, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_y(y_ptr, b_ptr, s_ptr, tot, pid, m, mm, n, nm, N, M_PAD, BLOCK_N, HAS_BIAS, SILU_OUT, W_SCALE)
    else:
        _store_y(y_ptr, b_ptr, s_ptr, acc, pid, m, mm, n, nm, N, M_PAD, BLOCK_N, HAS_BIAS, SILU_OUT, W_SCALE)


@triton.jit
def _store_y(y_ptr, b_ptr, s_ptr, acc, pid, m, mm, n, nm, N, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_BIAS: tl.constexpr, SILU_OUT: tl.constexpr, W_SCALE: tl.constexpr):
    """The product's tile acc [M_PAD, BLOCK_N] (fp32, columns n) plus the bias, rounded to y's dtype and
    stored; SILU_OUT: the tile's gate and up halves taken apart and silu(gate) * up stored into y [M, N / 2]
    at the program's BLOCK_N / 2 columns, rounded as silu_mul rounds its rounded input (the same bits as
    the product stored, then silu_mul). W_SCALE: each column first times its int8 row's scale s[n]."""
    if W_SCALE:
        acc = acc * tl.load(s_ptr + n, mask=nm, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    yv = acc.to(y_ptr.dtype.element_ty)
    if SILU_OUT:
        g, u = tl.split(tl.permute(tl.reshape(yv, [M_PAD, 2, BLOCK_N // 2]), (0, 2, 1)))
        gf = g.to(tl.float32)
        sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        c = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + m.to(tl.int64)[:, None] * (N // 2) + c[None, :],
                 (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mm[:, None] & (c < N // 2)[None, :])
    else:
        tl.store(y_ptr + m.to(tl.int64)[:, None] * N + n[None, :], yv, mask=mm[:, None] & nm[None, :])


# Split-K partials and counts, per (device, weight, rows, ranges): allocated (zeroed) outside any capture
# the first time a product runs eagerly (the forwards warm up before they capture), then baked into the
# graphs. One weight's split product must not run on two streams at once (a model's forwards run on one).
_SPLIT_BUFS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(w: torch.Tensor, M: int, n_split: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp32 partials [n_split * M * N], int32 counts [n_blocks]) for a split product of w with M rows;
    None while capturing if they do not exist yet (a capture cannot zero new memory before it runs)."""
    key = (w.device, w.data_ptr(), tuple(w.shape), M, n_split, n_blocks)
    bufs = _SPLIT_BUFS.get(key)
    if bufs is None:
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bufs = (torch.empty(n_split * M * w.shape[0], device=w.device, dtype=torch.float32),
                torch.zeros(n_blocks, device=w.device, dtype=torch.int32))
        _SPLIT_BUFS[key] = bufs
    return bufs


def drop_split_buffers(w: torch.Tensor) -> None:
    """Forget the split buffers of weight w (its memory is about to be freed or reused)."""
    for key in [k for k in _SPLIT_BUFS if k[1] == w.data_ptr() and k[0] == w.device]:
        del _SPLIT_BUFS[key]


class SplitUnavailable(RuntimeError):
    """A split product's buffers would have to be made inside a capture: the caller falls back."""


def skinny_linear(pro: int, cfg: P.SkinnyConfig, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  delta: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
                  eps: float = 0.0, silu_out: bool = False,
                  w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the skinny GEMM with configuration cfg -> (x + delta or x, the product [..., N]).
    pro: plan.PRO_NONE (x @ w^T + b), PRO_NORM (norm_linear's product), PRO_SILU (act_linear's; x holds
    gate | up, 2K wide). A looped dot configuration with a prologue runs silu_mul / add_rms_norm first and
    the plain product on its output (plan.kernel_pro): the prologue inside the pipelined K loop costs more
    than the launch (measured on the H200 and, swapped, on an H100). silu_out (w a gate | up weight, N
    even): the product's silu_mul [..., N / 2] instead, computed where the product is stored. The kernel's
    constexprs are plan.launch's. w_scale (fp32 [N]): w is int8 and its row n stands for w[n] * w_scale[n]
    (no SiLU prologue; the SiLU output takes the scaled columns: int8_linear / int8_norm_linear / norm_mlp's
    int8 copies). The forward calls it through `linear` / `norm_linear` / `act_linear` / `norm_mlp` and the
    int8 pair."""
    x = x.contiguous()
    if w_scale is not None and (w.dtype != torch.int8 or pro == P.PRO_SILU
                                or w_scale.shape != (w.shape[0],) or w_scale.dtype != torch.float32):
        raise ValueError(f"skinny_linear: a scaled weight is int8 with fp32 scales [{w.shape[0]}], without the "
                         f"SiLU prologue (got {w.dtype}, scales {tuple(w_scale.shape)} {w_scale.dtype}, "
                         f"{cfg.label()}, pro {P.PRO_NAMES[pro]})")
    rows_dot = P.rows_dot_tile(cfg)  # the prologue inside, on the real rows
    if P.kernel_pro(pro, cfg, w.shape[1]) != pro:  # the prologue as its own launch, then the plain tile
        if pro == P.PRO_NORM:
            xo, h = add_rms_norm(x, delta, norm_w, eps)
            return xo, skinny_linear(P.PRO_NONE, cfg, h, w, b, silu_out=silu_out, w_scale=w_scale)[1]
        return x, skinny_linear(P.PRO_NONE, cfg, silu_mul(x), w, b, silu_out=silu_out)[1]
    N, K = w.shape
    if silu_out and (N % 2 or not P.holds_silu_pairs(cfg)):
        raise ValueError(f"skinny_linear: silu_out takes a gate | up weight of an even row count (not {N}) and "
                         f"a tile of at least 2 columns ({cfg.label()})")
    M = x.numel() // (2 * K if pro == P.PRO_SILU else K)
    if not w.is_contiguous():
        raise ValueError("skinny_linear: the weight must be contiguous")
    if not cfg.dot and not 1 <= M <= P.SUM_MAX_ROWS:
        raise ValueError(f"skinny_linear: the multiply-and-sum tile takes 1 to {P.SUM_MAX_ROWS} rows, got {M}")
    if rows_dot and not 1 <= M <= P.MAX_ROWS:
        raise ValueError(f"skinny_linear: the compact-rows dot tile takes 1 to {P.MAX_ROWS} rows, got {M}")
    if pro == P.PRO_NORM and not rows_dot and (K > cfg.block_k or cfg.split > 1):
        raise ValueError(f"skinny_linear: the norm prologue needs K ({K}) <= block_k ({cfg.block_k}), no split")
    if cfg.swap and (not cfg.dot or rows_dot or pro != P.PRO_NONE):
        raise ValueError(f"skinny_linear: {cfg.label()} is swapped: a looped dot tile with no prologue inside")
    ks, n_split, constexprs = P.launch(pro, cfg, M, K, delta is not None, b is not None,
                                       silu_out=silu_out, w_scale=w_scale is not None)  # per row bucket
    n_blocks = triton.cdiv(N, cfg.block_n)  # silu_out: cdiv(N / 2, block_n / 2), the same for an even N
    ws = cnt = w
    if n_split > 1:
        bufs = split_buffers(w, M, n_split, n_blocks)
        if bufs is None:
            raise SplitUnavailable(f"split product {cfg.label()} of a new weight inside a capture")
        ws, cnt = bufs
    delta = None if delta is None else delta.contiguous()
    y = torch.empty(*x.shape[:-1], N // 2 if silu_out else N, device=x.device, dtype=x.dtype)
    xo = torch.empty_like(x) if delta is not None else x
    pdl = _pdl(x.device)
    _skinny_kernel[(n_blocks, n_split)](
        x, delta if delta is not None else x, norm_w if norm_w is not None else w, xo, w,
        b if b is not None else w, y, ws, cnt, w_scale if w_scale is not None else w, M, N, K, ks, eps,
        IEEE=x.dtype == torch.float32,
        FIXED_TRIPS=triton.cdiv(ks, cfg.block_k) if _INTERPRETED else 0, PDL=pdl, **constexprs,
        num_warps=cfg.warps, num_stages=cfg.stages, **_launch_kw(pdl))
    return xo, y


def _fallback(pro: int, x, w, b, delta, norm_w, eps, w_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product with cuBLAS (and the separate norm / SiLU kernel before it); an int8 weight (w_scale
    given): its definition, reference.int8_linear (a dequantized copy: what a candidate's output is checked
    against, never a choice; _measure times the bf16 product as an INT8 key's yardstick)."""
    if w_scale is not None:
        xo, h = add_rms_norm(x, delta, norm_w, eps) if pro == P.PRO_NORM else (x, x)
        return xo, R.int8_linear(h, w, w_scale, b)
    if pro == P.PRO_NORM:
        xo, h = add_rms_norm(x, delta, norm_w, eps)
        return xo, F.linear(h, w, b)
    if pro == P.PRO_SILU:
        return x, F.linear(silu_mul(x), w, b)
    return x, F.linear(x, w, b)


L2_BEAT_BYTES = 192 << 20  # the measurement cycles through this many bytes of weight copies (L2: 50-60 MB)
MEASURE_CALLS = 64  # launches per timed graph


def _product_inputs(key: P.Key, copies: int, seed: int) -> tuple:
    """Random inputs of key's product on its card: (copies weights [N, K], x, delta, norm weight, bias,
    the weights' row scales), None where the product has none; an INT8 key: int8 weights with fp32 scales,
    the rest bf16."""
    dev_index, pro, M, N, K, dtype_name, has_bias, has_delta = key
    dev = torch.device("cuda", dev_index)
    scaled = dtype_name == P.INT8
    dtype = torch.bfloat16 if scaled else getattr(torch, dtype_name)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * std).to(dtype)

    if scaled:
        ws = [torch.randint(-127, 128, (N, K), device=dev, generator=gen, dtype=torch.int8) for _ in range(copies)]
        scales = torch.rand(N, device=dev, generator=gen) * (K ** -0.5 / 64)
    else:
        ws, scales = [rnd(N, K, std=K ** -0.5) for _ in range(copies)], None
    x = rnd(M, 2 * K if pro == P.PRO_SILU else K)
    return (ws, x, rnd(M, K) if has_delta else None, rnd(K) if pro == P.PRO_NORM else None,
            rnd(N) if has_bias else None, scales)


def _output_error(got_x, got, ref_x, ref) -> float | None:
    """The relative error of a candidate's product against cuBLAS's, or None where it is out of bounds
    (not finite, beyond fp32's 1e-4 / bf16's 2e-2, or a residual sum that is not the same bits)."""
    err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    ok = math.isfinite(err) and err < (1e-4 if ref.dtype == torch.float32 else 2e-2) and torch.equal(got_x, ref_x)
    return err if ok else None


def _measure(key: P.Key, cands: list[P.SkinnyConfig]) -> dict:
    """Seconds per call of cuBLAS (None) and each candidate for `key`, timed in a CUDA graph over
    distinct weight copies; a candidate that fails to build or to match cuBLAS's output gets inf. An INT8
    key's None is the product it would replace (int8_linear's None: the caller's bf16 weight), the faster of
    cuBLAS and the bf16 key's tiles on bf16 weights of the same shape (plan.int8_yardstick), and its
    candidates must match the int8 definition (_fallback's)."""
    dev_index, pro, M, N, K, dtype_name, has_bias, has_delta = key
    dev = torch.device("cuda", dev_index)
    wbytes = N * K * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    copies = max(2, min(64, math.ceil(L2_BEAT_BYTES / wbytes)))
    ws, x, delta, nw, b, sc = _product_inputs(key, copies, 1234)
    eps = 1e-6
    ref_x, ref = _fallback(pro, x, ws[0], b, delta, nw, eps, sc)
    reps = max(1, math.ceil(MEASURE_CALLS / copies))
    yard = ws if sc is None else [w.to(x.dtype) for w in ws]  # bf16 copies: as many bytes as a bf16 key's
    # an INT8 key is also timed against the bf16 key's tiles on those copies (plan.int8_yardstick): ("bf16", cfg)
    bf_cands = [] if sc is None else [("bf16", c) for c in P.bucket_candidates(pro, M, N, K)]
    for c, weights in [*((c, ws) for c in cands), *((c, yard) for _, c in bf_cands)]:
        _, n_split = P.k_ranges(pro, K, c)  # a split configuration's buffers for every copy, made before any capture
        if n_split > 1:
            for w in weights:
                split_buffers(w, M, n_split, triton.cdiv(N, c.block_n))
    times: dict = {}
    for cfg in [None, *cands, *bf_cands]:
        bf = isinstance(cfg, tuple)  # a bf16 tile of the yardstick: not checked here (its own key checks it)
        weights = yard if cfg is None or bf else ws

        def call(w, cfg=cfg, bf=bf):
            if cfg is None:
                return _fallback(pro, x, w, b, delta, nw, eps)
            if bf:
                return skinny_linear(pro, cfg[1], x, w, b, delta, nw, eps)
            return skinny_linear(pro, cfg, x, w, b, delta, nw, eps, w_scale=sc)
        try:
            got_x, got = call(weights[0])
            torch.cuda.synchronize(dev)
            if (cfg is not None and not bf or sc is None) and _output_error(got_x, got, ref_x, ref) is None:
                err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
                raise ValueError(f"output differs from cuBLAS's (relative error {err:.2e})")
            g = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(g, capture_error_mode="thread_local"):  # capture.gc_paused: why
                for _ in range(reps):
                    for w in weights:
                        call(w)
            g.replay()
            best = math.inf
            for _ in range(3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1) / 1e3 / (reps * copies))
            times[cfg] = best
            del g
        except Exception as exc:  # a configuration this card or Triton cannot run: not a candidate
            log.warning("skinny GEMM %s %s for %s: %s", P.PRO_NAMES[pro], cfg, key, exc)
            times[cfg] = math.inf
    torch.cuda.synchronize(dev)
    for w in {id(w): w for w in [*ws, *yard]}.values():
        drop_split_buffers(w)
    if bf_cands:  # the bf16 product the int8 copy replaces: cuBLAS or the bf16 key's fastest tile
        times[None] = P.int8_yardstick(times[None], min(times.pop(c) for c in bf_cands))
    del ws, yard
    return times


def _check(key: P.Key, cfg: P.SkinnyConfig) -> bool:
    """Whether cfg computes key's product as cuBLAS does on this card (a seeded choice's check: one
    build and one call on fresh random inputs, the tolerance of _measure; no timing)."""
    pro, dev = key[1], torch.device("cuda", key[0])
    (w,), x, delta, nw, b, sc = _product_inputs(key, 1, 4321)
    try:
        ref_x, ref = _fallback(pro, x, w, b, delta, nw, 1e-6, sc)
        got_x, got = skinny_linear(pro, cfg, x, w, b, delta, nw, 1e-6, w_scale=sc)
        torch.cuda.synchronize(dev)
        return _output_error(got_x, got, ref_x, ref) is not None
    finally:
        drop_split_buffers(w)


def _plan_seed(dev_index: int) -> P.PlanSeed | None:
    """The shipped plan seed of CUDA device dev_index (plan.seed_path; None: none for this card)."""
    name = torch.cuda.get_device_name(dev_index)
    path = P.seed_path(name)
    return None if path is None else P.PlanSeed(path, name)


def _plan_cache(dev_index: int) -> P.PlanCache | None:
    """The plan cache of CUDA device dev_index (plan.cache_path; None where DRAFTRELAY_PLAN_CACHE=off)."""
    meta = {"device": torch.cuda.get_device_name(dev_index), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "kernels": _SOURCE_DIGEST, "pdl": _pdl(torch.device("cuda", dev_index))}
    path = P.cache_path(meta)
    return None if path is None else P.PlanCache(path, meta)


def _source_digest() -> str:
    """A digest of the kernels' and the plan's source: a cached choice is trusted only for the code
    that measured it (a changed kernel or candidate rule measures again)."""
    h = hashlib.sha256()
    for path in (__file__, P.__file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


_SOURCE_DIGEST = _source_digest()
PLANNER = P.Planner(_measure, _plan_cache, seed_for=_plan_seed, check=_check, whole_shape=True)


def _plan(pro: int, x: torch.Tensor, w: torch.Tensor, b, delta) -> P.SkinnyConfig | None:
    if P.MODE == "off" or x.device.type != "cuda" or w.dim() != 2 or not w.is_contiguous():
        return None
    N, K = w.shape
    M = x.numel() // (2 * K if pro == P.PRO_SILU else K)
    dtype = P.INT8 if w.dtype == torch.int8 else str(x.dtype).replace("torch.", "")
    planned = P.plan_key(x.device.index if x.device.index is not None else torch.cuda.current_device(), pro, M,
                         N, K, dtype, b is not None, delta is not None)
    if planned is None:
        return None  # prefill chunks and large batches: cuBLAS, nothing to measure
    key, cands = planned  # per row bucket, measured at its top
    if key not in PLANNER.table and torch.cuda.is_current_stream_capturing():
        return None  # no measuring inside a capture (the forward is warmed up first, so this is rare)
    try:
        return PLANNER.choose(key, cands)
    except Exception:  # the measurement itself failed (memory, a capture refused): cuBLAS for this shape
        log.exception("skinny GEMM plan for %s failed; cuBLAS", key)
        PLANNER.table[key] = None
        return None


def _run_planned(pro: int, cfg: P.SkinnyConfig | None, x, w, b) -> torch.Tensor:
    if cfg is not None:
        try:
            return skinny_linear(pro, cfg, x, w, b)[1]
        except SplitUnavailable:  # a weight first seen inside a capture: this capture keeps cuBLAS
            log.warning("split product of a weight first seen inside a capture: cuBLAS in this graph")
    return _fallback(pro, x, w, b, None, None, 0.0)[1]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return _run_planned(P.PRO_NONE, _plan(P.PRO_NONE, x, w, b, None), x, w, b)


def act_linear(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return _run_planned(P.PRO_SILU, _plan(P.PRO_SILU, gu, w, b, None), gu, w, b)


def use_norm_linear(rows: int, w: torch.Tensor) -> bool:
    """Decode and verify rows take norm_linear (which chooses, per shape, the fused kernel or
    add_rms_norm + cuBLAS); prefill chunks take add_rms_norm and cuBLAS directly."""
    return rows <= P.MAX_ROWS


def _norm_product(cfg: P.SkinnyConfig | None, x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor,
                  eps: float, w: torch.Tensor, b: torch.Tensor | None,
                  w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_linear's product with its planned configuration (None: cuBLAS after the norm's own kernel; a bf16
    weight only, an int8 one always has a planned tile here)."""
    if cfg is None:
        return _fallback(P.PRO_NORM, x, w, b, delta, norm_w, eps)
    return skinny_linear(P.PRO_NORM, cfg, x, w, b, delta, norm_w, eps, w_scale=w_scale)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_product(_plan(P.PRO_NORM, x, w, b, delta), x, delta, norm_w, eps, w, b)


def norm_mlp(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, wgu: torch.Tensor,
             wd: torch.Tensor, qgu: tuple[torch.Tensor, torch.Tensor] | None = None,
             qd: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP of decode and verify rows: where the gate|up product is a skinny tile of gate and up pairs (as
    planned) it stores SiLU * up itself and the down product reads that (SILU_EPILOGUE); else norm_linear's
    product then act_linear. qgu / qd: int8 copies (q, row scales) of wgu / wd (int8_layers.py), each read
    where the plan has an int8 tile for the rows, else its bf16 weight (int8_linear's None); act_linear's
    path (no tile of gate and up pairs) reads the bf16 down: no int8 tile takes the SiLU prologue."""
    cfg = None if qgu is None else _plan(P.PRO_NORM, x, qgu[0], None, delta)
    wg, sc = (wgu, None) if cfg is None else qgu
    if cfg is None:
        cfg = _plan(P.PRO_NORM, x, wgu, None, delta)
    if cfg is None or not SILU_EPILOGUE or not P.holds_silu_pairs(cfg):
        x, gu = _norm_product(cfg, x, delta, norm_w, eps, wg, None, sc)
        return x, act_linear(gu, wd)
    x, act = skinny_linear(P.PRO_NORM, cfg, x, wg, None, delta, norm_w, eps, silu_out=True, w_scale=sc)
    down = None if qd is None else int8_linear(act, *qd)
    return x, linear(act, wd) if down is None else down


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                b: torch.Tensor | None = None) -> torch.Tensor | None:
    """reference.int8_linear on the planned tile; None where the plan chose none for these rows (none beat
    the bf16 product, _measure's yardstick of an INT8 key, or the rows are past MAX_ROWS), or where a split
    tile's buffers would be made inside a capture: the caller runs its bf16 weight instead."""
    cfg = _plan(P.PRO_NONE, x, q, b, None)
    if cfg is None:
        return None
    try:
        return skinny_linear(P.PRO_NONE, cfg, x, q, b, w_scale=s)[1]
    except SplitUnavailable:  # an int8 copy first read inside a capture: this capture keeps the bf16 weight
        log.warning("split int8 product of a weight first seen inside a capture: its bf16 weight in this graph")
        return None


def int8_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, q: torch.Tensor,
                     s: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """reference.int8_norm_linear on the planned tile (the norm inside, or its own launch first where the tile
    is a looped dot: plan.kernel_pro); None as int8_linear."""
    cfg = _plan(P.PRO_NORM, x, q, b, delta)
    return None if cfg is None else skinny_linear(P.PRO_NORM, cfg, x, q, b, delta, norm_w, eps, w_scale=s)


PICK_CHUNK = 4096  # vocabulary entries per program of greedy_pick's first pass


@triton.jit
def _logit_chunk(l_ptr, V, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The first pass's (row b, chunk c) of a pick over the logits: its ids offs (in range: msk), its logits x
    in fp32, their max mx and sum of exp(x - mx) s (0 where the chunk is all -inf: exp(-inf - -inf) would be
    NaN). greedy_pick's and greedy_top's first passes both: their confidences merge the same sums."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    _pdl_entry(PDL)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    msk = offs < V
    x = tl.load(l_ptr + b * V + offs, mask=msk, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=0)
    s = tl.where(mx == float("-inf"), 0.0, tl.sum(tl.exp(x - mx), axis=0))
    return b, c, offs, msk, x, mx, s


@triton.jit
def _pick_part_kernel(l_ptr, pm_ptr, pi_ptr, ps_ptr, V, n_chunk, CHUNK: tl.constexpr, PDL: tl.constexpr):
    b, c, offs, msk, x, mx, s = _logit_chunk(l_ptr, V, CHUNK, PDL)
    idx = tl.min(tl.where(x == mx, offs, V), axis=0)  # the lowest id of the chunk's maximum
    tl.store(pm_ptr + b * n_chunk + c, mx)
    tl.store(pi_ptr + b * n_chunk + c, idx)
    tl.store(ps_ptr + b * n_chunk + c, s)


@triton.jit
def _pick_merge_kernel(pm_ptr, pi_ptr, ps_ptr, tok_ptr, conf_ptr, ids_ptr, V, n_chunk, NC: tl.constexpr,
                       IDS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    _pdl_entry(PDL)
    c = tl.arange(0, NC)
    cm = c < n_chunk
    m = tl.load(pm_ptr + b * n_chunk + c, mask=cm, other=float("-inf"))
    i = tl.load(pi_ptr + b * n_chunk + c, mask=cm, other=V)
    s = tl.load(ps_ptr + b * n_chunk + c, mask=cm, other=0.0)
    mx = tl.max(m, axis=0)
    idx = tl.min(tl.where(m == mx, i, V), axis=0)  # chunks in id order: the lowest id overall
    total = tl.sum(tl.where(cm, s * tl.exp(m - mx), 0.0), axis=0)
    if IDS:  # a draft vocabulary's column -> its token id, here instead of a gather launch after the pick
        idx = tl.load(ids_ptr + idx)
    tl.store(tok_ptr + b, idx.to(tl.int64))
    tl.store(conf_ptr + b, 1.0 / total)  # softmax at the argmax: exp(0) / sum exp(l - max)


def greedy_pick(logits: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.greedy_pick (ids included) in two launches."""
    if P.MODE == "off":
        return R.greedy_pick(logits, ids)
    logits = logits.contiguous()
    B, V = logits.shape
    nc = triton.cdiv(V, PICK_CHUNK)
    pm = torch.empty(B, nc, device=logits.device, dtype=torch.float32)
    pi = torch.empty(B, nc, device=logits.device, dtype=torch.int32)
    ps = torch.empty(B, nc, device=logits.device, dtype=torch.float32)
    pdl = _pdl(logits.device)
    _pick_part_kernel[(B, nc)](logits, pm, pi, ps, V, nc, CHUNK=PICK_CHUNK, PDL=pdl, num_warps=8, **_launch_kw(pdl))
    tok = torch.empty(B, device=logits.device, dtype=torch.int64)
    conf = torch.empty(B, device=logits.device, dtype=torch.float32)
    _pick_merge_kernel[(B,)](pm, pi, ps, tok, conf, pi if ids is None else ids, V, nc,
                             NC=max(16, triton.next_power_of_2(nc)), IDS=ids is not None, PDL=pdl,
                             num_warps=1, **_launch_kw(pdl))
    return tok, conf


TOP_CHUNK = PICK_CHUNK  # greedy_top's chunks are greedy_pick's: the same partial sums, the same confidence


@triton.jit
def _top_part_kernel(l_ptr, tv_ptr, ti_ptr, ps_ptr, V, n_chunk, M: tl.constexpr, CHUNK: tl.constexpr,
                     PDL: tl.constexpr):
    # one (row, chunk): its m largest (lowest id first among equals) and its sum exp(l - chunk max), the
    # latter exactly as _pick_part_kernel computes it (so the merged confidence is greedy_pick's)
    b, c, offs, msk, x, mx, s = _logit_chunk(l_ptr, V, CHUNK, PDL)
    tl.store(ps_ptr + b * n_chunk + c, s)
    alive = msk  # a taken entry leaves by id, not by value: an -inf logit is still a candidate
    out = (b * n_chunk + c) * M
    for j in tl.static_range(M):
        v = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        i = tl.min(tl.where(alive & (x == v), offs, V), axis=0)
        tl.store(tv_ptr + out + j, v)
        tl.store(ti_ptr + out + j, i)
        alive = alive & (offs != i)


@triton.jit
def _top_merge_kernel(tv_ptr, ti_ptr, ps_ptr, tok_ptr, conf_ptr, oi_ptr, op_ptr, ids_ptr, V, n_chunk,
                      M: tl.constexpr, NC: tl.constexpr, NM: tl.constexpr, IDS: tl.constexpr, PDL: tl.constexpr):
    # one row: the m largest of the chunks' candidates (lowest id first among equals: ids are unique, so
    # taking by id is exact), the confidence from the chunk sums as _pick_merge_kernel forms it
    b = tl.program_id(0).to(tl.int64)
    _pdl_entry(PDL)
    c = tl.arange(0, NC)
    cm = c < n_chunk
    n = tl.arange(0, NM)
    nm = n < n_chunk * M
    v = tl.load(tv_ptr + b * n_chunk * M + n, mask=nm, other=float("-inf"))
    i = tl.load(ti_ptr + b * n_chunk * M + n, mask=nm, other=V)
    alive = nm & (i < V)
    pm = tl.max(tl.where(alive, v, float("-inf")), axis=0)  # the row's max: its chunk's first candidate
    # each chunk's max is its first candidate (index c * M)
    cmax = tl.load(tv_ptr + b * n_chunk * M + c * M, mask=cm, other=float("-inf"))
    s = tl.load(ps_ptr + b * n_chunk + c, mask=cm, other=0.0)
    total = tl.sum(tl.where(cm, s * tl.exp(cmax - pm), 0.0), axis=0)
    conf = 1.0 / total
    tl.store(conf_ptr + b, conf)
    for j in tl.static_range(M):
        vj = tl.max(tl.where(alive, v, float("-inf")), axis=0)
        ij = tl.min(tl.where(alive & (v == vj), i, V), axis=0)
        tid = ij
        if IDS:  # a draft vocabulary's column -> its token id (ascending ids: the order is the same)
            tid = tl.load(ids_ptr + ij)
        if j == 0:
            tl.store(tok_ptr + b, tid.to(tl.int64))
        tl.store(oi_ptr + b * M + j, tid.to(tl.int64))
        tl.store(op_ptr + b * M + j, tl.exp(vj - pm) * conf)
        alive = alive & (i != ij)


def greedy_top(logits: torch.Tensor, m: int,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.greedy_top (ids included) in two launches: per (row, chunk of TOP_CHUNK) its m largest and
    sum of exponentials, then per row the m largest of those. torch.topk over a [32, 151936] bf16 tensor took
    ~120 us on an H200 (one radix select per row), this ~10 (benchmarks/branch_work.py)."""
    if P.MODE == "off":
        return R.greedy_top(logits, m, ids)
    logits = logits.contiguous()
    B, V = logits.shape
    if not 1 <= m <= V:
        raise ValueError(f"greedy_top: m={m} outside 1..{V} (the vocabulary)")
    dev = logits.device
    nc = triton.cdiv(V, TOP_CHUNK)
    tv = torch.empty(B, nc, m, device=dev, dtype=torch.float32)
    ti = torch.empty(B, nc, m, device=dev, dtype=torch.int32)
    ps = torch.empty(B, nc, device=dev, dtype=torch.float32)
    pdl = _pdl(dev)
    _top_part_kernel[(B, nc)](logits, tv, ti, ps, V, nc, M=m, CHUNK=TOP_CHUNK, PDL=pdl, num_warps=8,
                              **_launch_kw(pdl))
    tok = torch.empty(B, device=dev, dtype=torch.int64)
    conf = torch.empty(B, device=dev, dtype=torch.float32)
    top = torch.empty(B, m, device=dev, dtype=torch.int64)
    probs = torch.empty(B, m, device=dev, dtype=torch.float32)
    _top_merge_kernel[(B,)](tv, ti, ps, tok, conf, top, probs, ti if ids is None else ids, V, nc, M=m,
                            NC=max(16, triton.next_power_of_2(nc)), NM=max(16, triton.next_power_of_2(nc * m)),
                            IDS=ids is not None, PDL=pdl, num_warps=4, **_launch_kw(pdl))
    return tok, conf, top, probs


@functools.lru_cache(maxsize=8)
def _n_sm(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (development on a CPU): an H200's count
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(kv_len: int, n_programs: int, n_sm: int, block: int = BLOCK_N,
               split_block: int = BLOCK_N) -> tuple[int, int]:
    """(chunk, n_split) for a static kv_len: one chunk up to SINGLE_MAX keys (a multiple of `block`, the
    tile of that case); beyond, enough chunks (>= MIN_CHUNK keys each, a multiple of BLOCK_N and of
    `split_block`, the tile of the split programs) that all (row, kv head) programs together fill about
    two waves of SMs."""
    if kv_len <= SINGLE_MAX:
        return triton.cdiv(kv_len, block) * block, 1
    n_split = max(1, min(triton.cdiv(kv_len, MIN_CHUNK), triton.cdiv(2 * n_sm, n_programs)))
    unit = max(BLOCK_N, split_block)  # both powers of two: a multiple of either
    chunk = triton.cdiv(triton.cdiv(kv_len, n_split), unit) * unit
    return chunk, triton.cdiv(kv_len, chunk)


@dataclasses.dataclass
class AttnLaunch:
    """What the attention kernels' launches share (this module's _attn_kernel and the forked rows' kernel,
    draftrelay.worker.fork_triton): the shapes, the split of the keys over programs, the output and, where
    the keys are split, the partial results the combine kernel reads."""

    B: int
    T: int
    H: int
    n_kv: int
    D: int
    rep: int
    R_PAD: int
    chunk: int
    n_split: int
    block: int
    warps: int
    out: torch.Tensor
    acc: torch.Tensor
    ml: torch.Tensor

    @property
    def single(self) -> bool:
        return self.n_split == 1


def attn_warps(rows: int, D: int) -> int:
    """Warps of an attention program holding `rows` (padded) query rows of head dim D: 4, or 8 beyond 4,096
    fp32 accumulators."""
    return 4 if rows * D <= 64 * 64 else 8


def attn_launch(who: str, q: torch.Tensor, ck: torch.Tensor, kv_len: int, rope: tuple | None,
                with_partials: bool = True) -> AttnLaunch:
    """The launch of an attention over q [B, T, H, D] (with rope = (inv_freq, n_heads, n_kv): q is the q|k|v
    product [B, 1, (H + 2 n_kv) D]) and a cache of ck's head dim; ValueError (prefixed `who`) where a fused
    RoPE is asked of more than one token per row or one chunk of keys (attention_fuses_rope). with_partials
    False: a split launch's partials are left to the caller (acc and ml stand in as out), which sizes them
    for programs of its own (fork_attention's shared ones)."""
    if rope is None:
        B, T, H, D = q.shape
        n_kv = ck.shape[1]
    else:
        _, H, n_kv = rope
        B, T = q.shape[:2]
        D = ck.shape[-1]
    rep = H // n_kv
    R_PAD = max(16, triton.next_power_of_2(rep * T))
    sblock = SINGLE_BLOCK.get((D, R_PAD), BLOCK_N)
    tile, warps = SPLIT_TILE.get((D, R_PAD), (BLOCK_N, attn_warps(R_PAD, D)))
    chunk, n_split = split_plan(kv_len, B * n_kv, _n_sm(q.device), sblock, tile)
    if rope is not None and not (n_split == 1 and T == 1):
        raise ValueError(f"{who}: the fused RoPE takes one token per row and one chunk, not T={T} over "
                         f"{n_split} chunks (attention_fuses_rope)")
    out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    acc, ml = (out, out) if n_split == 1 or not with_partials else partials(B * n_kv * n_split, R_PAD, D, q.device)
    if n_split == 1:
        tile, warps = sblock, attn_warps(R_PAD, D)
    return AttnLaunch(B, T, H, n_kv, D, rep, R_PAD, chunk, n_split, tile, warps, out, acc, ml)


def partials(n_parts: int, R_PAD: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for n_parts partial results of a split attention (each R_PAD query rows): the fp32 accumulators
    [n_parts * R_PAD * D] and the running max and sum of each row [n_parts * 2 * R_PAD]."""
    return (torch.empty(n_parts * R_PAD * D, device=device, dtype=torch.float32),
            torch.empty(n_parts * 2 * R_PAD, device=device, dtype=torch.float32))


def attn_combine(a: AttnLaunch, pdl: bool) -> None:
    """The combine of a split attention's partial results into a.out (nothing where it is one chunk)."""
    if not a.single:
        _attn_combine_kernel[(a.B * a.n_kv, a.rep * a.T)](
            a.out, a.acc, a.ml, a.T, a.H, a.n_split, REP=a.rep, R_PAD=a.R_PAD, D=a.D,
            S_BLK=COMBINE_BLOCK.get(a.D, 32), PDL=pdl, FIXED_SPLIT=a.n_split if _INTERPRETED else 0,
            num_warps=4, **_launch_kw(pdl))


def _attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
               kv_len: int, rope: tuple | None) -> torch.Tensor:
    """decode_attention; with rope = (inv_freq, n_heads, n_kv) q is the q|k|v product and the kernel
    rotates and stores the new keys itself (one chunk only: the caller checks attention_fuses_rope)."""
    if ck.stride(-1) != 1 or cv.stride(-1) != 1 or not q.is_contiguous():
        raise ValueError("decode_attention: q must be contiguous and the cache's last dim dense")
    a = attn_launch("rope_attention", q, ck, kv_len, rope)
    pdl = _pdl(q.device)
    _attn_kernel[(a.B * a.n_kv, a.n_split)](
        q, ck, cv, rows, start, a.out, a.acc, a.ml, rope[0] if rope is not None else start, a.T, a.H,
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        a.chunk, a.n_split, a.D ** -0.5, REP=a.rep, R_PAD=a.R_PAD, D=a.D, BLOCK=a.block, SINGLE=a.single,
        IEEE=q.dtype == torch.float32, FIXED_TRIPS=a.chunk // a.block if _INTERPRETED else 0,
        ROPE=rope is not None, PDL=pdl, PREFETCH=ATTN_PREFETCH and not _INTERPRETED,
        num_warps=a.warps, num_stages=2, **_launch_kw(pdl))
    attn_combine(a, pdl)
    return a.out


def decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
                     start: torch.Tensor, kv_len: int) -> torch.Tensor:
    return _attention(q, ck, cv, rows, start, kv_len, None)


def attention_fuses_rope(kv_len: int, T: int) -> bool:
    """Whether rope_attention is one launch: one token per row (decode, the drafter's steps; a verify's
    rows would each need their own angles for every q row) and one chunk of keys (no split, combine)."""
    return T == 1 and kv_len <= SINGLE_MAX


def rope_attention(qkv: torch.Tensor, start: torch.Tensor, inv_freq: torch.Tensor, n_heads: int, n_kv: int,
                   ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor, kv_len: int) -> torch.Tensor:
    if not (attention_fuses_rope(kv_len, qkv.shape[1]) and _FUSED_ROPE_OK.get(qkv.device, True)):
        q = rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows)
        return decode_attention(q, ck, cv, rows, start, kv_len)
    if not qkv.is_contiguous():
        raise ValueError("rope_attention: qkv must be contiguous")
    if ck.dtype != qkv.dtype or cv.dtype != qkv.dtype:
        raise ValueError(f"rope_attention: cache dtype {ck.dtype} != activations {qkv.dtype}")
    out = guarded_launch(_FUSED_ROPE_OK, qkv.device, "fused RoPE + attention",
                         lambda: _attention(qkv, ck, cv, rows, start, kv_len, (inv_freq, n_heads, n_kv)))
    if out is not None:
        return out
    q = rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows)
    return decode_attention(q, ck, cv, rows, start, kv_len)


def guarded_launch(ok: dict, device: torch.device, what: str, launch):
    """launch() of a fused kernel that may not build on every card or Triton, or None where the caller
    runs its unfused kernels instead: the kernel failed to launch on this device before (ok[device] False),
    or its first launch (which compiles it) would be inside a CUDA graph capture, where a failure would
    break the capture (the capture helper's warm-up launches it first, outside). The first launch's
    outcome is recorded in ok[device]."""
    state = ok.get(device)
    if state:
        return launch()
    if state is False or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None
    try:
        out = launch()
    except Exception:
        log.exception("%s failed to launch; its unfused kernels instead", what)
        ok[device] = False
        return None
    ok[device] = True
    return out


_FUSED_ROPE_OK: dict[torch.device, bool] = {}  # per device, once the fused kernel has been launched
