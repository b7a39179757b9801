"""A drafter's head restricted to a draft vocabulary (draft_vocab.py): the picks are the full logits'
argmax over the kept ids, logits come back at the vocabulary's width, every drafter path drafts the same
tokens, the engine's output is the target's, and a replayed trace is restricted by the same law."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from draftrelay import model as M
from draftrelay.draft_vocab import DraftVocab, DraftVocabError
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.replay import Trace, TraceEntry, count_accepted
from draftrelay.worker.drafters import Job, LlamaDrafter, load_drafter
from draftrelay.worker.process import start_worker_process

V = M.tiny_config().vocab_size
IDS = np.sort(np.random.default_rng(0).choice(V, 64, replace=False))


@pytest.mark.parametrize("fast", [False, True])
def test_restricted_forward_is_the_full_logits_over_the_kept_ids(fast):
    _, d = M.tiny_pair()
    d.fast = fast
    rng = torch.Generator().manual_seed(1)
    toks = torch.randint(0, V, (2, 5), generator=rng)
    start, rows = torch.tensor([0, 0]), torch.tensor([0, 1])
    full = d(toks, start, d.new_cache(2, 64), rows)
    d.draft_vocab = DraftVocab(IDS, V)
    ids = torch.from_numpy(IDS)
    sub = full[..., ids]
    got = d(toks, start, d.new_cache(2, 64), rows)
    assert got.shape == full.shape
    assert torch.equal(got[..., ids], sub)  # the kept rows' logits, the same bits
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[..., outside]).all()
    tok, p = d(toks, start, d.new_cache(2, 64), rows, last_only=True, greedy=True)
    assert torch.equal(tok, ids[sub[:, -1].argmax(-1)])
    assert torch.allclose(p, torch.softmax(sub[:, -1], -1).max(-1).values, atol=1e-6)
    am = d(toks, start, d.new_cache(2, 64), rows, argmax_only=True)
    assert torch.equal(am, ids[sub.argmax(-1)])
    assert set(tok.tolist()) <= set(IDS.tolist())


def test_parse_and_refusals(tmp_path):
    assert DraftVocab.parse("", V) is None and DraftVocab.parse("off", V) is None
    assert DraftVocab.parse(str(V), V) is None  # the whole vocabulary: the whole head
    dv = DraftVocab.parse("32", V)
    assert dv.ids.tolist() == list(range(32)) and len(dv) == 32
    ranking = np.array([200, 3, 77, 9], np.uint32)
    path = tmp_path / "rank.npy"
    np.save(path, ranking)
    assert DraftVocab.parse(f"{path}:2", V).ids.tolist() == [3, 200]
    assert DraftVocab.parse(str(path), V).ids.tolist() == [3, 9, 77, 200]
    with pytest.raises(DraftVocabError, match="draft vocabulary 0: must be at least 1"):
        DraftVocab.parse("0", V)
    with pytest.raises(DraftVocabError, match="between 1 and the ranking's 4"):
        DraftVocab.parse(f"{path}:5", V)
    with pytest.raises(DraftVocabError, match="does not exist"):
        DraftVocab.parse("/no/such/ranking.npy", V)
    with pytest.raises(DraftVocabError, match="repeated"):
        DraftVocab([1, 1, 2], V)
    with pytest.raises(DraftVocabError, match=r"\[0, 256\)"):
        DraftVocab([1, 256], V)
    with pytest.raises(DraftVocabError, match="head of 10 rows"):
        DraftVocab([1, 2], V).head(torch.zeros(10, 4))


def test_every_drafter_path_drafts_the_same_tokens_inside_the_vocab():
    _, net = M.tiny_pair()
    full = LlamaDrafter(net, 4, 256, 8, "d", "", mode="eager")
    rng = np.random.default_rng(2)
    jobs = [Job(r, 0, rng.integers(0, V, 6 + r).astype(np.int32)) for r in range(3)]
    ref, _ = full.run(jobs, 5)
    out = {}
    for mode in ("eager", "lean"):
        _, net = M.tiny_pair()
        net.draft_vocab = DraftVocab(IDS, V)
        out[mode] = LlamaDrafter(net, 4, 256, 8, "d", "", mode=mode).run(jobs, 5)
    assert np.array_equal(out["eager"][0], out["lean"][0])
    assert np.allclose(out["eager"][1], out["lean"][1], atol=1e-5)
    assert set(out["eager"][0].reshape(-1).tolist()) <= set(IDS.tolist())
    assert not np.array_equal(out["eager"][0], ref)  # the restriction took effect (64 of 256 ids)


def test_load_drafter_restricts_and_refuses():
    d = load_drafter("tiny", draft_vocab="48")
    assert len(d.model.draft_vocab) == 48
    drafts, _ = d.run([Job(0, 0, np.arange(5, dtype=np.int32))], 4)
    assert drafts.max() < 48
    with pytest.raises(ValueError, match="'test' drafter has no head"):
        load_drafter("test", draft_vocab="48")
    from draftrelay.worker.tp import shard_model
    with pytest.raises(ValueError, match="draft vocabulary .* not split over tp 2"):
        shard_model(d.model, 2, 0, "cpu")


@pytest.mark.parametrize("args,words", [
    (["--model", "test", "--draft-vocab", "64"], "'test' drafter has no head"),
    (["--model", "tiny", "--draft-vocab", "0"], "draft vocabulary 0: must be at least 1"),
    (["--model", "tiny", "--tp", "2", "--tp-mode", "emulate", "--draft-vocab", "64"], "not with --tp"),
])
def test_worker_cli_names_a_bad_draft_vocab(args, words):
    out = subprocess.run([sys.executable, "-m", "draftrelay.cli", "worker", "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr, out.stderr


PROMPTS = [list(b"Hello, world"), list(b"The quick brown fox"), list(b"abc")]


def _generate(target, mode, spec=None, F=0):
    h = HandoffConfig(round_spec=spec or {"kind": "builtin"}, deadline_ms=3000, round_budget_ms=2500)
    cfg = EngineConfig(mode=mode, n_draft=4, max_batch=3, max_len=256, handoff=h, spec_fanout=F,
                       spec_options={"guard": False})
    with Engine(target, cfg) as eng:
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=24))
        return [r.output for r in reqs], eng.metrics()


def test_engine_output_is_the_targets_with_a_restricted_drafter():
    target, _ = M.tiny_pair()
    ref, _ = _generate(target, "off")
    # ids 0..127: the prompts' bytes are partly outside, so some drafts must miss, none may change a token
    with start_worker_process(["--model", "tiny", "--device", "cpu", "--draft-vocab", "128"],
                              env={"OMP_NUM_THREADS": "1", "DRAFTRELAY_BRANCH_CUT": "off"}) as w:
        spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": M.tiny_model_id()}
        for mode, F in (("sync", 0), ("async", 0), ("async", 8)):
            out, m = _generate(target, mode, spec, F)
            assert out == ref, (mode, F)
            t = m["total"]
            assert t["rounds"]["failed"] == 0 and t["rounds"]["watchdog"] == 0
            assert t["mean_accepted"] > 0.5, (mode, F, t["mean_accepted"])


def test_trace_restricted_takes_the_first_kept_token_and_never_accepts_an_unknown_one():
    e = TraceEntry(prompt=[1, 2], target=[5, 7, 9, 4], draft_top=[[5, 6], [8, 7], [30, 31], [4]],
                   draft_prob=[[0.6, 0.3], [0.5, 0.4], [0.7, 0.2], [0.9]], name="t")
    tr = Trace("pair", 2, [e], vocab_size=40)
    r = tr.restricted([4, 5, 7, 9, 10])
    got = r.entries[0]
    assert got.draft_top[0] == [5] and got.draft_prob[0] == [0.6]
    assert got.draft_top[1] == [7] and got.draft_prob[1] == [0.4]  # the kept one moves up to top-1
    assert got.draft_top[2][0] != 9 and got.draft_top[2][0] in (4, 5) and got.draft_prob[2] == [0.0]
    assert got.draft_top[3] == [4]
    assert r.meta["draft_vocab"] == 5 and "restricted to 5 ids" in r.pair
    r.validate()
    # the direct count on the restricted trace: position 1 now accepted (7 moved up), position 2 never
    assert count_accepted(e, 3) == [(2, 0), (1, 0), (0, 0)]
    assert count_accepted(got, 3) == [(2, 1), (0, 0)]


def test_replayed_acceptance_with_a_draft_vocab_is_the_restricted_traces_count(tmp_path):
    from draftrelay import replay

    tr = replay.synthetic_trace(V, 3, 48, 0.8, seed=3, pair="synthetic test pair")
    path = str(tmp_path / "trace.json")
    tr.save(path)
    kept = np.arange(128)
    restricted = tr.restricted(kept)
    k, max_tokens = 4, 40
    target, _ = M.tiny_pair()
    hook = replay.install_replay_target(target, tr, n_rows=4, max_len=256)
    try:
        with start_worker_process(["--model", f"replay:{path}:tiny", "--device", "cpu", "--dtype", "float32",
                                   "--draft-vocab", "128"], env={"OMP_NUM_THREADS": "1"}) as w:
            spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": M.tiny_model_id()}
            cfg = EngineConfig(mode="sync", n_draft=k, max_batch=3, max_len=256,
                               handoff=HandoffConfig(round_spec=spec, deadline_ms=5000, round_budget_ms=4000))
            with Engine(target, cfg) as eng:
                reqs = eng.generate([e.prompt for e in tr.entries], SamplingParams(max_tokens=max_tokens))
    finally:
        hook.remove()
    full = sum(sum(kk for _, kk in count_accepted(e, k, max_tokens)) for e in tr.entries)
    want = sum(sum(kk for _, kk in count_accepted(e, k, max_tokens)) for e in restricted.entries)
    assert [r.output for r in reqs] == [e.target[:max_tokens] for e in tr.entries]
    assert sum(sum(r.kept) for r in reqs) == want  # the restricted trace's count, exactly
    assert 0 < want < full  # tokens outside ids 0..127 were accepted before and cannot be now


def test_pick_and_top_with_ids_are_the_widened_logits_pick():
    from draftrelay.kernels import reference as R

    g = torch.Generator().manual_seed(4)
    sub = torch.randn(5, len(IDS), generator=g).to(torch.bfloat16)
    sub[0, 3] = sub[0, 9] = sub[0].max() + 1  # a tie: the lower column, so the lower id
    dv = DraftVocab(IDS, V)
    wide = dv.widen(sub)
    tok, conf = R.greedy_pick(sub, dv.ids)
    assert torch.equal(tok, R.greedy_pick(wide)[0]) and int(tok[0]) == int(IDS[3])
    assert torch.allclose(conf, R.greedy_pick(wide)[1])
    t2, c2, top, probs = R.greedy_top(sub, 6, dv.ids)
    w2, wc, wtop, wprobs = R.greedy_top(wide, 6)
    assert torch.equal(t2, w2) and torch.equal(top, wtop) and torch.allclose(probs, wprobs)


def test_generate_with_a_restricted_local_drafter_is_the_target_only_output(capsys):
    from draftrelay import cli, demo_pair

    target, drafter = demo_pair.paths()  # a 2,048-id vocabulary: the drafter keeps its first 1,024
    base = ["generate", "def add(a, b):", "--model", target, "--drafter", drafter, "--device", "cpu",
            "--max-tokens", "24", "--k", "4"]
    assert cli.main([*base, "--mode", "off"]) == 0
    want = capsys.readouterr().out.split("\n")[0]
    assert cli.main([*base, "--mode", "sync", "--drafter-vocab", "1024"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == want and want


def test_generate_and_serve_name_a_bad_drafter_vocab(tmp_path, capsys):
    import argparse

    from draftrelay import cli
    from draftrelay.serve import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    for flags, words in [(["--drafter-vocab", "0"], "--drafter-vocab 0: must be at least 1"),
                         (["--drafter-vocab", "/no/such.npy:8"], "--drafter-vocab /no/such.npy:8: expected N"),
                         (["--drafter-vocab", "64", "--worker", "h:1"], "--drafter-vocab 64: the local worker's")]:
        assert serve_cli._check(p.parse_args(flags)).startswith(words)
    ranking = tmp_path / "r.npy"
    np.save(ranking, np.arange(10))
    assert serve_cli._check(p.parse_args(["--drafter-vocab", f"{ranking}:4"])) == ""
    assert serve_cli._check(p.parse_args(["--drafter-vocab", "off"])) == ""  # the whole head, as the worker reads it
    assert cli.main(["generate", "x", "--drafter-vocab", "abc"]) == 2
    assert "--drafter-vocab abc: expected N, FILE.npy or FILE.npy:N; 'abc' does not exist" in capsys.readouterr().err


def record_traces_module():
    """benchmarks/record_traces.py, loaded as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "record_traces.py"
    spec = importlib.util.spec_from_file_location("record_traces", path)
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    return rt


def test_record_traces_with_a_draft_vocab_reuses_the_targets_and_drafts_kept_ids(tmp_path):
    from draftrelay import demo_pair

    rt = record_traces_module()
    target, drafter = demo_pair.paths()
    full, cut = str(tmp_path / "full.json"), str(tmp_path / "cut.json")
    base = ["--model", target, "--drafter", drafter, "--only", "quicksort,prose_rivers", "--max-tokens", "12"]
    assert rt.main([*base, "--out", full]) == 0
    assert rt.main([*base, "--out", cut, "--targets-from", full, "--draft-vocab", "300"]) == 0
    a, b = Trace.load(full), Trace.load(cut)
    assert [e.target for e in a.entries] == [e.target for e in b.entries]  # the target not run again
    assert all(t < 300 for e in b.entries for row in e.draft_top for t in row)
    assert b.meta["draft_vocab"] == "300" and "restricted to 300 ids" in b.pair
    # the restricted drafter's own top-1 is the whole head's first kept token wherever the top 8 holds one
    bound = a.restricted(np.arange(300))
    for ea, eb, ec in zip(a.entries, bound.entries, b.entries, strict=True):
        for j, row in enumerate(ea.draft_top):
            if any(t < 300 for t in row):
                assert eb.draft_top[j][0] == ec.draft_top[j][0], (ea.name, j)


def test_record_traces_takes_more_candidates_from_the_drafter_alone(tmp_path, capsys):
    """--targets-from without --model: the target is not loaded (its continuations come from the trace, the
    drafter's tokenizer encodes the prompts), and a wider --top-f keeps the narrower trace's candidates as
    its first ones; the new trace names the old one's target and pair. Without either, a clear error."""
    from draftrelay import demo_pair

    rt = record_traces_module()
    target, drafter = demo_pair.paths()
    full, wide = str(tmp_path / "full.json"), str(tmp_path / "wide.json")
    only = ["--only", "quicksort,prose_rivers", "--max-tokens", "12"]
    assert rt.main(["--model", target, "--drafter", drafter, *only, "--out", full]) == 0
    assert rt.main(["--drafter", drafter, *only, "--targets-from", full, "--top-f", "16", "--out", wide]) == 0
    a, b = Trace.load(full), Trace.load(wide)
    assert b.top_f == 16 and b.pair == a.pair and b.meta["model"] == a.meta["model"]
    for ea, eb in zip(a.entries, b.entries, strict=True):
        assert ea.target == eb.target and ea.prompt == eb.prompt
        assert [row[:8] for row in eb.draft_top] == ea.draft_top
    with pytest.raises(SystemExit):
        rt.main(["--drafter", drafter, *only, "--out", str(tmp_path / "x.json")])
    assert "--model (the target) is needed unless --targets-from" in capsys.readouterr().err
