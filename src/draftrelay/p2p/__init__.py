"""P2P collectives for the TP drafter: push all-reduce and argmax exchange with bounded waits.

One concept per module: `protocol` (error bits, modes, op tags, payload checks), `reference` (the
oracle and the math), `emulated` (EmulatedGroup: every rank as torch ops, CPU included), `pair`
(P2PGroup: the CUDA kernels of kernels.cu between GPUs), `standin` (StandInGroup: one rank alone).
Importing this package needs no GPU; P2PGroup builds its kernels (nvcc) at first use.
"""

from .emulated import EmulatedGroup
from .pair import P2PGroup, wait_for_error
from .protocol import (
    DEFAULT_MODE,
    ERR_CANCELLED,
    ERR_EPOCH_EXHAUSTED,
    ERR_INVALID_ID,
    ERR_LOCAL_TIMEOUT,
    ERR_PEER_TIMEOUT,
    MAX_RANKS,
    P2PError,
    describe_error,
    op_tag,
)
from .reference import (
    combine_argmax,
    reference_all_reduce,
    reference_argmax,
    reference_shard_argmax,
    sum_in_rank_order,
)
from .standin import StandInGroup

__all__ = [
    "DEFAULT_MODE",
    "ERR_CANCELLED",
    "ERR_EPOCH_EXHAUSTED",
    "ERR_INVALID_ID",
    "ERR_LOCAL_TIMEOUT",
    "ERR_PEER_TIMEOUT",
    "MAX_RANKS",
    "EmulatedGroup",
    "P2PError",
    "P2PGroup",
    "StandInGroup",
    "combine_argmax",
    "describe_error",
    "op_tag",
    "reference_all_reduce",
    "reference_argmax",
    "reference_shard_argmax",
    "sum_in_rank_order",
    "wait_for_error",
]
