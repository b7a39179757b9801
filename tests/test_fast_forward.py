"""The fast forward (Transformer.fast: the fused kernels of draftrelay.kernels) against the plain one.

On a CPU the fast forward runs its own structure (positions instead of RoPE tables and masks, fused
add+norm, SiLU*mul, RoPE+KV write, attention over per-row lengths) with each kernel's plain-torch
definition (kernels.reference); the Triton kernels themselves are checked against those definitions on
a GPU (tests_gpu/test_fast_forward_gpu.py). Fresh random inputs in every check."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import run_interpreted
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


def _decode_run(model: Transformer, prompt: torch.Tensor, steps: int, k: int = 1, forced: list[int] | None = None):
    """Prefill, then `steps` verify-shaped forwards of k tokens each (greedy feedback, or the `forced`
    tokens): logits, tokens."""
    cache = model.new_cache(2, prompt.shape[1] + steps * k + 1)
    with torch.no_grad():
        lg = model(prompt, torch.tensor([0]), cache, torch.tensor([1]), last_only=True)
        outs, toks = [lg[0, -1]], []
        for _ in range(steps):
            nxt = outs[-1].argmax() if forced is None else torch.tensor(forced[len(toks)])
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
    a, toks = _decode_run(plain, prompt, 6, k=5)
    # the same inputs on both paths: a bf16 near-tie may pick another token, and then the logits of
    # two different sequences are compared
    b, _ = _decode_run(fast, prompt, 6, k=5, forced=toks)
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


def test_positions_ahead_rows_are_the_loop_positions_each_contiguous():
    first = torch.tensor([5, 9, 0])
    ahead = M.positions_ahead(first, 3)
    assert ahead.tolist() == [[5, 9, 0], [6, 10, 1], [7, 11, 2]] and ahead.dtype == first.dtype
    assert all(ahead[s].is_contiguous() for s in range(3))  # what the kernels take as start
    assert M.positions_ahead(first, 0).shape == (0, 3)


def test_embedding_definition_and_the_forward_use_it():
    """The reference is F.embedding; the forward's first step goes through the backend's embedding on the
    fast path (the CUDA kernel there), F.embedding on the plain one."""
    w = torch.randn(30, 8)
    ids = torch.tensor([[1, 29], [0, 0]])
    assert torch.equal(R.embedding(ids, w), w[ids])
    with pytest.raises(IndexError):
        R.embedding(torch.tensor([30]), w)
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(R, name)

        def embedding(self, t, wt):
            calls.append(t.shape)
            return R.embedding(t, wt)
    cfg = small_cfg()
    st = M.step_state(torch.tensor([0]), 1, 4, torch.tensor([0]), cfg.n_rep, M.rope_inv_freq(cfg), torch.float32,
                      fast=False)
    assert torch.equal(M.embedding(ids, w, st), w[ids]) and not calls
    st.kernels = Spy()
    assert torch.equal(M.embedding(ids, w, st), w[ids]) and calls == [ids.shape]


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


# ---- the skinny-GEMM plan, the greedy pick, and the Triton kernels under Triton's interpreter ----------

def test_skinny_candidates_fit_the_kernel_rules():
    from draftrelay.kernels import plan as P
    shapes = [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936), (3584, 4608), (18944, 3584), (7, 5)]
    for pro in (P.PRO_NONE, P.PRO_NORM, P.PRO_SILU):
        for K, N in shapes:
            for rows in (1, 2, 5, 16):
                cands = P.candidates(pro, rows, N, K)
                for c in cands:
                    pow2 = all(v & (v - 1) == 0 for v in (c.block_n, c.block_k))
                    assert pow2 and c.warps in (4, 8) and (c.dot or rows <= P.SUM_MAX_ROWS), (pro, rows, N, K, c)
                    assert not c.dot or c.block_n >= 16  # tensor-core dots: tiles of at least 16
                    ks, n_split = P.split_range(K, c)
                    assert ks % c.block_k == 0 and (n_split - 1) * ks < K <= n_split * ks
                    if P.rows_dot_tile(c):  # compact-rows dot tiles: a few rows (one: mid-sized weights), one slice
                        assert rows > 1 and N * K <= P.ROWS_DOT_MAX
                        assert ks == c.block_k and c.block_k in (128, 256) and c.stages == 1
                        assert c.pre == (pro == P.PRO_NORM and K > 1024)  # long rows: the norm its own launch
                        if pro == P.PRO_NORM and not c.pre:  # the RMS pass: the row in tiles of the slice
                            assert P.norm_trips(pro, K, c) * c.block_k >= K > (P.norm_trips(pro, K, c) - 1) * c.block_k
                        continue
                    assert not c.pre and P.norm_trips(pro, K, c) == 0
                    if c.swap:  # the weight tile first: a warp group's 64 rows, a looped tile (prologue first)
                        assert rows > 1 and c.dot and c.block_n == 64 and c.warps == 4 and K > c.block_k
                        assert c.stages == 4 or (c.stages == 3 and c.split == 1 and K > 1024)  # 3: long rows only
                        two = c.split == 2 and pro != P.PRO_NORM  # long K, no norm: two ranges whatever N is
                        assert c.split == 1 or (K > 1024 and (-(-N // 64) < P.ROWS_DOT_PROGRAMS or two))
                        assert P.k_ranges(pro, K, c) == P.split_range(K, c)  # the norm first: its ranges split
                    assert not c.unroll or (K > 1024 and not c.dot and pro != P.PRO_NORM)
                    assert c.split == 1 or (K > 1024 and (pro != P.PRO_NORM or c.swap))  # split-K: long K, no norm
                    if pro == P.PRO_NORM:  # the norm in the tile needs the whole row; a looped dot runs it first
                        assert c.block_k >= K or (c.dot and rows > 1 and c.block_k == 128)
                if pro != P.PRO_NORM or K <= 1024 or rows > 1 or K <= P.NORM_MAX_K:
                    assert cands, (pro, rows, N, K)
                assert len(set(cands)) == len(cands), (pro, rows, N, K)  # each configuration measured once
            assert P.candidates(pro, 17, 896, 896) == [] and P.candidates(pro, 0, 896, 896) == []
    assert P.candidates(P.PRO_NORM, 1, 10, 5000) == []  # K beyond one tile: add_rms_norm + cuBLAS
    whole = [P.SkinnyConfig(16, 1024, True, 8, 1), P.SkinnyConfig(32, 1024, True, 8, 1)]
    for rows in (2, 4, 8, 16):  # a norm's product on rows of one tile: the whole-row dot tiles, the norm inside
        assert all(c in P.candidates(P.PRO_NORM, rows, 9728, 896) for c in whole), rows
        assert not any(c.dot and c.block_k >= 3584 for c in P.candidates(P.PRO_NORM, rows, 4608, 3584)), rows
        assert not any(c in P.candidates(P.PRO_NONE, rows, 896, 896) for c in whole), rows
    assert not any(c in P.candidates(P.PRO_NORM, 1, 9728, 896) for c in whole)  # one row: the sum tiles
    # the swapped tile at 3 stages for long rows (the 7B's; at the 0.5B's 896 it slowed the four-request STEP),
    # and over two K ranges for long K without a norm (the 7B's down and o_proj)
    s3, two = P.SkinnyConfig(64, 128, True, 4, 3, swap=True), P.SkinnyConfig(64, 128, True, 4, 4, False, 2, swap=True)
    for rows in (2, 8, 16):
        assert s3 in P.candidates(P.PRO_NORM, rows, 37888, 3584) and s3 not in P.candidates(P.PRO_NORM, rows, 9728, 896)
        assert two in P.candidates(P.PRO_SILU, rows, 3584, 18944) and two in P.candidates(P.PRO_NONE, rows, 3584, 3584)
        assert two not in P.candidates(P.PRO_NORM, rows, 37888, 3584)
        assert two not in P.candidates(P.PRO_NONE, rows, 896, 896)
    assert s3 not in P.candidates(P.PRO_NONE, 1, 3584, 18944)  # one row: the multiply-and-sum tiles


def test_planner_measures_each_key_once_and_keeps_cublas_unless_clearly_faster():
    import math

    from draftrelay.kernels import plan as P
    a, b = P.SkinnyConfig(4, 1024, False, 4, 2), P.SkinnyConfig(16, 128, True, 4, 4)
    calls = []
    # cuBLAS is charged P.CHAIN_S (the chain of PDL launches it breaks), then a candidate must be MARGIN faster
    chained = (10e-6 + P.CHAIN_S) * (1 - P.MARGIN)
    speeds = {("fast",): {None: 10e-6, a: 6e-6, b: 7e-6},
              ("slower alone",): {None: 10e-6, a: chained * 0.99, b: math.inf},
              ("close",): {None: 10e-6, a: chained * 1.01, b: math.inf},
              ("broken",): {None: 10e-6, a: math.inf, b: math.inf}}

    def measure(key, cands):
        calls.append(key)
        assert cands == [a, b]
        return speeds[key]

    pl = P.Planner(measure)
    assert pl.choose(("fast",), [a, b]) == a
    assert pl.choose(("slower alone",), [a, b]) == a  # slower than cuBLAS alone, faster than cuBLAS in a chain
    assert pl.choose(("close",), [a, b]) is None  # within MARGIN of cuBLAS in a chain: cuBLAS
    assert pl.choose(("broken",), [a, b]) is None  # every candidate failed its check
    assert pl.choose(("fast",), [a, b]) == a
    assert calls == [("fast",), ("slower alone",), ("close",), ("broken",)]
    assert pl.choose(("none",), []) is None and ("none",) not in calls  # nothing to measure
    assert pl.report[("fast",)]["cublas"] == 10e-6 and pl.report[("fast",)][a.label()] == 6e-6


def test_greedy_top_definition():
    """The m most likely ids in descending order with ties to the lower id, each with its softmax
    probability; its token and confidence are greedy_pick's; an m outside 1..V is refused by name."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    lg = torch.randn(4, 3000, generator=g)
    lg[1, 2900] = lg[1, 7] = lg[1].max() + 1  # a tie at the top: the lower id first
    lg[2, 40] = lg[2, 41] = lg[2, 5] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        x = lg.to(dtype)
        tok, conf, ids, probs = R.greedy_top(x, 8)
        pt, pc = R.greedy_pick(x)
        assert torch.equal(tok, pt) and torch.equal(conf, pc) and torch.equal(ids[:, 0], tok)
        assert ids.dtype == torch.int64 and ids.shape == (4, 8) and probs.dtype == torch.float32
        assert ids[1, :2].tolist() == [7, 2900]
        xf = x.float()
        vals = xf.gather(-1, ids)
        assert torch.equal(vals, xf.topk(8, dim=-1).values)  # the 8 largest, in descending order
        assert bool((vals[:, :-1] >= vals[:, 1:]).all())
        torch.testing.assert_close(probs, torch.softmax(xf, -1).gather(-1, ids))
    assert R.greedy_top(lg, 3000)[2].shape == (4, 3000)
    for bad in (0, 3001):
        with pytest.raises(ValueError, match=f"m={bad}"):
            R.greedy_top(lg, bad)


def test_greedy_pick_definition_and_the_forward_greedy_output():
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    lg = torch.randn(4, 300, generator=g)
    lg[1, 7] = lg[1, 250] = lg[1].max() + 1  # a tie: the lower id, as torch.argmax
    tok, conf = R.greedy_pick(lg.to(torch.bfloat16))
    ref = lg.to(torch.bfloat16).float()
    assert tok.dtype == torch.int64 and int(tok[1]) == 7 and torch.equal(tok, ref.argmax(-1))
    torch.testing.assert_close(conf, torch.softmax(ref, -1).max(-1).values)
    cfg = small_cfg(n_layers=2, qkv_bias=True)
    for fast in (False, True):
        m = Transformer.random(cfg, seed=int(torch.randint(0, 1 << 30, ())), std=0.1)
        m.fast = fast
        toks = torch.randint(0, cfg.vocab_size, (2, 3))
        at = torch.tensor([2, 0])
        c1, c2 = m.new_cache(2, 16), m.new_cache(2, 16)
        with torch.no_grad():
            lg = m(toks, torch.tensor([0, 0]), c1, torch.tensor([0, 1]), kv_len=16, logits_at=at)[:, 0]
            t, c = m(toks, torch.tensor([0, 0]), c2, torch.tensor([0, 1]), kv_len=16, logits_at=at, greedy=True)
            assert torch.equal(t, lg.argmax(-1)), fast
            torch.testing.assert_close(c, torch.softmax(lg, -1).max(-1).values)
            with pytest.raises(ValueError, match="one position"):
                m(toks, torch.tensor([0, 0]), c2, torch.tensor([0, 1]), kv_len=16, greedy=True)


INTERPRETED_CHECK = r'''
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from draftrelay.kernels import plan as P, reference as R, triton_ops as T
g = torch.Generator().manual_seed(int(sys.argv[1]))
n = splits = silus = 0


def check(pro, cfg, M, N, K, launches):
    """One configuration on fresh inputs against the definition, launched `launches` times."""
    global silus
    x = torch.randn(M, 2 * K if pro == P.PRO_SILU else K, generator=g)
    w, b = torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g)
    d, nw = torch.randn(M, K, generator=g), torch.randn(K, generator=g)
    if pro == P.PRO_NORM:
        rx, ref = R.norm_linear(x, d, nw, 1e-6, w, b)
    else:
        rx, ref = x, (R.act_linear if pro == P.PRO_SILU else R.linear)(x, w, b)
    for _ in range(launches):
        gx, got = T.skinny_linear(pro, cfg, x, w, b, d if pro == P.PRO_NORM else None, nw, 1e-6)
        assert torch.equal(gx, rx), (pro, cfg)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"{pro} {cfg} {M} {N} {K}")
    if pro == P.PRO_NORM and N % 2 == 0 and cfg.block_n >= 2:  # norm_mlp's gate|up: silu_mul stored by it
        for _ in range(launches):
            gx, got = T.skinny_linear(pro, cfg, x, w, b, d, nw, 1e-6, silu_out=True)
            assert torch.equal(gx, rx) and got.shape == (M, N // 2), (cfg, got.shape)
            torch.testing.assert_close(got, R.silu_mul(ref), atol=3e-5, rtol=3e-5, msg=f"silu {cfg} {M} {N} {K}")
        silus += 1


for M, N, K in ((1, 40, 96), (3, 33, 200), (1, 24, 1100), (16, 17, 64), (1, 20, 4500), (3, 40, 2300),
                (5, 24, 300), (4, 16, 1500), (2, 72, 600)):
    for pro in (P.PRO_NONE, P.PRO_NORM, P.PRO_SILU):
        for cfg in P.candidates(pro, M, N, K):
            check(pro, cfg, M, N, K, 2 if cfg.split > 1 else 1)  # twice: the counts are left ready for the next
            n += 1
            splits += cfg.split > 1
for M, N, K in ((1, 40, 96), (1, 24, 1100)):  # the compact-rows dot tile at one row (not a candidate there)
    for pro in (P.PRO_NONE, P.PRO_NORM, P.PRO_SILU):
        check(pro, P.rows_dot(N, K, 32, pro == P.PRO_NORM and K > 1024), M, N, K, 2)
        n += 1
# norm_mlp: with the gate|up planned on a skinny tile it stores SiLU * up and the down reads that; unplanned (a
# CPU tensor, or cuBLAS on a GPU) norm_linear then act_linear; a one-column tile (no gate and up pair) the same
x, d, nw = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
wgu, wd = torch.randn(48, 64, generator=g) * 0.125, torch.randn(64, 24, generator=g) * 0.2
rx, want = R.norm_mlp(x, d, nw, 1e-6, wgu, wd)
planned, kernel_calls = T._plan, []
launch = T.skinny_linear
T.skinny_linear = lambda *a, **k: kernel_calls.append(k.get("silu_out", False)) or launch(*a, **k)
for cfg in (None, P.SkinnyConfig(16, 64, False, 4, 1), P.SkinnyConfig(1, 64, False, 4, 1)):
    T._plan = lambda pro, *a, cfg=cfg: cfg if pro == P.PRO_NORM else None
    kernel_calls.clear()
    gx, got = T.norm_mlp(x, d, nw, 1e-6, wgu, wd)
    assert torch.equal(gx, rx) and kernel_calls == ([True] if cfg and cfg.block_n > 1 else [False] if cfg else [])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
T._plan, T.skinny_linear = planned, launch
lg = torch.randn(3, 9000, generator=g)
lg[0, 8999] = lg[0, 4100] = lg[0].max() + 1  # tied across two chunks of the first pass
tok, conf = T.greedy_pick(lg)
rt, rc = R.greedy_pick(lg)
assert torch.equal(tok, rt) and int(tok[0]) == 4100, (tok, rt)
torch.testing.assert_close(conf, rc)
lg[1, 100] = lg[1, 9] = lg[1].max() + 1  # tied inside one chunk
lg[2, :4096] = float("-inf")  # a chunk of -inf logits: no candidate of it is taken twice
for m in (1, 8):
    got, want = T.greedy_top(lg, m), R.greedy_top(lg, m)
    assert all(torch.equal(a, b) for a, b in zip(got[:3:2], want[:3:2], strict=True)), (got, want)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[3], want[3])
    assert torch.equal(got[1], T.greedy_pick(lg)[1])  # greedy_pick's confidence, summed the same way
assert T.linear(torch.ones(1, 96), torch.ones(5, 96)).sum() == 5 * 96  # not CUDA: cuBLAS's place, F.linear
T.COMBINE_BLOCK[16] = 4  # the combine over 1300 keys' six chunks: a full block of partials, a masked one
for blk in (64, 128, 256):  # the attention's one-program tile sizes (SINGLE_BLOCK), one row and a verify
    T.SINGLE_BLOCK[16, 16] = T.SINGLE_BLOCK[16, 32] = blk
    for B, Tq, kv, starts in ((2, 1, 256, [100, 3]), (1, 5, 512, [400]), (1, 1, 1300, [1290])):
        q = torch.randn(B, Tq, 4, 16, generator=g)
        ck, cv = torch.randn(B + 1, 2, kv + 8, 16, generator=g), torch.randn(B + 1, 2, kv + 8, 16, generator=g)
        rows, st = torch.arange(B, 0, -1), torch.tensor(starts)
        torch.testing.assert_close(T.decode_attention(q, ck, cv, rows, st, kv),
                                   R.decode_attention(q, ck, cv, rows, st, kv), atol=1e-5, rtol=1e-5)
        qkv = torch.randn(B, Tq, 8 * 16, generator=g)  # 4 q heads, 2 kv heads: RoPE + write + attention fused
        inv = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
        ck2, cv2 = ck.clone(), cv.clone()
        got = T.rope_attention(qkv, st, inv, 4, 2, ck, cv, rows, kv)
        ref = R.rope_attention(qkv, st, inv, 4, 2, ck2, cv2, rows, kv)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ck, ck2, atol=1e-6, rtol=1e-6)
        # (1300 keys split into several chunks: the RoPE then runs as its own kernel, the combine loops)
        assert torch.equal(cv, cv2) and T.attention_fuses_rope(kv, Tq) == (Tq == 1 and kv < 1300)
# the fused kernel ran (a launch that fails falls back to the unfused kernels, with the same values)
assert T._FUSED_ROPE_OK == {torch.device("cpu"): True}, T._FUSED_ROPE_OK
for tile in ((32, 4), (128, 2)):  # a split's programs in other tiles (SPLIT_TILE): chunks a multiple of each
    T.SPLIT_TILE[16, 16] = tile
    q = torch.randn(2, 1, 4, 16, generator=g)
    ck, cv = torch.randn(3, 2, 1400, 16, generator=g), torch.randn(3, 2, 1400, 16, generator=g)
    rows, st = torch.tensor([2, 0]), torch.tensor([1299, 700])
    torch.testing.assert_close(T.decode_attention(q, ck, cv, rows, st, 1300),
                               R.decode_attention(q, ck, cv, rows, st, 1300), atol=1e-5, rtol=1e-5)
    assert T.attn_launch("t", q, ck, 1300, None).chunk % max(64, tile[0]) == 0
T.SPLIT_TILE.clear()
ew = torch.randn(50, 40, generator=g)  # the embedding gather: one block a row, and a row split in two
ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
assert torch.equal(T.embedding(ids, ew), R.embedding(ids, ew))
ew2 = torch.randn(10, 1500, generator=g)
assert torch.equal(T.embedding(torch.tensor([9, 0, 4]), ew2), ew2[[9, 0, 4]])
got = T.embedding(torch.tensor([[-1, 10, 2]]), ew2)  # ids outside the table: zeros, nothing read out of it
assert got.shape == (1, 3, 1500) and not got[0, :2].any() and torch.equal(got[0, 2], ew2[2])
assert splits >= 6 and silus >= 10, (splits, silus)
print("checked", n)
'''


def test_triton_kernels_under_the_interpreter_equal_their_definitions(tmp_path):
    """The skinny GEMM (every candidate configuration of a few shapes, each prologue), greedy_pick, the
    embedding gather and the attention at each one-program tile size run by Triton's interpreter in fp32
    (its bf16 emulation is not faithful; bf16 runs on the GPU tests)."""
    out = run_interpreted(tmp_path, INTERPRETED_CHECK)
    assert "checked" in out, out[-3000:]
    assert int(out.split("checked")[1]) >= 25  # configurations checked


def test_the_attention_split_count_is_not_compiled_in():
    """The split count follows the context (a chunk per MIN_CHUNK keys): as a constexpr of the combine
    kernel every MIN_CHUNK tokens of an eager decode compiled a new kernel inside that step."""
    import ast
    import pathlib

    import draftrelay.kernels as K

    # read from the source: importing triton_ops here would load the planner into this process (the serve
    # tests expect a CPU process never to have it)
    tree = ast.parse((pathlib.Path(K.__file__).parent / "triton_ops.py").read_text())
    kernels = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for name in ("_attn_kernel", "_attn_combine_kernel"):
        args = {a.arg: a.annotation for a in kernels[name].args.args}
        assert "n_split" in args and args["n_split"] is None, name  # no tl.constexpr annotation


@pytest.mark.parametrize("var,module,name", [("DRAFTRELAY_PDL", "draftrelay.kernels.triton_ops", "PDL"),
                                             ("DRAFTRELAY_ATTN_PREFETCH", "draftrelay.kernels.triton_ops",
                                              "ATTN_PREFETCH"),
                                             ("DRAFTRELAY_FORK_SHARE", "draftrelay.worker.fork_triton", "SHARE"),
                                             ("DRAFTRELAY_SILU_EPILOGUE", "draftrelay.kernels.triton_ops",
                                              "SILU_EPILOGUE")])
def test_a_kernel_switch_takes_on_or_off_and_names_any_other_value(var, module, name):
    """The fused kernels' on/off switches read at import: `off` switches off, and a value such as `0` (which
    a reader may take for off) is refused with the variable and the value named, not taken as on."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = f"import {module} as T; print(T.{name})"
    env = {k: v for k, v in os.environ.items() if k != var}
    for value, want in ((None, "True"), ("on", "True"), ("off", "False")):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=env if value is None else {**env, var: value})
        assert p.returncode == 0 and p.stdout.strip() == want, (value, p.stdout, p.stderr[-800:])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, var: "0"})
    assert p.returncode != 0 and f"SettingError: {var}='0': expected one of on, off" in p.stderr, p.stderr[-800:]
