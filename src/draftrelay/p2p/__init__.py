"""P2P collectives for the TP2 drafter: push all-reduce and argmax exchange with bounded waits.

Importing this package needs no GPU; `P2PGroup` builds its CUDA kernels (kernels.cu, nvcc) at first use.
"""

from .collectives import (
    ERR_CANCELLED,
    ERR_EPOCH_EXHAUSTED,
    ERR_INVALID_ID,
    ERR_LOCAL_TIMEOUT,
    ERR_PEER_TIMEOUT,
    EmulatedGroup,
    P2PError,
    P2PGroup,
    combine_argmax,
    describe_error,
    op_tag,
    reference_all_reduce,
    reference_argmax,
    reference_shard_argmax,
    sum_in_rank_order,
    wait_for_error,
)

__all__ = [
    "ERR_CANCELLED",
    "ERR_EPOCH_EXHAUSTED",
    "ERR_INVALID_ID",
    "ERR_LOCAL_TIMEOUT",
    "ERR_PEER_TIMEOUT",
    "EmulatedGroup",
    "P2PError",
    "P2PGroup",
    "combine_argmax",
    "describe_error",
    "op_tag",
    "reference_all_reduce",
    "reference_argmax",
    "reference_shard_argmax",
    "sum_in_rank_order",
    "wait_for_error",
]
