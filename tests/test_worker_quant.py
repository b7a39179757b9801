"""The quantized drafters (`draftrelay worker --quant int8|int4`, worker/quant.py): each int8 and int4
product against the fp32 one, the products they decline, the lean loop on quantized weights (its forked
branch rows: tests/test_spec_cache_units.py), the output of the engine unchanged with a quantized
drafter, and the refusals of the settings they do not run in."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from draftrelay import cli, demo_pair
from draftrelay.wire import protocol as P
from draftrelay.worker import quant as Q
from draftrelay.worker.drafters import load_drafter
from test_worker_lean import make as make_worker

pytestmark = pytest.mark.skipif(bool(Q.available("int8") or Q.available("int4")),
                                reason=Q.available("int8") or Q.available("int4") or "int8 and int4 available")


@pytest.mark.parametrize("N,K,M", [(40, 96, 1), (1152, 896, 3), (17, 64, 16), (896, 4864, 2)])
def test_int8_product_is_the_fp32_one_within_its_rounding(N, K, M):
    g = torch.Generator().manual_seed(N + K)
    w, b, x = torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g), torch.randn(M, K, generator=g)
    w[3] = 0.0  # a zero row: scale 1, q all zero, its outputs the bias
    lin = Q.Int8Linear.make(w, b, "test")
    assert isinstance(lin, Q.Int8Linear) and lin.q.dtype == torch.int8
    assert lin.nbytes() < w.numel() * w.element_size() / 3  # about a quarter of fp32's bytes
    # each weight within half a step of its row's scale
    deq = lin.q.float() * lin.scale.float()[:, None]
    assert float(((deq - w).abs() - lin.scale.float()[:, None] / 2).max()) <= 1e-6
    assert torch.equal(lin.q[3], torch.zeros(K, dtype=torch.int8))
    y = lin(x)
    assert y.dtype == x.dtype and y.shape == (M, N)
    ref = F.linear(x, w, b)
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 2e-2, rel  # int8 weights and bf16 activations: about 1 %
    # against the dequantized weights the only rounding left is the activations' and the output's bf16
    rel_deq = float((y - F.linear(x.bfloat16().float(), deq, b)).norm() / ref.norm())
    assert rel_deq < 1e-2, rel_deq
    assert torch.allclose(y[:, 3], b.expand(M, N)[:, 3].to(y.dtype), atol=1e-2)
    y3 = lin(x[None])  # leading dimensions kept
    assert y3.shape == (1, M, N) and torch.equal(y3[0], y)


@pytest.mark.parametrize("N,K,M", [(48, 96, 1), (1152, 896, 3), (32, 64, 16), (896, 4864, 2)])
def test_int4_product_is_the_fp32_one_within_its_rounding(N, K, M):
    g = torch.Generator().manual_seed(N + K)
    w, b, x = torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g), torch.randn(M, K, generator=g)
    w[3] = 0.0  # a zero row: its outputs are the bias
    w[5] = 0.37  # a constant row: each group's one value is q = 0 with scale |value| / 8
    lin = Q.Int4Linear.make(w, b, "test")
    assert isinstance(lin, Q.Int4Linear)
    assert lin.nbytes() < w.numel() * w.element_size() / 6  # about an eighth of fp32's bytes, plus the scales
    # the quantized values, dequantized as the kernel does: each weight within about half a step of its group
    q, so = Q.Int4Linear.quantize(w)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and so.shape == (K // Q.INT4_GROUP, N, 2)
    scale = so[..., 0].float().t().repeat_interleave(Q.INT4_GROUP, 1)
    deq = (q.float() - 8.0) * scale + so[..., 1].float().t().repeat_interleave(Q.INT4_GROUP, 1)
    assert float(((deq - w).abs() - 0.55 * scale).max()) <= 1e-6  # half a step, and the offset's bf16 rounding
    assert float((deq[5] - 0.37).abs().max()) < 0.37 / 256 and float(deq[3].abs().max()) == 0.0
    y = lin(x)
    assert y.dtype == x.dtype and y.shape == (M, N)
    ref = F.linear(x, w, b)
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 0.12, rel  # 16 levels a group of 32: about 8 % on Gaussian weights
    # against the dequantized weights only the activations' and the output's bf16 rounding is left
    rel_deq = float((y - F.linear(x.bfloat16().float(), deq, b)).norm() / ref.norm())
    assert rel_deq < 1e-2, rel_deq
    assert torch.allclose(y[:, 3], b.expand(M, N)[:, 3].to(y.dtype), atol=1e-2)
    y3 = lin(x[None])  # leading dimensions kept
    assert y3.shape == (1, M, N) and torch.equal(y3[0], y)


def test_products_the_kernel_misreads_stay_fp32_and_say_why(caplog):
    w = torch.randn(8, 200)  # K = 200: the kernel returned garbage or crashed for this row length
    with caplog.at_level(logging.WARNING, "draftrelay.worker"):
        assert Q.Int8Linear.make(w, None, "layer 3 down") is None
    assert "layer 3 down" in caplog.text and "K = 200" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "draftrelay.worker"):  # the int4 packing's shapes
        assert Q.Int4Linear.make(torch.randn(17, 64), None, "layer 1 o") is None
        assert Q.Int4Linear.make(torch.randn(32, 48), None, "layer 2 qkv") is None
    assert "layer 1 o" in caplog.text and "[N, K] = [17, 64]" in caplog.text
    assert "layer 2 qkv" in caplog.text and "[N, K] = [32, 48]" in caplog.text
    with pytest.raises(ValueError, match="quant 'int3'"):
        Q.layer_products([], "int3")


def _pair(quant: str):
    return make_worker(demo_pair.paths()[1], quant=quant)


# how often the demo drafter's drafts on quantized weights equal its fp32 ones at least, and the median of
# how far their confidences move at most (int8: every draft equal here, gaps a median of 0.002; int4, 16 levels
# a group on this small model: two thirds equal, a median gap of 0.03)
AGREE = {"int8": (0.85, 0.02), "int4": (0.55, 0.1)}


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_lean_loop_on_quantized_weights_drafts_close_to_fp32(quant):
    d8, c8, s8 = _pair(quant)
    d32, c32, s32 = _pair("none")
    assert d8.mode == d32.mode == "lean" and f"{quant} products" in d8.info and quant not in d32.info
    kind = {"int8": Q.Int8Linear, "int4": Q.Int4Linear}[quant]
    assert all(isinstance(p, kind) for layer in d8._lean.prods for p in layer)
    assert all(isinstance(p, Q.DenseLinear) for layer in d32._lean.prods for p in layer)
    rng = np.random.default_rng(3)
    vocab = d8.vocab_size
    ctx = {r: 0 for r in (1, 2)}
    pending = {r: rng.integers(0, vocab, 12).astype(np.int32) for r in ctx}
    same = total = 0
    gaps = []
    for rnd in range(20):
        blocks = [P.Block(r, 0, ctx[r], pending[r], 4) for r in ctx]
        a, b = c32.step(s32, blocks), c8.step(s8, blocks)
        assert a.counts.tolist() == b.counts.tolist() == [4, 4], rnd
        same += int((a.drafts == b.drafts).sum())
        total += a.drafts.size
        gaps.append(np.abs(a.confidences - b.confidences).ravel())
        for i, r in enumerate(ctx):
            ctx[r] += len(pending[r])
            k = int(rng.integers(0, 5))  # keep a random prefix of the fp32 drafts and one token: the same
            pending[r] = np.concatenate([a.drafts[i, :k], rng.integers(0, vocab, 1)]).astype(np.int32)
    assert same >= AGREE[quant][0] * total, (same, total)
    assert float(np.median(np.concatenate(gaps))) < AGREE[quant][1]


@pytest.mark.parametrize("mode,quant", [("sync", "int8"), ("async", "int8"), ("sync", "int4"), ("async", "int4")])
def test_engine_output_with_a_quantized_drafter_is_the_target_only_output(mode, quant, capsys):
    target, drafter = demo_pair.paths()
    base = ["generate", "def add(a, b):", "--model", target, "--drafter", drafter, "--device", "cpu",
            "--max-tokens", "24", "--k", "4"]
    assert cli.main([*base, "--mode", "off"]) == 0
    want = capsys.readouterr().out
    assert cli.main([*base, "--mode", mode, "--drafter-quant", quant]) == 0
    got = capsys.readouterr().out
    text = lambda out: out.split("\n")[0]  # noqa: E731 - the generated text is the first line
    assert text(got) == text(want) and text(want)


def test_int8_refuses_what_it_does_not_run_on(capsys):
    with pytest.raises(ValueError, match="lean loop"):
        load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, mode="eager", quant="int8")
    with pytest.raises(ValueError, match="no weights to quantize"):
        load_drafter("test", device="cpu", quant="int8")
    with pytest.raises(ValueError, match="quant 'int3'"):
        load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, quant="int3")
    with pytest.raises(ValueError, match="lean loop"):
        load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, mode="eager", quant="int4")
    for q in Q.QUANTS:  # every quant the module has but int8 (a GPU drafter's too): each CLI refuses it on CUDA
        args = (["worker", "--model", "tiny", "--quant", q, "--device", "cuda"], f"--quant {q}: for a CPU drafter",
                ["generate", "x", "--drafter-quant", q, "--device", "cuda:0"], f"--drafter-quant {q}: for a CPU")
        if q in ("none", "int8"):
            continue
        assert cli.main(args[0]) == 2 and args[1] in capsys.readouterr().err
        assert cli.main(args[2]) == 2 and args[3] in capsys.readouterr().err
    with pytest.raises(ValueError, match="--quant int4: for a CPU drafter"):
        load_drafter("tiny", device="cuda", quant="int4")  # refused before anything touches the device
    assert cli.main(["worker", "--model", "test", "--quant", "int8"]) == 2
    assert "--quant int8: the 'test' drafter has no weights" in capsys.readouterr().err
    assert cli.main(["worker", "--model", "tiny", "--quant", "int8", "--tp", "2"]) == 2
    assert "--quant int8: for a one-card drafter, not with --tp" in capsys.readouterr().err
    from draftrelay.engine.cli_generate import local_quant_problems

    assert local_quant_problems("int8", "cuda:0", "") == []  # a GPU drafter takes int8 (int8_layers.py)
    assert local_quant_problems("int4", "cuda:0", "")[0].startswith("--drafter-quant int4: for a CPU drafter")
