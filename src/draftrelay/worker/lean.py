"""The drafter's STEP on a CPU without the general forward's per-call overhead (LlamaDrafter mode "lean").

A small drafter's forward on a CPU is mostly dispatch: the demo drafter (1 layer, 192 wide) runs ~40
small ops per forward, and `Transformer.forward` adds host-side work around them on every call (input
checks that read `cache.lengths` row by row, the RoPE tables and mask rebuilt from positions, the
layer weights gathered from the modules, a tensor made per argument), which costs about as much again.
A STEP runs 1 + (n_steps - 1) forwards back to back, so that overhead is paid n_steps times.

`LeanSteps` keeps what does not change between forwards: the layer weights (views of the model's
tensors), RoPE cos/sin for every position of the cache (the same expression `model.step_tables`
evaluates, so the same values) and the key positions. Each forward then runs the plain path's ops in the
plain path's order on the same shapes (`model.attention`'s write-then-read of the KV, `model.attend`'s two
GEMMs, the same norms and products), so its logits, and the drafts, equal the eager path's bit for bit on
fp32 (tests/test_worker_lean.py holds it to that). One exception: a large fp32 head (greedy_head.usable;
the reference 0.5B drafter's 151,936 x 896 head is 544 MB, a quarter of its bytes per draft) is screened
through its int8 copy (`greedy_head.head_pick`): the drafts are the full head's argmax (up to fp32 ties),
the confidences lie within a proven interval around the full head's, and a confidence stop decides as
the full head would (a step the interval leaves undecided takes the full head). What it does not do:
prompts (extensions longer than PAD_LIMIT go through the eager path), q/k norms (Qwen3) and the
fused-kernel fast path; a drafter needing one of those stays eager. With `quant="int8"` or `"int4"`
(worker/quant.py) the layers' products read int8 or int4 weights: the drafts are then approximate, not the
eager path's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from draftrelay import greedy_head
from draftrelay import model as M
from draftrelay.worker import quant as Q
from draftrelay.worker.draft_stop import all_stopped


def supports(model: M.Transformer) -> bool:
    """Whether the lean loop runs this model exactly as the plain path does."""
    return supports_shape(model.cfg, model.device) and not model.fast_path()


def supports_shape(cfg: M.ModelConfig, device: torch.device | str) -> bool:
    """supports() from the shape and the device alone (before any weights are loaded): a model of this
    shape on this device runs lean unless its fused-kernel path is forced on."""
    return torch.device(device).type == "cpu" and not cfg.qk_norm


class LeanSteps:
    def __init__(self, model: M.Transformer, cache: M.KVCache, screen: bool = True, quant: str = "none") -> None:
        cfg = model.cfg
        self.model, self.cache = model, cache
        self.layers = model.layer_weights()  # views of the model's tensors: no copy
        # each layer's (q|k|v, o, gate|up, down) products: the weights as they are, or int8 / int4
        # (worker/quant.py: fewer bytes a draft, approximate drafts; the target's verify keeps the output)
        self.prods = Q.layer_products(self.layers, quant)
        self.embed = model.embed_tokens.weight
        self.head = model.head_weight()  # the draft vocabulary's rows where the model has one
        self.vocab = model.draft_vocab
        self.final_norm, self.eps = model.norm.weight, cfg.rms_norm_eps
        self.H, self.HK, self.D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_rep, self.d = cfg.n_rep, cfg.hidden_size
        self.scale = self.D ** -0.5
        dtype = model.dtype
        # step_tables' RoPE, for every position at once: pos.float()[..., None] * inv_freq, then the same
        # cat / cos / sin / cast per element
        pos = torch.arange(cache.max_len)
        ang = pos.float()[..., None] * M.rope_inv_freq(cfg)
        sin = ang.sin()
        self.cos = torch.cat((ang, ang), dim=-1).cos().to(dtype)  # [max_len, D]
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)
        self.key_pos = torch.arange(cache.max_len)
        self.t_pos = torch.arange(64)
        # the head screened through its int8 copy where greedy_head runs it (a large fp32 head: the
        # reference 0.5B's is a quarter of its bytes); heads it declines, and steps it cannot decide, are full
        self.screen = screen
        self.screened = self.full = 0  # steps picked each way (benchmarks read them)
        if screen and greedy_head.usable(torch.empty(1, self.head.shape[1], dtype=self.head.dtype), self.head):
            greedy_head.screened_for(self.head)  # the int8 copy built with the drafter, not in a round

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return M.rms_norm(x, w, self.eps)

    def tables(self, pos: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE cos / signed sin [B, T, 1, D] and the blocked mask [B, T, kv_len] of positions pos [B, T]
        (model.step_tables' values: the mask is expanded over the query heads in forward)."""
        return (self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :],
                self.key_pos[:kv_len][None, None, :] > pos[:, :, None])

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, tables, rows: list[int], kv_len: int,
                pick: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 at positions pos [B, T] of cache rows rows[b] (the caller has checked them and
        keeps cache.lengths), tables: `tables(pos, kv_len)` or views of a larger one -> the final norm's output
        [B, 1, D] at position pick[b] of each row (None: T == 1), the head's input (`pick`)."""
        B, T = tokens.shape
        H, HK, D, n_rep = self.H, self.HK, self.D, self.n_rep
        cos, sin, blocked = tables
        blocked = blocked[:, None, None].expand(B, 1, n_rep, T, kv_len).reshape(B, 1, n_rep * T, kv_len)
        r0 = rows[0]
        in_place = rows == list(range(r0, r0 + B))
        # K/V written with one index_copy_ per tensor into the layer's cache seen as [rows * HK * len, D]:
        # entry (b, t, h) at ((rows[b] * HK + h) * len + pos[b, t]), the values model.attention's index_put writes
        rows_t = torch.tensor(rows)
        n = self.cache.max_len
        widx = ((rows_t[:, None, None] * HK + self.t_pos[:HK][None, None, :]) * n + pos[:, :, None]).reshape(-1)
        half = D // 2
        x, red = F.embedding(tokens, self.embed), None
        for i, w in enumerate(self.layers):
            p_qkv, p_o, p_gu, p_d = self.prods[i]
            if red is not None:
                x = x + red.to(x.dtype)
            qkv = p_qkv(self._norm(x, w.ln1))
            qk = qkv[..., :(H + HK) * D].view(B, T, H + HK, D)
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
            q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[..., (H + HK) * D:].view(B, T, HK, D)
            ck, cv = self.cache.k[i], self.cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, k.reshape(-1, D).to(ck.dtype))
            cv.view(-1, D).index_copy_(0, widx, v.reshape(-1, D).to(cv.dtype))
            if in_place:  # a run of rows is read in place, as model.attention does with a slice
                keys, vals = ck[r0:r0 + B, :, :kv_len], cv[r0:r0 + B, :, :kv_len]
            else:
                keys, vals = ck[rows_t, :, :kv_len], cv[rows_t, :, :kv_len]
            keys, vals = keys.to(q.dtype), vals.to(q.dtype)
            qg = q.transpose(1, 2).reshape(B, HK, n_rep * T, D)
            out = M.attend(qg, keys, vals, blocked)
            o = out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, -1)
            red = p_o(o)
            x = x + red.to(x.dtype)
            gu = p_gu(self._norm(x, w.ln2))
            m = gu.shape[-1] // 2
            red = p_d(F.silu(gu[..., :m]) * gu[..., m:])
        x = x + red.to(x.dtype)
        if pick is not None:
            x = x[torch.arange(B), pick][:, None]
        return self._norm(x, self.final_norm)

    def pick(self, hn: torch.Tensor, min_conf: np.ndarray | None) -> tuple[torch.Tensor, np.ndarray]:
        """The greedy drafts int64 [B] and their confidences float32 [B] from the normed last hidden states
        hn [B, 1, D]: through the screened head (greedy_head.head_pick: the full head's argmax, the
        confidence within its proven interval, every stop at min_conf decided as the full head decides it),
        else from the full logits (the plain path's ops: ties go to the lower id)."""
        if self.screen:
            got = greedy_head.head_pick(hn[:, 0], self.head, None if min_conf is None else torch.from_numpy(min_conf))
            if got is not None:
                self.screened += 1
                return self._token(got[0]), got[1].numpy()
        self.full += 1
        logits = M.linear(hn, self.head).float()[:, 0]
        tok = logits.argmax(-1)
        return self._token(tok), torch.softmax(logits, -1).gather(-1, tok[:, None])[:, 0].float().numpy()

    def _token(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab is None else self.vocab.token(idx)

    def logits(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 logits of normed hidden states at the vocabulary's width (-inf outside a draft vocabulary)."""
        out = M.linear(hn, self.head).float()
        return out if self.vocab is None else self.vocab.widen(out)

    def run(self, jobs, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """LlamaDrafter.run for jobs whose extensions are all short: roll back, extend (right-padded, one
        forward), then n_steps greedy drafts, feeding each back in. Row lengths end as the eager path's."""
        cache = self.cache
        B = len(jobs)
        lens = [len(j.tokens) for j in jobs]
        T = max(lens)
        for j in jobs:
            cache.truncate(j.row, j.keep)
        toks = np.zeros((B, T), np.int64)  # right padding: causal, so it never leaks back
        for b, j in enumerate(jobs):
            toks[b, :lens[b]] = j.tokens
        keeps = [j.keep for j in jobs]
        rows = [j.row for j in jobs]
        for r, kp, n in zip(rows, keeps, lens, strict=True):
            end = max(kp + T, kp + n + n_steps - 1)  # the padded extension, then the drafts fed back
            if end > cache.max_len:
                raise ValueError(f"row {r}: positions up to {end} exceed the cache's max_len {cache.max_len}")
        start = torch.tensor(keeps)
        with torch.inference_mode():
            pos = start[:, None] + self.t_pos[:T][None, :]
            kv = max(keeps) + T
            hn = self.forward(torch.from_numpy(toks), pos, self.tables(pos, kv), rows, kv,
                              pick=torch.tensor([n - 1 for n in lens]))
            if n_steps == 0:
                out_d, out_c = np.zeros((B, 0), np.int32), np.zeros((B, 0), np.float32)
            else:
                # the decode steps' positions, RoPE rows and masks, made once for the whole STEP
                first = start + torch.tensor(lens)  # position of the first draft
                kv = max(k + n for k, n in zip(keeps, lens, strict=True))
                steps = first[:, None] + self.t_pos[:max(1, n_steps - 1)][None, :]  # [B, n_steps - 1]
                cos, sin, blocked = self.tables(steps, kv + n_steps - 1)
                out_t, confs = [], []
                pending = np.array([getattr(j, "min_conf", 0.0) for j in jobs], np.float32)  # confidence stop
                stopping = bool(pending.any())
                for s in range(n_steps):
                    # each step's draft and confidence (a softmax per step: row by row the values of one over
                    # all steps); with a stop, the stop decides whether to go on
                    tok, conf = self.pick(hn, pending if stopping else None)
                    out_t.append(tok)
                    confs.append(conf)
                    if stopping and all_stopped(conf, pending):
                        break
                    if s < n_steps - 1:
                        L = kv + s + 1
                        hn = self.forward(tok[:, None], steps[:, s:s + 1],
                                          (cos[:, s:s + 1], sin[:, s:s + 1], blocked[:, s:s + 1, :L]), rows, L)
                out_d = torch.stack(out_t, 1).to(torch.int32).numpy()
                out_c = np.stack(confs, 1)
                n_steps = len(out_t)  # fewer where every job's stop fired
        for b, j in enumerate(jobs):  # context + the drafts fed back (n_steps - 1), as the eager path leaves them
            cache.lengths[j.row] = j.keep + lens[b] + max(0, n_steps - 1)
        return out_d, out_c
