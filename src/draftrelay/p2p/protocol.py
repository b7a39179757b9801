"""The P2P collectives' shared vocabulary: error bits, protocol mode bits, op tags, payload checks.

The numbers are the same in kernels.cu. Imports no GPU code (the emulation and the oracle use it too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# error bits (the same in kernels.cu)
ERR_LOCAL_TIMEOUT = 1
ERR_PEER_TIMEOUT = 2
ERR_INVALID_ID = 4
ERR_CANCELLED = 8
ERR_EPOCH_EXHAUSTED = 16
ERR_NAMES = {
    ERR_LOCAL_TIMEOUT: "local timeout",
    ERR_PEER_TIMEOUT: "peer timeout",
    ERR_INVALID_ID: "invalid id",
    ERR_CANCELLED: "cancelled",
    ERR_EPOCH_EXHAUSTED: "epoch exhausted",
}

# protocol mode bits (kernels.cu); docs/P2P.md has what each costs on the H200 pair
M_SPIN_RELAXED = 1  # spin with relaxed loads, one acquire load once the flag is there
M_ACK_RELAXED = 2  # consumption acks as relaxed stores (the reads they cover completed before a barrier)
M_SINGLE_FLAG = 4  # one flag per op released by the last block (instead of one per block)
M_EAGER_CANCEL = 8  # poll the host cancel word (a PCIe read) from the start of every wait: ~1 us per block
M_BLOCK_EPOCH = 16  # one epoch word per block: no end-of-kernel atomic on the critical path
DEFAULT_MODE = M_SPIN_RELAXED | M_ACK_RELAXED | M_BLOCK_EPOCH

KIND_ALL_REDUCE = 1
KIND_ARGMAX = 2
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_RANKS = 8


def describe_error(bits: int) -> str:
    names = [name for bit, name in ERR_NAMES.items() if bits & bit]
    return ", ".join(names) if names else "ok"


class P2PError(RuntimeError):
    """A collective failed (timeout, desync, cancel, exhaustion) or the group refuses launches."""

    def __init__(self, message: str, errors: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


def op_tag(kind: int, code: int, n: int) -> int:
    """32-bit tag carried in every flag: both ranks must run the same collective on the same size."""
    return ((kind & 0xF) | ((code & 0xF) << 4) | ((n & 0xFFFFFF) << 8)) & 0xFFFFFFFF


def check_payload(x: torch.Tensor, what: str) -> None:
    if x.dtype not in DTYPE_CODES:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported (float32 or bfloat16)")
    if not x.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")


def check_argmax_inputs(val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None) -> None:
    if val.dim() != 1 or val.dtype != torch.float32 or not val.is_contiguous():
        raise ValueError(
            f"argmax_exchange: val must be a contiguous 1-D float32 tensor, got {val.dtype} {tuple(val.shape)}"
        )
    if idx.shape != val.shape or idx.dtype != torch.int64 or not idx.is_contiguous():
        raise ValueError(f"argmax_exchange: idx must be contiguous int64 of shape {tuple(val.shape)}")
    if val2 is not None and (val2.shape != val.shape or val2.dtype != torch.float32 or not val2.is_contiguous()):
        raise ValueError(f"argmax_exchange: val2 must be contiguous float32 of shape {tuple(val.shape)}")
