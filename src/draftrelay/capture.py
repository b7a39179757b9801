"""CUDA-graph capture in one place, and the KV-bucket rule every captured forward uses.

The engine's verify graphs (engine.graphs), the worker's draft-step graphs (worker.drafters) and the
tensor-parallel ranks' graphs (worker.tp) all capture through `GraphCapture`:

  * an explicit capture stream on the graph's own GPU: torch's default capture stream is made once per
    process on whichever GPU was current then, and a capture on another GPU's stream records an empty
    graph (whose replays leave stale outputs behind);
  * one memory pool per GPU, shared by every graph captured there: graphs that replay on one stream,
    each one's outputs read before the next replay, may reuse each other's scratch, so N graphs cost
    about the memory of the largest (capture largest first and the later ones fit in its blocks);
  * a warm-up outside capture on a side stream (lazy kernels, cuBLAS workspaces, Triton compilation and
    the allocator's blocks are all in place before the capture, which must not cudaMalloc);
  * thread-local capture mode: the hand-off's and the server's own threads may use CUDA meanwhile;
  * Python's cyclic garbage collector paused for the capture (`gc_paused`): torch no longer collects
    before a capture (torch.compiler.config.force_cudagraph_gc is off by default), so a dead graph left
    in a reference cycle (an engine or drafter dropped earlier) could be freed by an automatic
    collection inside the capture; destroying its executable graph is refused while a stream captures
    and invalidates the capture in progress ("operation failed due to a previous error during capture":
    a replay_headline.py engine's decode graphs on an H100, pytorch/pytorch#161037).

A captured forward attends over a static number of keys, masked: `kv_bucket` rounds a step's need up
to a power of two (at least KV_MIN) or the cache length, so a short request in a long cache attends
over its bucket, not the whole cache, and a long one gets a new capture only at each doubling.
The bucket rule imports nothing (the worker's test drafter runs without torch); torch is imported
where a graph is made.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV_MIN = 256  # the smallest KV bucket

_gc_lock = threading.Lock()
_gc_pauses = 0  # captures in progress in this process (any thread) that paused the collector
_gc_was_enabled = False  # the collector's state when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's automatic cyclic garbage collection off while the block runs (a CUDA graph capture), back
    to what it was when the last of the blocks in progress ends: the switch is process-wide, so a capture
    on one thread must not turn it back on under another's. Explicit gc.collect() calls still collect."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def kv_buckets(max_len: int, min_kv: int = KV_MIN) -> list[int]:
    """Powers of two from min_kv below max_len, then max_len itself: [256, 512, ..., max_len]."""
    out, kv = [], max(1, min_kv)
    while kv < max_len:
        out.append(kv)
        kv *= 2
    out.append(max_len)
    return out


def kv_bucket(need: int, max_len: int, min_kv: int = KV_MIN) -> int:
    """The smallest bucket of kv_buckets(max_len, min_kv) that holds `need` keys (max_len beyond it)."""
    buckets = kv_buckets(max_len, min_kv)
    return next((kv for kv in buckets if kv >= need), buckets[-1])


class GraphCapture:
    """Captures CUDA graphs on one device into one shared pool, from an explicit capture stream."""

    def __init__(self, device: torch.device | str, stream: torch.cuda.Stream | None = None) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        with torch.cuda.device(self.device):
            self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
        self.pool = None
        self.captured = 0

    def warm(self, fn: Callable[[], Any], times: int = 1) -> None:
        """Run fn eagerly `times` times on a side stream, outside any capture; the current stream waits."""
        import torch

        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                for _ in range(times):
                    fn()
            cur.wait_stream(side)

    def capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture one call of fn (warmed up before) -> (graph, what fn returned: its static outputs)."""
        import torch

        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(g, pool=self.pool, stream=self.stream,
                                               capture_error_mode="thread_local"):
                out = fn()
        self.captured += 1
        return g, out
