"""The KV caches' memory check (draftrelay/memory.py): a cache beyond the memory available is refused before
its pages are touched, with its size, the memory and the settings named; serve fits its context to it."""

from __future__ import annotations

import argparse

import pytest
import torch

from draftrelay import memory
from draftrelay import model as M
from draftrelay.memory import KVMemoryError

GIB = 1 << 30


def test_check_fits_names_the_sizes_and_lets_what_fits_through():
    memory.check_fits(GIB, "cpu", "cache", avail=2 * GIB)  # within 90 % of 2 GiB
    memory.check_fits(memory.CHECK_FROM_BYTES - 1, "cpu", "cache", avail=0)  # small: never checked
    with pytest.raises(KVMemoryError) as e:
        memory.check_fits(3 * GIB, "cpu", "KV cache of 8 rows", "fewer rows", avail=2 * GIB)
    msg = str(e.value)
    assert "KV cache of 8 rows needs 3.0 GiB" in msg and "1.8 GiB" in msg and "2.0 GiB available on cpu" in msg
    assert msg.endswith("; fewer rows")
    assert isinstance(e.value, ValueError)  # the CLIs' existing refusal paths catch it


def test_available_bytes_reads_this_host():
    n = memory.available_bytes("cpu")
    assert n is not None and 0 < n < 1 << 50
    assert memory.available_bytes(torch.device("meta")) is None


def test_fit_positions():
    assert memory.fit_positions(1000, 4, 1e12, 4096) == 4096  # everything fits: the limit
    assert memory.fit_positions(1000, 4, 4000 * 1000, 4096) == 768  # 1000 positions -> a multiple of 256
    assert memory.fit_positions(1000, 4, 200 * 4000, 4096) == 0
    assert memory.fit_positions(1000, 4, 4000 * 1000, 4096, multiple=1) == 1000
    assert memory.size(3 * GIB) == "3.0 GiB" and memory.size(5 << 20) == "5.0 MiB"
    with pytest.raises(ValueError, match="positive sizes"):
        memory.fit_positions(0, 4, 1e9, 4096)


def test_a_cache_beyond_the_memory_is_refused_before_it_is_allocated(monkeypatch):
    """With 1 GiB said to be available, a 100 GiB CPU cache is refused at once (allocating and zeroing it
    would take the host down, not raise); a small one is still made."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: GIB)
    cfg = M.ModelConfig(vocab_size=100, hidden_size=64, n_layers=32, n_heads=8, n_kv_heads=8, head_dim=128,
                        intermediate_size=128, max_position_embeddings=1 << 20, name="big")
    per = M.KVCache.position_bytes(cfg, torch.float32)
    assert per == 2 * 32 * 8 * 128 * 4
    with pytest.raises(KVMemoryError, match=r"KV cache of 8 rows x 51200 positions \(big\) needs 100.0 GiB.*"
                                            r"serve --max-batch / --max-model-len"):
        M.KVCache(cfg, 8, 51200)
    assert M.KVCache(cfg, 1, 16).k.shape == (32, 1, 8, 16, 128)


def _serve_args(**kw) -> argparse.Namespace:
    base = {"mode": "async", "worker": "", "drafter": "tiny", "k": 4, "max_batch": 8, "spec_cache": 0}
    return argparse.Namespace(**{**base, **kw})


def test_serve_fits_its_context_to_the_memory(monkeypatch):
    """Per position: the target's 8 rows and its scratch row, and a local worker's 16 rows of the drafter's
    shape, after the worker's weights; a remote worker or target-only counts the target's rows alone."""
    target, drafter = M.tiny_pair(seed=0)
    cfg = target.cfg
    t_pp = M.KVCache.position_bytes(cfg, torch.float32)
    d_pp = M.KVCache.position_bytes(drafter.cfg, torch.float32)
    weights = drafter.cfg.n_params() * 4
    said: list[str] = []
    from draftrelay.serve.cli import fit_context

    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**15)
    assert fit_context(target, "cpu", _serve_args(), said.append) == cfg.max_position_embeddings and not said
    # room for 1,000 positions with the local worker: 1000 - (k + 1 + 64) = 931 -> 768, and said
    avail = int((1000 * (9 * t_pp + 16 * d_pp) + weights) / memory.FIT_SHARE) + 1
    monkeypatch.setattr(memory, "available_bytes", lambda device: avail)
    assert fit_context(target, "cpu", _serve_args(), said.append) == 768
    assert said and said[-1].startswith("context capped to 768 tokens: the model's 4096 at --max-batch 8") \
        and "the local worker's weights" in said[-1]
    # without a local worker the target's 9 rows alone take the memory: more positions fit
    alone = int((1000 * (9 * t_pp + 16 * d_pp) + weights) // (9 * t_pp)) - 69
    for args in (_serve_args(worker="h:1"), _serve_args(mode="off")):
        assert fit_context(target, "cpu", args, said.append) == min(4096, alone // 256 * 256) > 768
    # the speculation cache's branch rows at F = 3: 8 x 3 = 24 -> 32 rows and a spare. On a CPU the worker
    # drafts in the lean loop, whose rows hold a branch's own positions (COMPACT_POSITIONS each, whatever
    # the context): set aside with the weights
    from draftrelay.worker.prefetch import COMPACT_POSITIONS

    compact = 33 * COMPACT_POSITIONS * d_pp
    branchy = int((1000 * (9 * t_pp + 16 * d_pp) + weights + compact) / memory.FIT_SHARE) + 1
    monkeypatch.setattr(memory, "available_bytes", lambda device: branchy)
    assert fit_context(target, "cpu", _serve_args(spec_cache=3), said.append) == 768
    assert f"the local worker's weights and branch rows ({memory.size(weights + compact)})" in said[-1]
    # on a GPU (the worker's fast forward, bf16) every branch row spans the context, beside the worker's 16
    d16 = M.KVCache.position_bytes(drafter.cfg, torch.bfloat16)
    gpu = int((1000 * (9 * t_pp + (16 + 33) * d16) + drafter.cfg.n_params() * 2) / memory.FIT_SHARE) + 1
    monkeypatch.setattr(memory, "available_bytes", lambda device: gpu)
    assert fit_context(target, "cuda", _serve_args(spec_cache=3), said.append) == 768
    assert fit_context(target, "cpu", _serve_args(spec_cache=3), said.append) > 768
    with pytest.raises(KVMemoryError, match="--max-batch 64: the K/V of even 256 positions a row does not fit"):
        fit_context(target, "cpu", _serve_args(max_batch=64), said.append)


def test_serve_refuses_a_batch_the_memory_cannot_hold(monkeypatch, capsys):
    """The whole command: the refusal is said and serve exits 2 before it starts a worker or listens."""
    from draftrelay.serve import cli as serve_cli

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--drafter", "tiny", "--device", "cpu", "--max-batch", "4"])
    assert serve_cli.run(args) == 2
    assert "--max-batch 4: the K/V of even 256 positions a row does not fit" in capsys.readouterr().err


def test_drafter_config_reads_the_shape_without_the_weights(tmp_path):
    """serve counts its local worker's K/V from the drafter's shape: 'tiny', a GGUF file, a model directory;
    None where there is none to read (the worker then says why when it loads)."""
    import sys
    from pathlib import Path

    from draftrelay.checkpoint import hf
    from draftrelay.engine import loading as L

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_files import byte_vocab, write_gguf

    drafter = M.tiny_pair(seed=M.TINY_SEED)[1]
    assert L.drafter_config("tiny") == drafter.cfg
    write_gguf(drafter, str(tmp_path / "d.gguf"), "llama", vocab=byte_vocab())
    hf.save_hf_dir(drafter, tmp_path / "dir")
    for spec in (str(tmp_path / "d.gguf"), str(tmp_path / "dir")):
        got = L.drafter_config(spec)
        assert got is not None and M.KVCache.position_bytes(got, torch.float32) == \
            M.KVCache.position_bytes(drafter.cfg, torch.float32) and got.n_params() == drafter.cfg.n_params()
    (tmp_path / "bad.gguf").write_bytes(b"not gguf")
    assert L.drafter_config(str(tmp_path / "bad.gguf")) is None
    assert L.drafter_config("test") is None and L.drafter_config(str(tmp_path / "missing")) is None


def test_branch_rows_the_memory_refuses_are_refused_once(monkeypatch, caplog):
    """The worker's branch scratch (prefetch.ForkSteps.scratch) beyond the memory: refused with the reason,
    logged once; as many rows or more are refused again without a new allocation or log line (each round's
    table is then empty: hits lost, no token); fewer rows are still tried."""
    import logging

    from draftrelay.worker import prefetch
    from draftrelay.worker.drafters import load_drafter

    d = load_drafter("tiny", n_rows=2, max_ctx=64, mode="eager")
    fs = prefetch.ForkSteps(d)
    made: list[int] = []
    new_cache = d.model.new_cache

    def counted(rows: int, max_len: int):
        made.append(rows)
        return new_cache(rows, max_len)

    monkeypatch.setattr(d.model, "new_cache", counted)
    monkeypatch.setattr(memory, "CHECK_FROM_BYTES", 0)
    per_row = M.KVCache.position_bytes(d.model.cfg, d.model.dtype) * d.cache.max_len
    monkeypatch.setattr(memory, "available_bytes", lambda device: int(4 * per_row / memory.HEADROOM))
    with caplog.at_level(logging.WARNING, logger=prefetch.log.name):
        for _ in range(3):
            with pytest.raises(KVMemoryError, match="branch rows: KV cache of 9 rows"):
                fs.scratch(8)  # 8 rows and the spare: 9 > 4
    assert made == [9] and fs.cache is None and fs.refused[0] == 8
    assert sum("tables of 8 branch rows or more stay empty" in r.getMessage() for r in caplog.records) == 1
    fs.scratch(2)  # 2 rows and the spare fit
    assert made == [9, 3] and fs.cache is not None and fs.n_rows == 2
