"""One KV-bucket rule for every captured forward (capture.kv_bucket): the engine's verify graphs, the
worker's draft steps and the TP ranks; the capture helper refuses what cannot be captured."""

from __future__ import annotations

import pytest
import torch

from draftrelay.capture import KV_MIN, GraphCapture, kv_bucket, kv_buckets
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
