"""P2PGroup: the real collectives between the GPUs of one host (kernels.cu, loaded by native.py).

Each rank pushes its payload over NVLink into the peers' receive buffers, signals with system-scope
release stores, waits with bounded acquire loads and combines in fp32 in rank order (reference.py's
math, bit for bit). Graph-capturable: per-rank calls launch on that rank's current stream and keep all
state on the device. docs/P2P.md has the protocol and the figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .protocol import (
    DEFAULT_MODE,
    DTYPE_CODES,
    KIND_ALL_REDUCE,
    KIND_ARGMAX,
    MAX_RANKS,
    P2PError,
    check_argmax_inputs,
    check_payload,
    describe_error,
    op_tag,
)


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

    # The kernels' source: None = p2p/kernels.cu. Only a measurement build (a benchmark's subclass)
    # points it at a file that includes kernels.cu with extra, unsafe modes.
    kernels: Path | None = None

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
        self._lib = native.load(_arch_for(self.devices[0]), self.kernels or native.SOURCE)
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
                    raise RuntimeError(f"p2p_ctx_new refused its arguments (or mode {self.mode:#x} of this build)")
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
        check_payload(x, "all_reduce")
        if x.numel() * x.element_size() > self.max_bytes:
            nbytes = x.numel() * x.element_size()
            raise ValueError(f"all_reduce: {nbytes} B exceeds the group's capacity {self.max_bytes} B")
        if out is None:
            with _on(stream):  # allocate on the stream that uses it (the caching allocator is per stream)
                out = torch.empty_like(x)
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError("all_reduce: out must be contiguous and match x in shape and dtype")
        handle = self._launch_prep(rank, (x, out), stream)
        code = DTYPE_CODES[x.dtype]
        rc = self._lib.p2p_allreduce(self._ctx[rank], code, x.data_ptr(), out.data_ptr(), x.numel(),
                                     op_tag(KIND_ALL_REDUCE, code, x.numel()), 0, handle)
        self._check(self._lib, rc, "all_reduce launch")
        return out

    def argmax_exchange(
        self, rank: int, val: torch.Tensor, idx: torch.Tensor, val2: torch.Tensor | None = None, *, vocab: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        check_argmax_inputs(val, idx, val2)
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
        if logits.dim() != 2 or logits.shape[1] < 1 or logits.stride(1) != 1 or logits.dtype not in DTYPE_CODES:
            raise ValueError("shard_argmax: logits must be [rows, V>=1], float32/bfloat16, unit stride in V")
        rows = logits.shape[0]
        with _on(stream):
            o1 = torch.empty(rows, dtype=torch.float32, device=logits.device)
            oi = torch.empty(rows, dtype=torch.int64, device=logits.device)
            o2 = torch.empty_like(o1) if top2 else None
        handle = self._launch_prep(rank, (logits,), stream)
        rc = self._lib.p2p_shard_argmax(
            self.devices[rank].index, DTYPE_CODES[logits.dtype], logits.data_ptr(), rows, logits.shape[1],
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
