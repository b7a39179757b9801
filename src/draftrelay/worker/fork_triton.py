"""The forked rows' attention on CUDA (draftrelay.worker.fork): the fast forward's flash-decoding kernel
(draftrelay.kernels.triton_ops: one program per (row, kv head, key chunk), all n_rep * T query rows of a
kv head at once, online softmax in fp32, long contexts split and combined) with its key loop in two
parts: the chunk's keys below the row's pivot from the parent row, the rest from the forked row itself.
The tiles, the split plan and the combine kernel are triton_ops' own, so a forked row costs what a
plain row of the same length costs. Imported only where Triton is (fork.fork_attention_triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftrelay.kernels import triton_ops as TO
from draftrelay.kernels.triton_ops import (
    _attn_new_key,
    _attn_program,
    _attn_store,
    _attn_tile,
    _prefetch_l2,
    _rope_new_kv,
)

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _fork_attn_kernel(q_ptr, ck_ptr, cv_ptr, rows_ptr, start_ptr, pk_ptr, pv_ptr, parent_ptr, pivot_ptr,
                      o_ptr, acc_ptr, ml_ptr, inv_ptr, T, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos,
                      s_prow, s_phead, s_ppos, s_qrow, s_qhead, s_qpos, chunk, n_split, scale,
                      REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      SINGLE: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr, ROPE: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH: tl.constexpr = False):
    """ROPE (one token per row, one chunk): q_ptr is the q|k|v product and the program rotates its kv
    head's query rows and the new key, stores the new key and value into the forked row at its position
    (start >= pivot: a forked row's own positions) and takes the new key from registers, as the fast
    forward's fused _attn_kernel does: rope_kv_write and fork_attention in one launch. PDL as there:
    the next kernel may start its prologue now; this one reads nothing before its producer is done."""
    bg, sp, n_kv, b, g, start, row, lo, hi, r, rvalid, h, d, qo, qpos = _attn_program(
        rows_ptr, start_ptr, T, H, chunk, REP, R_PAD, D, PDL)
    prow = tl.load(parent_ptr + b).to(tl.int64)
    pivot = tl.load(pivot_ptr + b).to(tl.int32)
    pkb = pk_ptr + prow * s_prow + g * s_phead
    pvb = pv_ptr + prow * s_qrow + g * s_qhead
    kb = ck_ptr + row * s_crow + g * s_chead
    vb = cv_ptr + row * s_vrow + g * s_vhead
    if PREFETCH:  # the parent's first tile of keys and values towards L2 now, while q and the new key rotate
        pn = lo + tl.arange(0, BLOCK)
        pm = pn < tl.minimum(tl.minimum(hi, start), pivot)
        pl = tl.arange(0, (D + 63) // 64) * 64  # one pointer per 64 elements (a 128-byte line in bf16)
        _prefetch_l2(pkb + pn.to(tl.int64)[:, None] * s_ppos + pl[None, :], pm[:, None])
        _prefetch_l2(pvb + pn.to(tl.int64)[:, None] * s_qpos + pl[None, :], pm[:, None])
    if ROPE:
        q, knew, vnew = _rope_new_kv(q_ptr, inv_ptr, o_ptr, kb, vb, b, g, h, rvalid, d, start, H, n_kv,
                                     s_cpos, s_vpos, D)
        hi = tl.minimum(hi, start)  # the earlier keys from the caches; the new one from registers below
    else:
        q = tl.load(q_ptr + qo[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
    mid = tl.maximum(tl.minimum(hi, pivot), lo)  # [lo, mid): the parent's keys; [mid, hi): the row's own
    m_i = tl.full([R_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D], tl.float32)
    if FIXED_TRIPS:  # Triton's interpreter takes no run-time loop bound: every tile of the chunk, masked
        for it in range(0, FIXED_TRIPS):
            m_i, l_i, acc = _attn_tile(q, pkb, pvb, s_ppos, s_qpos, lo + it * BLOCK, mid, qpos, d, m_i, l_i,
                                          acc, scale, BLOCK, IEEE)
        for it in range(0, FIXED_TRIPS + 1):
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, mid + it * BLOCK, hi, qpos, d, m_i, l_i,
                                          acc, scale, BLOCK, IEEE)
    else:
        n_par = (tl.maximum(mid - lo, 0) + BLOCK - 1) // BLOCK
        for it in range(0, n_par):
            m_i, l_i, acc = _attn_tile(q, pkb, pvb, s_ppos, s_qpos, lo + it * BLOCK, mid, qpos, d, m_i, l_i,
                                          acc, scale, BLOCK, IEEE)
        n_own = (tl.maximum(hi - mid, 0) + BLOCK - 1) // BLOCK
        for it in range(0, n_own):
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, mid + it * BLOCK, hi, qpos, d, m_i, l_i,
                                          acc, scale, BLOCK, IEEE)
    if ROPE:
        m_i, l_i, acc = _attn_new_key(q, knew, vnew, m_i, l_i, acc, scale)
    _attn_store(o_ptr, acc_ptr, ml_ptr, acc, m_i, l_i, bg, sp, n_split, qo, r, rvalid, d, R_PAD, D, SINGLE)


def fork_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                   kv_len: int, pk: torch.Tensor, pv: torch.Tensor, parent: torch.Tensor,
                   pivot: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
    """The forked rows' attention of q [B, T, H, D]; with rope = (inv_freq, n_heads, n_kv), q is the q|k|v
    product [B, 1, (H + 2 n_kv) D] and the kernel rotates and stores the new keys itself (one token per
    row and one chunk: TO.attention_fuses_rope)."""
    for name, x in (("ck", ck), ("cv", cv), ("pk", pk), ("pv", pv)):
        if x.stride(-1) != 1 or x.dtype != q.dtype:
            raise ValueError(f"fork_attention: {name} needs a dense last dim and q's dtype")
    if not q.is_contiguous():
        raise ValueError("fork_attention: q must be contiguous")
    a = TO.attn_launch("fork_attention", q, ck, kv_len, rope)
    pdl = TO._pdl(q.device)
    _fork_attn_kernel[(a.B * a.n_kv, a.n_split)](
        q, ck, cv, rows, start, pk, pv, parent, pivot, a.out, a.acc, a.ml, rope[0] if rope is not None else start,
        a.T, a.H, ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        pk.stride(0), pk.stride(1), pk.stride(2), pv.stride(0), pv.stride(1), pv.stride(2),
        a.chunk, a.n_split, a.D ** -0.5, REP=a.rep, R_PAD=a.R_PAD, D=a.D, BLOCK=a.block, SINGLE=a.single,
        IEEE=q.dtype == torch.float32, FIXED_TRIPS=a.chunk // a.block if TO._INTERPRETED else 0,
        ROPE=rope is not None, PDL=pdl, PREFETCH=rope is not None and TO.ATTN_PREFETCH and not TO._INTERPRETED,
        num_warps=a.warps, num_stages=2, **TO._launch_kw(pdl))
    TO.attn_combine(a, pdl)
    return a.out
