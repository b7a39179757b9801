"""The fused-kernel forward on a real GPU (not collected by CI): `pytest -q tests_gpu/test_fast_forward_gpu.py`.

1. Each Triton kernel against its plain-torch definition (kernels.reference) on fresh random bf16
   inputs of the real shapes, long contexts (split-K with the combine) included.
2. The forward's hidden states and logits against a float64 reference (the same weights, plain path):
   the fast forward's relative error within bf16 bounds, and not more than twice the plain bf16 path's.
3. The worker's drafts: graph replay (fast path) == eager in >= 95 % of rounds, and the fast path
   against the plain one with every mismatch a classified numeric near-tie (docs/TP2.md's rule).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from draftrelay import kernels
from draftrelay import model as M
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter
from near_tie import near_tie as _near_tie

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available("cuda")),
                                reason="needs a CUDA GPU with Triton")
DEV = torch.device("cuda")
REPORT: dict = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fresh() -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("H,HK,D,T,kv,starts", [
    (14, 2, 64, 1, 256, [100]), (14, 2, 64, 5, 1024, [1000, 3, 500, 17]), (28, 4, 128, 5, 40960, [40000]),
    (28, 4, 128, 1, 32784, [32770, 200]), (14, 2, 64, 8, 8192, [5000, 8180]), (28, 4, 128, 5, 1024, [1000]),
    (28, 4, 128, 1, 256, [128, 40])])
def test_kernels_equal_their_definitions(H, HK, D, T, kv, starts):
    K = kernels.backend(DEV)
    g = fresh()
    B = len(starts)
    bf = torch.bfloat16
    x = torch.randn(B, T, 896, device=DEV, generator=g).to(bf)
    dl = torch.randn(B, T, 896, device=DEV, generator=g)  # fp32 delta, as a TP all-reduce
    w = torch.randn(896, device=DEV, generator=g).to(bf)
    for delta in (None, dl, dl.to(bf)):
        a, b = K.add_rms_norm(x, delta, w, 1e-6), R.add_rms_norm(x, delta, w, 1e-6)
        assert torch.equal(a[0], b[0]) and rel(a[1], b[1]) < 4e-3
    for n_out, b in ((1152, True), (9728, False), (4608, True)):  # through the planner (as the forward)
        wt = (torch.randn(n_out, 896, device=DEV, generator=g) * 0.05).to(bf)
        bias = torch.randn(n_out, device=DEV, generator=g).to(bf) if b else None
        for delta in (None, dl):
            a, r = K.norm_linear(x, delta, w, 1e-6, wt, bias), R.norm_linear(x, delta, w, 1e-6, wt, bias)
            assert torch.equal(a[0], r[0]) and rel(a[1], r[1]) < 1e-2, rel(a[1], r[1])
    gu = torch.randn(B, T, 2 * 4864, device=DEV, generator=g).to(bf)
    assert rel(K.silu_mul(gu), R.silu_mul(gu)) < 4e-3
    inv = (1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D)))
    start = torch.tensor(starts, device=DEV)
    rows = torch.arange(B, 0, -1, device=DEV)
    qkv = torch.randn(B, T, (H + 2 * HK) * D, device=DEV, generator=g).to(bf)
    ck = torch.randn(B + 1, HK, kv + 8, D, device=DEV, generator=g).to(bf)
    cv = torch.randn(B + 1, HK, kv + 8, D, device=DEV, generator=g).to(bf)
    ck2, cv2 = ck.clone(), cv.clone()
    q1 = K.rope_kv_write(qkv, start, inv, H, HK, ck, cv, rows)
    q2 = R.rope_kv_write(qkv, start, inv, H, HK, ck2, cv2, rows)
    assert rel(q1, q2) < 4e-3 and rel(ck, ck2) < 4e-3 and torch.equal(cv, cv2)
    o1 = K.decode_attention(q1, ck, cv, rows, start, kv)
    o2 = R.decode_attention(q1, ck, cv, rows, start, kv)
    e = rel(o1, o2)
    # RoPE + K/V write + attention in one launch (up to a chunk of keys) against the two kernels it fuses
    ck3, cv3 = torch.randn_like(ck), torch.randn_like(cv)
    ck4, cv4 = ck3.clone(), cv3.clone()
    o3 = K.rope_attention(qkv, start, inv, H, HK, ck3, cv3, rows, kv)
    o4 = K.decode_attention(K.rope_kv_write(qkv, start, inv, H, HK, ck4, cv4, rows), ck4, cv4, rows, start, kv)
    o5 = R.rope_attention(qkv, start, inv, H, HK, ck4.clone(), cv4.clone(), rows, kv)
    e_fused = rel(o3, o5)
    REPORT.setdefault("kernels", []).append({"H": H, "HK": HK, "D": D, "T": T, "kv": kv, "attn_rel": e,
                                             "rope_attn_rel": e_fused, "fused": K.attention_fuses_rope(kv, T)})
    assert torch.isfinite(o1).all() and e < 1e-2, e
    assert torch.equal(cv3, cv4) and rel(ck3, ck4) < 4e-3 and rel(o3, o4) < 4e-3 and e_fused < 1e-2, e_fused


@pytest.mark.parametrize("pro,K,N,bias", [
    (P.PRO_NORM, 896, 1152, True), (P.PRO_NONE, 896, 896, False), (P.PRO_NORM, 896, 9728, False),
    (P.PRO_SILU, 4864, 896, False), (P.PRO_NONE, 896, 151936, False), (P.PRO_NORM, 3584, 4608, True),
    (P.PRO_NONE, 3584, 3584, False), (P.PRO_SILU, 18944, 3584, False)])
@pytest.mark.parametrize("M", [1, 5])
def test_every_skinny_config_equals_its_definition(pro, K, N, bias, M):
    """Each configuration the planner may choose, at the 0.5B and 7B product shapes, against the plain
    product (and x + delta bit for bit); a gate|up product's also storing SiLU * up (norm_mlp's) against
    silu_mul of the plain product, and whether it has the bits of silu_mul of its own product."""
    from draftrelay.kernels import triton_ops as TO
    g = fresh()
    bf = torch.bfloat16
    x = torch.randn(M, 2 * K if pro == P.PRO_SILU else K, device=DEV, generator=g).to(bf)
    w = (torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(bf)
    b = torch.randn(N, device=DEV, generator=g).to(bf) if bias else None
    d = torch.randn(M, K, device=DEV, generator=g) if pro == P.PRO_NORM else None
    nw = torch.randn(K, device=DEV, generator=g).to(bf)
    if pro == P.PRO_NORM:
        ref_x, ref = R.norm_linear(x, d, nw, 1e-6, w, b)
    else:
        ref_x, ref = x, (R.act_linear(x, w, b) if pro == P.PRO_SILU else R.linear(x, w, b))
    cands = P.candidates(pro, M, N, K)
    errs, silu_errs, silu_same = {}, {}, {}
    for cfg in cands:
        got_x, got = TO.skinny_linear(pro, cfg, x, w, b, d, nw, 1e-6)
        errs[cfg.label()] = rel(got, ref)
        assert torch.equal(got_x, ref_x) and errs[cfg.label()] < 1e-2, (cfg, errs)
        if pro == P.PRO_NORM and N in (9728, 4608) and cfg.block_n >= 2:  # the 0.5B gate|up, the 7B K
            sx, act = TO.skinny_linear(pro, cfg, x, w, b, d, nw, 1e-6, silu_out=True)
            silu_errs[cfg.label()] = rel(act, R.silu_mul(ref))
            silu_same[cfg.label()] = bool(torch.equal(act, TO.silu_mul(got)))
            assert torch.equal(sx, ref_x) and act.shape == (M, N // 2) and silu_errs[cfg.label()] < 1e-2, (
                cfg, silu_errs)
        if cfg.split > 1:  # again, in a graph replayed twice: the counts left ready, the same bits every time
            again = [TO.skinny_linear(pro, cfg, x, w, b, d, nw, 1e-6)[1] for _ in range(2)]
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                out = TO.skinny_linear(pro, cfg, x, w, b, d, nw, 1e-6)[1]
            for _ in range(2):
                out.zero_()
                gr.replay()
                assert torch.equal(out, got)
            assert all(torch.equal(a, got) for a in again), cfg
    REPORT.setdefault("skinny", []).append({"product": P.PRO_NAMES[pro], "M": M, "N": N, "K": K, "rel": errs,
                                           **({"silu_rel": silu_errs, "silu_same_bits": silu_same} if silu_errs
                                              else {})})


def test_embedding_gather_equals_its_definition_bit_for_bit():
    """The PDL embedding kernel at the 0.5B's and the 7B's widths, eager and inside a graph (the drafting
    loop's use: the ids written by the kernel before it); an id outside the table gives zeros."""
    K = kernels.backend(DEV)
    g = fresh()
    for V, D in ((151936, 896), (152064, 3584)):
        w = torch.randn(V, D, device=DEV, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, V, (4, 5), device=DEV, generator=g)
        assert torch.equal(K.embedding(ids, w), R.embedding(ids, w))
        src = torch.randint(0, V, (4,), device=DEV, generator=g)
        with torch.inference_mode():
            K.embedding((src + 1)[:, None], w)  # compiled outside the capture
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                out = K.embedding((src + 1)[:, None] % V, w)
            for _ in range(2):
                src.copy_(torch.randint(0, V, (4,), device=DEV, generator=g))
                gr.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, R.embedding(((src + 1) % V)[:, None], w))
        bad = K.embedding(torch.tensor([-1, V, 3], device=DEV), w)
        assert not bad[:2].any() and torch.equal(bad[2], w[3])


def test_greedy_pick_equals_argmax_and_softmax():
    K = kernels.backend(DEV)
    g = fresh()
    for dtype in (torch.bfloat16, torch.float32):
        lg = (torch.randn(5, 151936, device=DEV, generator=g) * 3).to(dtype)
        lg[2, 70000] = lg[2, 9] = lg[2].max() + 1  # a tie across chunks: the lower id
        tok, conf = K.greedy_pick(lg)
        rt, rc = R.greedy_pick(lg)
        assert torch.equal(tok, rt) and int(tok[2]) == 9
        torch.testing.assert_close(conf, rc, rtol=1e-4, atol=1e-7)


def test_greedy_top_equals_its_definition_and_greedy_pick():
    K = kernels.backend(DEV)
    g = fresh()
    for dtype in (torch.bfloat16, torch.float32):
        for B in (1, 8, 32):
            lg = (torch.randn(B, 151936, device=DEV, generator=g) * 3).to(dtype)
            lg[0, 70000] = lg[0, 9] = lg[0].max() + 1  # a tie across chunks: the lower id first
            lg[-1, 4096:8192] = float("-inf")
            for m in (1, 8):
                tok, conf, ids, probs = K.greedy_top(lg, m)
                rt, rc, ri, rp = R.greedy_top(lg, m)
                pt, pc = K.greedy_pick(lg)
                assert torch.equal(tok, rt) and torch.equal(ids, ri) and int(ids[0, 0]) == 9
                # The same pick; the confidence agrees with greedy_pick's to rounding (the two merges
                # add the chunk sums in different orders, so not bit for bit).
                assert torch.equal(tok, pt)
                torch.testing.assert_close(conf, pc, rtol=1e-6, atol=1e-9)
                torch.testing.assert_close(conf, rc, rtol=1e-4, atol=1e-7)
                torch.testing.assert_close(probs, rp, rtol=1e-4, atol=1e-7)
                if m > 1:
                    assert int(ids[0, 1]) == 70000


def _forward_hidden_and_logits(model, cache, toks, start, kv):
    """Logits and the final hidden state (the normed output: the head replaced by the identity)."""
    with torch.inference_mode():
        lg = model(toks, start, cache, torch.tensor([0], device=DEV), kv_len=kv)
        head = model.lm_head
        d = model.cfg.hidden_size
        eye = torch.eye(d, device=DEV, dtype=model.dtype)
        model.lm_head = torch.nn.Linear(d, d, bias=False, device=DEV, dtype=model.dtype)
        model.lm_head.weight.data.copy_(eye)
        try:
            hid = model(toks, start, cache, torch.tensor([0], device=DEV), kv_len=kv)
        finally:
            model.lm_head = head
    return hid, lg


@pytest.mark.parametrize("mode", ["auto", "off"])
@pytest.mark.parametrize("T", [1, 5])
def test_fast_forward_error_vs_float64_within_bf16_bounds(T, mode, monkeypatch):
    monkeypatch.setattr(P, "MODE", mode)  # off: cuBLAS for every product (as the forward without skinny GEMMs)
    cfg = M.ModelConfig(**{**SHAPES["qwen2.5-0.5b"], "n_layers": 6, "vocab_size": 8192,
                           "tie_word_embeddings": False}, name="0.5b-6L")
    seed = int.from_bytes(os.urandom(2), "little")
    ref = M.Transformer.random(cfg, seed=seed, device=DEV, dtype=torch.float64, draw_on="device")
    ref.fast = False
    bf = copy.deepcopy(ref).to(torch.bfloat16)
    ctx = 3000
    out = {}
    toks = torch.randint(0, cfg.vocab_size, (1, ctx + T), device=DEV)
    for name, m, fast in (("f64", ref, False), ("plain", bf, False), ("fast", bf, True)):
        m.fast = fast
        cache = m.new_cache(1, 4096)  # the static kv_len below spans the whole cache
        with torch.inference_mode():
            m.fast = False  # the prompt through the plain prefill (SDPA) in every variant
            m(toks[:, :ctx], torch.tensor([0], device=DEV), cache, torch.tensor([0], device=DEV), kv_len=ctx)
            m.fast = fast
        out[name] = _forward_hidden_and_logits(m, cache, toks[:, ctx:], torch.tensor([ctx], device=DEV), 4096)
    errs = {k: {"hidden": rel(out[k][0], out["f64"][0]), "logits": rel(out[k][1], out["f64"][1])}
            for k in ("plain", "fast")}
    REPORT.setdefault("f64", []).append({"T": T, "mode": mode, **errs})
    for what in ("hidden", "logits"):
        assert errs["fast"][what] < 3e-2, errs  # bf16 operands over 6 layers: a few 1e-3 expected
        assert errs["fast"][what] <= 2 * errs["plain"][what] + 2e-3, errs


def test_drafts_graph_equals_eager_and_fast_vs_plain_are_near_ties():
    cfg = M.ModelConfig(**SHAPES["qwen2.5-0.5b"], name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=int.from_bytes(os.urandom(2), "little"), device=DEV,
                                 dtype=torch.bfloat16, draw_on="device")
    n_req, rounds, n_out = 3, 30, 4  # 90 request-rounds: the 95 % rule leaves at most 4 graph != eager
    ds = {"graph_fast": (LlamaDrafter(model, 4, 2048, 8, "d", "", mode="graph"), True),
          "eager_fast": (LlamaDrafter(model, 4, 2048, 8, "d", "", mode="eager"), True),
          "eager_plain": (LlamaDrafter(model, 4, 2048, 8, "d", "", mode="eager"), False)}
    rng = np.random.default_rng(0)
    ctx = {r: list(rng.integers(0, cfg.vocab_size, 40 + 7 * r)) for r in range(n_req)}
    synced = dict.fromkeys(ctx, 0)
    same = {"graph_fast": 0, "eager_plain": 0}
    mism = []
    for rnd in range(rounds):
        jobs = [Job(r, synced[r], np.array(ctx[r][synced[r]:], np.int32)) for r in range(n_req)]
        res = {}
        for k, (d, fast) in ds.items():
            model.fast = fast
            res[k] = d.run([Job(j.row, j.keep, j.tokens.copy()) for j in jobs], n_out)[0]
        for k in same:
            for r in range(n_req):
                if np.array_equal(res[k][r], res["eager_fast"][r]):
                    same[k] += 1
                else:  # classify the first differing draft with both paths' logits there
                    j = int(np.argmax(res[k][r] != res["eager_fast"][r]))
                    seq = ctx[r] + list(res["eager_fast"][r][:j])
                    lg = {}
                    for fast in (True, False):
                        model.fast = fast
                        cache = model.new_cache(1, len(seq) + 1)
                        with torch.inference_mode():
                            lg[fast] = model(torch.tensor([seq]), torch.tensor([0]), cache, torch.tensor([0]),
                                             last_only=True)[0, 0]
                    mism.append({"vs": k, "round": rnd, "pos": j, **_near_tie(lg[True], lg[False],
                                                                     int(res["eager_fast"][r][j]),
                                                                     int(res[k][r][j]))})
        for r in range(n_req):  # accept a random prefix of the fast eager drafts, plus one token
            keep = int(rng.integers(0, n_out + 1))
            synced[r] = len(ctx[r])
            ctx[r] += list(res["eager_fast"][r][:keep]) + [int(rng.integers(0, cfg.vocab_size))]
    model.fast = None
    total = rounds * n_req
    REPORT["drafts"] = {"request_rounds": total, "graph_eq_eager": same["graph_fast"] / total,
                        "fast_eq_plain": same["eager_plain"] / total, "mismatches": mism}
    assert same["graph_fast"] >= 0.95 * total, REPORT["drafts"]
    assert all(m["near_tie"] for m in mism), mism


def teardown_module(module):
    from draftrelay.kernels import triton_ops as TO
    REPORT["plans"] = [{"key": list(k), "us": {c: t * 1e6 for c, t in v.items()},
                        "choice": None if TO.PLANNER.table[k] is None else TO.PLANNER.table[k].label()}
                       for k, v in TO.PLANNER.report.items()]
    path = os.environ.get("FAST_FORWARD_GPU_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)
