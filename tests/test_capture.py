"""One KV-bucket rule for every captured forward (capture.kv_bucket): the engine's verify graphs, the
worker's draft steps and the TP ranks; the capture helper refuses what cannot be captured and captures
with Python's cyclic collector paused (capture.gc_paused)."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from draftrelay import capture as C
from draftrelay.capture import KV_MIN, GraphCapture, gc_paused, kv_bucket, kv_buckets
from draftrelay.engine.graphs import DecodeGraphs
from draftrelay.model import tiny_pair
from draftrelay.worker.drafters import load_drafter, steady_state_keys


def test_buckets_are_powers_of_two_then_the_cache_length():
    assert KV_MIN == 256
    assert kv_buckets(617) == [256, 512, 617]
    assert kv_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert kv_buckets(100) == [100] and kv_buckets(40, min_kv=16) == [16, 32, 40]
    assert [kv_bucket(n, 617) for n in (1, 256, 257, 513, 617, 10**6)] == [256, 256, 512, 617, 617, 617]


def test_engine_and_worker_use_the_same_rule():
    target, _ = tiny_pair()
    cache = target.new_cache(3, 1500)
    g = DecodeGraphs(target, cache, 2, 5, capture=False)
    assert g.buckets == kv_buckets(1500)
    tok = torch.zeros(1, 5, dtype=torch.long)
    with torch.inference_mode():  # as the engine calls it
        for start in (0, 300, 900):
            g.run(tok, torch.tensor([start]), torch.tensor([0]))
    assert {kv for kv, n in g.bucket_replays.items() if n} == {kv_bucket(s + 5, 1500) for s in (0, 300, 900)}
    d = load_drafter("tiny", device="cpu", n_rows=2, max_ctx=1000, mode="static")
    assert {k[3] for k in steady_state_keys([3], 1, d.cache.max_len)} == set(kv_buckets(d.cache.max_len))


def test_capture_needs_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        GraphCapture("cpu")


@pytest.fixture
def gc_on():
    """The collector on at the start (as in a serving process) and as it was after the test."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_gc_paused_restores_the_collector_only_when_the_last_capture_in_any_thread_ends(gc_on):
    """Two captures overlapping on two threads: the first to end must not turn automatic collection back
    on under the other, and the last leaves it as it found it (on here; off where it was off)."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second():
        first_in.wait(5)
        with gc_paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first ended"] = gc.isenabled()
        seen["after both"] = gc.isenabled()

    th = threading.Thread(target=second)
    th.start()
    with gc_paused():
        seen["inside"] = gc.isenabled()
        first_in.set()
        second_in.wait(5)
    first_out.set()
    th.join(5)
    assert seen == {"inside": False, "after the first ended": False, "after both": True}
    assert gc.isenabled() and C._gc_pauses == 0
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()  # off before: off after


def test_gc_paused_restores_the_collector_when_the_block_raises(gc_on):
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled() and C._gc_pauses == 0


def test_the_capture_helper_captures_with_the_collector_paused(gc_on, monkeypatch):
    """GraphCapture.capture on stand-ins for torch's CUDA calls (no GPU here): the captured function, and
    the capture's begin and end around it, run with automatic collection off; it is on again after. A
    collection there could free a dead graph mid-capture, which CUDA refuses (capture.py)."""
    states = []

    @contextlib.contextmanager
    def graph(g, **kw):
        states.append(("begin", gc.isenabled()))
        yield
        states.append(("end", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    cap = object.__new__(GraphCapture)
    cap.device, cap.stream, cap.pool, cap.captured = torch.device("cuda", 0), None, None, 0
    g, out = cap.capture(lambda: states.append(("fn", gc.isenabled())) or "out")
    assert (g, out, cap.captured, cap.pool) == ("graph", "out", 1, "pool")
    assert states == [("begin", False), ("fn", False), ("end", False)]
    assert gc.isenabled()
