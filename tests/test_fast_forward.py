"""The fast forward (Transformer.fast: the fused kernels of draftrelay.kernels) against the plain one.

On a CPU the fast forward runs its own structure (positions instead of RoPE tables and masks, fused
add+norm, SiLU*mul, RoPE+KV write, attention over per-row lengths) with each kernel's plain-torch
definition (kernels.reference); the Triton kernels themselves are checked against those definitions on
a GPU (tests_gpu/test_fast_forward_gpu.py). Fresh random inputs in every check."""

from __future__ import annotations

import copy

import pytest
import torch

from draftrelay import kernels
from draftrelay import model as M
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.kernels import reference as R
from draftrelay.model import ModelConfig, Transformer, tiny_pair


def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                intermediate_size=48, max_position_embeddings=512)
    base.update(kw)
    return ModelConfig(**base)


def test_backend_on_cpu_is_the_reference_and_auto_is_off():
    assert kernels.backend("cpu") is R and not kernels.triton_available("cpu")
    m = Transformer.random(small_cfg())
    assert m.fast is None and not m.fast_path()  # auto: the plain path on a CPU (as fast as before)
    m.fast = True
    assert m.fast_path()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_kernel_definition_equals_the_plain_ops(dtype, tol):
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x, d = torch.randn(3, 5, 40, generator=g).to(dtype), torch.randn(3, 5, 40, generator=g)
    w = torch.randn(40, generator=g).to(dtype)
    xo, h = R.add_rms_norm(x, d, w, 1e-6)  # delta fp32 (as a TP all-reduce's sum): rounded first
    ref_x = x + d.to(dtype)
    assert torch.equal(xo, ref_x)
    torch.testing.assert_close(h.float(), M.rms_norm(ref_x, w, 1e-6).float(), atol=tol, rtol=tol)
    wl, bl = torch.randn(24, 40, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
    xo2, y = R.norm_linear(x, d, w, 1e-6, wl, bl)
    assert torch.equal(xo2, ref_x) and R.use_norm_linear(15, wl)
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(M.rms_norm(ref_x, w, 1e-6), wl, bl).float(),
                               atol=4 * tol, rtol=4 * tol)
    gu = torch.randn(2, 3, 96, generator=g).to(dtype)
    torch.testing.assert_close(R.silu_mul(gu).float(), (torch.nn.functional.silu(gu[..., :48]) * gu[..., 48:]).float(),
                               atol=tol, rtol=tol)
    # RoPE + KV write against apply_rope with step_tables and the plain index write
    B, T, H, HK, D = 2, 3, 4, 2, 8
    cfg = small_cfg()
    inv = M.rope_inv_freq(cfg)
    qkv = torch.randn(B, T, (H + 2 * HK) * D, generator=g).to(dtype)
    start, rows = torch.tensor([7, 0]), torch.tensor([2, 0])
    ck, cv = torch.zeros(3, HK, 16, D, dtype=dtype), torch.zeros(3, HK, 16, D, dtype=dtype)
    q = R.rope_kv_write(qkv, start, inv, H, HK, ck, cv, rows)
    pos, cos, sin, _ = M.step_tables(start, T, 16, 2, inv, torch.float32)
    qk = M.apply_rope(qkv[..., :(H + HK) * D].float().view(B, T, H + HK, D), cos, sin)
    torch.testing.assert_close(q.float(), qk[:, :, :H], atol=tol, rtol=tol)
    for b in range(B):
        p = pos[b]
        torch.testing.assert_close(ck[rows[b], :, p].float(), qk[b, :, H:].transpose(0, 1), atol=tol, rtol=tol)
        assert torch.equal(cv[rows[b], :, p], qkv[b, :, (H + HK) * D:].view(T, HK, D).transpose(0, 1))
    assert ck[1].abs().sum() == 0 and cv[1].abs().sum() == 0  # row 1 untouched
    # attention over per-row lengths against attend() with the plain path's mask
    kv = 16
    ck, cv = torch.randn(3, HK, kv, D, generator=g).to(dtype), torch.randn(3, HK, kv, D, generator=g).to(dtype)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    got = R.decode_attention(q, ck, cv, rows, start, kv)
    _, _, _, blocked = M.step_tables(start, T, kv, H // HK, inv, dtype)
    qg = q.transpose(1, 2).reshape(B, HK, (H // HK) * T, D)
    ref = M.attend(qg, ck[rows], cv[rows], blocked).reshape(B, H, T, D).transpose(1, 2)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def _decode_run(model: Transformer, prompt: torch.Tensor, steps: int, k: int = 1):
    """Prefill, then `steps` verify-shaped forwards of k tokens each (greedy feedback): logits, tokens."""
    cache = model.new_cache(2, prompt.shape[1] + steps * k + 1)
    with torch.no_grad():
        lg = model(prompt, torch.tensor([0]), cache, torch.tensor([1]), last_only=True)
        outs, toks = [lg[0, -1]], []
        for _ in range(steps):
            nxt = outs[-1].argmax()
            toks.append(int(nxt))
            tok = torch.full((1, k), int(nxt))
            lg = model(tok, torch.tensor([int(cache.lengths[1])]), cache, torch.tensor([1]))
            outs.append(lg[0, -1])
    return torch.stack(outs), toks


def test_fast_forward_logits_within_bf16_of_plain_and_greedy_equal_in_fp32():
    seed = int(torch.randint(0, 1 << 30, ()))
    cfg = small_cfg(n_layers=3, qkv_bias=True)
    plain = Transformer.random(cfg, seed=seed, std=0.1, dtype=torch.bfloat16)
    fast = copy.deepcopy(plain)
    fast.fast = True
    prompt = torch.randint(0, cfg.vocab_size, (1, 20))
    a, _ = _decode_run(plain, prompt, 6, k=5)
    b, _ = _decode_run(fast, prompt, 6, k=5)
    spread = a.float().std().item()
    assert (a - b).abs().max().item() <= 0.05 * spread + 1e-2, ((a - b).abs().max(), spread)  # bf16 rounding
    # greedy tokens: the built-in tiny target in fp32 and a fixed prompt (a fresh random one could land on
    # an exact near-tie, where 1e-7 of summation order picks the other token legitimately)
    target, _ = tiny_pair()
    fast_t = copy.deepcopy(target)
    fast_t.fast = True
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    la, ta = _decode_run(target, prompt, 24)
    lb, tb = _decode_run(fast_t, prompt, 24)
    assert ta == tb
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)


def test_fast_forward_with_rows_as_slice_and_tensor_and_static_kv_len():
    cfg = small_cfg()
    m = Transformer.random(cfg, seed=3, std=0.1)
    m.fast = True
    toks = torch.randint(0, cfg.vocab_size, (2, 4))
    c1, c2 = m.new_cache(4, 32), m.new_cache(4, 32)
    with torch.no_grad():
        a = m(toks, torch.tensor([0, 0]), c1, slice(1, 3), kv_len=32)
        b = m(toks, torch.tensor([0, 0]), c2, torch.tensor([1, 2]), kv_len=32)
        m.fast = False
        c3 = m.new_cache(4, 32)
        ref = m(toks, torch.tensor([0, 0]), c3, torch.tensor([1, 2]), kv_len=32)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(c1.v, c2.v) and c1.k[:, 0].abs().sum() == 0 and c1.k[:, 3].abs().sum() == 0


def _engine_outputs(target: Transformer, mode: str) -> list[list[int]]:
    h = HandoffConfig(round_spec={"kind": "builtin"})
    cfg = EngineConfig(mode=mode, n_draft=4, max_batch=4, max_len=256, handoff=h)
    prompts = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"abc")]
    with Engine(target, cfg) as eng:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=12))
    return [r.output for r in reqs]


def test_engine_greedy_identical_across_round_modes_with_the_fast_path():
    plain, _ = tiny_pair()
    fast = copy.deepcopy(plain)
    fast.fast = True
    ref = _engine_outputs(plain, "off")
    for mode in ("off", "sync", "async"):
        assert _engine_outputs(fast, mode) == ref, mode
