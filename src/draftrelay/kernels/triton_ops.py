"""Triton kernels of the fast forward (CUDA): the same functions as `kernels.reference`, one launch
each instead of the plain forward's several per op.

  add_rms_norm      residual add + RMSNorm (+ weight), one pass over the row         (plain: 4 kernels)
  silu_mul          SiLU(gate) * up of the fused gate|up GEMM's output              (plain: 2)
  rope_kv_write     RoPE of q and k from positions (angles in-kernel), k and v stored (plain: ~12 with
                    into the cache rows at their positions, q written head-major      the step's tables)
  norm_linear       add_rms_norm fused into the GEMV that reads its output (q|k|v, gate|up) for
                    decode and verify rows, where the weight is small enough (GEMV_MAX_BYTES; off:
                    slower than cuBLAS here, see there)
  decode_attention  flash-decoding: each program streams one key chunk of one (row, kv head) once, for
                    all n_rep * T query rows of that kv head (GQA without repeating K/V), online
                    softmax in fp32; long contexts split over many programs whose partials one combine
                    kernel merges. Reads only the keys each row has (start + T), not the whole bucket.
                                                                                   (plain: ~10)
Shapes and dtypes are the reference's; inputs must be contiguous where the reference's docstring says
"one GEMM's output" (they are in the forward).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
BLOCK_N = 64  # keys per tile of the attention loop
SINGLE_MAX = 1024  # up to this many keys one program per (row, kv head) reads them all: no combine launch
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MIN_CHUNK = 256  # the smallest key chunk of a split (below it the combine costs more than it spreads)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, N, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
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
    _add_rms_norm_kernel[(rows,)](x, d, weight, xo, h, N, eps, HAS_DELTA=delta is not None,
                                  BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    return xo, h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
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
    _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](gu, out, n, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _rope_kv_kernel(qkv_ptr, start_ptr, rows_ptr, inv_ptr, q_ptr, ck_ptr, cv_ptr,
                    T, HQ, HK, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, HALF: tl.constexpr):
    bt = tl.program_id(0)
    h = tl.program_id(1)
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
    _rope_kv_kernel[(B * T, n_heads + 2 * n_kv)](
        qkv, start, rows, inv_freq, q, ck, cv, T, n_heads, n_kv,
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        HALF=D // 2, num_warps=1)
    return q


@triton.jit
def _attn_tile(q, kb, vb, s_cpos, s_vpos, n0, hi, qpos, d, m_i, l_i, acc, scale,
               BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """One tile of BLOCK keys from n0 (those < hi) into the running max m_i, sum l_i and acc."""
    n = n0 + tl.arange(0, BLOCK)
    nm = n < hi
    k = tl.load(kb + n.to(tl.int64)[:, None] * s_cpos + d[None, :], mask=nm[:, None], other=0.0)
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
    v = tl.load(vb + n.to(tl.int64)[:, None] * s_vpos + d[None, :], mask=nm[:, None], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn_kernel(q_ptr, ck_ptr, cv_ptr, rows_ptr, start_ptr, o_ptr, acc_ptr, ml_ptr,
                 T, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, chunk, n_split, scale,
                 REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 SINGLE: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr):
    bg = tl.program_id(0)
    sp = tl.program_id(1)
    n_kv = H // REP
    b = bg // n_kv
    g = bg % n_kv
    start = tl.load(start_ptr + b).to(tl.int32)
    row = tl.load(rows_ptr + b).to(tl.int64)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, start + T)  # no row has keys beyond start + T: they are never read
    r = tl.arange(0, R_PAD)  # query row r: head g * REP + r // T, token r % T
    rvalid = r < REP * T
    t = r % T
    h = g * REP + r // T
    d = tl.arange(0, D)
    qo = ((b * T + t).to(tl.int64) * H + h) * D
    q = tl.load(q_ptr + qo[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
    qpos = start + t
    m_i = tl.full([R_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D], tl.float32)
    kb = ck_ptr + row * s_crow + g * s_chead
    vb = cv_ptr + row * s_vrow + g * s_vhead
    if FIXED_TRIPS:  # Triton's interpreter (CPU development) takes no run-time loop bound: every tile
        for it in range(0, FIXED_TRIPS):  # of the chunk (FIXED_TRIPS = chunk // BLOCK), masked: the same
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    else:
        n_iter = (tl.maximum(hi - lo, 0) + BLOCK - 1) // BLOCK  # only the tiles the row has
        for it in range(0, n_iter):
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    if SINGLE:
        o = acc / l_i[:, None]
        tl.store(o_ptr + qo[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
    else:
        part = (bg * n_split + sp).to(tl.int64)
        tl.store(acc_ptr + (part * R_PAD + r)[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + part * 2 * R_PAD + r, m_i)
        tl.store(ml_ptr + part * 2 * R_PAD + R_PAD + r, l_i)


@triton.jit
def _attn_combine_kernel(o_ptr, acc_ptr, ml_ptr, T, H, n_split: tl.constexpr,
                         REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr):
    bg = tl.program_id(0)
    n_kv = H // REP
    b = bg // n_kv
    g = bg % n_kv
    r = tl.arange(0, R_PAD)
    d = tl.arange(0, D)
    M = tl.full([R_PAD], NEG_INF, tl.float32)
    L = tl.zeros([R_PAD], tl.float32)
    A = tl.zeros([R_PAD, D], tl.float32)
    for sp in range(0, n_split):
        part = (bg * n_split + sp).to(tl.int64)
        m_s = tl.load(ml_ptr + part * 2 * R_PAD + r)
        l_s = tl.load(ml_ptr + part * 2 * R_PAD + R_PAD + r)
        a_s = tl.load(acc_ptr + (part * R_PAD + r)[:, None] * D + d[None, :])
        M_new = tl.maximum(M, m_s)
        safe = tl.where(M_new == NEG_INF, 0.0, M_new)
        wa = tl.exp(M - safe)
        ws = tl.exp(m_s - safe)
        L = L * wa + l_s * ws
        A = A * wa[:, None] + a_s * ws[:, None]
        M = M_new
    rvalid = r < REP * T
    t = r % T
    h = g * REP + r // T
    qo = ((b * T + t).to(tl.int64) * H + h) * D
    tl.store(o_ptr + qo[:, None] + d[None, :], (A / L[:, None]).to(o_ptr.dtype.element_ty), mask=rvalid[:, None])


@triton.jit
def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, xo_ptr, w_ptr, b_ptr, out_ptr, M, N, eps,
                        K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """out[M, N] = rms_norm(x + delta) * nw @ W[N, K]^T (+ b); program 0 also writes x + delta. Every
    program recomputes the (tiny) normalised rows, then streams its BLOCK_N rows of W once."""
    pid = tl.program_id(0)
    m = tl.arange(0, M_PAD)
    mm = m < M
    rows = m.to(tl.int64)[:, None] * K
    ss = tl.zeros([M_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        msk = mm[:, None] & (kk < K)[None, :]
        xv = tl.load(x_ptr + rows + kk[None, :], mask=msk, other=0.0)
        if HAS_DELTA:
            dv = tl.load(d_ptr + rows + kk[None, :], mask=msk, other=0.0)
            xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
            if pid == 0:
                tl.store(xo_ptr + rows + kk[None, :], xv, mask=msk)
        xf = xv.to(tl.float32)
        ss += tl.sum(xf * xf, 1)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        msk = mm[:, None] & km[None, :]
        xv = tl.load(x_ptr + rows + kk[None, :], mask=msk, other=0.0)
        if HAS_DELTA:
            dv = tl.load(d_ptr + rows + kk[None, :], mask=msk, other=0.0)
            xv = (xv.to(tl.float32) + dv.to(xv.dtype).to(tl.float32)).to(xv.dtype)
        normed = (xv.to(tl.float32) * rstd[:, None]).to(xv.dtype)
        nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
        h = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(xv.dtype)
        wt = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h, tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(wt))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


# the fused norm + GEMV is used up to this many rows and this many weight bytes. 0: never, because on the
# H200 cuBLAS's GEMM (plus the separate add_rms_norm launch) was faster at every layer shape of the 0.5B
# and 7B models (benchmarks/fast_forward.py, "gemm_cublas": e.g. 0.5B down 7.5 us against 41.8 us, 7B
# gate_up 74.0 us against 98.5 us), and the forward with it was 0.7-0.8 ms slower per step
GEMV_MAX_ROWS = 16
GEMV_MAX_BYTES = 0


def use_norm_linear(rows: int, w: torch.Tensor) -> bool:
    return rows <= GEMV_MAX_ROWS and w.numel() * w.element_size() <= GEMV_MAX_BYTES


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    delta = None if delta is None else delta.contiguous()
    K = x.shape[-1]
    M = x.numel() // K
    N = w.shape[0]
    if not w.is_contiguous():
        raise ValueError("norm_linear: the weight must be contiguous")
    out = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    xo = torch.empty_like(x) if delta is not None else x
    BLOCK_N = 16 if N <= 16384 else 32
    _norm_linear_kernel[(triton.cdiv(N, BLOCK_N),)](
        x, delta if delta is not None else x, norm_w, xo, w, b if b is not None else w, out, M, N, eps,
        K=K, M_PAD=max(16, triton.next_power_of_2(M)), BLOCK_N=BLOCK_N, BLOCK_K=128,
        HAS_DELTA=delta is not None, HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=3)
    return xo, out


@functools.lru_cache(maxsize=8)
def _n_sm(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (development on a CPU): an H200's count
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(kv_len: int, n_programs: int, n_sm: int) -> tuple[int, int]:
    """(chunk, n_split) for a static kv_len: one chunk up to SINGLE_MAX keys; beyond, enough chunks
    (>= MIN_CHUNK keys each) that all (row, kv head) programs together fill about two waves of SMs."""
    if kv_len <= SINGLE_MAX:
        return triton.cdiv(kv_len, BLOCK_N) * BLOCK_N, 1
    n_split = max(1, min(triton.cdiv(kv_len, MIN_CHUNK), triton.cdiv(2 * n_sm, n_programs)))
    chunk = triton.cdiv(triton.cdiv(kv_len, n_split), BLOCK_N) * BLOCK_N
    return chunk, triton.cdiv(kv_len, chunk)


def decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
                     start: torch.Tensor, kv_len: int) -> torch.Tensor:
    B, T, H, D = q.shape
    n_kv = ck.shape[1]
    rep = H // n_kv
    R_PAD = max(16, triton.next_power_of_2(rep * T))
    if ck.stride(-1) != 1 or cv.stride(-1) != 1 or not q.is_contiguous():
        raise ValueError("decode_attention: q must be contiguous and the cache's last dim dense")
    chunk, n_split = split_plan(kv_len, B * n_kv, _n_sm(q.device))
    out = torch.empty_like(q)
    single = n_split == 1
    if single:
        acc = ml = out  # unused
    else:
        acc = torch.empty(B * n_kv * n_split * R_PAD * D, device=q.device, dtype=torch.float32)
        ml = torch.empty(B * n_kv * n_split * 2 * R_PAD, device=q.device, dtype=torch.float32)
    warps = 4 if R_PAD * D <= 64 * 64 else 8
    _attn_kernel[(B * n_kv, n_split)](
        q, ck, cv, rows, start, out, acc, ml, T, H,
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        chunk, n_split, D ** -0.5, REP=rep, R_PAD=R_PAD, D=D, BLOCK=BLOCK_N, SINGLE=single,
        IEEE=q.dtype == torch.float32, FIXED_TRIPS=chunk // BLOCK_N if _INTERPRETED else 0,
        num_warps=warps, num_stages=2)
    if not single:
        _attn_combine_kernel[(B * n_kv,)](out, acc, ml, T, H, n_split, REP=rep, R_PAD=R_PAD, D=D,
                                          num_warps=warps)
    return out
