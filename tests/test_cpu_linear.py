"""cpu_linear: which library runs a CPU fp32 product (MKL or oneDNN), chosen by a probe or fixed."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
import torch.nn.functional as F

import draftrelay.cpu_linear as C
import draftrelay.model as M


@pytest.fixture(autouse=True)
def restore_choice():
    """Each test starts undecided ("auto") and leaves the process's choice as it found it."""
    before = C._chosen
    C._chosen = None
    yield
    C._chosen = before
    C._probe.clear()


@pytest.fixture
def counted(monkeypatch):
    """Counts the oneDNN calls that model.linear makes (the real op still computes them)."""
    calls, real = [], C._onednn
    monkeypatch.setattr(C, "_onednn", lambda x, w, b: calls.append(tuple(w.shape)) or real(x, w, b))
    return calls


needs_onednn = pytest.mark.skipif(bool(C.onednn_unavailable()), reason=C.onednn_unavailable() or "available")


@pytest.mark.parametrize("name, env", [("blas", "openblas"), ("mkl+blas", "onednn+onednn")])
def test_choose_refuses_unknown_names_and_env_values(monkeypatch, name, env):
    """Single names and NARROW+WIDE pairs alike: an unknown one is named, in choose() and in the setting."""
    with pytest.raises(ValueError, match=f"'{re.escape(name)}'"):
        C.choose(name)
    monkeypatch.setenv(C.ENV, env)
    with pytest.raises(ValueError, match=f"DRAFTRELAY_CPU_LINEAR='{re.escape(env)}'"):
        C._from_env()
    monkeypatch.setenv(C.ENV, "MKL")
    C._from_env()
    assert C.chosen() == "mkl"


def test_without_onednn_every_product_is_mkl_and_forcing_it_names_why(monkeypatch, counted):
    monkeypatch.setattr(C, "onednn_unavailable", lambda: "this torch is built without oneDNN (test)")
    with pytest.raises(RuntimeError, match="without oneDNN"):
        C.choose("onednn")
    w = torch.randn(2048, 1024)  # 8 MB: would probe
    out = M.linear(torch.randn(2, 1024), w)
    assert C.chosen() == "mkl" and counted == [] and out.shape == (2, 2048)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 512), (4, 512), (3, 1, 512), (2, 5, 512)])
def test_onednn_products_equal_mkl_ones(counted, shape):
    """Forced oneDNN: model.linear's values (1 row, 4 rows, 3-d inputs, with a bias, on a row view of a
    fused weight as Proj hands out) are F.linear's within fp32 summation-order differences."""
    C.choose("onednn")
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(3072, 512, generator=g)  # 6 MB
    b = torch.randn(1024, generator=g)
    x = torch.randn(*shape, 512, generator=g)
    for w, bias in ((fused, None), (fused[1024:2048], b)):
        got = M.linear(x, w, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert counted == [(3072, 512), (1024, 512)]


@needs_onednn
def test_small_bf16_and_strided_weights_stay_on_mkl(counted):
    C.choose("onednn")
    x = torch.randn(2, 256)
    M.linear(x, torch.randn(1024, 256))  # 1 MB: below ONEDNN_MIN_BYTES
    M.linear(x.bfloat16(), torch.randn(4096, 256).bfloat16())  # bf16: torch's own oneDNN path
    M.linear(x, torch.randn(256, 4096).t())  # not contiguous
    assert counted == []
    M.linear(x, torch.randn(4096, 256))  # 4 MB fp32: oneDNN
    assert counted == [(4096, 256)]


def test_only_a_large_weight_triggers_the_probe(monkeypatch):
    ran = []
    monkeypatch.setattr(C, "probe", lambda *a: ran.append(1) or C.choose("mkl"))
    M.linear(torch.randn(2, 512), torch.randn(1536, 512))  # 3 MB: below PROBE_MIN_BYTES
    assert ran == [] and C.chosen() == "auto"
    M.linear(torch.randn(2, 512), torch.randn(2048, 512))  # 4 MB
    assert ran == [1] and C.chosen() == "mkl"
    M.linear(torch.randn(2, 512), torch.randn(4096, 512))
    assert ran == [1]  # decided once


def _slow(f, delay_s: float):
    def run(*a):
        time.sleep(delay_s)
        return f(*a)
    return run


@needs_onednn
def test_probe_keeps_the_faster_library(monkeypatch):
    """The library made 50 ms slower per call loses the probe (the probe takes each variant's best of
    three, so a load spike has to hit all three to matter)."""
    monkeypatch.setattr(C, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(C, "_onednn", _slow(C._onednn, 0.05))
    assert C.probe() == "mkl"
    assert min(C.probe_times()["onednn_1"], C.probe_times()["onednn_4"]) >= 50
    monkeypatch.undo()
    monkeypatch.setattr(C, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(C.F, "linear", _slow(F.linear, 0.05))
    assert C.probe() == "onednn" and C.chosen() == "onednn"
    assert min(C.probe_times()["mkl_1"], C.probe_times()["mkl_4"]) >= 50
    timings = C.probe_times()
    assert C.choose("mkl") == "mkl" and C.probe_times() == timings  # a fixed choice keeps what was measured
    assert C.choose("auto") == "auto" and C.probe_times() == {}  # a new probe will run: nothing stale kept


def _slow_narrow(f, delay_s: float):
    """f made delay_s slower on products of fewer than WIDE_ROWS rows only."""
    def run(x, *a):
        if x.numel() // x.shape[-1] < C.WIDE_ROWS:
            time.sleep(delay_s)
        return f(x, *a)
    return run


@needs_onednn
def test_probe_decides_narrow_and_wide_products_apart(monkeypatch):
    """oneDNN slow at one row only: MKL keeps the narrow products and oneDNN takes the wide ones (MKL made
    slow there), and model.linear routes each width to its library."""
    monkeypatch.setattr(C, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(C, "_onednn", _slow_narrow(C._onednn, 0.05))
    real = F.linear
    monkeypatch.setattr(C.F, "linear", lambda x, *a: time.sleep(0.05 * (x.numel() // x.shape[-1] >= C.WIDE_ROWS))
                        or real(x, *a))
    assert C.probe() == "mkl+onednn" and C.chosen() == "mkl+onednn"
    t = C.probe_times()
    assert t["onednn_1"] >= 50 and t["mkl_4"] >= 50 and max(t["mkl_1"], t["onednn_4"]) < 50


@needs_onednn
@pytest.mark.parametrize("library, narrow, wide", [("mkl+onednn", False, True), ("onednn+mkl", True, False),
                                                   ("onednn", True, True), ("mkl", False, False)])
def test_each_width_runs_on_its_library(counted, library, narrow, wide):
    assert C.choose(library) == library
    w = torch.randn(2048, 1024)  # 8 MB: above the oneDNN floor
    for rows, on in ((1, narrow), (3, narrow), (C.WIDE_ROWS, wide), (9, wide)):
        counted.clear()
        x = torch.randn(rows, 1024)
        torch.testing.assert_close(M.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
        assert counted == ([(2048, 1024)] if on else []), (library, rows)


@needs_onednn
def test_probe_refuses_a_wrong_onednn_product(monkeypatch, caplog):
    monkeypatch.setattr(C, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(C, "_onednn", lambda x, w, b: F.linear(x, w) * 1.01)  # 1 % off
    with caplog.at_level(logging.WARNING, logger="draftrelay.cpu_linear"):
        assert C.probe() == "mkl"
    assert "off by" in caplog.text


@needs_onednn
def test_a_model_decodes_alike_on_both_libraries(monkeypatch):
    """The tiny pair's target with every product on oneDNN (the size floor lowered) gives MKL's logits
    within fp32 rounding and the same greedy tokens."""
    from draftrelay.model import ModelConfig, Transformer
    monkeypatch.setattr(C, "ONEDNN_MIN_BYTES", 0)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=256, hidden_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                    head_dim=32, intermediate_size=256, qkv_bias=True)).eval()
    toks = torch.randint(0, 256, (1, 12))
    out = {}
    for lib in ("mkl", "onednn"):
        C.choose(lib)
        cache = model.new_cache(1, 16)
        with torch.inference_mode():
            out[lib] = model(toks, torch.tensor([0]), cache, torch.tensor([0]))
    torch.testing.assert_close(out["onednn"], out["mkl"], rtol=1e-4, atol=1e-4)
    assert torch.equal(out["onednn"].argmax(-1), out["mkl"].argmax(-1))


def test_engine_metrics_name_the_library_in_force():
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.model import tiny_pair

    target, _ = tiny_pair()
    C.choose("mkl")
    with Engine(target, EngineConfig(mode="off", max_batch=1, max_len=64)) as eng:
        eng.generate([list(b"hello")], SamplingParams(max_tokens=4))
        assert eng.metrics()["total"]["cpu_linear"] == "mkl"
        C._chosen = ("onednn", "onednn")
        assert eng.metrics()["total"]["cpu_linear"] == "onednn"
        C._chosen = ("mkl", "onednn")
        assert eng.metrics()["total"]["cpu_linear"] == "mkl+onednn"


def test_prepare_probes_only_models_with_a_large_fp32_cpu_weight(monkeypatch):
    ran = []
    monkeypatch.setattr(C, "probe", lambda *a: ran.append(1) or C.choose("mkl"))
    small = torch.nn.Linear(512, 512)  # 1 MB
    assert C.prepare(small) == "auto" and ran == []
    assert C.prepare(torch.nn.Linear(1024, 1024).bfloat16()) == "auto" and ran == []  # bf16: not ours to choose
    C.prepare(torch.nn.Linear(1024, 1024))  # 4 MB fp32
    assert ran == [1] and C.chosen() != "auto"
    C.prepare(torch.nn.Linear(1024, 1024))
    assert ran == [1]  # decided once


def test_prepare_probes_on_the_models_own_weights(monkeypatch):
    """prepare() hands the probe the model's large 2-D fp32 weights, in order, up to PROBE_MODEL_BYTES."""
    seen = []
    monkeypatch.setattr(C, "probe", lambda weights=None: seen.append(weights) or C.choose("mkl"))
    monkeypatch.setattr(C, "PROBE_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(C, "PROBE_MODEL_BYTES", 3 << 18)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 512), torch.nn.Linear(512, 256),
                                torch.nn.Linear(256, 512))  # 128 KB, 256 KB, 512 KB, 512 KB weights
    assert C.prepare(model) == "mkl"
    (ring,) = seen
    assert [tuple(w.shape) for w in ring] == [(128, 256), (512, 128), (256, 512)]  # stops once 768 KB is reached
