"""The demo pair shipped in the package: complete, small, loadable by both sides, its tokenizer
lossless, and its greedy outputs the same in every round mode (CPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from draftrelay import demo_pair
from draftrelay.engine import cli_demo
from draftrelay.engine import loading as L
from draftrelay.model import ModelError
from draftrelay.worker.drafters import load_drafter


def test_the_pair_is_complete_and_within_its_size_budget():
    tdir, ddir = demo_pair.paths()
    weights = sum(os.path.getsize(os.path.join(d, "model.safetensors")) for d in (tdir, ddir))
    assert weights <= demo_pair.MAX_WEIGHT_BYTES
    everything = sum(os.path.getsize(os.path.join(d, f)) for d in (tdir, ddir) for f in demo_pair.FILES)
    assert everything <= demo_pair.MAX_WEIGHT_BYTES + 1_000_000  # plus two small tokenizer.json and configs
    with open(os.path.join(tdir, "tokenizer.json"), "rb") as a, open(os.path.join(ddir, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()  # the handshake compares their hashes
    for d in (tdir, ddir):
        with open(os.path.join(d, "config.json")) as f:
            assert json.load(f)["torch_dtype"] == "bfloat16"


def test_the_tokenizer_round_trips_text():
    tok = L.HFTokenizer.from_dir(demo_pair.TARGET_DIR)
    samples = ["def fibonacci(n):\n    if n < 2:\n        return n\n",
               "\tx = {'a': [1, 2.5e-3]}  # tabs, braces\r\n",
               "naïve = 'Grüße, 東京 🐍'\n", "", "   \n\n  trailing   "]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # a byte-level BPE: common code fragments are single tokens, so text costs well under a token per byte
    code = open(os.path.join(os.path.dirname(os.__file__), "os.py"), encoding="utf-8").read()
    assert len(tok.encode(code)) < len(code.encode()) / 2.5


def test_target_and_drafter_load_through_the_engine_and_worker_loaders():
    target = L.load_target(demo_pair.TARGET_DIR, torch.device("cpu"))
    drafter = load_drafter(demo_pair.DRAFTER_DIR, device="cpu", n_rows=2, max_ctx=64)
    assert target.model.dtype == torch.float32  # bf16 storage, fp32 compute on a CPU
    assert target.tokenizer_hash and drafter.tokenizer_hash == target.tokenizer_hash
    tcfg, dcfg = target.model.cfg, drafter.model.cfg
    assert tcfg.vocab_size == dcfg.vocab_size
    # much smaller: 1/8 of the params and 1/24 of the layers (what one forward costs is a benchmark's)
    assert dcfg.n_params() * 7 < tcfg.n_params() and dcfg.n_layers * 8 <= tcfg.n_layers
    assert target.stop_ids  # end of file: the tokenizer's <|endoftext|>


def test_the_demo_resolves_the_pair_and_refuses_a_target_without_a_drafter(tmp_path):
    assert cli_demo.pair_specs("demo", "", False) == (demo_pair.TARGET_DIR, demo_pair.DRAFTER_DIR)
    assert cli_demo.pair_specs("tiny", "", False) == ("tiny", "tiny")
    assert cli_demo.pair_specs("tiny", "demo", False) == ("tiny", demo_pair.DRAFTER_DIR)
    with pytest.raises(ValueError, match="--drafter"):
        cli_demo.pair_specs(str(tmp_path), "", False)
    assert cli_demo.pair_specs(str(tmp_path), "", True) == (str(tmp_path), "")  # a running worker drafts


def test_an_incomplete_pair_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(demo_pair, "DRAFTER_DIR", str(tmp_path))
    with pytest.raises(ModelError, match="config.json is missing"):
        demo_pair.paths()


def test_the_demo_writes_python_identically_in_every_mode(tmp_path):
    out_json = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "draftrelay.cli", "demo", "--device", "cpu", "--max-tokens", "40",
                           "--k", "4",
                           "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "identical in off, sync, async: yes" in out
    res = json.loads(out_json.read_text())["modes"]
    for mode in ("sync", "async"):
        t = res[mode]["total"]
        assert t["round_mode"] == mode, t["refusal"]
        assert t["rounds"]["ok"] > 0 and t["rounds"]["failed"] == 0
        assert t["mean_accepted"] >= 1.5  # the trained drafter agrees with the target most of the time
        assert len(t["accept_rate_by_pos"]) == 4 and t["accept_rate_by_pos"][0] > 0.5
    assert res["off"]["total"]["output_tokens"] == res["sync"]["total"]["output_tokens"] \
        == res["async"]["total"]["output_tokens"] > 0
    doc = json.loads(out_json.read_text())
    assert doc["threads"] == 1  # the demo's CPU default: one thread for the target (and one for the worker)
    assert doc["best"][0] in ("sync", "async")
    assert f"fastest: {doc['best'][0]}, {doc['best'][1]:.2f} x the tokens/s of off" in out
    assert "(llama 1L d192 0.8M params, cpu float32, lean)" in out  # the worker's banner: the lean CPU loop
    # the continuations are code: indented lines under the prompt's def/class
    listing = out[out.index("outputs:"):out.index("identical in")]
    assert listing.count("[1] prompt") == 1 and "[3] prompt" in listing
    assert sum(line.startswith("          ") for line in listing.splitlines()) >= 3
