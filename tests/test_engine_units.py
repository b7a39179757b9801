"""Small pieces of the engine that the GPU path relies on, checked on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from draftrelay.engine.engine import drafts_from_reply
from draftrelay.engine.graphs import _pow2_sizes
from draftrelay.handoff.region import Layout, RegionConfig, Status, decode_reply, write_reply


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
