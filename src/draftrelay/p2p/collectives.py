"""P2P collectives for tensor-parallel drafting: one controller process, N ranks (one GPU each).

Three implementations of the same math, bit for bit:

* `P2PGroup` - the real thing: CUDA kernels (kernels.cu) that push each rank's payload over NVLink
  into the peers' receive buffers, signal with system-scope release stores, wait with bounded acquire
  loads and combine in fp32 in rank order. Graph-capturable: per-rank calls launch on that rank's
  current stream and keep all state on the device.
* `EmulatedGroup` - torch ops on any device (CPU included): the development mode of the TP2 worker.
  Rank r's call returns its output tensor, which is filled once every rank has made the same call
  (single-controller lockstep: the controller issues each op for every rank in turn).
* `reference_*` - the oracle: plain torch copies to every rank's device and fp32 adds.

Math (identical everywhere): all-reduce out = dtype(((x0 + x1) + x2) + ...) with every term in fp32,
one rounding at the end; argmax exchange per row: the best (value, id) over ranks, a NaN value beats
any number, equal values go to the lower id; top2 = the larger of the winner's own runner-up and every
other rank's best value.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

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
M_FLAG_RELAXED = 32  # UNSAFE (no ordering of the payload before the flag): only to price the release fence
DEFAULT_MODE = M_SPIN_RELAXED | M_ACK_RELAXED | M_BLOCK_EPOCH

KIND_ALL_REDUCE = 1
KIND_ARGMAX = 2
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
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


def _check_payload(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported (float32 or bfloat16)")
    if not x.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")


def _check_argmax_inputs(val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None) -> None:
    if val.dim() != 1 or val.dtype != torch.float32 or not val.is_contiguous():
        raise ValueError(
            f"argmax_exchange: val must be a contiguous 1-D float32 tensor, got {val.dtype} {tuple(val.shape)}"
        )
    if idx.shape != val.shape or idx.dtype != torch.int64 or not idx.is_contiguous():
        raise ValueError(f"argmax_exchange: idx must be contiguous int64 of shape {tuple(val.shape)}")
    if val2 is not None and (val2.shape != val.shape or val2.dtype != torch.float32 or not val2.is_contiguous()):
        raise ValueError(f"argmax_exchange: val2 must be contiguous float32 of shape {tuple(val.shape)}")


# --------------------------------------------------------------------------------------------------
# the math, in torch (shared by the emulation and the oracle)


def sum_in_rank_order(terms: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = terms[0].to(torch.float32)
    for t in terms[1:]:
        acc = acc + t.to(torch.float32)
    return acc.to(dtype)


def _better(av: torch.Tensor, ai: torch.Tensor, bv: torch.Tensor, bi: torch.Tensor) -> torch.Tensor:
    an, bn = torch.isnan(av), torch.isnan(bv)
    return torch.where(an != bn, an, torch.where(~an & (av != bv), av > bv, ai < bi))


def combine_argmax(
    v1s: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], v2s: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-rank (top1, id, top2) rows in rank order, as the kernel does."""
    wv, wi = v1s[0], ids[0]
    wk = torch.zeros_like(ids[0])
    for k in range(1, len(v1s)):
        b = _better(v1s[k], ids[k], wv, wi)
        wv, wi = torch.where(b, v1s[k], wv), torch.where(b, ids[k], wi)
        wk = torch.where(b, torch.full_like(wk, k), wk)
    s2 = torch.full_like(wv, float("-inf"))
    for k in range(len(v1s)):
        own2 = v2s[k] if v2s[k] is not None else torch.full_like(wv, float("-inf"))
        cand = torch.where(wk == k, own2, v1s[k])
        s2 = torch.where(cand > s2, cand, s2)
    return wv, wi, s2


def reference_shard_argmax(
    logits: torch.Tensor, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top1 value, lowest id of it + offset, top2 value) per row; a NaN counts as the largest value."""
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"shard_argmax: logits must be 2-D [rows, V>=1], got {tuple(logits.shape)}")
    x = logits.to(torch.float32)
    rows, v = x.shape
    ar = torch.arange(v, device=x.device).expand(rows, v)
    nan = torch.isnan(x)
    big = torch.full_like(ar, v)
    x_nonan = torch.where(nan, torch.full_like(x, float("-inf")), x)
    m = x_nonan.max(dim=1).values
    first_max = torch.where(x_nonan == m[:, None], ar, big).min(dim=1).values
    first_nan = torch.where(nan, ar, big).min(dim=1).values
    has_nan = nan.any(dim=1)
    idx = torch.where(has_nan, first_nan, first_max)
    v1 = torch.where(has_nan, torch.full_like(m, float("nan")), m)
    if v >= 2:
        v2 = torch.topk(x_nonan, 2, dim=1).values[:, 1].contiguous()
    else:
        v2 = torch.full_like(m, float("-inf"))
    return v1, idx.to(torch.int64) + offset, v2


def reference_all_reduce(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle: every rank copies every payload to its own device, adds in fp32 in rank order."""
    outs = []
    for x in xs:
        gathered = [t.to(x.device, copy=True) for t in xs]
        outs.append(sum_in_rank_order(gathered, x.dtype))
    return outs


def reference_argmax(shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle for a vocabulary split: argmax of the concatenated logits (rank 0 = lowest ids)."""
    full = torch.cat([s.to(shards[0].device, torch.float32) for s in shards], dim=1)
    return reference_shard_argmax(full, 0)


# --------------------------------------------------------------------------------------------------
# emulation


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
        _check_payload(x, "all_reduce")
        out = torch.empty_like(x) if out is None else out
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError("all_reduce: out must match x in shape and dtype")
        self._join(rank, KIND_ALL_REDUCE, op_tag(KIND_ALL_REDUCE, _DTYPES[x.dtype], x.numel()), (x.clone(),), (out,))
        return out

    def argmax_exchange(
        self, rank: int, val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None = None, *, vocab: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None, stream: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        _check_argmax_inputs(val, idx, val2)
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


# --------------------------------------------------------------------------------------------------
# the real pair


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _arch_for(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class P2PGroup:
    """N ranks on N GPUs of one host (a device may repeat: both ranks on one GPU, for development).

    Per-rank calls (`all_reduce(rank, ...)`) launch on that rank's current stream (or `stream=`) and
    can be captured into that rank's CUDA graph. A collective completes only when every rank has
    launched its half; the controller issues each op for every rank in turn (never wait on rank 0's
    output before launching rank 1's half). After a step, call `check()` (or `errors()`).
    """

    def __init__(
        self, devices: Sequence[int | torch.device], *, max_bytes: int = 2 << 20, blocks: int = 64,
        threads: int = 512, timeout_ms: float = 2000.0, mode: int | None = None,
    ) -> None:
        from . import native

        if not torch.cuda.is_available():
            raise RuntimeError("P2PGroup needs CUDA; use EmulatedGroup on a machine without a GPU")
        devs = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
        if not 1 <= len(devs) <= MAX_RANKS or any(d.type != "cuda" for d in devs):
            raise ValueError(f"devices must be 1..{MAX_RANKS} CUDA devices, got {devices}")
        if not 1 <= blocks <= 1024 or threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(
                f"blocks must be 1..1024 and threads a multiple of 32 in 32..1024 (got {blocks}, {threads})"
            )
        self.devices = [torch.device("cuda", d.index if d.index is not None else 0) for d in devs]
        self.world_size = len(self.devices)
        self.blocks, self.threads = blocks, threads
        self.region = ((max_bytes + blocks - 1) // blocks + 15) // 16 * 16  # bytes per (slot, source, block)
        self.max_bytes = self.region * blocks
        self.timeout_ms = float(timeout_ms)
        self.mode = DEFAULT_MODE if mode is None else int(mode)
        self._lib = native.load(_arch_for(self.devices[0]))
        self._check = native.check
        self._poisoned = 0
        self._dead = ""
        self._streams: dict[int, int] = {}  # stream handle -> device index, every stream we launched on
        self._bases: list[int] = []
        self._ctx: list[int] = []
        self._side: list[int] = []
        self._cancel_host = ctypes.c_void_p()
        self._hdr_host = ctypes.c_void_p()
        lib = self._lib
        idx = [d.index for d in self.devices]
        # peer access, verified by a real peer write and read in both directions
        for a in sorted(set(idx)):
            for b in sorted(set(idx)):
                if a != b:
                    self._check(lib, lib.p2p_enable_peer(a, b), f"enable peer access {a}->{b}")
        for a in sorted(set(idx)):
            for b in sorted(set(idx)):
                if a != b:
                    self._check(lib, lib.p2p_probe(a, b), f"peer write/read probe {a}->{b}")
        try:
            # state: plain device allocations, made here (outside any capture), never moved
            nbytes = lib.p2p_state_bytes(self.world_size, blocks, self.region)
            for d in idx:
                p = ctypes.c_void_p()
                rc = lib.p2p_malloc(d, nbytes, ctypes.byref(p))
                self._check(lib, rc, f"allocate {nbytes} B of P2P state on cuda:{d}")
                self._bases.append(p.value)
            cancel_dev = ctypes.c_void_p()
            rc = lib.p2p_host_word(ctypes.byref(self._cancel_host), ctypes.byref(cancel_dev))
            self._check(lib, rc, "cancel word")
            self._cancel_word = ctypes.cast(self._cancel_host, ctypes.POINTER(ctypes.c_uint32))
            # pinned landing words for header reads (a pageable copy could serialize behind a parked kernel)
            hdr_dev = ctypes.c_void_p()
            self._check(lib, lib.p2p_host_word(ctypes.byref(self._hdr_host), ctypes.byref(hdr_dev)), "header words")
            self._hdr = ctypes.cast(self._hdr_host, ctypes.POINTER(ctypes.c_uint32))
            bases = (ctypes.c_void_p * self.world_size)(*self._bases)
            for r, d in enumerate(idx):
                ctx = lib.p2p_ctx_new(d, r, self.world_size, blocks, threads, self.region,
                                      int(self.timeout_ms * 1e6), bases, cancel_dev, self.mode)
                if not ctx:
                    raise RuntimeError("p2p_ctx_new refused its arguments")
                self._ctx.append(ctx)
                s = ctypes.c_void_p()
                self._check(lib, lib.p2p_stream_create(d, ctypes.byref(s)), "side stream")
                self._side.append(s.value)
            self.reset()
            self.preload()
        except BaseException:
            self._release()  # nothing was launched that uses the state yet: free what was made
            raise

    # --- lifecycle ---
    def preload(self) -> None:
        """Launch every kernel once on every device (lazy module loading could otherwise stall a
        device while a collective spins on it)."""
        for ctx in self._ctx:
            self._check(self._lib, self._lib.p2p_preload(ctx), "preload")

    def set_timeout(self, timeout_ms: float) -> None:
        """Applies to launches made after this call (a captured graph keeps the value it was captured with)."""
        self.timeout_ms = float(timeout_ms)
        for ctx in self._ctx:
            self._lib.p2p_ctx_set_timeout(ctx, int(self.timeout_ms * 1e6))

    def headers(self) -> list[tuple[int, int, int]]:
        """(epoch, done, error) per rank, read on side streams (works while a collective is parked)."""
        out = []
        for r, ctx in enumerate(self._ctx):
            rc = self._lib.p2p_read_header(ctx, self._hdr, self._side[r], int(max(self.timeout_ms, 1000) * 2e6))
            if rc:
                self._dead = f"reading rank {r}'s header failed (code {rc})"
                self._check(self._lib, rc, "read header")
            out.append((int(self._hdr[0]), int(self._hdr[1]), int(self._hdr[2])))
        return out

    def errors(self) -> list[int]:
        errs = [h[2] for h in self.headers()]
        if any(errs):
            self._poisoned |= max(errs)
        return errs

    def check(self) -> None:
        errs = self.errors()
        if any(errs):
            raise P2PError(f"collective failed: {[describe_error(e) for e in errs]}", errs)

    def cancel(self) -> None:
        """Interrupt every parked wait (any stream, any rank): they end with ERR_CANCELLED."""
        self._cancel_word[0] = 1

    def reset(self, epoch_base: int = 0, streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Drain (bounded) every stream we launched on plus `streams`, then clear flags, acks, errors.

        `epoch_base` starts the next generation's counter (tests use a value near 2**32 to reach
        exhaustion). If a stream does not drain in time the group is dead for good: nothing is cleared
        while the GPU may still use the state.
        """
        if self._dead:
            raise P2PError(f"group is unusable: {self._dead}")
        if not 0 <= epoch_base <= 0xFFFFFFFF:
            raise ValueError("epoch_base must fit in 32 bits")
        pending = dict(self._streams)
        for d in self.devices:
            pending[torch.cuda.current_stream(d).cuda_stream] = d.index
        for s in streams:
            pending[s.cuda_stream] = s.device.index
        bound_ns = int(max(self.timeout_ms, 100.0) * 3e6) + 1_000_000_000
        for handle, dev in pending.items():
            rc = self._lib.p2p_stream_wait(dev, handle, bound_ns)
            if rc:
                self._dead = f"stream {handle:#x} on cuda:{dev} did not drain (code {rc})"
                raise P2PError(f"group is unusable: {self._dead}")
        for r, ctx in enumerate(self._ctx):
            self._check(self._lib, self._lib.p2p_reset_state(ctx, epoch_base, self._side[r]), "reset")
        for r, d in enumerate(self.devices):
            self._check(self._lib, self._lib.p2p_stream_wait(d.index, self._side[r], bound_ns), "reset drain")
        self._cancel_word[0] = 0
        self._poisoned = 0
        self._streams.clear()

    def close(self) -> None:
        """Free the state (drains first). The caller must have dropped every graph that uses it."""
        if not self._ctx:
            return
        try:
            self.reset()
        finally:
            self._release()

    def _release(self) -> None:
        lib = self._lib
        for r, s in enumerate(self._side):
            lib.p2p_stream_destroy(self.devices[r].index, s)
        for r, base in enumerate(self._bases):
            lib.p2p_free(self.devices[r].index, base)
        for ctx in self._ctx:
            lib.p2p_ctx_free(ctx)
        for word in (self._cancel_host, self._hdr_host):
            if word.value:
                lib.p2p_free_host(word)
                word.value = None
        self._ctx, self._bases, self._side = [], [], []

    # --- collectives ---
    def _launch_prep(self, rank: int, tensors: Sequence[torch.Tensor | None], stream: torch.cuda.Stream | None) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        if self._dead or self._poisoned:
            raise P2PError(f"group refuses launches ({self._dead or describe_error(self._poisoned)}); reset() it first")
        dev = self.devices[rank]
        for t in tensors:
            if t is not None and t.device != dev:
                raise ValueError(f"rank {rank}'s tensors must be on {dev}, got {t.device}")
        s = stream if stream is not None else torch.cuda.current_stream(dev)
        if s.device != dev:
            raise ValueError(f"rank {rank}'s stream must be on {dev}")
        handle = s.cuda_stream
        if not torch.cuda.is_current_stream_capturing():
            self._streams[handle] = dev.index
        return handle

    def all_reduce(
        self, rank: int, x: torch.Tensor, out: torch.Tensor | None = None, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor:
        _check_payload(x, "all_reduce")
        if x.numel() * x.element_size() > self.max_bytes:
            nbytes = x.numel() * x.element_size()
            raise ValueError(f"all_reduce: {nbytes} B exceeds the group's capacity {self.max_bytes} B")
        if out is None:
            with _on(stream):  # allocate on the stream that uses it (the caching allocator is per stream)
                out = torch.empty_like(x)
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError("all_reduce: out must be contiguous and match x in shape and dtype")
        handle = self._launch_prep(rank, (x, out), stream)
        code = _DTYPES[x.dtype]
        rc = self._lib.p2p_allreduce(self._ctx[rank], code, x.data_ptr(), out.data_ptr(), x.numel(),
                                     op_tag(KIND_ALL_REDUCE, code, x.numel()), 0, handle)
        self._check(self._lib, rc, "all_reduce launch")
        return out

    def argmax_exchange(
        self, rank: int, val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None = None, *, vocab: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        _check_argmax_inputs(val, idx, val2)
        if not 0 < vocab < 2**31:
            raise ValueError(f"argmax_exchange: vocab must be in 1..2**31-1, got {vocab}")
        if out is None:
            with _on(stream):
                out = (torch.empty_like(val), torch.empty_like(idx), None if val2 is None else torch.empty_like(val))
        o1, oi, o2 = out
        if (o2 is None) != (val2 is None):
            raise ValueError("argmax_exchange: pass val2 and out[2] together (top2 wanted) or neither")
        handle = self._launch_prep(rank, (val, idx, val2, o1, oi, o2), stream)
        rows = val.numel()
        rc = self._lib.p2p_argmax_xchg(
            self._ctx[rank], val.data_ptr(), idx.data_ptr(), None if val2 is None else val2.data_ptr(),
            o1.data_ptr(), oi.data_ptr(), None if o2 is None else o2.data_ptr(), rows, vocab,
            op_tag(KIND_ARGMAX, 0, rows), 0, handle)
        self._check(self._lib, rc, "argmax_exchange launch")
        return out

    def shard_argmax(
        self, rank: int, logits: torch.Tensor, offset: int, top2: bool = False,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Local (no communication) deterministic (top1, lowest id + offset, top2) per row of a shard."""
        if logits.dim() != 2 or logits.shape[1] < 1 or logits.stride(1) != 1 or logits.dtype not in _DTYPES:
            raise ValueError("shard_argmax: logits must be [rows, V>=1], float32/bfloat16, unit stride in V")
        rows = logits.shape[0]
        with _on(stream):
            o1 = torch.empty(rows, dtype=torch.float32, device=logits.device)
            oi = torch.empty(rows, dtype=torch.int64, device=logits.device)
            o2 = torch.empty_like(o1) if top2 else None
        handle = self._launch_prep(rank, (logits,), stream)
        rc = self._lib.p2p_shard_argmax(
            self.devices[rank].index, _DTYPES[logits.dtype], logits.data_ptr(), rows, logits.shape[1],
            logits.stride(0), offset, o1.data_ptr(), oi.data_ptr(), None if o2 is None else o2.data_ptr(), 0, handle)
        self._check(self._lib, rc, "shard_argmax launch")
        return o1, oi, o2

    def delay(self, rank: int, microseconds: float, stream: torch.cuda.Stream | None = None) -> None:
        """Test helper: a kernel that spins for `microseconds` on rank's stream (a delayed stream)."""
        handle = self._launch_prep(rank, (), stream)
        self._check(self._lib, self._lib.p2p_sleep(self.devices[rank].index, int(microseconds * 1000), handle), "delay")

    # --- list helpers for eager lockstep ---
    def all_reduce_all(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self.all_reduce(r, x) for r, x in enumerate(xs)]


def wait_for_error(group: P2PGroup, timeout_s: float) -> tuple[list[int], float]:
    """Poll the error words until every rank has one set (or timeout_s passes); returns (errors, seconds)."""
    t0 = time.monotonic()
    while True:
        errs = [h[2] for h in group.headers()]
        if all(errs) or time.monotonic() - t0 > timeout_s:
            return errs, time.monotonic() - t0
        time.sleep(0.001)
