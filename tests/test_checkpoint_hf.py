"""HF checkpoint directories: config.json parsing, safetensors round trips, refusals, parity with transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftrelay.checkpoint.hf import config_from_dict, config_to_dict, load_hf_dir, read_config, save_hf_dir
from draftrelay.model import ModelError, Transformer
from test_model import full_logits, rand_tokens, small_cfg


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_roundtrip(tmp_path, shards, tied):
    cfg = small_cfg(tie_word_embeddings=tied)
    model = Transformer.random(cfg, seed=3, std=0.1)
    save_hf_dir(model, tmp_path, shards=shards)
    files = sorted(os.listdir(tmp_path))
    assert ("model.safetensors.index.json" in files) == (shards > 1)
    names = set()
    for f in files:
        if f.endswith(".safetensors"):
            names |= set(load_file(tmp_path / f))
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert ("lm_head.weight" in names) == (not tied)
    loaded = load_hf_dir(tmp_path)
    assert loaded.cfg == cfg
    toks = rand_tokens(12, cfg.vocab_size)
    assert torch.equal(full_logits(model, toks), full_logits(loaded, toks))


def test_hf_qwen2_style_bias_and_extra_tensors(tmp_path):
    cfg = small_cfg(qkv_bias=True)
    model = Transformer.random(cfg, seed=5)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    save_hf_dir(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old checkpoints carry it
    save_file(sd, tmp_path / "model.safetensors")
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["model_type"] == "qwen2"
    loaded = load_hf_dir(tmp_path)
    toks = rand_tokens(9, cfg.vocab_size, seed=1)
    assert torch.equal(full_logits(model, toks), full_logits(loaded, toks))


def test_hf_config_defaults_and_head_dim(tmp_path):
    cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 8, "intermediate_size": 100})
    assert cfg.n_kv_heads == 8 and cfg.head_dim == 8 and cfg.rope_scaling is None
    cfg2 = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                                     "intermediate_size": 100, "rope_scaling": {"rope_type": "default"}})
    assert cfg2.n_kv_heads == 2 and cfg2.head_dim == 16 and cfg2.rope_scaling is None


def _write_cfg(path, **over):
    d = config_to_dict(small_cfg())
    d.update(over)
    d = {k: v for k, v in d.items() if v is not ...}
    (path / "config.json").write_text(json.dumps(d))


def test_errors_dir_and_config(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_hf_dir(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot parse"):
        read_config(tmp_path)
    _write_cfg(tmp_path, num_hidden_layers=...)
    with pytest.raises(ModelError, match="missing field 'num_hidden_layers'"):
        read_config(tmp_path)
    _write_cfg(tmp_path, hidden_size="big")
    with pytest.raises(ModelError, match="'hidden_size' must be int"):
        read_config(tmp_path)
    _write_cfg(tmp_path, num_key_value_heads=3)
    with pytest.raises(ModelError, match="multiple of n_kv_heads"):
        read_config(tmp_path)
    _write_cfg(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelError, match="'yarn' is not supported"):
        read_config(tmp_path)
    _write_cfg(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelError, match="low_freq_factor"):
        read_config(tmp_path)
    _write_cfg(tmp_path, hidden_act="gelu")
    with pytest.raises(ModelError, match="hidden_act"):
        read_config(tmp_path)
    _write_cfg(tmp_path)
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_hf_dir(tmp_path)


def test_errors_tensors(tmp_path):
    model = Transformer.random(small_cfg(), seed=1)
    save_hf_dir(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        load_hf_dir(tmp_path)
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="k_proj.weight' has shape \\(8, 32\\), expected \\(16, 32\\)"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ModelError, match="cannot read safetensors"):
        load_hf_dir(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ModelError, match="shard gone.safetensors is missing"):
        load_hf_dir(tmp_path)


def test_transformers5_rope_parameters_are_read():
    cfg = config_from_dict({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 100, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    plain = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                      "num_attention_heads": 4, "intermediate_size": 100,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


@pytest.mark.parametrize("kind", ["llama3-gqa-untied", "qwen2-bias-tied", "qwen3-qknorm-tied"])
def test_logits_equal_huggingface_transformers(tmp_path, kind):
    """Our model on checkpoints written by transformers itself (not in CI: transformers is not a dependency;
    this runs where transformers is installed, e.g. the GPU machine's image)."""
    transformers = pytest.importorskip("transformers")
    import inspect

    torch.manual_seed(0)
    common = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind.startswith("llama3"):
        Config, Model = transformers.LlamaConfig, transformers.LlamaForCausalLM
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        theta, tie = 500000.0, False
    elif kind.startswith("qwen2"):
        Config, Model = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
        rope, theta, tie = None, 1000000.0, True
    else:
        if not hasattr(transformers, "Qwen3Config"):
            pytest.skip("this transformers has no Qwen3")
        Config, Model = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        rope, theta, tie = None, 1000000.0, True
        common["head_dim"] = 24  # Qwen3 states head_dim; here not hidden / heads
    if "rope_parameters" in inspect.signature(Config.__init__).parameters:
        extra = {"rope_parameters": {"rope_type": "default", **(rope or {}), "rope_theta": theta}}
    else:
        extra = {"rope_theta": theta, "rope_scaling": rope}
    hf = Model(Config(**common, tie_word_embeddings=tie, **extra)).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF's init leaves biases zero and norms one: make them count
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf_dir(tmp_path)
    assert ours.cfg.qkv_bias == kind.startswith("qwen2") and ours.cfg.tie_word_embeddings == tie
    assert ours.cfg.qk_norm == kind.startswith("qwen3")
    toks = rand_tokens(150, 120, seed=2)  # past original_max_position_embeddings: the llama3 scaling matters
    with torch.no_grad():
        ref = hf(toks).logits.float()
    torch.testing.assert_close(full_logits(ours, toks), ref, atol=1e-4, rtol=1e-4)


# ---- refusals: what the decoder would run wrong -------------------------------------------------------


@pytest.mark.parametrize("over,match", [
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    ({"model_type": ...}, "model_type None is not supported"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architecture.*Qwen3ForCausalLM.*not supported"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window attention \\(sliding_window=4096\\)"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope' is not supported"),
])
def test_refuses_configs_it_would_run_wrong(tmp_path, over, match):
    _write_cfg(tmp_path, **over)
    with pytest.raises(ModelError, match=match):
        read_config(tmp_path)


def test_accepts_windows_that_are_off(tmp_path):
    _write_cfg(tmp_path, model_type="qwen2", use_sliding_window=False, sliding_window=32768,
               architectures=["Qwen2ForCausalLM"])
    assert read_config(tmp_path).qkv_bias
    _write_cfg(tmp_path, model_type="mistral", sliding_window=None)
    assert not read_config(tmp_path).qkv_bias


def test_refuses_tensors_the_model_does_not_use(tmp_path):
    """A Qwen3 checkpoint read as Qwen2 would drop its q/k norms (logits off by up to 0.48): refused."""
    model = Transformer.random(small_cfg(), seed=1)
    save_hf_dir(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    save_file({**sd, "model.layers.0.self_attn.q_norm.weight": torch.ones(8),
               "model.layers.0.self_attn.k_norm.weight": torch.ones(8)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="does not use: model.layers.0.self_attn.k_norm.weight, model.layers.0.se"):
        load_hf_dir(tmp_path)


def test_tied_head_copy_must_equal_the_embedding(tmp_path):
    model = Transformer.random(small_cfg(tie_word_embeddings=True), seed=1)
    save_hf_dir(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    emb = sd["model.embed_tokens.weight"]
    save_file({**sd, "lm_head.weight": emb.clone()}, tmp_path / "model.safetensors")
    toks = rand_tokens(8, 97)
    assert torch.equal(full_logits(load_hf_dir(tmp_path), toks), full_logits(model, toks))
    save_file({**sd, "lm_head.weight": emb + 1}, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="'lm_head.weight' differs from the embedding"):
        load_hf_dir(tmp_path)
