"""CUDA graphs for the verify forward, one per padded batch size, with the two-slot ring.

A captured graph reads its inputs from static device tensors, which the host refreshes before each
replay with an async copy out of a pinned host buffer. Refreshing the host buffer for step N+1 while
the copy of step N has not run yet is a race (the graph would read step N+1's positions in step N).
Two ways to make it safe:

  ring off: one slot per size; before refreshing, wait until the slot's previous replay finished
            (a drain). Byte-identical to eager by construction, but the host waits for the GPU.
  ring on:  two slots per size (pinned inputs, static device inputs, graph, output), alternated per
            step; each slot records a reuse event after its replay and the host waits only on that
            slot's event before refreshing it, so step N+1's refresh overlaps replay N.

The second capture needs a second set of retained outputs; both sizes of every slot are captured
into one shared memory pool after a warm-up, so no capture ever needs a fresh cudaMalloc. Graphs of
one pool may reuse each other's scratch: that is safe because they replay on one stream and every
replay's logits are read before the next replay.

A replay attends over a static kv_len, masked. One kv_len (the cache's max_len) would make a short
request in a 128K engine pay for 128K positions every step, so each batch size is captured once per
KV bucket (capture.kv_buckets: powers of two from KV_MIN up to max_len, the last bucket max_len
itself), and a step replays the smallest bucket that holds its longest row. The graph path does no host-side checks and
leaves cache.lengths alone (the engine sets them after acceptance).
"""

from __future__ import annotations

import torch

from draftrelay.capture import KV_MIN, GraphCapture, kv_bucket, kv_buckets
from draftrelay.model import KVCache, Transformer


class _NoEvent:
    """Stands in for a CUDA event where the 'replay' is an eager forward (CPU tests)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Slot:
    def __init__(self, B: int, T: int, device: torch.device, cuda: bool) -> None:
        # start | rows | tokens, in one pinned host buffer and one device buffer: one H2D per step
        self.host = torch.zeros(2 * B + B * T, dtype=torch.long, pin_memory=cuda)
        self.dev = torch.zeros(2 * B + B * T, dtype=torch.long, device=device)
        self.start = self.dev[:B]
        self.rows = self.dev[B:2 * B]
        self.tokens = self.dev[2 * B:].view(B, T)
        self.kv_len = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.done = torch.cuda.Event(blocking=True) if cuda else _NoEvent()  # reuse event, after each replay
        self.used = False


class DecodeGraphs:
    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, T: int, ring: bool = False,
                 sizes: list[int] | None = None, capture: bool = True, min_kv: int = KV_MIN) -> None:
        """capture=False: no CUDA graphs, each 'replay' is an eager forward over the same static
        buffers (the slot, bucket, padding and ring bookkeeping, testable on a CPU)."""
        if capture and model.device.type != "cuda":
            raise ValueError("decode graphs need the model on a CUDA device (capture=False emulates them)")
        self.model, self.cache, self.T, self.ring, self.capture = model, cache, T, ring, capture
        self.spare_row = cache.max_batch - 1  # padding rows write here; never read back
        self.sizes = sorted(set(sizes or _pow2_sizes(max_batch)))
        self.min_kv = min_kv
        self.buckets = kv_buckets(cache.max_len, min_kv)
        self.slots: dict[tuple[int, int], list[_Slot]] = {}  # (padded batch, kv bucket) -> slots
        self.turn: dict[tuple[int, int], int] = {}
        self.pool = None
        self.replays = 0
        self.drains = 0
        self.bucket_replays = dict.fromkeys(self.buckets, 0)
        self._capture_all()

    def fits(self, B: int, T: int) -> bool:
        return T <= self.T and B <= self.sizes[-1]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        dev = self.model.device
        n_slots = 2 if self.ring else 1
        for B in self.sizes:
            for kv in self.buckets:
                self.slots[B, kv] = [_Slot(B, self.T, dev, self.capture) for _ in range(n_slots)]
                self.turn[B, kv] = 0
                for s in self.slots[B, kv]:
                    s.kv_len = kv
        if not self.capture:
            return
        cap = GraphCapture(dev)
        # every key warmed up before the first capture (lazy kernels, workspaces and the allocator's blocks
        # for the largest shapes in place), then captured largest first into one pool (capture.py)
        for key, slots in self.slots.items():
            s = slots[0]
            self._fill_dummy(s, key[0])
            cap.warm(lambda s=s: self.model(s.tokens, s.start, self.cache, s.rows, kv_len=s.kv_len), times=2)
        torch.cuda.synchronize(dev)
        for key in sorted(self.slots, reverse=True):
            for s in self.slots[key]:
                self._fill_dummy(s, key[0])
                s.graph, s.logits = cap.capture(
                    lambda s=s: self.model(s.tokens, s.start, self.cache, s.rows, kv_len=s.kv_len))
        self.pool = cap.pool
        torch.cuda.synchronize(dev)

    def _fill_dummy(self, s: _Slot, B: int) -> None:
        s.start.zero_()
        s.rows.fill_(self.spare_row)
        s.tokens.zero_()

    def run(self, tokens: torch.Tensor, start: torch.Tensor, rows: torch.Tensor,
            device_drafts: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T'] (host; T' <= T), start/rows [B] (host) -> logits [B, T, V] (a view of the
        slot's output, valid until this slot's next replay). device_drafts: optional [B, T-1] int
        tensor on the GPU that overrides tokens[:, 1:] (drafts straight from the hand-off reply)."""
        B, Tq = tokens.shape
        P = next(p for p in self.sizes if p >= B)
        need = int(start.max()) + self.T  # every position this replay writes or reads
        key = (P, kv_bucket(need, self.cache.max_len, self.min_kv))
        slots = self.slots[key]
        i = self.turn[key]
        self.turn[key] = (i + 1) % len(slots)
        s = slots[i]
        if s.used:
            # the slot's pinned inputs may still be read by its last H2D copy: wait for its replay
            # (ring: the replay before last of this size; no ring: the previous step -> a drain)
            s.done.synchronize()
            self.drains += not self.ring
        h = s.host
        h.zero_()
        h[:B] = start
        h[P:P + B] = rows
        h[P + B:2 * P] = self.spare_row
        toks = h[2 * P:].view(P, self.T)
        toks[:B, :Tq] = tokens
        s.dev.copy_(h, non_blocking=True)
        if device_drafts is not None:
            n = min(device_drafts.shape[1], self.T - 1)
            s.tokens[:B, 1:1 + n].copy_(device_drafts[:B, :n])
        if self.capture:
            s.graph.replay()
        else:
            s.logits = self.model(s.tokens, s.start, self.cache, s.rows, kv_len=s.kv_len)
        s.done.record()
        s.used = True
        self.replays += 1
        self.bucket_replays[s.kv_len] += 1
        return s.logits[:B]


def _pow2_sizes(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out
