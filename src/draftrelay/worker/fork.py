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

`fork_attention_reference` is the plain-torch definition (the CPU runs it); `fork_attention_triton` the
CUDA kernel: draftrelay.kernels.triton_ops' flash-decoding kernel with the key loop split at the pivot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftrelay import model as M
from draftrelay.kernels import backend, reference


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
        # the module's fused RoPE + attention reads only the forked row: here RoPE and the K/V write
        # stay the module's, the attention is the forked one (parent below the pivot)
        q = self._base.rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows)
        return self.decode_attention(q, ck, cv, rows, start, kv_len)


def fork_forward(model, tokens: torch.Tensor, start: torch.Tensor, cache, rows: torch.Tensor, parent_cache,
                 parent: torch.Tensor, pivot: torch.Tensor, kv_len: int,
                 logits_at: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
    """tokens [B, T] (device int64) at positions start[b].. of forked rows rows[b] of `cache` (their keys
    below pivot[b] in row parent[b] of `parent_cache`) -> fp32 logits [B, T, V] ([B, 1, V] with logits_at;
    raw: the head's output in the model's dtype, the same values before the fp32 cast). Writes the T new
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
    x, red = F.embedding(tokens, model.embed_tokens.weight), None
    for i, w in enumerate(layers):
        st.kernels = kern[i]
        x, o = M.attn_half(x, red, w, st, cache.k[i], cache.v[i], eps)
        red = M.out_product(o, w.wo, st)
        x, red = M.mlp_down(x, red, w, st, eps)
    st.kernels = base
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if not raw:
        return M.head_logits(x, red, st, model.norm.weight, head, eps, logits_at=logits_at)
    _, x = base.add_rms_norm(x, red, model.norm.weight, eps)  # head_logits' steps, without its fp32 cast
    if logits_at is not None:
        x = x[torch.arange(B, device=x.device), logits_at][:, None]
    return base.linear(x.contiguous(), head)
