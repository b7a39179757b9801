"""EmulatedGroup: every rank in one process on any device (CPU included), the collectives as torch ops.

The development mode of the TP2 worker, and the pair's second oracle: the same bits as P2PGroup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .protocol import (
    DTYPE_CODES,
    ERR_INVALID_ID,
    KIND_ALL_REDUCE,
    KIND_ARGMAX,
    MAX_RANKS,
    P2PError,
    check_argmax_inputs,
    check_payload,
    describe_error,
    op_tag,
)
from .reference import combine_argmax, reference_shard_argmax, sum_in_rank_order


@dataclass
class _Pending:
    kind: int
    tag: int
    inputs: dict[int, tuple] = field(default_factory=dict)
    outputs: dict[int, tuple] = field(default_factory=dict)


class EmulatedGroup:
    """All ranks in one process on any device(s), collectives as torch ops; the same bits as the pair.

    Rank r's k-th collective joins every other rank's k-th one; the outputs are written when the last
    rank arrives (so in-place calls are fine: inputs are copied at call time). Mismatched collectives
    (kind or size) poison the group with ERR_INVALID_ID, like the pair.
    """

    def __init__(self, world_size: int) -> None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be 1..{MAX_RANKS}, got {world_size}")
        self.world_size = world_size
        self._err = [0] * world_size
        self._seq = [0] * world_size
        self._ops: dict[int, _Pending] = {}

    # --- the common API ---
    def preload(self) -> None:
        return None

    def errors(self) -> list[int]:
        return list(self._err)

    def check(self) -> None:
        if any(self._err):
            raise P2PError(f"collective failed: {[describe_error(e) for e in self._err]}", self._err)

    def reset(self, epoch_base: int = 0) -> None:
        self._err = [0] * self.world_size
        self._seq = [0] * self.world_size
        self._ops.clear()

    def pending(self) -> int:
        return len(self._ops)

    # no waits to bound or interrupt here; kept so the worker can swap the two groups
    def set_timeout(self, timeout_ms: float) -> None:
        return None

    def cancel(self) -> None:
        return None

    def close(self) -> None:
        self.reset()

    def all_reduce(
        self, rank: int, x: torch.Tensor, out: torch.Tensor | None = None, stream: object = None
    ) -> torch.Tensor:
        check_payload(x, "all_reduce")
        out = torch.empty_like(x) if out is None else out
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError("all_reduce: out must match x in shape and dtype")
        tag = op_tag(KIND_ALL_REDUCE, DTYPE_CODES[x.dtype], x.numel())
        self._join(rank, KIND_ALL_REDUCE, tag, (x.clone(),), (out,))
        return out

    def argmax_exchange(
        self, rank: int, val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None = None, *, vocab: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None, stream: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        check_argmax_inputs(val, idx, val2)
        if out is None:
            out = (torch.empty_like(val), torch.empty_like(idx), None if val2 is None else torch.empty_like(val))
        tag = op_tag(KIND_ARGMAX, 0, val.numel())
        inputs = (val.clone(), idx.clone(), None if val2 is None else val2.clone(), vocab)
        self._join(rank, KIND_ARGMAX, tag, inputs, out)
        return out

    def shard_argmax(
        self, rank: int, logits: torch.Tensor, offset: int, top2: bool = False, stream: object = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        v1, idx, v2 = reference_shard_argmax(logits, offset)
        return v1, idx, (v2 if top2 else None)

    # --- internals ---
    def _join(self, rank: int, kind: int, tag: int, inputs: tuple, outputs: tuple) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        if any(self._err):
            raise P2PError(f"group is poisoned ({describe_error(max(self._err))}); reset() it first", self._err)
        k = self._seq[rank]
        self._seq[rank] += 1
        op = self._ops.setdefault(k, _Pending(kind, tag))
        if op.tag != tag:
            self._err = [ERR_INVALID_ID] * self.world_size
            raise P2PError(f"rank {rank}'s collective #{k} does not match its peers' (kind/size differ)", self._err)
        op.inputs[rank] = inputs
        op.outputs[rank] = outputs
        if len(op.inputs) < self.world_size:
            return
        del self._ops[k]
        ranks = range(self.world_size)
        if kind == KIND_ALL_REDUCE:
            for r in ranks:
                dev = op.outputs[r][0].device
                res = sum_in_rank_order([op.inputs[q][0].to(dev) for q in ranks], op.outputs[r][0].dtype)
                op.outputs[r][0].copy_(res)
            return
        vocab = op.inputs[0][3]
        for r in ranks:
            o1, oi, o2 = op.outputs[r]
            dev = o1.device
            ids = [op.inputs[q][1].to(dev) for q in ranks]
            if any(bool(((i < 0) | (i >= vocab)).any()) for i in ids):
                self._err = [ERR_INVALID_ID] * self.world_size
                raise P2PError("argmax_exchange: an id outside [0, vocab) was exchanged", self._err)
            v1, i1, s2 = combine_argmax(
                [op.inputs[q][0].to(dev) for q in ranks], ids,
                [None if op.inputs[q][2] is None else op.inputs[q][2].to(dev) for q in ranks],
            )
            o1.copy_(v1)
            oi.copy_(i1)
            if o2 is not None:
                o2.copy_(s2)
