"""Forked rows: the speculation cache's branch rows without copying their parent's KV.

A branch of a request continues the request's context C + f1..fa with its own few tokens. Instead of a
scratch row holding a copy of the whole context, a *forked row* holds only its own positions: row
`rows[b]` of a scratch cache from position `pivot[b]` on; every key below the pivot is read from row
`parent[b]` of the drafter's own cache, in place. Attention of a forked row is then one pass over two
key ranges with one online softmax (the parent's keys 0 .. pivot - 1, the row's own pivot .. start + t),
which is the same attention as over a row holding a copy, without the copy: the branch work no longer
grows with the context by F full-context copies per request.

`fork_forward` is the fast forward's decoder (draftrelay.model: the same layer functions, the same
fused kernels) with the attention swapped for the forked one; each layer's kernels are the fast
forward's own module with `decode_attention` bound to that layer's parent cache (`ForkKernels`). It
writes K/V only into the scratch rows at their true positions (the parent rows are only read), takes
static shapes (a CUDA graph captures it) and needs the fast attention's shapes (n_rep * T <= 64).

`fork_attention_reference` is the plain-torch definition; `fork_attention_triton` the CUDA kernel:
draftrelay.kernels.triton_ops' flash-decoding kernel with the key loop split at the pivot (where the keys
are split over programs, the rows of one parent read its keys below their lowest pivot once: fork_triton).

`LeanFork` is the CPU's forked forward, for a drafter in its lean loop (worker/lean.py), on compact rows
(a row stores its position p at p - pivot: rows of a branch's own few positions, not of the context, so the
speculation cache's branch rows cost a CPU a few MB instead of a context each): the lean loop's
ops with the attention in two parts, the parent's keys below the pivot read in place (one GEMM per kv
head over all branches of one parent) and the row's own few positions, one softmax over both. It has no
per-call host work beyond building the step's mask, and no forked row's attention copies a context (the
reference definition merges each row's keys into a full-length copy per layer, and `fork_forward`'s
fast-forward structure costs several times the lean loop's dispatch on a CPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from draftrelay import SettingError
from draftrelay import model as M
from draftrelay.kernels import backend, reference

# How a forked row's one-token forward (the branch run's later steps, the bonus) does RoPE: "split", the
# fast forward's rope_kv_write then the forked attention kernel (both with PDL), or "fused", one kernel
# that rotates, writes the new K/V and attends (fork_triton: ROPE). Split is the default because it was
# the faster on the H200 (docs/SPEC_CACHE.md, benchmarks/branch_work.py): the fused kernel's chain of
# dependent loads (indices, q|k|v, then keys) is longer than what the separate launch costs under PDL.
FORK_ROPE_MODES = ("split", "fused")
FORK_ROPE = os.environ.get("DRAFTRELAY_FORK_ROPE", "split")


def _merged_rows(ck: torch.Tensor, rows: torch.Tensor, pk: torch.Tensor, parent: torch.Tensor,
                 pivot: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, n_kv, kv_len, D]: row parent[b] of pk below pivot[b], row rows[b] of ck from it on."""
    own = ck[rows.long(), :, :kv_len]
    par = pk[parent.long(), :, :kv_len]
    below = torch.arange(kv_len, device=ck.device)[None, :] < pivot.long()[:, None]  # [B, L]
    return torch.where(below[:, None, :, None], par, own)


def fork_attention_reference(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
                             start: torch.Tensor, kv_len: int, pk: torch.Tensor, pv: torch.Tensor,
                             parent: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """reference.decode_attention of q [B, T, H, D] (token t of row b at position start[b] + t) over keys
    0 .. start[b] + t, where keys below pivot[b] are row parent[b] of pk / pv and the others row rows[b]
    of ck / cv (one layer each, [rows, n_kv, len, D]). The same rounding as decode_attention."""
    B = q.shape[0]
    keys = _merged_rows(ck, rows, pk, parent, pivot, kv_len)
    vals = _merged_rows(cv, rows, pv, parent, pivot, kv_len)
    ident = torch.arange(B, device=q.device)
    return reference.decode_attention(q, keys, vals, ident, start, kv_len)


def fork_attention_triton(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
                          start: torch.Tensor, kv_len: int, pk: torch.Tensor, pv: torch.Tensor,
                          parent: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    from draftrelay.worker import fork_triton

    return fork_triton.fork_attention(q, ck, cv, rows, start, kv_len, pk, pv, parent, pivot)


class ForkKernels:
    """The fast forward's kernel module for one layer, its decode_attention reading keys below each row's
    pivot from the parent cache layer (pk, pv). Everything else is the module's own."""

    def __init__(self, base, pk: torch.Tensor, pv: torch.Tensor, parent: torch.Tensor, pivot: torch.Tensor):
        self._base, self._pk, self._pv, self._parent, self._pivot = base, pk, pv, parent, pivot
        self._attn = fork_attention_reference if base is reference else fork_attention_triton

    def __getattr__(self, name):
        return getattr(self._base, name)

    def decode_attention(self, q, ck, cv, rows, start, kv_len):
        return self._attn(q, ck, cv, rows, start, kv_len, self._pk, self._pv, self._parent, self._pivot)

    def rope_attention(self, qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows, kv_len):
        """RoPE, the K/V write and the forked attention: the module's rope_kv_write, then the forked
        attention; with DRAFTRELAY_FORK_ROPE=fused, one launch on CUDA where the fast forward's own
        rope_attention is one (one token per row, one chunk of keys)."""
        if FORK_ROPE not in FORK_ROPE_MODES:
            raise SettingError(f"DRAFTRELAY_FORK_ROPE={FORK_ROPE!r}: expected one of {', '.join(FORK_ROPE_MODES)}")
        if (FORK_ROPE == "fused" and self._base is not reference
                and self._base.attention_fuses_rope(kv_len, qkv.shape[1])):
            out = _fused_fork(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows, kv_len, self._pk, self._pv,
                              self._parent, self._pivot)
            if out is not None:
                return out
        q = self._base.rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows)
        return self.decode_attention(q, ck, cv, rows, start, kv_len)


_FUSED_FORK_OK: dict[torch.device, bool] = {}  # per device, once the fused fork kernel has been launched


def _fused_fork(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows, kv_len, pk, pv, parent, pivot):
    """The fused RoPE + forked attention, or None where it cannot run (triton_ops.guarded_launch)."""
    from draftrelay.kernels import triton_ops
    from draftrelay.worker import fork_triton

    args = (qkv.contiguous(), ck, cv, rows, start, kv_len, pk, pv, parent, pivot, (inv_freq, n_heads, n_kv))
    return triton_ops.guarded_launch(_FUSED_FORK_OK, qkv.device, "fused RoPE + forked attention",
                                     lambda: fork_triton.fork_attention(*args))


def fork_forward(model, tokens: torch.Tensor, start: torch.Tensor, cache, rows: torch.Tensor, parent_cache,
                 parent: torch.Tensor, pivot: torch.Tensor, kv_len: int,
                 logits_at: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
    """tokens [B, T] (device int64) at positions start[b].. of forked rows rows[b] of `cache` (their keys
    below pivot[b] in row parent[b] of `parent_cache`) -> fp32 logits [B, T, V] ([B, 1, V] with logits_at;
    raw: the head's output in the model's dtype, the same values before the fp32 cast; with a draft
    vocabulary only its columns, which the pick maps to token ids: model.draft_vocab.ids_on). Writes the T new
    K/V into the forked rows at their positions; kv_len >= every start + T (static)."""
    dev = model.device
    B, T = tokens.shape
    inv = model._inv_freq.get(dev)
    if inv is None:
        inv = model._inv_freq[dev] = M.rope_inv_freq(model.cfg).to(dev)
    st = M.step_state(start, T, kv_len, rows, model.cfg.n_rep, inv, model.dtype, fast=True)
    if not st.fast_attn:
        raise ValueError(f"fork_forward: {model.cfg.n_rep} x {T} query rows per kv head exceed the fast "
                         f"attention's {M.DECODE_ROWS}")
    base = backend(dev)
    layers = model.layer_weights()
    kern = [ForkKernels(base, parent_cache.k[i], parent_cache.v[i], parent, pivot) for i in range(len(layers))]
    eps = model.cfg.rms_norm_eps
    x, red = M.embedding(tokens, model.embed_tokens.weight, st), None
    for i, w in enumerate(layers):
        st.kernels = kern[i]
        x, o = M.attn_half(x, red, w, st, cache.k[i], cache.v[i], eps)
        red = M.out_product(o, w, st)
        x, red = M.mlp_down(x, red, w, st, eps)
    st.kernels = base
    head, vocab = model.head_weight(), model.draft_vocab
    if not raw:
        return M.head_logits(x, red, st, model.norm.weight, head, eps, logits_at=logits_at, vocab=vocab)
    _, x = base.add_rms_norm(x, red, model.norm.weight, eps)  # head_logits' steps, without its fp32 cast
    if logits_at is not None:
        x = x[torch.arange(B, device=x.device), logits_at][:, None]
    return base.linear(x.contiguous(), head)


class ForkPlan:
    """What the forwards of one branch run share (rows, parents and pivots are fixed over its steps): the
    runs of consecutive rows with one parent and, per run, its parent's keys 0 .. max pivot - 1 with the
    mask of those below each row's own pivot, and how to read its rows' own keys."""

    def __init__(self, rows: list[int], parent: list[int], pivot: list[int], n_rep: int, T: int) -> None:
        self.rows, self.parent, self.pivot = list(rows), list(parent), list(pivot)
        self.rows_t = torch.tensor(self.rows)
        self.segs = []  # (b0, b1, parent row, P, lo, own rows: slice or index, pivot [nb, 1, 1], parent mask)
        b0, B = 0, len(rows)
        for b in range(1, B + 1):
            if b < B and parent[b] == parent[b0]:
                continue
            piv = self.pivot[b0:b]
            P, lo = max(piv), min(piv)
            r = self.rows[b0:b]
            own = slice(r[0], r[0] + len(r)) if r == list(range(r[0], r[0] + len(r))) else self.rows_t[b0:b]
            piv_t = torch.tensor(piv)[:, None, None]
            par = (torch.arange(P)[None, None, :] >= piv_t).expand(-1, n_rep * T, -1)  # at and above the pivot
            self.segs.append((b0, b, parent[b0], P, lo, own, piv_t, par))
            b0 = b


class LeanFork:
    """Forked forwards on a CPU in the lean loop's ops (worker/lean.LeanSteps: its weights, RoPE tables,
    norms and products). Row b of the step is scratch row rows[b] of `cache` from pivot[b] on and row
    parent[b] of `parent_cache` below it. Rows that share a parent (the branches of one request) read that
    parent's keys 0 .. max pivot - 1 as one view, in one GEMM per kv head; each row's own keys are the few
    positions from its pivot on. Logits equal the forward over a row holding a copy up to the order of
    sums (tests/test_fork.py); greedy drafts from them are what the drafter's own loop drafts."""

    def __init__(self, lean, cache: M.KVCache, parent_cache: M.KVCache, compact: bool = False) -> None:
        """compact: a forked row stores its own position p at p - pivot (the scratch rows are then as long as
        a branch's own positions, COMPACT_POSITIONS, instead of the context); else at p."""
        self.lean, self.cache, self.parent_cache, self.compact = lean, cache, parent_cache, compact

    def plan(self, rows: list[int], parent: list[int], pivot: list[int], T: int = 1) -> ForkPlan:
        """The plan of forwards over forked rows rows[b] (parent rows parent[b] below pivot[b]) with T
        tokens per row."""
        return ForkPlan(rows, parent, pivot, self.lean.n_rep, T)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, plan: ForkPlan,
                pick: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 at positions pos [B, T] (each >= the row's pivot; T as planned) of the plan's
        forked rows -> fp32 logits [B, V] at position pick[b] of each row (None: [B, T, V], every
        position). Writes the new K/V into the forked rows at their positions; reads the parent rows below
        the pivots only."""
        ln = self.lean
        B, T = tokens.shape
        H, HK, D, n_rep = ln.H, ln.HK, ln.D, ln.n_rep
        R = n_rep * T
        cache, pc = self.cache, self.parent_cache
        hi = (pos[:, -1] + 1).tolist()
        qpos = pos.repeat(1, n_rep)[:, :, None]  # [B, R, 1]: grouped query row r is token t = r % T
        n = cache.max_len
        # where a row stores position p: at p, or (compact) at p - its pivot
        slot = pos - torch.tensor(plan.pivot)[:, None] if self.compact else pos
        if int(slot.min()) < 0 or int(slot.max()) >= n:
            raise ValueError(f"LeanFork: positions {pos.tolist()} of pivots {plan.pivot} fall outside the "
                             f"forked rows' {n} slots")
        segs = []
        for b0, b1, p, P, lo, own, piv, par in plan.segs:
            if self.compact:  # the rows' slots 0 .. W - 1 hold positions pivot .. pivot + W - 1
                W = max(h - v for h, v in zip(hi[b0:b1], plan.pivot[b0:b1], strict=True))
                kpos = piv + torch.arange(W)[None, None, :]
                blocked = kpos > qpos[b0:b1]  # every slot is at or above the row's pivot
                lo = 0
            else:
                W = max(hi[b0:b1]) - lo
                kpos = torch.arange(lo, lo + W)[None, None, :]
                blocked = (kpos < piv) | (kpos > qpos[b0:b1])  # own keys below the pivot or after the query
            segs.append((b0, b1, p, P, lo, W, own, torch.cat((par, blocked), -1) if P else blocked))
        cos, sin = ln.cos[pos][:, :, None, :], ln.sin[pos][:, :, None, :]
        widx = ((plan.rows_t[:, None, None] * HK + ln.t_pos[:HK][None, None, :]) * n + slot[:, :, None]).reshape(-1)
        half = D // 2
        scale = ln.scale
        x, red = F.embedding(tokens, ln.embed), None
        for i, w in enumerate(ln.layers):
            p_qkv, p_o, p_gu, p_d = ln.prods[i]  # the lean loop's products (int8 or int4 where it quantizes)
            if red is not None:
                x = x + red.to(x.dtype)
            qkv = p_qkv(ln._norm(x, w.ln1))
            qk = qkv[..., :(H + HK) * D].view(B, T, H + HK, D)
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
            q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[..., (H + HK) * D:].view(B, T, HK, D)
            ck, cv = cache.k[i], cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, k.reshape(-1, D).to(ck.dtype))
            cv.view(-1, D).index_copy_(0, widx, v.reshape(-1, D).to(cv.dtype))
            pk, pv = pc.k[i], pc.v[i]
            # [HK, B, R, D]: the grouped queries (kv head g: heads g * n_rep .., each over its T tokens)
            qg = q.reshape(B, T, HK, n_rep, D).permute(2, 0, 3, 1, 4).reshape(HK, B, R, D).to(ck.dtype)
            outs = []
            for b0, b1, p, P, lo, W, own, blocked in segs:
                nb = b1 - b0
                qs = qg[:, b0:b1]
                ok = ck[own, :, lo:lo + W].transpose(0, 1)  # [HK, nb, W, D]: the rows' own positions
                ov = cv[own, :, lo:lo + W].transpose(0, 1)
                s_own = torch.matmul(qs, ok.transpose(-1, -2))  # [HK, nb, R, W]
                if P:  # the parent's keys below the pivots, read in place: [HK, nb * R, P]
                    s_par = torch.matmul(qs.reshape(HK, nb * R, D), pk[p, :, :P].transpose(-1, -2))
                    sc = torch.cat((s_par.view(HK, nb, R, P), s_own), -1) * scale
                else:
                    sc = s_own * scale
                sc = sc.masked_fill(blocked, float("-inf"))  # every row sees its own position: never all -inf
                pr = torch.softmax(sc, dim=-1, dtype=torch.float32).to(cv.dtype)
                o = torch.matmul(pr[..., P:], ov)
                if P:
                    o = o + torch.matmul(pr[..., :P].reshape(HK, nb * R, P), pv[p, :, :P]).view(HK, nb, R, D)
                outs.append(o)
            out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)  # [HK, B, R, D]
            o = out.view(HK, B, n_rep, T, D).permute(1, 3, 0, 2, 4).reshape(B, T, H * D).to(x.dtype)
            red = p_o(o)
            x = x + red.to(x.dtype)
            gu = p_gu(ln._norm(x, w.ln2))
            m = gu.shape[-1] // 2
            red = p_d(F.silu(gu[..., :m]) * gu[..., m:])
        x = x + red.to(x.dtype)
        if pick is None:
            return ln.logits(ln._norm(x, ln.final_norm))
        x = x[torch.arange(B), pick][:, None]
        return ln.logits(ln._norm(x, ln.final_norm))[:, 0]
