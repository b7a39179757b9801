"""The int8 drafter (`draftrelay worker --quant int8`, worker/quant.py): each int8 product against the fp32
one, the products it declines, the lean loop on int8 weights (its forked branch rows:
tests/test_spec_cache_units.py), the output of the engine
unchanged with an int8 drafter, and the refusals of the settings it does not run in."""

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

pytestmark = pytest.mark.skipif(bool(Q.available()), reason=Q.available() or "int8 available")


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


def test_products_the_kernel_misreads_stay_fp32_and_say_why(caplog):
    w = torch.randn(8, 200)  # K = 200: the kernel returned garbage or crashed for this row length
    with caplog.at_level(logging.WARNING, "draftrelay.worker"):
        assert Q.Int8Linear.make(w, None, "layer 3 down") is None
    assert "layer 3 down" in caplog.text and "K = 200" in caplog.text
    with pytest.raises(ValueError, match="quant 'int4'"):
        Q.layer_products([], "int4")


def _pair(quant: str):
    return make_worker(demo_pair.paths()[1], quant=quant)


def test_lean_loop_on_int8_weights_drafts_close_to_fp32():
    d8, c8, s8 = _pair("int8")
    d32, c32, s32 = _pair("none")
    assert d8.mode == d32.mode == "lean" and "int8 products" in d8.info and "int8" not in d32.info
    assert all(isinstance(p, Q.Int8Linear) for layer in d8._lean.prods for p in layer)
    assert all(isinstance(p, Q.DenseLinear) for layer in d32._lean.prods for p in layer)
    rng = np.random.default_rng(3)
    vocab = d8.vocab_size
    ctx = {r: 0 for r in (1, 2)}
    pending = {r: rng.integers(0, vocab, 12).astype(np.int32) for r in ctx}
    same = total = 0
    for rnd in range(20):
        blocks = [P.Block(r, 0, ctx[r], pending[r], 4) for r in ctx]
        a, b = c32.step(s32, blocks), c8.step(s8, blocks)
        assert a.counts.tolist() == b.counts.tolist() == [4, 4], rnd
        same += int((a.drafts == b.drafts).sum())
        total += a.drafts.size
        conf_gap = np.abs(a.confidences - b.confidences).max()
        assert conf_gap < 0.25, (rnd, conf_gap)
        for i, r in enumerate(ctx):
            ctx[r] += len(pending[r])
            k = int(rng.integers(0, 5))  # keep a random prefix of the fp32 drafts and one token: the same
            pending[r] = np.concatenate([a.drafts[i, :k], rng.integers(0, vocab, 1)]).astype(np.int32)
    # the demo drafter's logits are peaked: int8 rounding moves an argmax only at a near-tie
    assert same >= 0.85 * total, (same, total)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_output_with_an_int8_drafter_is_the_target_only_output(mode, capsys):
    target, drafter = demo_pair.paths()
    base = ["generate", "def add(a, b):", "--model", target, "--drafter", drafter, "--device", "cpu",
            "--max-tokens", "24", "--k", "4"]
    assert cli.main([*base, "--mode", "off"]) == 0
    want = capsys.readouterr().out
    assert cli.main([*base, "--mode", mode, "--drafter-quant", "int8"]) == 0
    got = capsys.readouterr().out
    text = lambda out: out.split("\n")[0]  # noqa: E731 - the generated text is the first line
    assert text(got) == text(want) and text(want)


def test_int8_refuses_what_it_does_not_run_on(capsys):
    with pytest.raises(ValueError, match="lean loop"):
        load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, mode="eager", quant="int8")
    with pytest.raises(ValueError, match="no weights to quantize"):
        load_drafter("test", device="cpu", quant="int8")
    with pytest.raises(ValueError, match="quant 'int4'"):
        load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, quant="int4")
    assert cli.main(["worker", "--model", "tiny", "--quant", "int8", "--device", "cuda"]) == 2
    assert "--quant int8: for a CPU drafter" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--drafter-quant", "int8", "--device", "cuda:0"]) == 2
    assert "--drafter-quant int8: for a CPU drafter" in capsys.readouterr().err
