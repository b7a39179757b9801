"""The shared Llama-family model: HF loading, cache semantics, rollback, GQA, RoPE scaling, errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftrelay.model import (
    KVCache,
    ModelConfig,
    ModelError,
    Transformer,
    rope_inv_freq,
    save_hf_dir,
    tiny_config,
    tiny_pair,
)


def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                max_position_embeddings=512)
    base.update(kw)
    return ModelConfig(**base)


def full_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """One pass over the whole sequence in a fresh cache (the reference)."""
    B, T = tokens.shape
    cache = model.new_cache(B, T)
    with torch.no_grad():
        return model(tokens, torch.zeros(B, dtype=torch.long), cache, torch.arange(B))


def rand_tokens(n: int, vocab: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---- HF loading ---------------------------------------------------------------------------------


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
    loaded = Transformer.from_hf_dir(tmp_path)
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
    loaded = Transformer.from_hf_dir(tmp_path)
    toks = rand_tokens(9, cfg.vocab_size, seed=1)
    assert torch.equal(full_logits(model, toks), full_logits(loaded, toks))


def test_hf_config_defaults_and_head_dim(tmp_path):
    cfg = ModelConfig.from_hf_dict({"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 8, "intermediate_size": 100})
    assert cfg.n_kv_heads == 8 and cfg.head_dim == 8 and cfg.rope_scaling is None
    cfg2 = ModelConfig.from_hf_dict({"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                                     "intermediate_size": 100, "rope_scaling": {"rope_type": "default"}})
    assert cfg2.n_kv_heads == 2 and cfg2.head_dim == 16 and cfg2.rope_scaling is None


# ---- errors -------------------------------------------------------------------------------------


def _write_cfg(path, **over):
    d = small_cfg().to_hf_dict()
    d.update(over)
    d = {k: v for k, v in d.items() if v is not ...}
    (path / "config.json").write_text(json.dumps(d))


def test_errors_dir_and_config(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Transformer.from_hf_dir(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        Transformer.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot parse"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, num_hidden_layers=...)
    with pytest.raises(ModelError, match="missing field 'num_hidden_layers'"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, hidden_size="big")
    with pytest.raises(ModelError, match="'hidden_size' must be int"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, num_key_value_heads=3)
    with pytest.raises(ModelError, match="multiple of n_kv_heads"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelError, match="'yarn' is not supported"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelError, match="low_freq_factor"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path, hidden_act="gelu")
    with pytest.raises(ModelError, match="hidden_act"):
        ModelConfig.from_hf_dir(tmp_path)
    _write_cfg(tmp_path)
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        Transformer.from_hf_dir(tmp_path)


def test_errors_tensors(tmp_path):
    model = Transformer.random(small_cfg(), seed=1)
    save_hf_dir(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        Transformer.from_hf_dir(tmp_path)
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="k_proj.weight' has shape \\(8, 32\\), expected \\(16, 32\\)"):
        Transformer.from_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ModelError, match="cannot read safetensors"):
        Transformer.from_hf_dir(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ModelError, match="shard gone.safetensors is missing"):
        Transformer.from_hf_dir(tmp_path)


# ---- cache semantics ------------------------------------------------------------------------------


def test_prefill_then_decode_equals_full_pass():
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=2, std=0.1)
    toks = rand_tokens(20, cfg.vocab_size, seed=4)
    ref = full_logits(model, toks)
    cache = model.new_cache(2, 32)
    row = torch.tensor([1])
    out = []
    with torch.no_grad():
        out.append(model(toks[:, :7], torch.tensor([0]), cache, row))      # prefill chunk 1
        out.append(model(toks[:, 7:12], torch.tensor([7]), cache, row))    # prefill chunk 2
        for p in range(12, 20):                                            # 1-token decode
            out.append(model(toks[:, p:p + 1], torch.tensor([p]), cache, row))
    assert int(cache.lengths[1]) == 20 and int(cache.lengths[0]) == 0
    torch.testing.assert_close(torch.cat(out, 1), ref, atol=2e-5, rtol=1e-5)


def test_batch_rows_at_different_lengths_verify_k_plus_1():
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=6, std=0.1)
    a, b = rand_tokens(15, cfg.vocab_size, seed=1), rand_tokens(9, cfg.vocab_size, seed=2)
    cache = model.new_cache(4, 32)
    with torch.no_grad():
        model(a[:, :11], torch.tensor([0]), cache, torch.tensor([3]))
        model(b[:, :5], torch.tensor([0]), cache, torch.tensor([0]))
        # one call verifies 4 tokens for both rows, each at its own position
        out = model(torch.cat([a[:, 11:15], b[:, 5:9]]), torch.tensor([11, 5]), cache, torch.tensor([3, 0]))
    torch.testing.assert_close(out[0], full_logits(model, a)[0, 11:15], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], full_logits(model, b)[0, 5:9], atol=2e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [9, 0, 0, 15]


def test_rollback_to_accepted_length():
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=7, std=0.1)
    toks = rand_tokens(16, cfg.vocab_size, seed=3)
    cache = model.new_cache(1, 32)
    r = torch.tensor([0])
    with torch.no_grad():
        model(toks[:, :10], torch.tensor([0]), cache, r)
        wrong = (toks[:, 10:14] + 1) % cfg.vocab_size
        model(wrong, torch.tensor([10]), cache, r)   # a verify whose last 3 tokens get rejected
        assert int(cache.lengths[0]) == 14
        cache.truncate(0, 11)                        # accepted length: first token only... but it was wrong
        cache.truncate(0, 10)                        # ...so go back further: rollback only shrinks
        out = model(toks[:, 10:16], torch.tensor([10]), cache, r)
    torch.testing.assert_close(out, full_logits(model, toks)[:, 10:16], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="within"):
        cache.truncate(0, 17)


def test_gap_and_overflow_are_refused():
    model = Transformer.random(small_cfg(), seed=1)
    cache = model.new_cache(2, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), torch.tensor([0]), cache, torch.tensor([0]))
        with pytest.raises(ValueError, match="gap"):
            model(torch.tensor([[3]]), torch.tensor([3]), cache, torch.tensor([0]))
        with pytest.raises(ValueError, match="max_len"):
            model(torch.ones(1, 7, dtype=torch.long), torch.tensor([2]), cache, torch.tensor([0]))
        with pytest.raises(ValueError, match="out of range"):
            model(torch.tensor([[3]]), torch.tensor([0]), cache, torch.tensor([5]))
        with pytest.raises(ValueError, match="distinct"):
            model(torch.tensor([[3], [4]]), torch.tensor([0, 0]), cache, torch.tensor([1, 1]))


def test_static_kv_len_path_matches_eager():
    """The graph-capture path (static kv_len, no host bookkeeping) computes the same logits."""
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=8, std=0.1)
    toks = rand_tokens(10, cfg.vocab_size, seed=8)
    c1, c2 = model.new_cache(1, 16), model.new_cache(1, 16)
    with torch.no_grad():
        model(toks[:, :9], torch.tensor([0]), c1, torch.tensor([0]))
        model(toks[:, :9], torch.tensor([0]), c2, torch.tensor([0]))
        eager = model(toks[:, 9:], torch.tensor([9]), c1, torch.tensor([0]))
        static = model(toks[:, 9:], torch.tensor([9]), c2, torch.tensor([0]), kv_len=16)
    torch.testing.assert_close(eager, static, atol=1e-6, rtol=1e-6)
    assert int(c2.lengths[0]) == 9  # the caller owns the lengths on the static path


# ---- GQA and RoPE -------------------------------------------------------------------------------------


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model equals the MHA model whose k/v heads are the GQA heads repeated n_rep times."""
    g = small_cfg(n_heads=4, n_kv_heads=1)
    gqa = Transformer.random(g, seed=9, std=0.1)
    mha = Transformer.random(g.replace(n_kv_heads=4), seed=0)
    src = dict(gqa.named_hf_tensors())  # HF's tensors (the fused projections as views)
    with torch.no_grad():
        for name, t in mha.named_hf_tensors():
            w = src[name]
            if name.endswith(("k_proj.weight", "v_proj.weight")):  # [1*8, 32] -> the head repeated
                w = w.view(1, 8, 32).repeat(4, 1, 1).reshape(32, 32)
            t.copy_(w)
    toks = rand_tokens(11, g.vocab_size, seed=5)
    torch.testing.assert_close(full_logits(gqa, toks), full_logits(mha, toks), atol=1e-5, rtol=1e-5)


def _hf_llama3_inv_freq(theta, dim, factor, low, high, old):
    """The published llama3 rule, written out per frequency (independent of model.py's vector form)."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        wl = 2 * math.pi / f
        if wl < old / high:
            out.append(f)
        elif wl > old / low:
            out.append(f / factor)
        else:
            s = (old / wl - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out)


def test_rope_scaling():
    base = small_cfg(head_dim=64, n_heads=2, n_kv_heads=2, hidden_size=64, rope_theta=500000.0)
    plain = rope_inv_freq(base)
    lin = rope_inv_freq(base.replace(rope_scaling={"rope_type": "linear", "factor": 4.0}))
    torch.testing.assert_close(lin, plain / 4.0)
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
    l3 = rope_inv_freq(base.replace(rope_scaling=s))
    torch.testing.assert_close(l3, _hf_llama3_inv_freq(500000.0, 64, 8.0, 1.0, 4.0, 8192), rtol=1e-5, atol=0)
    assert l3[0] == plain[0] and torch.isclose(l3[-1], plain[-1] / 8)  # high freq kept, low freq slowed
    # the old-style key "type" is accepted too, and the scaling changes the model's output
    cfg = ModelConfig.from_hf_dict({**base.to_hf_dict(), "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert cfg.rope_scaling["rope_type"] == "linear"
    m1 = Transformer.random(base, seed=1, std=0.2)
    m2 = Transformer.random(cfg, seed=1, std=0.2)
    toks = rand_tokens(30, base.vocab_size)
    a, b = full_logits(m1, toks), full_logits(m2, toks)
    assert torch.equal(a[:, 0], b[:, 0])  # position 0: no rotation either way
    assert not torch.allclose(a[:, 1:], b[:, 1:], atol=1e-4)


def test_bf16_keeps_fp32_rope_and_float32_logits():
    model = Transformer.random(small_cfg(), seed=1).to(torch.bfloat16)
    cache = model.new_cache(1, 8)
    assert cache.k.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), torch.tensor([0]), cache, torch.tensor([0]))
    assert out.dtype == torch.float32 and out.shape == (1, 3, 97)
    assert model._inv_freq[model.device].dtype == torch.float32


def test_kvcache_shape_and_errors():
    c = KVCache(small_cfg(), 3, 10)
    assert c.k.shape == (2, 3, 2, 10, 8) and c.lengths.tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        KVCache(small_cfg(), 0, 10)


# ---- tiny pair ------------------------------------------------------------------------------------------


def test_tiny_pair_drafter_agrees_often():
    target, drafter = tiny_pair(0)
    assert target.cfg == tiny_config() and drafter.cfg.n_layers < target.cfg.n_layers
    assert torch.equal(target.embed_tokens.weight, drafter.embed_tokens.weight)
    t2, _ = tiny_pair(0)
    assert torch.equal(t2.layers[3].mlp.up_proj.weight, target.layers[3].mlp.up_proj.weight)  # seeded
    # greedy continuation of the target from a few prompts; does the drafter's argmax agree?
    agree = total = 0
    for seed in range(4):
        prompt = rand_tokens(6, 256, seed=seed)
        cache = target.new_cache(1, 64)
        seq = prompt
        with torch.no_grad():
            logits = target(prompt, torch.tensor([0]), cache, torch.tensor([0]))
            for p in range(6, 40):
                nxt = logits[:, -1:].argmax(-1)
                seq = torch.cat([seq, nxt], 1)
                logits = target(nxt, torch.tensor([p]), cache, torch.tensor([0]))
        t_arg = full_logits(target, seq).argmax(-1)[0, 5:]
        d_arg = full_logits(drafter, seq).argmax(-1)[0, 5:]
        agree += int((t_arg == d_arg).sum())
        total += t_arg.numel()
        assert len(set(seq[0, 6:].tolist())) > 5  # the target does not just repeat one token
    rate = agree / total
    assert 0.5 < rate < 0.99, rate


def test_transformers5_rope_parameters_are_read():
    cfg = ModelConfig.from_hf_dict({
        "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 100, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_hf_dict({"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                      "num_attention_heads": 4, "intermediate_size": 100,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


@pytest.mark.parametrize("kind", ["llama3-gqa-untied", "qwen2-bias-tied"])
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
    else:
        Config, Model = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
        rope, theta, tie = None, 1000000.0, True
    if "rope_parameters" in inspect.signature(Config.__init__).parameters:
        extra = {"rope_parameters": {"rope_type": "default", **(rope or {}), "rope_theta": theta}}
    else:
        extra = {"rope_theta": theta, "rope_scaling": rope}
    hf = Model(Config(**common, tie_word_embeddings=tie, **extra)).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF's init leaves biases zero and norms one: make them count
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = Transformer.from_hf_dir(tmp_path)
    assert ours.cfg.qkv_bias == kind.startswith("qwen2") and ours.cfg.tie_word_embeddings == tie
    toks = rand_tokens(150, 120, seed=2)  # past original_max_position_embeddings: the llama3 scaling matters
    with torch.no_grad():
        ref = hf(toks).logits.float()
    torch.testing.assert_close(full_logits(ours, toks), ref, atol=1e-4, rtol=1e-4)


def test_rows_as_slice_read_in_place_equal_gathered_rows():
    """Consecutive rows are read in place (slice), scattered rows gathered: the same logits."""
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=11, std=0.1)
    toks = rand_tokens(10, cfg.vocab_size, seed=6, batch=2)
    c1, c2 = model.new_cache(4, 16), model.new_cache(4, 16)
    with torch.no_grad():
        a = model(toks, torch.tensor([0, 0]), c1, slice(1, 3), kv_len=16)          # static path, slice
        b = model(toks, torch.tensor([0, 0]), c2, torch.tensor([1, 2]), kv_len=16)  # static path, tensor
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert torch.equal(c1.k, c2.k)  # both wrote rows 1 and 2 only
        assert c1.k[:, 0].abs().sum() == 0 and c1.k[:, 3].abs().sum() == 0
        c3 = model.new_cache(4, 16)
        c3.lengths[:] = 0
        e = model(toks.flip(0), torch.tensor([0, 0]), c3, torch.tensor([3, 0]))      # eager, gathered
        torch.testing.assert_close(e.flip(0), a, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="consecutive"):
            model(toks, torch.tensor([0, 0]), c3, slice(0, 3))


def test_decode_forward_reads_the_kv_rows_without_copying_them_again():
    """The attention GEMMs take the gathered K/V rows as they come ([B, n_kv, L, D] in the cache's own
    layout): the only full-size K/V tensors a decode forward writes are the gather itself, one per
    layer for K and one for V, never a second (transpose) copy."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    cfg = small_cfg()
    model = Transformer.random(cfg, seed=1)
    B, L = 3, 64
    cache = model.new_cache(B + 1, L)
    kv_numel = B * cfg.n_kv_heads * L * cfg.head_dim
    big: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            big.extend(func.overloadpacket.__name__ for t in tree_leaves(out)  # written, not a view
                       if isinstance(t, torch.Tensor) and t.numel() == kv_numel
                       and t.untyped_storage().data_ptr() not in ins)
            return out

    with torch.no_grad(), Watch():
        model(torch.zeros(B, 1, dtype=torch.long), torch.tensor([5, 9, 2]), cache, torch.tensor([3, 0, 1]), kv_len=L)
    assert big == ["index"] * (2 * cfg.n_layers), big


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_split_kv_decode_attention_equals_one_gemm(monkeypatch, dtype, tol):
    """From SPLIT_KV keys on, probs @ V runs over chunks of keys with an fp32 sum: the same attention
    as the single GEMM (within rounding), for a cache slice read in place, a masked tail, and a length
    that is not a multiple of the chunk; a whole decode forward agrees too."""
    import draftrelay.model as M

    monkeypatch.setattr(M, "SPLIT_CHUNK", 16)
    g = torch.Generator().manual_seed(3)
    B, H, R, D, Lmax = 2, 2, 6, 8, 100
    ck, cv = (torch.randn(B + 1, H, Lmax, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, R, D, generator=g).to(dtype)
    for L in (64, 75):
        keys, vals = ck[1:][:, :, :L], cv[1:][:, :, :L]  # non-contiguous views, as a slice of the cache
        blocked = torch.zeros(B, 1, R, L, dtype=torch.bool)
        blocked[0, ..., L - 20:] = True
        monkeypatch.setattr(M, "SPLIT_KV", 1 << 40)
        one = M.attend(q, keys, vals, blocked)
        monkeypatch.setattr(M, "SPLIT_KV", 32)
        split = M.attend(q, keys, vals, blocked)
        assert split.dtype == dtype and split.shape == one.shape
        torch.testing.assert_close(split.float(), one.float(), atol=tol, rtol=tol)
    cfg = small_cfg()
    model = Transformer.random(cfg, seed=4, std=0.1)
    toks = rand_tokens(70, cfg.vocab_size, seed=2)
    outs = []
    for split_kv in (1 << 40, 32):
        monkeypatch.setattr(M, "SPLIT_KV", split_kv)
        cache = model.new_cache(1, 80)
        with torch.no_grad():
            model(toks[:, :66], torch.tensor([0]), cache, torch.tensor([0]))
            outs.append(model(toks[:, 66:], torch.tensor([66]), cache, torch.tensor([0]), kv_len=80))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_decode_forward_never_waits_for_the_device_stream():
    """Host inputs (tokens, positions, rows, logits_at) go to the device as enqueued copies: a blocking
    host-to-device copy synchronizes the stream, and in async rounds that stream is parked on the
    round, so the verify would not be enqueued until the round ended. Checked on the meta device (any
    non-CPU device takes the same path; on CUDA the host side is pinned first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = Transformer.random(tiny_config(), seed=0).to("meta")
    cache = model.new_cache(2, 32)
    blocking: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if (func.overloadpacket.__name__ == "_to_copy" and src is not None and src.device.type == "cpu"
                    and kwargs.get("device") is not None and kwargs["device"].type != "cpu"
                    and not kwargs.get("non_blocking")):
                blocking.append(str(tuple(src.shape)))
            return func(*args, **kwargs)

    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([0, 0]), cache, torch.tensor([0, 1]))  # warm
        with Watch():
            model(torch.tensor([[7, 8], [9, 10]]), torch.tensor([3, 3]), cache, torch.tensor([1, 0]),
                  logits_at=torch.tensor([1, 0]))
            model(torch.tensor([[7], [9]]), torch.tensor([5, 5]), cache, slice(0, 2), kv_len=8)
    assert blocking == [], f"blocking host-to-device copies of shapes {blocking}"
