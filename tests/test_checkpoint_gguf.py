"""GGUF checkpoints: weights equal to gguf's reference dequantization, logits equal to the same model
from safetensors, refusals by name, the engine and the worker running a GGUF pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from draftrelay.checkpoint import gguf as G
from draftrelay.checkpoint.hf import hf_name, load_hf_dir, save_hf_dir
from draftrelay.model import ModelConfig, ModelError, Transformer
from gguf_files import random_kquant_blocks, reference_weights, write_gguf
from test_model import full_logits, rand_tokens


def cfg_for(arch: str, **kw) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                max_position_embeddings=512, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    base.update(kw)
    return ModelConfig(**base)


def model_for(arch: str, seed: int = 0, **kw) -> Transformer:
    m = Transformer.random(cfg_for(arch, **kw), seed=seed, std=0.1)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a mix-up shows
        for name, p in m.named_hf_tensors():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return m


QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_weights_equal_the_gguf_reference_dequantization(tmp_path, arch, qtype):
    model = model_for(arch, tie_word_embeddings=qtype == Q.Q8_0)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, arch, qtype)
    loaded = G.load_gguf(path)
    assert loaded.cfg == model.cfg
    ref = reference_weights(path, arch, model.cfg.n_heads, model.cfg.n_kv_heads)
    ours = dict(loaded.named_hf_tensors())
    assert len(ref) == len(ours)
    for gname, want in ref.items():
        name = G.our_name(gname)
        assert torch.equal(ours[name], want), (gname, name)
    if qtype == Q.F32:  # lossless: the very weights written
        for name, t in model.named_hf_tensors():
            assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_equal_the_gguf_reference_dequantization(tmp_path, qtype):
    """k-quant blocks span 256 values: a model 256 wide, random valid blocks (gguf does not write k-quants)."""
    model = model_for("llama", hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_size=256)
    path = tmp_path / "k.gguf"
    write_gguf(model, path, "llama", quantize=lambda name, a: (random_kquant_blocks(*a.shape, qtype, len(name)), qtype))
    loaded = G.load_gguf(path)
    ref = reference_weights(path, "llama", 4, 2)
    ours = dict(loaded.named_hf_tensors())
    for gname, want in ref.items():
        assert torch.isfinite(want).all() and torch.equal(ours[G.our_name(gname)], want), gname
    stored = reference_weights(path, "as stored", 4, 2)  # rows in the file's (llama.cpp's) order
    assert not torch.equal(ours["layers.0.self_attn.q_proj.weight"], stored["blk.0.attn_q.weight"])


def test_slices_of_large_tensors_equal_one_pass(tmp_path, monkeypatch):
    """The loader dequantizes a few rows at a time: tiny slices (and permuted q/k rows across slices)
    give the same weights as whole tensors."""
    model = model_for("llama")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "llama", Q.Q8_0)
    whole = dict(G.load_gguf(path).named_hf_tensors())
    monkeypatch.setattr(G, "SLICE_ELEMENTS", 100)  # below one row: a row per slice
    sliced = dict(G.load_gguf(path).named_hf_tensors())
    for name, t in whole.items():
        assert torch.equal(sliced[name], t), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_logits_equal_the_same_model_from_safetensors(tmp_path, arch, qtype):
    """The GGUF model and an HF checkpoint of the weights it holds (dequantized by gguf itself) give the
    same logits, bit for bit; at F32 that is the original model."""
    model = model_for(arch, seed=2)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, arch, qtype)
    ref = reference_weights(path, arch, model.cfg.n_heads, model.cfg.n_kv_heads)
    hf_model = Transformer.random(model.cfg, seed=9)
    params = dict(hf_model.named_hf_tensors())
    with torch.no_grad():
        for gname, t in ref.items():
            params[G.our_name(gname)].copy_(t)
    save_hf_dir(hf_model, tmp_path / "hf")
    from_gguf, from_hf = G.load_gguf(path), load_hf_dir(tmp_path / "hf")
    toks = rand_tokens(20, model.cfg.vocab_size, seed=4)
    a = full_logits(from_gguf, toks)
    assert torch.equal(a, full_logits(from_hf, toks))
    if qtype == Q.F32:
        assert torch.equal(a, full_logits(model, toks))
    else:  # quantized: near the original (a layout mix-up would be ~1.4 away), not equal
        b = full_logits(model, toks)
        err = float((a - b).norm() / b.norm())
        assert 0 < err < {Q.F16: 0.01, Q.Q8_0: 0.05, Q.Q4_0: 0.8}[qtype], err


def test_bf16_load_equals_rounding_the_fp32_load(tmp_path):
    model = model_for("qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "qwen2", Q.Q8_0)
    f32 = dict(G.load_gguf(path, dtype=torch.float32).named_hf_tensors())
    b16 = G.load_gguf(path, dtype=torch.bfloat16)
    assert b16.dtype == torch.bfloat16
    for name, t in b16.named_hf_tensors():
        assert torch.equal(t, f32[name].to(torch.bfloat16)), name


def test_config_comes_from_the_metadata(tmp_path):
    model = model_for("llama", rope_theta=500000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                      rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "llama")
    ck = G.read_gguf(path)
    assert ck.config == model.cfg and ck.arch == "llama" and ck.name == "test model"
    toks = rand_tokens(30, 256, seed=1)  # linear scaling applied: equal logits to the original
    assert torch.equal(full_logits(G.load_gguf(path), toks), full_logits(model, toks))


# ---- refusals ---------------------------------------------------------------------------------------


def test_refuses_unknown_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(model_for("llama"), path, "gemma2")
    with pytest.raises(ModelError, match="architecture 'gemma2' is not supported"):
        G.read_gguf(path)


def test_refuses_tensors_the_model_does_not_use(tmp_path):
    """Tensors the decoder has no place for would be dropped and the logits be wrong: refused by name."""
    model = model_for("qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "qwen2", extra={"blk.0.attn_output.bias": np.ones(64),
                                            "blk.1.attn_q_norm.weight": np.ones(16)})
    with pytest.raises(ModelError, match="does not use: blk.0.attn_output.bias, blk.1.attn_q_norm.weight"):
        G.load_gguf(path)
    write_gguf(model, path, "qwen2", extra={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ModelError, match="rope_freqs.weight.*llama3-style"):
        G.load_gguf(path)


def test_refuses_missing_and_misshapen_tensors(tmp_path):
    model = model_for("llama")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "llama", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match="missing tensor.*layers.1.mlp.up_proj.weight"):
        G.load_gguf(path)
    write_gguf(model, path, "llama", meta={"llama.feed_forward_length": 64})
    with pytest.raises(ModelError, match="'blk.0.ffn_gate.weight' has shape \\(96, 64\\), expected \\(64, 64\\)"):
        G.load_gguf(path)
    write_gguf(model, path, "llama", meta={"llama.block_count": None})
    with pytest.raises(ModelError, match="missing metadata 'llama.block_count'"):
        G.read_gguf(path)


@pytest.mark.parametrize("meta,match", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope scaling 'yarn'"),
    ({"llama.attention.sliding_window": 128}, "sliding-window attention"),
    ({"llama.rope.dimension_count": 8}, "partial rotary"),
    ({"llama.expert_count": 8}, "mixture-of-experts"),
    ({"llama.attention.value_length": 8}, "value_length"),
])
def test_refuses_attention_and_rope_variants(tmp_path, meta, match):
    path = tmp_path / "m.gguf"
    write_gguf(model_for("llama"), path, "llama", meta=meta)
    with pytest.raises(ModelError, match=match):
        G.read_gguf(path)


def test_a_window_as_long_as_the_context_is_no_window(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(model_for("llama"), path, "llama", meta={"llama.attention.sliding_window": 512})
    assert G.read_gguf(path).config.max_position_embeddings == 512


def test_refuses_files_that_are_not_gguf_or_truncated(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        G.read_gguf(tmp_path / "none.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)
    with pytest.raises(ModelError, match="cannot read GGUF"):
        G.read_gguf(bad)
    path = tmp_path / "m.gguf"
    write_gguf(model_for("llama"), path, "llama", Q.F32)
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(ModelError):
        G.load_gguf(path)


# ---- peak memory ---------------------------------------------------------------------------------------

RSS_PROBE = """
import sys, torch
from draftrelay.checkpoint import gguf, hf
load = gguf.load_gguf if sys.argv[1] == "gguf" else hf.load_hf_dir
load(sys.argv[2])  # a tiny model first: the code paths' own memory (library pages, pools) is not the load's
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size: the load's own peak follows
base = status("VmRSS")
m = load(sys.argv[3])
print((status("VmHWM") - base) / sum(p.numel() * p.element_size() for p in m.parameters()))
"""


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_load_grows_the_process_by_about_the_model_size(tmp_path, kind):
    """An F32 file is as large as the fp32 model: a loader that kept the file's pages resident, or a
    full-size copy of each tensor, would grow the process by ~2x the model; ours stays under 1.3x."""
    cfg = cfg_for("llama", vocab_size=8192, hidden_size=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64,
                  intermediate_size=2048)
    paths = []
    for name, model in (("tiny", model_for("llama")), ("big", Transformer.random(cfg, seed=0, std=0.02))):
        paths.append(str(tmp_path / (name + (".gguf" if kind == "gguf" else ""))))
        write_gguf(model, paths[-1], "llama", Q.F32) if kind == "gguf" else save_hf_dir(model, paths[-1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, kind, *paths], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = float(out.stdout.strip().splitlines()[-1])
    assert growth < 1.3, growth


def test_hf_tensor_names_match_the_gguf_mapping():
    """Every parameter has exactly one GGUF name (the inverse of our_name)."""
    from gguf_files import gguf_name

    m = model_for("qwen3", qkv_bias=True)
    names = [n for n, _ in m.named_hf_tensors()]
    assert [G.our_name(gguf_name(n)) for n in names] == names
    assert G.our_name("rope_freqs.weight") is None and G.our_name("blk.0.attn_output.bias") not in names
    assert hf_name("lm_head.weight") == "lm_head.weight"


def test_gguf_metadata_json_safe(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(model_for("llama"), path, "llama")
    ck = G.read_gguf(path)
    json.dumps(ck.meta)  # scalars only: the arrays (vocabulary) are not kept in meta
    assert "tokenizer.ggml.tokens" not in ck.meta and len(ck.vocab.tokens) == 256


# ---- the engine and the worker on GGUF files -------------------------------------------------------------


def test_generate_with_a_gguf_pair_equals_off_mode(tmp_path, capsys):
    """The tiny pair as two GGUF files (Q8_0 and F16): the target through load_target, the drafter through the
    local worker's load_drafter; the handshake compares the GGUF vocabularies' digests."""
    from draftrelay import cli
    from draftrelay.model import tiny_pair

    target, drafter = tiny_pair()
    paths = [str(tmp_path / "target.gguf"), str(tmp_path / "drafter.gguf")]
    def q8_or_f16(name, a):  # rows of 176 values are no whole Q8_0 blocks: F16 there, as llama.cpp falls back
        return (quants.quantize(a, Q.Q8_0), Q.Q8_0) if a.shape[-1] % 32 == 0 else (a.astype(np.float16), Q.F16)

    for model, path in zip((target, drafter), paths, strict=True):
        write_gguf(model, path, "llama", quantize=q8_or_f16)
    outs = {}
    for mode in ("off", "sync"):
        js = tmp_path / f"{mode}.json"
        assert cli.main(["generate", "Hello", "--model", paths[0], "--drafter", paths[1], "--mode", mode,
                         "--max-tokens", "16", "--device", "cpu", "--json", str(js)]) == 0
        outs[mode] = capsys.readouterr().out
        if mode == "sync":
            m = json.loads(js.read_text())["total"]
            assert m["rounds"]["ok"] > 0 and m["mean_accepted"] > 0.5  # the worker drafted from the GGUF drafter
    assert outs["off"].startswith("Hello") and outs["sync"] == outs["off"]


def test_load_drafter_reads_gguf(tmp_path):
    from draftrelay.worker.drafters import load_drafter

    path = tmp_path / "d.gguf"
    write_gguf(model_for("qwen2"), path, "qwen2", Q.F16)
    d = load_drafter(str(path), n_rows=2, max_ctx=64)
    assert d.model_id == "d.gguf" and d.tokenizer_hash == G.read_gguf(path).vocab.digest()
    assert d.model.cfg.qkv_bias and d.vocab_size == 256
