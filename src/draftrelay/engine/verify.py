"""The verify forward: one target forward over [pending, d1..dk] for every request of the batch.

Three ways to run it, behind `Verifier.verify`:

  host drafts, graphs    the narrowest captured decode graph that fits the batch and width
  host drafts, eager     a plain forward (rows padded to the longest draft)
  device drafts          CUDA async rounds: the drafts are read on the GPU from the reply buffer the
                         hand-off fills, and the forward is enqueued right behind the stream's parked
                         wait (`enqueue`, before the engine waits for the round's result on the host),
                         through a graph when one fits, else eager

A failed round leaves stale bytes in the reply buffer: they are clamped into the vocabulary (so they
can never index outside the embedding) and never accepted, because the drafts the GPU used are
checked against the ones the host validated; position 0 does not depend on them at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from draftrelay import greedy_head
from draftrelay.model import KVCache, Transformer, to_device

from .request import Request


def drafts_from_reply(buf: torch.Tensor, layout, n_req: int, width: int, vocab: int) -> torch.Tensor:
    """The [n_req, width] draft-token block of a reply slot's bytes (a uint8 tensor on any device),
    clamped into the vocabulary so stale or garbage bytes can never index outside the embedding."""
    cfg = layout.cfg
    raw = buf[layout.reply_drafts_off:layout.reply_drafts_off + 4 * cfg.max_requests * cfg.max_drafts]
    return raw.view(torch.int32).view(cfg.max_requests, cfg.max_drafts)[:n_req, :width].clamp(0, vocab - 1).long()


@dataclass
class VerifyInputs:
    """What the verify needs that does not depend on the drafts (built while an async round runs)."""

    pending: list[int]  # each request's pending token: sampled, not yet in the target's KV
    start: torch.Tensor  # its position
    rows: torch.Tensor  # KV rows

    @classmethod
    def of(cls, batch: list[Request]) -> VerifyInputs:
        return cls([r.output[-1] for r in batch], torch.tensor([r.seq_len - 1 for r in batch], dtype=torch.long),
                   torch.tensor([r.row for r in batch], dtype=torch.long))


class Enqueued(NamedTuple):
    """A verify already on the stream: its logits, and the draft tokens the GPU fed it."""

    logits: torch.Tensor
    used: torch.Tensor


class Verified(NamedTuple):
    logits: torch.Tensor | None  # [B, >= 1 + len(drafts[i]), V]; None when only the argmax was asked for
    argmax: list[list[int]] | None  # logits.argmax(-1) on the host, when a greedy request needs it
    drafts: list[list[int]]  # the drafts verified for each request (a subset of the host's)


class Verifier:
    def __init__(self, model: Transformer, cache: KVCache, graphs: dict[int, Any], n_draft: int) -> None:
        self.model, self.cache, self.n_draft = model, cache, n_draft
        self.graphs = graphs  # verify width T -> DecodeGraphs (empty: eager only)
        self.vocab = model.cfg.vocab_size
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if greedy_head.usable(torch.empty(1, head.shape[1], dtype=head.dtype), head):
            greedy_head.screened_for(head)  # the int8 copy built now (~2 s at 151,936 rows), not in a request's step

    def enqueue(self, inp: VerifyInputs, buf: torch.Tensor, layout, T: int) -> Enqueued:
        """Verify fed from the device copy of a round's reply (CUDA async rounds)."""
        B = len(inp.pending)
        dd = drafts_from_reply(buf, layout, B, T - 1, self.vocab)
        g = self.graphs.get(T) or self.graphs.get(self.n_draft + 1)
        if g is not None and g.fits(B, T):
            tokens = torch.zeros(B, 1, dtype=torch.long)
            tokens[:, 0] = torch.tensor(inp.pending, dtype=torch.long)
            return Enqueued(g.run(tokens, inp.start, inp.rows, device_drafts=dd), dd)
        tokens = torch.empty(B, T, dtype=torch.long, device=self.model.device)
        tokens[:, 0] = to_device(torch.tensor(inp.pending, dtype=torch.long), self.model.device)
        tokens[:, 1:] = dd
        return Enqueued(self.model(tokens, inp.start, self.cache, inp.rows), dd)

    def verify(self, inp: VerifyInputs, drafts: list[list[int]], enqueued: Enqueued | None = None,
               argmax: bool = True, logits: bool = True) -> Verified:
        """The logits for each request's [pending, drafts]: from the forward `enqueue` already put on
        the stream (a request's drafts are kept only if the GPU used exactly those), else run now.
        logits=False (every request greedy): the argmax only, and an eager forward computes just that
        (model.forward's argmax_only: on the CPU the head is screened instead of read whole)."""
        if enqueued is not None:
            out = enqueued.logits
        else:
            out = self._forward(inp, drafts, argmax_only=argmax and not logits)
            if out.dim() == 2:  # the argmax itself (a captured graph returns its logits anyway)
                return Verified(None, out.tolist(), drafts)
        am = out.argmax(-1).tolist() if argmax else None
        if enqueued is not None:
            used = enqueued.used.tolist()
            drafts = [d if used[i][:len(d)] == d else [] for i, d in enumerate(drafts)]
        return Verified(out, am, drafts)

    def _forward(self, inp: VerifyInputs, drafts: list[list[int]], argmax_only: bool = False) -> torch.Tensor:
        """The verify's logits [B, T, V]; with argmax_only an eager forward returns their argmax [B, T]
        instead (a captured graph still returns its logits)."""
        B, T = len(drafts), 1 + max(len(d) for d in drafts)
        tokens = torch.zeros(B, T, dtype=torch.long)
        for i, (p, d) in enumerate(zip(inp.pending, drafts, strict=True)):
            tokens[i, 0] = p
            tokens[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        for width in sorted(self.graphs):  # the narrowest captured graph that fits
            if self.graphs[width].fits(B, T):
                return self.graphs[width].run(tokens, inp.start, inp.rows)
        return self.model(tokens, inp.start, self.cache, inp.rows, argmax_only=argmax_only)
