"""`draftrelay worker` command line: bad arguments and model directories get clear errors; a local HF
directory is served with its identity (directory name, tokenizer hash) and the model's own drafts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from draftrelay.checkpoint.hf import save_hf_dir
from draftrelay.model import ModelConfig, Transformer
from draftrelay.wire import Block, DrafterClient, WireRefused
from draftrelay.wire import protocol as P
from draftrelay.worker.process import start_worker_process


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "draftrelay.cli", "worker", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,words", [
    (["--port", "70000"], "--port 70000"),
    (["--n-out-max", "0"], "--n-out-max 0"),
    (["--rows", "-1"], "--rows -1"),
    (["--idle-timeout", "0"], "--idle-timeout 0"),
    (["--max-frame", "10"], "--max-frame 10"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--model", "random:nope"], "unknown shape 'nope'"),
    (["--tp", "0"], "--tp 0: must be 1-8"),
    (["--tp", "9"], "--tp 9: must be 1-8"),
    (["--tp", "2", "--model", "test"], "--tp needs a Llama-family model"),
    (["--tp", "3", "--tp-mode", "emulate", "--device", "cpu"], "n_kv_heads 2 is not divisible by tp 3"),
    (["--tp", "2", "--tp-mode", "emulate", "--device", "cpu", "--mode", "graph"], "CUDA graphs need"),
    (["--tp", "2", "--tp-mode", "bogus"], "invalid choice: 'bogus'"),
    (["--tp", "x"], "invalid int value: 'x'"),
])
def test_bad_arguments_are_named(args, words):
    out = run_cli(*args)
    assert out.returncode == 2 and words in out.stderr, out.stderr


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_tp_pair_without_two_gpus_is_named():
    out = run_cli("--tp", "2")
    assert out.returncode == 2 and "needs 2 CUDA devices" in out.stderr and "emulate" in out.stderr, out.stderr


def test_bad_model_dir_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    out = run_cli("--model", str(tmp_path))
    assert out.returncode == 2 and "missing field 'hidden_size'" in out.stderr, out.stderr


def test_port_in_use_is_named():
    with start_worker_process(["--model", "test"]) as w:
        out = run_cli("--model", "test", "--port", str(w.port))
        assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{w.port}" in out.stderr


def test_serves_a_local_hf_directory(tmp_path):
    cfg = ModelConfig(vocab_size=300, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=256)
    model = Transformer.random(cfg, seed=4, std=0.2)
    d = tmp_path / "my-drafter"
    save_hf_dir(model, d, shards=2)
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    thash = P.tokenizer_hash_of_dir(str(d))
    with start_worker_process(["--model", str(d), "--device", "cpu", "--max-ctx", "128"], timeout=120) as w:
        c = DrafterClient(w.host, w.port, model_id="my-drafter", vocab_size=300, tokenizer_hash=thash, timeout=10)
        info = c.connect()
        assert (info.model_id, info.tokenizer_hash, info.vocab_size, info.max_ctx) == ("my-drafter", thash, 300, 128)
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        r = c.step([Block(1, 0, 0, np.array(prompt, np.int32), 4)])[0]
        # greedy drafts of the same weights, computed here without any cache reuse
        seq = list(prompt)
        for _ in range(4):
            with torch.no_grad():
                logits = model(torch.tensor([seq]), torch.tensor([0]), model.new_cache(1, 64), torch.tensor([0]))
            seq.append(int(logits[0, -1].argmax()))
        assert r.drafts.tolist() == seq[len(prompt):]
        c.close()
        bad = DrafterClient(w.host, w.port, tokenizer_hash="0" * 16)
        with pytest.raises(WireRefused, match="tokenizer_hash"):
            bad.connect()
