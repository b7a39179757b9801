"""The forked rows' attention on CUDA (draftrelay.worker.fork): the fast forward's flash-decoding kernel
(draftrelay.kernels.triton_ops: one program per (row, kv head, key chunk), all n_rep * T query rows of a
kv head at once, online softmax in fp32, long contexts split and combined) with its key loop in two
parts: the chunk's keys below the row's pivot from the parent row, the rest from the forked row itself.
The tiles, the split plan and the combine kernel are triton_ops' own.

Where the keys are split (beyond triton_ops.SINGLE_MAX), the rows of one parent within a block of G rows
(the branches of one request) read that parent's keys below their lowest pivot once for all of them: one
program per (group, kv head, chunk) over all the group's query rows, as a plain row's program reads them
for its own. Each row alone then reads only its keys from that pivot on (a few: the branch's own
positions and the parent's above the group's lowest pivot). At 32K keys and eight branches, reading the
prefix per row cost 8 x its bytes (45 us a layer on an H100 where the prefix is 17 MB). Both kinds of
program are one launch, and the combine merges their partials. Imported only where Triton is
(fork.fork_attention_triton)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from draftrelay import env_choice
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
# Split keys: the rows of a parent within a block read its keys below their lowest pivot once (above).
# DRAFTRELAY_FORK_SHARE=off reads them per row, as a plain row does (to measure one against the other).
SHARE = env_choice("DRAFTRELAY_FORK_SHARE", "on", ("on", "off")) == "on"
SHARED_ROWS = 64  # query rows a shared program holds at most (the block's rows x n_rep x T, padded)
SHARED_WARPS = 0  # warps of the launch where rows share (0: triton_ops.attn_warps of the shared programs'
# rows, at least the split's); their registers bound how many an SM holds (benchmarks/attention_tiles.py)


def group_rows(B: int, rep: int, T: int, single: bool) -> int:
    """G, the rows of a block whose rows of one parent share a read of its keys (0: none shared, where the
    keys are one chunk, the rows one, or a row's query rows fill a shared program alone). A power of two,
    so that a request's branches (F of them, consecutive) fill whole blocks where F is one too."""
    if single or B < 2 or not SHARE:
        return 0
    G = 1
    while 2 * G * rep * T <= SHARED_ROWS and G < B:
        G *= 2
    return G if G > 1 else 0


@triton.jit
def _block_rows(parent_ptr, pivot_ptr, b0, B, G: tl.constexpr):
    """The rows [b0, b0 + G) of a block: their index a in it, which exist (iv: below B), their parents and
    pivots (parent -1 past B)."""
    a = tl.arange(0, G)
    iv = b0 + a < B
    return a, iv, tl.load(parent_ptr + b0 + a, mask=iv, other=-1), tl.load(pivot_ptr + b0 + a, mask=iv, other=0)


@triton.jit
def _group_of(a, iv, par, piv, j, G: tl.constexpr):
    """Row j of a block (_block_rows) and the rows of the block with its parent: (that parent pb, the
    group's lowest pivot P, whether j is the group's first row). The shared and the own programs both."""
    pb = tl.sum(tl.where(a == j, par, 0))
    same = iv & (par == pb)
    P = tl.min(tl.where(same, piv, 2 ** 30), axis=0).to(tl.int32)
    first = tl.min(tl.where(same, a, G), axis=0) == j
    return pb, P, first


@triton.jit
def _fork_shared(q_ptr, pkb, pvb, parent_ptr, acc_ptr, ml_ptr, g, c, b0, pb, P, B, T, H, s_ppos, s_qpos,
                 chunk_s, n_own, n_tot, scale, REP: tl.constexpr, R_PAD: tl.constexpr, G: tl.constexpr,
                 RG_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
                 FIXED_TRIPS: tl.constexpr):
    """Chunk c of the parent pb's keys [0, P) for every query row of its group in the block from b0 (called
    once a group, by _fork_shared_block): each member row's partial into its slot n_own + c of the n_tot a
    (row, kv head) has (its own are the first n_own)."""
    n_kv = H // REP
    RT = REP * T
    x = tl.arange(0, RG_PAD)  # query row x: row b0 + x // RT of the block, that row's query row x % RT
    rr = x % RT
    bq = b0 + x // RT
    inb = (x < G * RT) & (bq < B)
    member = inb & (tl.load(parent_ptr + bq, mask=inb, other=-1) == pb)
    t = rr % T
    h = g * REP + rr // T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (((bq * T + t).to(tl.int64) * H + h) * D)[:, None] + d[None, :], mask=member[:, None],
                other=0.0)
    qpos = tl.where(member, 2 ** 30, -1)  # every key below P precedes each member's queries; the rest see none
    lo = c * chunk_s
    hi = tl.minimum(lo + chunk_s, P)
    m_i = tl.full([RG_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([RG_PAD], tl.float32)
    acc = tl.zeros([RG_PAD, D], tl.float32)
    if FIXED_TRIPS:  # Triton's interpreter takes no run-time loop bound: every tile of the chunk, masked
        for it in range(0, FIXED_TRIPS):
            m_i, l_i, acc = _attn_tile(q, pkb, pvb, s_ppos, s_qpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    else:
        for it in range(0, (tl.maximum(hi - lo, 0) + BLOCK - 1) // BLOCK):
            m_i, l_i, acc = _attn_tile(q, pkb, pvb, s_ppos, s_qpos, lo + it * BLOCK, hi, qpos, d, m_i, l_i, acc,
                                       scale, BLOCK, IEEE)
    part = ((bq * n_kv + g) * n_tot + n_own + c).to(tl.int64)
    tl.store(acc_ptr + (part * R_PAD + rr)[:, None] * D + d[None, :], acc, mask=member[:, None])
    tl.store(ml_ptr + part * 2 * R_PAD + rr, m_i, mask=member)
    tl.store(ml_ptr + part * 2 * R_PAD + R_PAD + rr, l_i, mask=member)


@triton.jit
def _fork_shared_block(q_ptr, pk_ptr, pv_ptr, parent_ptr, pivot_ptr, acc_ptr, ml_ptr, blk, g, c, B, T, H, s_prow,
                       s_phead, s_ppos, s_qrow, s_qhead, s_qpos, chunk_s, n_own, n_tot, scale, REP: tl.constexpr,
                       R_PAD: tl.constexpr, G: tl.constexpr, RG_PAD: tl.constexpr, D: tl.constexpr,
                       BLOCK: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr):
    """Chunk c of the shared prefix reads of block blk's rows, kv head g: for each parent the block's rows
    have (one where a request's branches fill the block, as they do where F is a multiple of G), its keys
    below the lowest pivot of its rows in the block, for all of them (_fork_shared). One program per (block,
    kv head, chunk): the launch holds no program per row that would find itself no parent's first and
    read nothing (seven of eight of them at G = 8, each still paying its loads and its place in the grid)."""
    b0 = blk * G
    a, iv, par, piv = _block_rows(parent_ptr, pivot_ptr, b0, B, G)
    for j in tl.static_range(G):  # row b0 + j leads its parent's reads where it is the parent's first in the block
        pb, P, first = _group_of(a, iv, par, piv, j, G)
        if first & (b0 + j < B):
            prow = pb.to(tl.int64)
            _fork_shared(q_ptr, pk_ptr + prow * s_prow + g * s_phead, pv_ptr + prow * s_qrow + g * s_qhead,
                         parent_ptr, acc_ptr, ml_ptr, g, c, b0, pb, P, B, T, H, s_ppos, s_qpos, chunk_s,
                         n_own, n_tot, scale, REP, R_PAD, G, RG_PAD, D, BLOCK, IEEE, FIXED_TRIPS)


@triton.jit
def _fork_own(q_ptr, ck_ptr, cv_ptr, o_ptr, acc_ptr, ml_ptr, inv_ptr, pkb, pvb, row, b, g, h, bg, sp, n_kv, start,
              pivot, lo, hi, r, rvalid, d, qo, qpos, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, s_ppos,
              s_qpos, n_split, scale, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
              SINGLE: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr, ROPE: tl.constexpr,
              PREFETCH: tl.constexpr):
    """A row's program for its keys [lo, hi) of chunk sp: the parent's below the pivot, then its own."""
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
        n_own_t = (tl.maximum(hi - mid, 0) + BLOCK - 1) // BLOCK
        for it in range(0, n_own_t):
            m_i, l_i, acc = _attn_tile(q, kb, vb, s_cpos, s_vpos, mid + it * BLOCK, hi, qpos, d, m_i, l_i,
                                       acc, scale, BLOCK, IEEE)
    if ROPE:
        m_i, l_i, acc = _attn_new_key(q, knew, vnew, m_i, l_i, acc, scale)
    _attn_store(o_ptr, acc_ptr, ml_ptr, acc, m_i, l_i, bg, sp, n_split, qo, r, rvalid, d, R_PAD, D, SINGLE)


@triton.jit
def _fork_attn_kernel(q_ptr, ck_ptr, cv_ptr, rows_ptr, start_ptr, pk_ptr, pv_ptr, parent_ptr, pivot_ptr,
                      o_ptr, acc_ptr, ml_ptr, inv_ptr, T, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos,
                      s_prow, s_phead, s_ppos, s_qrow, s_qhead, s_qpos, chunk, n_split, scale, B, n_own, chunk_s,
                      REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      SINGLE: tl.constexpr, IEEE: tl.constexpr, FIXED_TRIPS: tl.constexpr, ROPE: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH: tl.constexpr = False, G: tl.constexpr = 0,
                      RG_PAD: tl.constexpr = 16, FIXED_SHARED: tl.constexpr = 0):
    """ROPE (one token per row, one chunk): q_ptr is the q|k|v product and the program rotates its kv
    head's query rows and the new key, stores the new key and value into the forked row at its position
    (start >= pivot: a forked row's own positions) and takes the new key from registers, as the fast
    forward's fused _attn_kernel does: rope_kv_write and fork_attention in one launch. PDL as there:
    the next kernel may start its prologue now; this one reads nothing before its producer is done.
    G (split keys only): programs sp < n_own read their row's keys from its group's lowest pivot on; the
    programs sp >= n_own, numbered (sp - n_own) * B * n_kv + bg, are one per (block of G rows, kv head,
    shared chunk) and read that chunk of the keys below each group's lowest pivot for the whole group
    (_fork_shared_block); n_split is then every slot a (row, kv head) has, n_own + the shared chunks."""
    bg, sp, n_kv, b, g, start, row, lo, hi, r, rvalid, h, d, qo, qpos = _attn_program(
        rows_ptr, start_ptr, T, H, chunk, REP, R_PAD, D, PDL)
    prow = tl.load(parent_ptr + b).to(tl.int64)
    pivot = tl.load(pivot_ptr + b).to(tl.int32)
    pkb = pk_ptr + prow * s_prow + g * s_phead
    pvb = pv_ptr + prow * s_qrow + g * s_qhead
    if G:
        if sp >= n_own:  # a shared program j of (block, kv head, chunk); the grid's last row holds idle ones
            j = (sp - n_own) * (B * n_kv) + bg
            n_s = n_split - n_own
            if j < tl.cdiv(B, G) * n_kv * n_s:
                _fork_shared_block(q_ptr, pk_ptr, pv_ptr, parent_ptr, pivot_ptr, acc_ptr, ml_ptr, j // n_s // n_kv,
                                   j // n_s % n_kv, j % n_s, B, T, H, s_prow, s_phead, s_ppos, s_qrow, s_qhead,
                                   s_qpos, chunk_s, n_own, n_split, scale, REP, R_PAD, G, RG_PAD, D, BLOCK, IEEE,
                                   FIXED_SHARED)
        else:  # its keys from the group's lowest pivot P on (below P: the group's shared programs)
            a, iv, par, piv = _block_rows(parent_ptr, pivot_ptr, (b // G) * G, B, G)
            _, P, _ = _group_of(a, iv, par, piv, b % G, G)
            _fork_own(q_ptr, ck_ptr, cv_ptr, o_ptr, acc_ptr, ml_ptr, inv_ptr, pkb, pvb, row, b, g, h, bg, sp, n_kv,
                      start, pivot, tl.maximum(lo, P), hi, r, rvalid, d, qo, qpos, H, s_crow, s_chead, s_cpos,
                      s_vrow, s_vhead, s_vpos, s_ppos, s_qpos, n_split, scale, R_PAD, D, BLOCK, SINGLE, IEEE,
                      FIXED_TRIPS, ROPE, PREFETCH)
    else:
        _fork_own(q_ptr, ck_ptr, cv_ptr, o_ptr, acc_ptr, ml_ptr, inv_ptr, pkb, pvb, row, b, g, h, bg, sp, n_kv, start,
                  pivot, lo, hi, r, rvalid, d, qo, qpos, H, s_crow, s_chead, s_cpos, s_vrow, s_vhead, s_vpos, s_ppos,
                  s_qpos, n_split, scale, R_PAD, D, BLOCK, SINGLE, IEEE, FIXED_TRIPS, ROPE, PREFETCH)


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
    a = TO.attn_launch("fork_attention", q, ck, kv_len, rope, with_partials=False)  # sized below, once
    pdl = TO._pdl(q.device)
    n_own, G, chunk_s, n_s, rg_pad, warps = a.n_split, group_rows(a.B, a.rep, a.T, a.single), 0, 0, 16, a.warps
    if G:  # the shared chunks: as if each block's rows were one row of G * n_rep * T query rows
        rg_pad = max(16, triton.next_power_of_2(G * a.rep * a.T))
        chunk_s, n_s = TO.split_plan(kv_len, triton.cdiv(a.B, G) * a.n_kv, TO._n_sm(q.device), a.block, a.block)
        # a row's own keys, from its group's lowest pivot on (a branch's few positions), in one program: split
        # as a whole row's keys are, all but the chunk holding them would read nothing
        n_own = 1
        acc, ml = TO.partials(a.B * a.n_kv * (n_own + n_s), a.R_PAD, a.D, q.device)
        a = dataclasses.replace(a, chunk=triton.cdiv(kv_len, a.block) * a.block, n_split=n_own + n_s, acc=acc,
                                ml=ml)
        warps = SHARED_WARPS or max(warps, TO.attn_warps(rg_pad, a.D))
    elif not a.single:
        acc, ml = TO.partials(a.B * a.n_kv * a.n_split, a.R_PAD, a.D, q.device)
        a = dataclasses.replace(a, acc=acc, ml=ml)
    # the shared programs, one per (block of G rows, kv head, chunk), fill the grid's rows after the own ones
    extra = triton.cdiv(triton.cdiv(a.B, G) * a.n_kv * n_s, a.B * a.n_kv) if G else 0
    _fork_attn_kernel[(a.B * a.n_kv, n_own + extra)](
        q, ck, cv, rows, start, pk, pv, parent, pivot, a.out, a.acc, a.ml, rope[0] if rope is not None else start,
        a.T, a.H, ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        pk.stride(0), pk.stride(1), pk.stride(2), pv.stride(0), pv.stride(1), pv.stride(2),
        a.chunk, a.n_split, a.D ** -0.5, a.B, n_own, chunk_s, REP=a.rep, R_PAD=a.R_PAD, D=a.D, BLOCK=a.block,
        SINGLE=a.single, IEEE=q.dtype == torch.float32, FIXED_TRIPS=a.chunk // a.block if TO._INTERPRETED else 0,
        ROPE=rope is not None, PDL=pdl, PREFETCH=rope is not None and TO.ATTN_PREFETCH and not TO._INTERPRETED,
        G=G, RG_PAD=rg_pad, FIXED_SHARED=chunk_s // a.block if TO._INTERPRETED and G else 0,
        num_warps=warps, num_stages=2, **TO._launch_kw(pdl))
    TO.attn_combine(a, pdl)
    return a.out
