"""Plain-torch definitions of the fused kernels (`draftrelay.kernels`): the contract each Triton kernel
computes, and what the fast forward runs where Triton does not (the CPU).

Each function is written the way its kernel rounds: fp32 arithmetic on the loaded values, one rounding
to the activation dtype per output (the plain forward in `draftrelay.model` rounds after every torch op
instead, so the two agree within bf16 rounding, and exactly in fp32 up to the order of sums).
"""

from __future__ import annotations

import torch

from draftrelay.kernels.plan import MAX_ROWS


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """tokens (any shape, ids in [0, V)) -> weight's rows [*tokens.shape, D]: F.embedding. (The CUDA kernel
    writes zeros for an id outside [0, V) where this raises: it runs inside graphs, where nothing can
    raise; the engine checks prompt ids against the vocabulary, the worker a STEP's ids, before any forward.)"""
    return torch.nn.functional.embedding(tokens, weight)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta rounded to x's dtype, RMSNorm of that times weight). delta may be fp32 (the TP
    all-reduce's sum) or None (first layer: no residual to add). Rounds as HF's RMSNorm: normalised
    in fp32, rounded, then scaled and rounded again."""
    if delta is not None:
        x = x + delta.to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return x, (normed.float() * weight.float()).to(x.dtype)


def use_norm_linear(rows: int, w: torch.Tensor) -> bool:
    """Whether the forward takes norm_linear for the product: for decode and verify rows (at most
    plan.MAX_ROWS), as on CUDA, so a CPU runs the fast forward's structure."""
    return rows <= MAX_ROWS


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, add_rms_norm's normed rows @ w^T + b): the norm and the product that reads it; the
    product accumulates in fp32 and rounds once (as a GEMM with its bias)."""
    x, h = add_rms_norm(x, delta, norm_w, eps)
    return x, torch.nn.functional.linear(h, w, b)


def norm_mlp(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, wgu: torch.Tensor,
             wd: torch.Tensor, qgu: tuple[torch.Tensor, torch.Tensor] | None = None,
             qd: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, the MLP's down product): norm_linear's gate|up product, silu_mul of it (rounded to its
    dtype, as the product is stored), then the down product. qgu / qd: the int8 copies (q, row scales) of
    wgu / wd (int8_layers.py), read in their place (int8_norm_linear's and int8_linear's products)."""
    if qgu is None:
        x, gu = norm_linear(x, delta, norm_w, eps, wgu, None)
    else:
        x, gu = int8_norm_linear(x, delta, norm_w, eps, *qgu)
    if qd is None:
        return x, act_linear(gu, wd)
    return x, int8_linear(silu_mul(gu), *qd)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T + b, accumulated in fp32 and rounded once (a GEMM): the row-parallel products (o_proj)
    and the head."""
    return torch.nn.functional.linear(x, w, b)


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (q * s[:, None])^T + b for int8 q [N, K] and fp32 row scales s [N] (draftrelay.int8_head): the rows
    times the int8 values summed in fp32, each column times its scale, plus b, rounded once to x's dtype.
    On CUDA the planned tile converts q where it multiplies (`triton_ops.int8_linear`, which returns None
    where no int8 tile beats the bf16 product for the rows: the caller then runs its own bf16 weight)."""
    y = torch.nn.functional.linear(x.float(), q.float()) * s.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def int8_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, q: torch.Tensor,
                     s: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, int8_linear of add_rms_norm's normed rows, plus b): norm_linear with an int8 weight."""
    x, h = add_rms_norm(x, delta, norm_w, eps)
    return x, int8_linear(h, q, s, b)


def act_linear(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(gu) @ w^T + b: SwiGLU's activations and the down product that reads them (the
    activations rounded to gu's dtype first, as silu_mul rounds)."""
    return torch.nn.functional.linear(silu_mul(gu), w, b)


def greedy_pick(logits: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (argmax int64 [B], its softmax probability float32 [B]):
    greedy drafting's token and confidence. Ties go to the lower id (torch.argmax); the probability is
    computed in fp32 from the logits as given (softmax at the argmax: 1 / sum exp(l - max)). ids (int64
    [V], ascending: a draft vocabulary's, draft_vocab.py): column j is token ids[j], the token returned is
    that id (ascending, so a tie still goes to the lower id)."""
    lf = logits.float()
    tok = lf.argmax(-1)
    conf = torch.softmax(lf, -1).gather(-1, tok[:, None])[:, 0]
    return (tok if ids is None else ids[tok]), conf


def greedy_top(logits: torch.Tensor, m: int,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype), 1 <= m <= V -> (token int64 [B], confidence float32 [B], top ids
    int64 [B, m], their probabilities float32 [B, m]): greedy_pick's token and confidence, and the m most
    likely ids in descending order, ties to the lower id (a stable sort), each with its softmax probability
    computed as exp(l - max) * confidence (ids[:, 0] is the token, probs[:, 0] its confidence). ids: as
    greedy_pick's, every id returned mapped through it."""
    if not 1 <= m <= logits.shape[-1]:
        raise ValueError(f"greedy_top: m={m} outside 1..{logits.shape[-1]} (the vocabulary)")
    tok, conf = greedy_pick(logits, ids)
    lf = logits.float()
    v, i = torch.sort(lf, dim=-1, descending=True, stable=True)
    v, i = v[:, :m], i[:, :m]
    i = i if ids is None else ids[i]
    return tok, conf, i.contiguous(), (torch.exp(v - v[:, :1]) * conf[:, None]).contiguous()


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2n] (rows gate | up of one GEMM) -> silu(gate) * up [..., n]; silu rounded first, as
    F.silu(gate) * up rounds."""
    n = gu.shape[-1] // 2
    g = gu[..., :n].float()
    s = (g * torch.sigmoid(g)).to(gu.dtype)
    return (s.float() * gu[..., n:].float()).to(gu.dtype)


def rope_kv_write(qkv: torch.Tensor, start: torch.Tensor, inv_freq: torch.Tensor, n_heads: int, n_kv: int,
                  ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """qkv [B, T, (n_heads + 2 n_kv) * D] (one GEMM's output, rows q | k | v) at positions start[b] + t:
    rotates q and k (HF's rotate-half, angles pos * inv_freq in fp32), writes k and v into the cache
    rows `rows[b]` ([rows, n_kv, len, D] of one layer) at their positions, returns q [B, T, n_heads, D]."""
    B, T, _ = qkv.shape
    D = ck.shape[-1]
    half = D // 2
    pos = start[:, None] + torch.arange(T, device=qkv.device)[None, :]  # [B, T]
    ang = pos.float()[..., None] * inv_freq.float()  # [B, T, D/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    qk = qkv[..., :(n_heads + n_kv) * D].view(B, T, n_heads + n_kv, D).float()
    x1, x2 = qk[..., :half], qk[..., half:]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(qkv.dtype)
    v = qkv[..., (n_heads + n_kv) * D:].view(B, T, n_kv, D)
    widx = rows.long()[:, None]
    ck[widx, :, pos] = rot[:, :, n_heads:].to(ck.dtype)
    cv[widx, :, pos] = v.to(cv.dtype)
    return rot[:, :, :n_heads].contiguous()


def decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
                     start: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Causal GQA attention of q [B, T, H, D] (token t of row b at position start[b] + t) over the
    cache rows `rows[b]` of one layer ([rows, n_kv, len, D]), keys 0 .. start[b] + t (kv_len bounds
    them all) -> [B, T, H, D]. Scores and softmax in fp32, the probabilities rounded to the activation
    dtype for the second product (as the plain path), the weighted sum in fp32, rounded once."""
    B, T, H, D = q.shape
    n_kv = ck.shape[1]
    rep = H // n_kv
    r = rows.long()
    keys = ck[r, :, :kv_len].float()  # [B, n_kv, L, D]
    vals = cv[r, :, :kv_len].float()
    qg = q.float().view(B, T, n_kv, rep, D).permute(0, 2, 3, 1, 4).reshape(B, n_kv, rep * T, D)
    s = torch.matmul(qg, keys.transpose(-1, -2)) * (D ** -0.5)  # [B, n_kv, rep*T, L]
    pos = start.long()[:, None] + torch.arange(T, device=q.device)[None, :]  # [B, T]
    blocked = torch.arange(kv_len, device=q.device)[None, None, :] > pos[:, :, None]  # [B, T, L]
    s = s.masked_fill(blocked[:, None, None].expand(B, 1, rep, T, kv_len).reshape(B, 1, rep * T, kv_len),
                      float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype).float()
    o = torch.matmul(p, vals)  # [B, n_kv, rep*T, D]
    return o.view(B, n_kv, rep, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D).to(q.dtype).contiguous()


def attention_fuses_rope(kv_len: int, T: int) -> bool:
    """Whether rope_attention runs as one kernel (on CUDA: one token per row, up to
    triton_ops.SINGLE_MAX keys); the definition is the same either way."""
    return True


def rope_attention(qkv: torch.Tensor, start: torch.Tensor, inv_freq: torch.Tensor, n_heads: int, n_kv: int,
                   ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor, kv_len: int) -> torch.Tensor:
    """rope_kv_write then decode_attention: the new keys rotated and stored with the values, q rotated
    (rounded to the activation dtype) and attended over the cache rows -> [B, T, n_heads, D]."""
    q = rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows)
    return decode_attention(q, ck, cv, rows, start, kv_len)
