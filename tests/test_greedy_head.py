"""The screened greedy head (greedy_head.py): its bound holds, its argmax is the full head's, the model's and
the engine's argmax-only paths use it and give the same tokens as the logits do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import draftrelay.greedy_head as G
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.model import Transformer, tiny_config

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="torch without int8 weight GEMM")


def peaked(V: int = 4096, D: int = 64, M: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A head and hidden states each aligned with one row (as a trained model's are): a clear maximum."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) * 0.05
    rows = torch.randint(0, V, (M,), generator=g).tolist()
    h = torch.randn(M, D, generator=g) + 6 * w[rows] / w[rows].norm(dim=1, keepdim=True) * D ** 0.5
    return w, h, rows


@pytest.fixture
def small_heads(monkeypatch):
    monkeypatch.setattr(G, "SCREEN_MIN_BYTES", 0)  # the test heads are small
    G._cache.clear()
    yield
    G._cache.clear()


def test_bound_covers_the_full_precision_logits():
    g = torch.Generator().manual_seed(1)
    for scale in (0.02, 1.0, 30.0):
        w = torch.randn(3000, 96, generator=g) * scale
        w[5] = 0.0  # an all-zero row: scale 1, no division by zero
        h = torch.randn(16, 96, generator=g) * 3
        a, err = G.ScreenedHead(w).bounds(h)
        full = F.linear(h, w)
        assert ((full - a).abs() <= err).all()
        assert ((full - a).abs() <= 0.5 * err).all()  # with room: the bound is not tight by accident
        assert torch.equal(a[:, 5], torch.zeros(16))


def test_screened_argmax_equals_the_full_heads_and_reads_few_rows(small_heads):
    w, h, rows = peaked()
    keep = G.screened_for(w).candidates(h)
    assert keep is not None and 1 <= keep.numel() <= 64  # the screen decided: a handful of 4096 rows
    assert set(rows) <= set(keep.tolist())
    assert G.head_argmax(h, w).tolist() == F.linear(h, w).argmax(-1).tolist() == rows


def test_the_screen_falls_back_where_it_cannot_decide(small_heads):
    w, h, _ = peaked()
    h[2, 3] = float("inf")
    assert G.screened_for(w).candidates(h) is None
    even = 0.05 + 1e-4 * torch.randn(4096, 64)  # rows nearly alike: more than KEEP_MAX_FRACTION of them kept
    assert G.screened_for(even).candidates(h[:2]) is None
    assert G.head_argmax(h[:2], even).tolist() == F.linear(h[:2], even).argmax(-1).tolist()
    assert not G.usable(torch.randn(G.SCREEN_MAX_ROWS + 1, 64), w)  # a prefill chunk: the full product
    assert not G.usable(h.bfloat16(), w.bfloat16())


def test_the_int8_copy_follows_writes_to_the_head(small_heads):
    w, h, rows = peaked()
    first = G.screened_for(w)
    assert G.screened_for(w) is first
    with torch.no_grad():
        w[[rows[0]]], w[[rows[1]]] = w[[rows[1]]].clone(), w[[rows[0]]].clone()  # swap two rows in place
    assert G.screened_for(w) is not first
    assert G.head_argmax(h[:2], w).tolist() == [rows[1], rows[0]]


def peaked_model() -> Transformer:
    """A small model whose untied head is big enough to screen and whose logits are peaked."""
    cfg = tiny_config().replace(vocab_size=256, name="screen")
    m = Transformer.random(cfg, seed=3, std=0.08, embed_std=0.3)
    with torch.no_grad():
        m.lm_head.weight.mul_(1 / 0.08)
    return m.eval()


@pytest.mark.parametrize("width", [1, 5])
def test_model_argmax_only_equals_the_logits_argmax(small_heads, monkeypatch, width):
    monkeypatch.setattr(G, "KEEP_MAX_FRACTION", 1.0)
    decided = []
    real = G.ScreenedHead.candidates
    monkeypatch.setattr(G.ScreenedHead, "candidates", lambda self, h: decided.append(real(self, h)) or decided[-1])
    m = peaked_model()
    toks = torch.randint(0, 256, (2, 12 + width), generator=torch.Generator().manual_seed(0))
    c1, c2 = m.new_cache(2, 32), m.new_cache(2, 32)
    with torch.inference_mode():
        for c in (c1, c2):
            m(toks[:, :12], torch.tensor([0, 0]), c, torch.tensor([0, 1]))
        logits = m(toks[:, 12:], torch.tensor([12, 12]), c1, torch.tensor([0, 1]))
        am = m(toks[:, 12:], torch.tensor([12, 12]), c2, torch.tensor([0, 1]), argmax_only=True)
    assert am.shape == (2, width) and am.dtype == torch.int64
    assert torch.equal(am, logits.argmax(-1))
    assert decided and all(k is not None and k.numel() < 256 for k in decided)  # screened, not the full product
    assert int(c2.lengths[0]) == 12 + width  # the KV was extended as by a logits forward


def test_greedy_engine_output_is_the_same_screened_or_not(small_heads, monkeypatch):
    monkeypatch.setattr(G, "KEEP_MAX_FRACTION", 1.0)
    m = peaked_model()
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    calls = []
    real = G.ScreenedHead.candidates
    monkeypatch.setattr(G.ScreenedHead, "candidates", lambda self, h: calls.append(1) or real(self, h))

    def run() -> list[list[int]]:
        eng = Engine(m, EngineConfig(mode="off", n_draft=0, max_batch=2, max_len=64))
        try:
            return [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))]
        finally:
            eng.close()

    G._cache.clear()
    eng = Engine(m, EngineConfig(mode="off", n_draft=0, max_batch=1, max_len=16))
    assert [v[0]() for v in G._cache.values()] == [m.lm_head.weight]  # built with the engine, not in a step
    eng.close()
    screened = run()
    assert calls  # the engine's greedy steps asked for the argmax only
    monkeypatch.setattr(G, "SCREEN_MIN_BYTES", 1 << 62)
    n = len(calls)
    assert run() == screened
    assert len(calls) == n  # the second run read the whole head


def full_pick(h: torch.Tensor, w: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    lg = F.linear(h, w).float()
    tok = lg.argmax(-1)
    return tok.tolist(), torch.softmax(lg, -1).gather(-1, tok[:, None])[:, 0]


@pytest.mark.parametrize("cap", [None, 1 / 512])
@pytest.mark.parametrize("sharp", [2.0, 6.0, 12.0])
def test_pick_interval_holds_the_full_heads_confidence(small_heads, monkeypatch, sharp, cap):
    """Over peaked and flat rows: the argmax is the full head's, the full head's confidence lies in the
    interval, and the value returned is close to it (the tail estimated from the int8 logits); with a
    small cap on the rows computed in fp32 (8 of 4096: the flat distribution's path) the interval holds."""
    if cap is not None:
        monkeypatch.setattr(G, "CONF_MAX_FRACTION", cap)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(4096, 64, generator=g) * 0.05
        rows = torch.randint(0, 4096, (5,), generator=g)
        h = torch.randn(5, 64, generator=g) + sharp * w[rows] / w[rows].norm(dim=1, keepdim=True) * 8
        got = G.pick_interval(h, w)
        assert got is not None
        tok, p, lo, hi = got
        want_tok, want_p = full_pick(h, w)
        assert tok.tolist() == want_tok
        assert (lo <= want_p * (1 + 1e-6)).all() and (want_p <= hi * (1 + 1e-6)).all()
        assert (lo <= p).all() and (p <= hi).all()
        if cap is None:
            assert torch.allclose(p, want_p, rtol=2e-3, atol=1e-5)


def test_head_pick_decides_a_stop_as_the_full_head_or_declines(small_heads):
    w, h, _ = peaked(M=4)
    h[1] *= 0.45  # a flatter row: a confidence well inside (0, 1)
    _, want = full_pick(h, w)
    _, _, lo, hi = G.pick_interval(h, w)
    assert 0.01 < float(want[1]) < 0.99
    for thr in [0.0, 0.05, 0.3, 0.5, 0.7, 0.9, 0.999, float(want[1]), float(lo[1]), float(hi[1])]:
        t = torch.full((4,), thr)
        got = G.head_pick(h, w, t)
        inside = ((lo * (1 - G.CONF_MARGIN) < t) & (hi * (1 + G.CONF_MARGIN) >= t) & (t > 0)).any()
        if got is None:
            assert inside  # declined only where the interval straddles the threshold
            continue
        assert not inside
        assert ((got[1] < t) == (want < t)).all(), thr  # the stop fires where the full head's would
    # a threshold at the full head's own value always straddles: the caller takes the full head
    assert G.head_pick(h, w, torch.tensor([0.0, float(want[1]), 0.0, 0.0])) is None
    assert G.head_pick(h, w, torch.tensor([0.0, float("inf"), 0.0, 0.0])) is not None  # inf: stopped already
