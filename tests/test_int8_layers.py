"""A GPU drafter's layer products on int8 weights (int8_layers.py, `worker --quant int8` on CUDA): the copies,
the fast forward's wiring (every product of decode and verify rows reads the copy, the plain path and the
tensor-parallel ranks the bf16 weights), and the loader's and CLIs' rules. The kernels themselves: the int8
tiles with a bias and with the SiLU output under Triton's interpreter (tests/test_int8_head.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from draftrelay import model as M
from draftrelay.int8_layers import LayerInt8, dequantized, nbytes, quantize_layers
from draftrelay.kernels import reference as R


def _run(net: M.Transformer, fast: bool, toks: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """The logits of a prompt (a prefill: past the plan's rows, the bf16 weights) and then toks (decode or
    verify rows) on a fresh cache."""
    net.fast = fast
    cache = net.new_cache(toks.shape[0], 64)
    rows = torch.arange(toks.shape[0])
    with torch.inference_mode():
        net(prompt, torch.zeros(toks.shape[0], dtype=torch.long), cache, rows)
        return net(toks, torch.full((toks.shape[0],), prompt.shape[1]), cache, rows)


def test_copies_are_every_layers_four_products_within_half_a_step():
    _, net = M.tiny_pair(M.TINY_SEED)
    layers = quantize_layers(net)
    assert len(layers) == net.cfg.n_layers
    for blk, q8 in zip(net.layers, layers, strict=True):
        w = blk.weights()
        for name in LayerInt8._fields:
            q, s = getattr(q8, name)
            ref = getattr(w, name)
            assert q.dtype == torch.int8 and q.shape == ref.shape and s.shape == (ref.shape[0],)
            assert bool(((ref.float() - q.float() * s[:, None]).abs() <= s[:, None] * (0.5 + 1e-4)).all())
    assert nbytes(layers) == sum(q.numel() + 4 * s.numel() for lay in layers for q, s in lay)


def _after_bf16_prompt(net: M.Transformer, prefill: M.Transformer, prompt: torch.Tensor, toks: torch.Tensor,
                       greedy: bool = False):
    """net's fast forward of toks over the KV that `prefill`'s fast forward of the prompt leaves (a prompt is a
    prefill chunk past the plan's rows: the bf16 weights, whatever copies a model holds)."""
    B = prompt.shape[0]
    net.fast = prefill.fast = True
    cache, rows = net.new_cache(B, 64), torch.arange(B)
    with torch.inference_mode():
        prefill(prompt, torch.zeros(B, dtype=torch.long), cache, rows)
        return net(toks, torch.full((B,), prompt.shape[1]), cache, rows, greedy=greedy)


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 5)])
def test_fast_forward_reads_the_copies_and_the_plain_forward_does_not(B, T):
    """Decode (T = 1) and verify (T = 5) rows: the fast forward with the int8 copies gives the logits (and the
    greedy picks) of the same model with the dequantized weights (fp32: equal up to the order of sums), not
    the bf16 model's; the plain forward ignores the copies."""
    _, net = M.tiny_pair(M.TINY_SEED)
    g = torch.Generator().manual_seed(B * 10 + T)
    prompt = torch.randint(0, net.cfg.vocab_size, (B, 20), generator=g)
    toks = torch.randint(0, net.cfg.vocab_size, (B, T), generator=g)
    plain = _run(net, False, toks, prompt)
    bf16 = copy.deepcopy(net)
    net.int8_layers = quantize_layers(net)
    deq = dequantized(net, net.int8_layers)
    assert torch.equal(_run(net, False, toks, prompt), plain)  # the plain path reads the bf16 weights
    got = _after_bf16_prompt(net, bf16, prompt, toks)
    torch.testing.assert_close(got, _after_bf16_prompt(deq, bf16, prompt, toks), atol=2e-4, rtol=2e-4)
    assert not torch.allclose(got, _after_bf16_prompt(bf16, bf16, prompt, toks), atol=1e-4)  # the copies moved it
    tok, conf = _after_bf16_prompt(net, bf16, prompt, toks[:, :1], greedy=True)
    want_tok, want_conf = _after_bf16_prompt(deq, bf16, prompt, toks[:, :1], greedy=True)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(conf, want_conf, atol=1e-5, rtol=1e-4)


def test_a_wrong_scale_in_one_copy_changes_the_fast_forward():
    _, net = M.tiny_pair(M.TINY_SEED)
    g = torch.Generator().manual_seed(1)
    prompt, toks = torch.randint(0, 100, (1, 12), generator=g), torch.randint(0, 100, (1, 1), generator=g)
    net.int8_layers = quantize_layers(net)
    good = _run(net, True, toks, prompt)
    for name in LayerInt8._fields:  # each of the four products is read: doubling its scales moves the logits
        q8 = net.int8_layers[0]
        q, s = getattr(q8, name)
        net.int8_layers[0] = q8._replace(**{name: (q, s * 2)})
        assert not torch.allclose(_run(net, True, toks, prompt), good, atol=1e-4), name
        net.int8_layers[0] = q8


def test_layer_weights_carry_the_copies_and_check_their_count():
    _, net = M.tiny_pair(M.TINY_SEED)
    assert all(w.q8 is None for w in net.layer_weights())
    net.int8_layers = quantize_layers(net)
    ws = net.layer_weights()
    assert all(w.q8 is q for w, q in zip(ws, net.int8_layers, strict=True))
    net.int8_layers = net.int8_layers[:-1]
    with pytest.raises(M.ModelError, match="int8_layers holds"):
        net.layer_weights()


def test_reference_norm_mlp_reads_each_copy_given():
    g = torch.Generator().manual_seed(2)
    x, d, nw = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    wgu, wd = torch.randn(80, 32, generator=g) * 0.2, torch.randn(32, 40, generator=g) * 0.2
    from draftrelay.int8_head import quantize_rows

    qgu, qd = quantize_rows(wgu), quantize_rows(wd)
    xo, y = R.norm_mlp(x, d, nw, 1e-6, wgu, wd, qgu, qd)
    _, h = R.add_rms_norm(x, d, nw, 1e-6)
    want = R.silu_mul(h @ (qgu[0].float() * qgu[1][:, None]).T) @ (qd[0].float() * qd[1][:, None]).T
    assert torch.equal(xo, x + d)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    plain = R.act_linear(R.norm_linear(x, d, nw, 1e-6, wgu, None)[1], wd)
    assert torch.equal(R.norm_mlp(x, d, nw, 1e-6, wgu, wd)[1], plain)


def test_loader_quantizes_a_cuda_drafter_only():
    from draftrelay.worker.drafters import load_drafter

    d = load_drafter("tiny", device="cpu", n_rows=2, max_ctx=64, n_out_max=4, quant="int8")  # the lean loop's
    assert d.model.int8_layers is None and "int8 products" in d.info
    with pytest.raises(ValueError, match="--quant int4: for a CPU drafter"):
        load_drafter("tiny", device="cuda", quant="int4")


def test_generate_and_serve_take_int8_for_a_local_gpu_worker(monkeypatch):
    """--drafter-quant int8 with a GPU target: accepted by both CLIs and passed to the local worker as --quant
    int8 (which then quantizes its layers: int8_layers.py); int4 is still refused there."""
    import argparse

    from draftrelay.engine import loading as L
    from draftrelay.serve import cli as serve_cli
    from draftrelay.worker import process

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli._check(p.parse_args(["--drafter-quant", "int8", "--device", "cuda"])) == ""
    assert serve_cli._check(p.parse_args(["--drafter-quant", "int4", "--device", "cuda"])).startswith(
        "--drafter-quant int4: for a CPU drafter")
    seen = []
    monkeypatch.setattr(process, "start_worker_process", lambda args, env=None: seen.append(args))
    L.start_local_worker("tiny", torch.device("cuda"), 4, 256, 1, quant="int8")
    assert seen[0][seen[0].index("--quant") + 1] == "int8"


def test_an_int8_tile_is_chosen_only_where_it_beats_the_bf16_product_the_forward_runs():
    """plan.int8_yardstick: an INT8 key's cuBLAS entry is the faster of cuBLAS on bf16 weights (pick charges it
    CHAIN_S) and the bf16 key's best tile (no charge). The 0.5B's four-row q|k|v on an H100: cuBLAS 6.3 us, the
    bf16 whole-row tile 3.4; an int8 tile of 4.0 us beat cuBLAS but not the tile the forward would run."""
    from draftrelay.kernels import plan as P

    cfg = P.SkinnyConfig(32, 1024, True, 8, 1)
    us = 1e-6
    assert P.pick({None: 6.3 * us, cfg: 4.0 * us}) == cfg  # against cuBLAS alone it was chosen
    assert P.pick({None: P.int8_yardstick(6.3 * us, 3.4 * us), cfg: 4.0 * us}) is None
    assert P.pick({None: P.int8_yardstick(6.3 * us, 3.4 * us), cfg: 3.0 * us}) == cfg
    # where no bf16 tile runs (inf) the yardstick is cuBLAS as before, charged as before
    assert P.int8_yardstick(6.3 * us, float("inf")) == 6.3 * us
    assert P.pick({None: P.int8_yardstick(6.3 * us, float("inf")), cfg: 7.0 * us}) == cfg


def test_drafter_info_names_the_int8_copies_and_their_size():
    """A user reading the worker's info line sees the int8 layer copies and the memory they add beside the bf16
    weights (int8_layers.nbytes, in MB)."""
    from draftrelay.worker.drafters import LlamaDrafter

    _, net = M.tiny_pair(M.TINY_SEED)
    assert "int8 layer products" not in LlamaDrafter(net, 2, 64, 4, "d", "", mode="eager").info
    net.int8_layers = quantize_layers(net)
    info = LlamaDrafter(net, 2, 64, 4, "d", "", mode="eager").info
    assert f"int8 layer products (+{nbytes(net.int8_layers) / 1e6:.0f} MB)" in info, info
