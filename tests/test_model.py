"""The shared Llama-family model: cache semantics, rollback, GQA, RoPE scaling (HF I/O: test_checkpoint_hf)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import draftrelay.model as M
from draftrelay import cpu_linear
from draftrelay.checkpoint import hf
from draftrelay.model import (
    KVCache,
    ModelConfig,
    Transformer,
    rope_inv_freq,
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
    cfg = hf.config_from_dict({**hf.config_to_dict(base), "rope_scaling": {"type": "linear", "factor": 4.0}})
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


@pytest.fixture
def counted_linear(monkeypatch):
    """F.linear counting the weight rows of each call (`calls`) and the real F.linear (`real`); torch's
    thread count is restored afterwards."""
    calls, real, before = [], F.linear, torch.get_num_threads()
    monkeypatch.setattr(M.F, "linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    yield calls, real
    torch.set_num_threads(before)


def test_blocked_cpu_linear_with_threads_blocks_only_large_weights(monkeypatch, counted_linear):
    """With several threads a block holds a share per thread, and only weights of at least
    CPU_BLOCK_MIN_THREADED are blocked; the values are the one GEMM's."""
    monkeypatch.setattr(cpu_linear, "CPU_BLOCK_BYTES", 16384)
    monkeypatch.setattr(cpu_linear, "CPU_BLOCK_MIN", 1 << 16)
    monkeypatch.setattr(cpu_linear, "CPU_BLOCK_MIN_THREADED", 1 << 19)
    g = torch.Generator().manual_seed(4)
    big, small = torch.randn(1000, 256, generator=g), torch.randn(400, 256, generator=g)  # 1 MB, 0.4 MB
    calls, real = counted_linear
    torch.set_num_threads(2)
    x = torch.randn(7, 256, generator=g)
    out = M.linear(x, big)
    assert len(calls) > 1 and max(calls) == 32  # 2 x 16 KB of 1 KB rows per block
    torch.testing.assert_close(out, real(x, big), rtol=1e-6, atol=1e-5)
    calls.clear()
    M.linear(x, small)
    assert calls == [400]  # below the threaded minimum: one GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_cpu_linear_equals_one_gemm(monkeypatch, counted_linear, dtype):
    """A few-row single-threaded product in row blocks of the weight gives the one GEMM's values within
    fp32 summation order (each block computes whole output columns); other shapes and thread counts are
    the one GEMM."""
    monkeypatch.setattr(cpu_linear, "CPU_BLOCK_BYTES", 4096)
    monkeypatch.setattr(cpu_linear, "CPU_BLOCK_MIN", 1 << 16)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 256, generator=g).to(dtype)  # 4096-byte blocks would be 4 rows: 16 at least
    b = torch.randn(1000, generator=g).to(dtype)
    calls, real = counted_linear
    torch.set_num_threads(1)
    for rows in (4, 7, 16):
        x = torch.randn(1, rows, 256, generator=g).to(dtype)
        calls.clear()
        out = M.linear(x, w, b)
        assert len(calls) > 1 and max(calls) == 16  # blocks of 16 rows (the floor), the last shorter
        # the same dot products; MKL's kernel for a block may sum them in another order (last bits: on the
        # AMD EPYC VM 1 of 16,000 values was 1.1e-5 off, on the Intel one none)
        torch.testing.assert_close(out, real(x, w, b), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-4 if dtype == torch.float32 else 1e-2)
    for rows in (1, 3, 17):
        calls.clear()
        M.linear(torch.randn(rows, 256, generator=g).to(dtype), w, b)
        assert calls == [1000]
    torch.set_num_threads(2)
    calls.clear()
    M.linear(torch.randn(5, 256, generator=g).to(dtype), w, b)
    assert calls == [1000]
