"""Small pieces of the engine that the GPU path relies on, checked on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from draftrelay.engine.engine import drafts_from_reply
from draftrelay.engine.graphs import _pow2_sizes
from draftrelay.handoff.region import Layout, RegionConfig, decode_reply, write_reply
from draftrelay.round import Status


def test_drafts_from_reply_reads_what_decode_reply_reads():
    layout = Layout(RegionConfig(max_requests=4, max_tokens=64, max_drafts=6, vocab_size=100))
    buf = np.zeros(layout.reply_size, np.uint8)
    drafts = np.array([[5, 6, 7, 0, 0, 0], [9, 8, 0, 0, 0, 0], [99, 98, 97, 96, 0, 0]], np.int32)
    counts = np.array([3, 2, 4], np.int32)
    write_reply(layout, buf, 7, Status.OK, counts, drafts, np.zeros_like(drafts, np.float32))
    buf[:4].view("<u4")[0] = 14  # claim word: round 7 won by the proxy
    host = decode_reply(layout, buf, 7, np.array([4, 4, 4], np.int32))
    assert host.ok
    dev = drafts_from_reply(torch.from_numpy(buf), layout, 3, 4, 100)
    assert dev.dtype == torch.long and dev.shape == (3, 4)
    for i in range(3):
        c = int(host.counts[i])
        assert dev[i, :c].tolist() == host.drafts[i, :c].tolist()


def test_drafts_from_reply_clamps_garbage_into_the_vocabulary():
    layout = Layout(RegionConfig(max_requests=2, max_tokens=64, max_drafts=4, vocab_size=50))
    buf = np.zeros(layout.reply_size, np.uint8)
    d = buf[layout.reply_drafts_off:layout.reply_drafts_off + 4 * 2 * 4].view("<i4")
    d[:] = [-7, 3, 1 << 30, 49, 50, 0, -1, 12]
    dev = drafts_from_reply(torch.from_numpy(buf), layout, 2, 4, 50)
    assert dev.tolist() == [[0, 3, 49, 49], [49, 0, 0, 12]]


def test_graph_batch_sizes():
    assert _pow2_sizes(1) == [1]
    assert _pow2_sizes(3) == [1, 2, 3]
    assert _pow2_sizes(8) == [1, 2, 4, 8]


def test_decode_graph_bookkeeping_emulated_on_cpu():
    """The graph path's static buffers, padding rows (spare KV row), padded batch sizes, widths and
    the two-slot ring, with eager forwards standing in for replays: greedy outputs unchanged."""
    from draftrelay.engine.engine import Engine, EngineConfig, LocalRounds, SamplingParams
    from draftrelay.engine.graphs import DecodeGraphs
    from draftrelay.model import tiny_pair

    target, _ = tiny_pair()
    prompts = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"abc")]

    def fn(t, requests, budget_s):  # fixed drafts: some right, most wrong (exercises k+1 widths)
        return [(np.array([(int(r.tokens[-1]) * 7 + j) % 256 for j in range(r.n_out)], np.int32),
                 np.zeros(r.n_out, np.float32)) if len(r.tokens) else (np.zeros(0, np.int32), np.zeros(0, np.float32))
                for r in requests]

    def gen(graphs: bool, ring: bool, mode: str):
        cfg = EngineConfig(mode="off", n_draft=4, max_batch=4, max_len=96)
        with Engine(target, cfg, rounds=LocalRounds(fn) if mode == "spec" else None) as eng:
            if graphs:
                eng.graphs = {T: DecodeGraphs(target, eng.cache, 4, T, ring=ring, capture=False, min_kv=16)
                              for T in (1, 5)}
            reqs = eng.generate(prompts, SamplingParams(max_tokens=20))
            return [r.output for r in reqs], {T: (g.replays, g.drains, sorted({B for B, _ in g.slots}),
                                                  g.bucket_replays) for T, g in eng.graphs.items()}

    ref, _ = gen(False, False, "off")
    for mode in ("off", "spec"):
        for ring in (False, True):
            out, info = gen(True, ring, mode)
            assert out == ref, (mode, ring)
            assert info[1][2] == [1, 2, 4]  # padded sizes: 3 requests run as 4 with the spare row
            used = info[5] if mode == "spec" else info[1]
            assert used[0] > 0 and (used[1] == 0) == ring
            # KV buckets 16/32/64/96: the rows grow from 3-19 to 22-38 positions, so the replays
            # moved from the 32 bucket to the 64 one, and none needed the whole row
            assert list(used[3]) == [16, 32, 64, 96]
            assert used[3][32] > 0 and used[3][64] > 0 and used[3][96] == 0


def test_handoff_config_parks_with_memops_only_for_a_worker_on_the_engine_gpu():
    from draftrelay.engine.loading import handoff_config

    spec = {"kind": "worker", "host": "127.0.0.1", "port": 1}
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    local, remote = handoff_config(spec, gpu, 50.0, True), handoff_config(spec, gpu, 50.0, False)
    assert (local.backend, local.cuda_wait, remote.cuda_wait) == ("cuda", "memop", "")
    on_cpu = handoff_config(spec, cpu, 50.0, True, max_requests=4)
    assert (on_cpu.backend, on_cpu.cuda_wait, on_cpu.max_requests, on_cpu.nap_us) == ("emulated", "", 4, 200)
    assert local.round_spec is spec and local.deadline_ms == 50.0 and (local.spin_us, local.nap_us) == (20_000, 20)
    assert (local.park, remote.park, on_cpu.park) == ("stream", "stream", "stream")  # measured fastest


def test_a_closed_engine_holds_no_kv_memory_even_while_referenced():
    """close() gives the KV cache and the graphs back at once: a benchmark or server that keeps a
    reference to a closed engine (or a cycle gc.freeze made uncollectable) holds no device memory
    beside the next engine's. Its metrics stay readable; decoding after close fails."""
    import pytest

    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.model import tiny_pair

    target, _ = tiny_pair()
    eng = Engine(target, EngineConfig(mode="off", n_draft=0, max_batch=2, max_len=64))
    reqs = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert eng.cache.nbytes() > 0
    eng.close()
    assert eng.cache.nbytes() == 0 and eng.graphs == {}
    assert eng.metrics(reqs)["total"]["output_tokens"] == 4
    eng.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="engine is closed"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
