"""A GPU drafter's head read as int8 (int8_head.py): the quantization, the plan's int8 candidates, the
multiply-and-sum tile with a row scale under Triton's interpreter against its definition, the forward's
wiring (greedy picks from the int8 copy, everything else from the bf16 head) and the worker's refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import run_interpreted
from draftrelay import model as M
from draftrelay.int8_head import Int8Head, quantize_rows
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R


def test_quantize_rows_is_within_half_a_step_of_each_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 70, generator=g) * torch.linspace(0.01, 3, 300)[:, None]
    w[5] = 0  # a zero row: scale 0, q 0 (no division by zero)
    w[9, 3] = 50.0  # an outlier sets its row's step
    q, s = quantize_rows(w.to(torch.bfloat16))
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (300,)
    assert int(q.abs().max()) == 127 and not q[5].any() and float(s[5]) == 0.0
    wb = w.to(torch.bfloat16).float()
    err = (wb - q.float() * s[:, None]).abs()
    assert bool((err <= s[:, None] * (0.5 + 1e-4)).all())  # half a step (and fp32 rounding of w / s)
    assert torch.allclose(s, wb.abs().amax(1) / 127)
    bad = w.clone()
    bad[250, 1] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        quantize_rows(bad)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(q)


def test_int8_head_copies_once_per_head_tensor():
    h = Int8Head()
    w = torch.randn(40, 16)
    a, b = h.of(w), h.of(w)
    assert a[0] is b[0] and h.nbytes() == 40 * 16 + 4 * 40
    w2 = w[:20].clone()  # another tensor (a draft vocabulary's rows): its own copy
    assert h.of(w2)[0].shape == (20, 16) and h.nbytes() == 60 * 16 + 4 * 60


def test_int8_keys_offer_the_bf16_keys_tiles():
    """An INT8 key's candidates are the bf16 key's (a dot tile converts each int8 tile to bf16 before its
    dot): the 0.5B head's multiply-and-sum tiles at one row, its dot tiles at four (the weight is past
    SMALL_WEIGHT there: no multiply-and-sum tile); the SiLU prologue none (no int8 weight has one)."""
    for pro in (P.PRO_NONE, P.PRO_NORM):
        for rows in (1, 4, 16):
            assert P.bucket_candidates(pro, rows, 151936, 896, P.INT8) == P.bucket_candidates(pro, rows, 151936, 896)
    head = P.bucket_candidates(P.PRO_NORM, 1, 151936, 896, P.INT8)
    assert head and not any(c.dot for c in head)
    four = P.bucket_candidates(P.PRO_NORM, 4, 151936, 896, P.INT8)
    assert four and all(c.dot for c in four)
    assert P.bucket_candidates(P.PRO_SILU, 1, 896, 4864, P.INT8) == []
    key, cands = P.plan_key(0, P.PRO_NORM, 1, 151936, 896, P.INT8, False, True)
    assert key[5] == P.INT8 and cands == head
    # the compiled kernel is another one (W_SCALE), not the bf16 head's
    cfg = head[0]
    assert P.launch_key(P.PRO_NORM, cfg, 1, 151936, 896, P.INT8, False, True) != \
        P.launch_key(P.PRO_NORM, cfg, 1, 151936, 896, "bfloat16", False, True)


INT8_INTERPRETED = r'''
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from draftrelay.kernels import plan as P, reference as R, triton_ops as T
from draftrelay.int8_head import quantize_rows
g = torch.Generator().manual_seed(int(sys.argv[1]))
n = 0
dots = 0
for M, N, K in ((1, 40, 96), (3, 33, 200), (1, 24, 1100), (2, 20, 300), (1, 20, 4500), (5, 40, 1100)):
    for pro in (P.PRO_NONE, P.PRO_NORM):
        cands = P.bucket_candidates(pro, M, N, K, P.INT8)
        if not cands:  # a norm over rows longer than one tile holds: none at one row either
            assert pro == P.PRO_NORM and P.next_pow2(K) > P.NORM_MAX_K, (pro, M, N, K)
            continue
        for cfg in cands:
            x = torch.randn(M, K, generator=g)
            q, s = quantize_rows(torch.randn(N, K, generator=g) * K ** -0.5)
            d, nw = torch.randn(M, K, generator=g), torch.randn(K, generator=g)
            if pro == P.PRO_NORM:
                rx, ref = R.int8_norm_linear(x, d, nw, 1e-6, q, s)
            else:
                rx, ref = x, R.int8_linear(x, q, s)
            for _ in range(2 if cfg.split > 1 else 1):
                gx, got = T.skinny_linear(pro, cfg, x, q, None, d if pro == P.PRO_NORM else None, nw, 1e-6,
                                          w_scale=s)
                assert torch.equal(gx, rx), (pro, cfg)
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"{pro} {cfg} {M} {N} {K}")
            wrong = T.skinny_linear(pro, cfg, x, q, None, d if pro == P.PRO_NORM else None, nw, 1e-6,
                                    w_scale=s * 2)[1]
            assert not torch.allclose(wrong, ref, atol=1e-3), "the scale is applied"
            n += 1
            dots += cfg.dot
assert dots >= 4, dots
try:
    T.skinny_linear(P.PRO_SILU, cands[0], torch.randn(2, 512), q[:, :256].contiguous(), w_scale=s)
    raise SystemExit("a SiLU prologue took an int8 weight")
except ValueError as e:
    assert "without the SiLU prologue" in str(e), e
# the layers' products (int8_layers.py): a bias (q|k|v) and the SiLU output of a gate|up tile (N even), each
# with the scale applied before them, against the definitions; a mutated bias is caught
silu = 0
for M, N, K in ((1, 48, 96), (4, 64, 200), (2, 40, 1100)):
    for pro in (P.PRO_NONE, P.PRO_NORM):
        for cfg in P.bucket_candidates(pro, M, N, K, P.INT8):
            x, d, nw = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g), torch.randn(K, generator=g)
            q, s = quantize_rows(torch.randn(N, K, generator=g) * K ** -0.5)
            b = torch.randn(N, generator=g)
            dd = d if pro == P.PRO_NORM else None
            rx, h = R.add_rms_norm(x, d, nw, 1e-6) if pro == P.PRO_NORM else (x, x)
            ref = R.int8_linear(h, q, s, b)
            gx, got = T.skinny_linear(pro, cfg, x, q, b, dd, nw, 1e-6, w_scale=s)
            assert torch.equal(gx, rx), (pro, cfg)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"bias {pro} {cfg} {M} {N} {K}")
            assert not torch.allclose(T.skinny_linear(pro, cfg, x, q, b * 2, dd, nw, 1e-6, w_scale=s)[1], ref,
                                      atol=1e-3), "the bias is added"
            if P.holds_silu_pairs(cfg):
                got = T.skinny_linear(pro, cfg, x, q, None, dd, nw, 1e-6, silu_out=True, w_scale=s)[1]
                torch.testing.assert_close(got, R.silu_mul(R.int8_linear(h, q, s)), atol=1e-5, rtol=1e-5,
                                           msg=f"silu_out {pro} {cfg} {M} {N} {K}")
                silu += 1
assert silu >= 4, silu
# the public pair: on a CPU tensor nothing is planned (None: the caller reads its bf16 head)
assert T.int8_linear(torch.randn(1, 1100), q, s) is None
print("checked", n, "dots", dots, "silu", silu)
'''


def test_int8_tiles_under_the_interpreter_equal_their_definition(tmp_path):
    """Every INT8 candidate (the multiply-and-sum and dot tiles, split ones too, each prologue) on int8 weights
    with row scales against reference.int8_linear / int8_norm_linear, in fp32 under Triton's interpreter; the
    scale doubled is caught; the SiLU prologue refuses an int8 weight."""
    out = run_interpreted(tmp_path, INT8_INTERPRETED)
    assert "checked" in out and int(out.split("checked")[1].split()[0]) >= 15, out[-2000:]


def _with_head(d: M.Transformer, head: torch.Tensor) -> M.Transformer:
    """A copy of d whose head is `head` (the tiny drafter's head is a weight of its own, not the embedding):
    the forward an int8 head must equal."""
    e = copy.deepcopy(d)
    assert e.lm_head is not None
    e.int8_head = None
    e.lm_head.weight.data.copy_(head)
    return e


def test_greedy_picks_read_the_int8_copy_and_nothing_else_does():
    """On the fast path (the CPU runs it with the definitions) a greedy forward with an int8 head picks as the
    same model whose head is the dequantized copy (q * s); its non-greedy logits, and the plain path, stay
    the bf16 head's. A draft vocabulary's rows are quantized after they are picked."""
    _, d = M.tiny_pair()
    d.fast = True
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, d.cfg.vocab_size, (2, 5), generator=g)
    start, rows = torch.tensor([0, 0]), torch.tensor([0, 1])

    def run(m, **kw):
        return m(toks, start, m.new_cache(2, 64), rows, **kw)

    full = run(d)
    want_tok, want_conf = run(d, last_only=True, greedy=True)
    d.int8_head = Int8Head()
    q, s = d.int8_head.of(d.head_weight())
    deq = _with_head(d, q.float() * s[:, None])
    deq.fast = True
    for kw in ({"last_only": True}, {"logits_at": torch.tensor([4, 2])}):
        tok, conf = run(d, greedy=True, **kw)
        rt, rc = run(deq, greedy=True, **kw)
        assert torch.equal(tok, rt), kw
        torch.testing.assert_close(conf, rc, atol=1e-5, rtol=1e-5)
    tok, conf = run(d, last_only=True, greedy=True)
    assert not torch.equal(conf, want_conf)  # the int8 copy was read (its logits are not the bf16 head's)
    assert torch.equal(run(d), full)  # the logits themselves: the bf16 head
    d.fast = False
    assert torch.equal(run(d, last_only=True, greedy=True)[0], want_tok)  # the plain path: the bf16 head
    d.fast = True
    from draftrelay.draft_vocab import DraftVocab

    d.draft_vocab = DraftVocab.top(100, d.cfg.vocab_size)
    tok, _ = run(d, last_only=True, greedy=True)
    assert int(tok.max()) < 100 and d.int8_head.of(d.head_weight())[0].shape[0] == 100


def test_reference_int8_linear_rounds_once():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    q, s = quantize_rows(torch.randn(10, 64, generator=g))
    b = torch.randn(10, generator=g)
    want = ((x.float() @ q.float().T) * s + b).to(torch.bfloat16)
    assert torch.equal(R.int8_linear(x, q, s, b), want)
    xo, y = R.int8_norm_linear(x, x, torch.ones(64, dtype=torch.bfloat16), 1e-6, q, s)
    assert torch.equal(xo, x + x) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("args, words", [
    (["--model", "test", "--head-int8"], "CUDA drafter with a head"),
    (["--model", "tiny", "--device", "cpu", "--head-int8"], "CUDA drafter with a head"),
    (["--model", "tiny", "--tp", "2", "--head-int8"], "one-card drafter"),
])
def test_worker_cli_refuses_head_int8_where_it_cannot_apply(args, words):
    import argparse

    from draftrelay.worker import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    problem = cli._check(p.parse_args(args))
    assert problem and words in problem and "--head-int8" in problem, problem


def test_load_drafter_refuses_head_int8_off_a_gpu():
    from draftrelay.worker.drafters import load_drafter

    with pytest.raises(ValueError, match="--head-int8: for a CUDA drafter"):
        load_drafter("tiny", device="cpu", head_int8=True)
    with pytest.raises(ValueError, match="--head-int8"):
        load_drafter("test", device="cpu", head_int8=True)


def test_generate_and_serve_pass_head_int8_to_the_local_gpu_worker_only(monkeypatch, capsys):
    """--drafter-head-int8: the local worker's --head-int8 (start_local_worker adds it); refused with a remote
    worker (it takes the flag itself) and on a CPU device, naming the flag."""
    import argparse

    from draftrelay import cli
    from draftrelay.engine import loading as L
    from draftrelay.serve import cli as serve_cli
    from draftrelay.worker import process

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli._check(p.parse_args(["--drafter-head-int8", "--worker", "h:1"])).startswith(
        "--drafter-head-int8: the local worker's setting")
    assert serve_cli._check(p.parse_args(["--drafter-head-int8", "--device", "cpu"])).startswith(
        "--drafter-head-int8: for a GPU drafter")
    assert serve_cli._check(p.parse_args(["--drafter-head-int8", "--device", "cuda"])) == ""
    assert cli.main(["generate", "x", "--drafter-head-int8", "--device", "cpu"]) == 2
    assert "--drafter-head-int8: for a GPU drafter" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(process, "start_worker_process", lambda args, env=None: seen.append(args))
    L.start_local_worker("tiny", torch.device("cuda"), 4, 256, 1, head_int8=True)
    L.start_local_worker("tiny", torch.device("cuda"), 4, 256, 1)
    assert "--head-int8" in seen[0] and "--head-int8" not in seen[1]


def test_eager_drafter_reads_the_int8_head_as_the_static_step_does():
    """The eager drafter is the reference the captured steps are checked against (tests_gpu's graph == eager), so
    with an int8 head its picks come from the int8 copy as the static step's do: over rounds of three requests
    (a prompt extension, then decodes) its drafts and confidences equal the static step's and those of an
    eager drafter whose head is the dequantized copy, and not those of the bf16 head."""
    import numpy as np

    from draftrelay.worker.drafters import Job, load_drafter

    def drafter(mode: str, head: str):
        d = load_drafter("tiny", device="cpu", n_rows=4, max_ctx=300, n_out_max=6, mode=mode)
        d.model.fast = True
        if head == "int8":
            d.model.int8_head = Int8Head()
            d.model.int8_head.of(d.model.head_weight())
        elif head == "deq":
            q, s = Int8Head().of(d.model.head_weight())
            d.model.lm_head.weight.data.copy_(q.float() * s[:, None])
        return d

    ds = {"eager": drafter("eager", "int8"), "static": drafter("static", "int8"), "deq": drafter("eager", "deq"),
          "bf16": drafter("eager", "bf16")}
    rng = np.random.default_rng(7)
    ctx = {r: list(rng.integers(0, 256, 9 + 4 * r)) for r in range(3)}
    synced = dict.fromkeys(ctx, 0)
    conf_moved = 0.0
    for _ in range(8):
        jobs = [Job(r, synced[r], np.array(ctx[r][synced[r]:], np.int32)) for r in ctx]
        res = {k: d.run([Job(j.row, j.keep, j.tokens.copy()) for j in jobs], 4) for k, d in ds.items()}
        for other in ("static", "deq"):
            assert res["eager"][0].tolist() == res[other][0].tolist(), other
            np.testing.assert_allclose(res["eager"][1], res[other][1], atol=2e-5)
        conf_moved = max(conf_moved, float(np.abs(res["eager"][1] - res["bf16"][1]).max()))
        for r in ctx:
            keep = int(rng.integers(0, 5))
            synced[r] = len(ctx[r])
            ctx[r] += list(res["eager"][0][r][:keep]) + [int(rng.integers(0, 256))]
    assert conf_moved > 1e-4  # the int8 copy was read: the bf16 head's confidences are not these
