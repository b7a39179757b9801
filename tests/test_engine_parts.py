"""The engine's pieces on their own: KV rows, the rounds interface, cancel, what the engine may touch."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from draftrelay.engine.engine import Engine, EngineConfig, LocalRounds, SamplingParams
from draftrelay.engine.kv import KVRows
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig, SyncRounds
from draftrelay.model import tiny_pair
from draftrelay.round import Rounds

ENGINE_DIR = Path(__file__).resolve().parents[1] / "src" / "draftrelay" / "engine"


def test_kv_rows_take_the_lowest_free_row_and_reset_it_both_ways():
    target, _ = tiny_pair()
    cache = target.new_cache(4, 16)
    kv = KVRows(cache, 3)  # row 3 is the graph path's spare: never handed out
    cache.lengths[:] = 5
    assert [kv.alloc(), kv.alloc()] == [0, 1] and int(cache.lengths[0]) == 0
    kv.set_len(1, 9)
    kv.release(1)
    kv.release(1)  # idempotent
    assert kv.free == [1, 2] and int(cache.lengths[1]) == 0
    assert [kv.alloc(), kv.alloc()] == [1, 2] and not kv
    with pytest.raises(ValueError, match="row 3"):
        kv.release(3)


def test_every_rounds_kind_implements_the_rounds_protocol():
    h = HandoffConfig(vocab_size=100, max_requests=3)
    sync, unstarted = SyncRounds(h), AsyncRounds(h)
    for r in (LocalRounds(lambda t, reqs, b: []), sync, unstarted):
        assert isinstance(r, Rounds), type(r).__name__
        assert r.reply_device_buffer(1) is None and not r.device_replies
    assert sync.capacity == unstarted.capacity == 3 and LocalRounds(lambda *a: []).capacity is None
    sync.close()
    unstarted.close()


def test_the_engine_reads_no_rounds_internals():
    """The engine drives rounds through draftrelay.round.Rounds only: no getattr probing, no private
    state of a rounds object (the names the hand-off keeps to itself)."""
    for path in ENGINE_DIR.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"getattr\(\s*self\.rounds", src), path.name
        assert not re.search(r"rounds\.(_pending|_fn|_dst|_results|cfg|stream|region)\b", src), path.name


def _blocks_seen():
    seen: list[list[tuple[int, int, int]]] = []

    def fn(t, requests, budget_s):
        seen.append([(r.req_id, r.n_out, len(r.tokens)) for r in requests])
        return [(np.full(r.n_out, 1, np.int32), np.zeros(r.n_out, np.float32)) for r in requests]

    return seen, fn


def test_cancel_frees_the_row_and_ends_the_request_on_the_drafter():
    target, _ = tiny_pair()
    seen, fn = _blocks_seen()
    with Engine(target, EngineConfig(mode="sync", n_draft=2, max_batch=2, max_len=64), rounds=LocalRounds(fn)) as eng:
        a, b, c = (eng.add_request(list(b"abc"), SamplingParams(max_tokens=20)) for _ in range(3))
        eng.step()
        assert [r.id for r in eng.running] == [a.id, b.id] and list(eng.waiting) == [c]
        assert seen[-1] == [(a.id, 2, 4), (b.id, 2, 4)]  # the prompt and the first token
        assert eng.cancel(c) is c and c.done and c.finish_reason == "cancelled" and c.row == -1
        row = a.row
        eng.cancel(a.id)
        assert a not in eng.running and eng.free_rows == [row] and a.done
        eng.step()
        # b's block, then the END block for a (no tokens, no drafts); none for c: the drafter never saw it
        assert seen[-1][0][0] == b.id and seen[-1][1:] == [(a.id, 0, 0)]
        eng.step()
        assert all(blk[0] == b.id for blk in seen[-1])  # sent once
        assert a not in eng.finished and c not in eng.finished
        with pytest.raises(ValueError, match="not waiting or running"):
            eng.cancel(a)
        with pytest.raises(ValueError, match="no waiting or running request with id 99"):
            eng.cancel(99)
        while eng.has_work():
            eng.step()
        assert eng.finished == [b] and sorted(eng.free_rows) == [0, 1]


def test_cancel_keep_row_leaves_the_row_for_resume():
    target, _ = tiny_pair()
    with Engine(target, EngineConfig(mode="off", max_batch=1, max_len=64)) as eng:
        r = eng.add_request(list(b"hello"), SamplingParams(max_tokens=8))
        eng.prefill_waiting()
        eng.cancel(r, keep_row=True)
        assert eng.free_rows == [] and not eng.has_work()
        new = eng.resume(r)
        while eng.has_work():
            eng.step()
        assert new.output[0] == r.output[0] and len(new.output) == 8 and eng.free_rows == [0]
