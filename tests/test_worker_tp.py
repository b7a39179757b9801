"""The tensor-parallel drafter (worker/tp.py) on CPU: the split is exact, the emulated ranks equal the
one-card drafter within rounding (the unsplit code bit for bit) and themselves bit for bit across runs,
a failed collective fails the STEP loudly (INTERNAL) and the worker exits after 3 in a row (bad --tp
values: tests/test_worker_cli.py). The real pair (P2PGroup on two GPUs) runs in tests_gpu/tp2_probe.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftrelay.model import ModelConfig, Transformer, tiny_pair
from draftrelay.wire import Block, DrafterClient, WireRemoteError
from draftrelay.wire import protocol as P
from draftrelay.worker.core import StepFailed, WorkerCore
from draftrelay.worker.drafters import Job, LlamaDrafter
from draftrelay.worker.process import start_worker_process
from draftrelay.worker.server import WorkerServer
from draftrelay.worker.tp import TPDrafter, check_split, shard_model, split_points

FAIL = 201  # --test-tp-fail-token: a step holding it launches nothing on the last rank


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def small_cfg(**kw) -> ModelConfig:  # GQA (2 query heads per kv head), q/k/v bias, tied head, odd sizes
    base = dict(vocab_size=300, hidden_size=48, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                intermediate_size=100, qkv_bias=True, tie_word_embeddings=True, max_position_embeddings=512)
    return ModelConfig(**{**base, **kw})


def small_model(seed=5) -> Transformer:
    m = Transformer.random(small_cfg(), seed=seed, std=0.2)
    with torch.no_grad():  # non-trivial biases and norms, so a wrong slice of them shows
        for name, p in m.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3 + (
                    1.0 if "norm" in name else 0.0))
    return m


# ---- the split ----------------------------------------------------------------------------------------


def test_split_points_tile_aligned_and_even():
    assert split_points(151936, 2) == [0, 76032, 151936]  # qwen vocab: the cut on a 128 multiple
    assert split_points(4864, 2) == [0, 2432, 4864] and split_points(8960, 2) == [0, 4480, 8960]
    assert split_points(176, 2) == [0, 88, 176]  # small: plain even cut
    assert split_points(300, 4) == [0, 75, 150, 225, 300]
    with pytest.raises(ValueError, match="n_kv_heads 2 is not divisible by tp 3"):
        check_split(tiny_pair()[1].cfg, 3)
    with pytest.raises(ValueError, match="must be 1..8"):
        check_split(small_cfg(), 9)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_are_the_full_tensors_columns_bit_for_bit(world):
    m = small_model()
    shards = [shard_model(m, world, r, "cpu") for r in range(world)]
    for i, blk in enumerate(m.layers):
        at, mlp = blk.self_attn, blk.mlp
        ls = [s.layers[i] for s in shards]

        def cat(name, dim, ls=ls):
            return torch.cat([getattr(x, name) for x in ls], dim=dim)

        for name, full, dim in [("wq", at.q_proj.weight, 0), ("bq", at.q_proj.bias, 0), ("wk", at.k_proj.weight, 0),
                                ("bk", at.k_proj.bias, 0), ("wv", at.v_proj.weight, 0), ("bv", at.v_proj.bias, 0),
                                ("wo", at.o_proj.weight, 1), ("wg", mlp.gate_proj.weight, 0),
                                ("wu", mlp.up_proj.weight, 0), ("wd", mlp.down_proj.weight, 1)]:
            assert torch.equal(bits(cat(name, dim)), bits(full.detach())), (world, i, name)
        for x in ls:  # replicated
            assert torch.equal(bits(x.ln1), bits(blk.input_layernorm.weight.detach()))
            assert torch.equal(bits(x.ln2), bits(blk.post_attention_layernorm.weight.detach()))
    head = torch.cat([s.head for s in shards], 0)
    assert torch.equal(bits(head), bits(m.embed_tokens.weight.detach()))  # tied: the vocabulary split
    for r, s in enumerate(shards):
        assert torch.equal(bits(s.embed), bits(m.embed_tokens.weight.detach()))
        assert s.head.untyped_storage().data_ptr() == s.embed.untyped_storage().data_ptr()  # a view, no copy
        assert s.vocab[0] == (0 if r == 0 else shards[r - 1].vocab[1])  # rank 0 holds the lowest ids
        # whole kv-head groups: query head h of the rank reads kv head h // n_rep
        assert s.heads == (s.kv_heads[0] * 2, s.kv_heads[1] * 2)
    assert shards[-1].vocab[1] == 300 and shards[-1].channels[1] == 100
    # untied head (tiny): rows of lm_head
    _, tiny = tiny_pair()
    t2 = [shard_model(tiny, 2, r, "cpu") for r in range(2)]
    assert torch.equal(torch.cat([s.head for s in t2]), tiny.lm_head.weight.detach())


# ---- the math ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [False, True])
def test_unsplit_code_equals_the_model_bit_for_bit(fast):
    """The TP ranks run the model's own layer functions (model.decoder_steps): at 1 rank the same bits as
    the one-card model, on the plain path and on the fused-kernel path (its definitions on a CPU)."""
    m = small_model()
    m.fast = fast
    d = TPDrafter(m, 1, "emulate", 2, 200, 6, "m", "")
    assert d.fast is fast
    toks = np.arange(3, 19, dtype=np.int32)  # 16 tokens: one forward, as the model's
    got = d.forward_logits([Job(0, 0, toks)], kv_len=64)
    cache = m.new_cache(3, 300)
    with torch.inference_mode():
        ref = m(torch.from_numpy(toks[None].astype(np.int64)), torch.tensor([0]), cache, torch.tensor([0]),
                kv_len=64, logits_at=torch.tensor([len(toks) - 1]))[:, 0]
    assert torch.equal(bits(got), bits(ref))


@pytest.mark.parametrize("world", [2, 4])
def test_emulated_logits_within_rounding_of_one_card(world):
    m = small_model()
    d = TPDrafter(m, world, "emulate", 2, 200, 6, "m", "")
    rng = np.random.default_rng(world)
    jobs = [Job(0, 0, rng.integers(0, 300, 37).astype(np.int32)), Job(1, 0, rng.integers(0, 300, 5).astype(np.int32))]
    got = d.forward_logits(jobs)
    cache = m.new_cache(3, 300)
    with torch.inference_mode():
        ref = torch.cat([m(torch.from_numpy(j.tokens[None].astype(np.int64)), torch.tensor([0]), cache,
                           torch.tensor([j.row]), last_only=True)[:, 0] for j in jobs])
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert 0 < err <= 1e-5 * scale, (err, scale)  # fp32 partial sums in another order: a few ulps, not exact


def drive(drafters, rounds: int, seed: int, n_req: int = 3, vocab: int = 256):
    """Feed every drafter the same frames (through WorkerCore: rollback, KV reuse of accepted drafts,
    mixed lengths, a long first prompt); returns each one's StepResults."""
    cores = [WorkerCore(d, max_requests=4) for d in drafters]
    sess = [c.open_session(P.Hello(max_requests=4, n_out_max=6))[0] for c in cores]
    rng = np.random.default_rng(seed)
    ctx = {rid: 0 for rid in range(1, n_req + 1)}
    pending = {rid: rng.integers(0, vocab, 40 if rid == 1 else 6).astype(np.int32) for rid in ctx}
    results = [[] for _ in drafters]
    for _ in range(rounds):
        rids = [r for r in ctx if rng.random() < 0.8] or [1]
        blocks = [P.Block(r, 0, ctx[r], pending[r], int(rng.integers(1, 7))) for r in rids]
        outs = [c.step(s, blocks) for c, s in zip(cores, sess, strict=True)]
        for k, o in enumerate(outs):
            results[k].append(o)
        a = outs[0]
        for i, r in enumerate(rids):
            ctx[r] += len(pending[r])
            d = a.drafts[i, :a.counts[i]]
            keep = int(rng.integers(0, len(d) + 1))
            pending[r] = np.concatenate([d[:keep], rng.integers(0, vocab, 1)]).astype(np.int32)
    return results


def test_emulated_tp2_drafts_equal_one_card_and_itself():
    _, m = tiny_pair()
    one = LlamaDrafter(m, 6, 200, 6, "tiny", "", mode="eager")
    tp_a = TPDrafter(m, 2, "emulate", 6, 200, 6, "tiny", "")
    tp_b = TPDrafter(m, 2, "emulate", 6, 200, 6, "tiny", "")
    unsplit = TPDrafter(m, 1, "emulate", 6, 200, 6, "tiny", "")
    ref, a, b, u = drive([one, tp_a, tp_b, unsplit], rounds=25, seed=11)
    worst = 0.0
    for x, y, z, w in zip(ref, a, b, u, strict=True):
        assert x.status.tolist() == y.status.tolist() == w.status.tolist()
        # the tiny drafter's logits are peaked (top-1 ~0.75): no near-ties, the drafts are equal
        assert x.drafts.tolist() == y.drafts.tolist() == w.drafts.tolist()
        worst = max(worst, float(np.abs(x.confidences - y.confidences).max()))
        # the same emulation twice: the same bits
        assert y.drafts.tolist() == z.drafts.tolist()
        assert y.confidences.view(np.int32).tolist() == z.confidences.view(np.int32).tolist()
    assert worst < 5e-6  # confidences: softmax in another summation order


def test_emulation_is_bit_identical_across_runs_at_four_ranks():
    m = small_model(seed=8)
    runs = [drive([TPDrafter(m, 4, "emulate", 6, 200, 6, "m", "")], rounds=8, seed=3, vocab=300)[0]
            for _ in range(2)]
    for x, y in zip(*runs, strict=True):
        assert x.drafts.tolist() == y.drafts.tolist()
        assert x.confidences.view(np.int32).tolist() == y.confidences.view(np.int32).tolist()


def test_solo_runs_rank0_alone():
    _, m = tiny_pair()
    d = TPDrafter(m, 2, "solo", 2, 100, 6, "tiny", "")
    assert len(d.shards) == 1 and d.shards[0].vocab == (0, 128)
    drafts, confs = d.run([Job(0, 0, np.arange(1, 9, dtype=np.int32))], 4)
    assert drafts.shape == (1, 4) and drafts.max() < 128 and np.isfinite(confs).all()  # its own half only
    with pytest.raises(ValueError, match="every rank"):
        d.forward_logits([Job(1, 0, np.arange(3, dtype=np.int32))])


# ---- failures -----------------------------------------------------------------------------------------


def test_failed_collective_is_internal_then_recovers_then_fatal():
    _, m = tiny_pair()
    drafter = TPDrafter(m, 2, "emulate", 4, 200, 6, "tiny", "", fail_token=FAIL)
    fatal = []
    drafter.on_fatal = fatal.append
    core = WorkerCore(drafter, max_requests=2)
    srv = WorkerServer(core, "127.0.0.1", 0)
    host, port = srv.start()
    ref = LlamaDrafter(m, 4, 200, 6, "tiny", "", mode="eager")
    try:
        c = DrafterClient(host, port, max_requests=2, n_out_max=6, timeout=10.0)
        r = c.step([Block(1, 0, 0, np.array([5, 6, 7], np.int32), 4), Block(2, 0, 0, np.array([9], np.int32), 4)])
        assert [x.status for x in r] == [P.OK, P.OK]
        with pytest.raises(WireRemoteError) as e:  # rank 1 never joins: the whole STEP fails loudly
            c.step([Block(1, 0, 3, np.array([FAIL], np.int32), 4), Block(2, 0, 1, np.array([3], np.int32), 4)])
        assert e.value.code == P.INTERNAL and "step failed" in e.value.message and c.connected
        assert drafter.group.errors() == [0, 0] and drafter.group.pending() == 0  # reset already
        # the frame's requests were dropped (never a draft from a half-done step): resend from 0
        r = c.step([Block(1, 0, 4, np.array([8], np.int32), 4)])
        assert r[0].status == P.UNKNOWN_REQUEST
        r = c.step([Block(1, 0, 0, np.array([5, 6, 7, 8], np.int32), 4), Block(2, 0, 0, np.array([9, 3], np.int32), 4)])
        want = ref.run([Job(0, 0, np.array([5, 6, 7, 8], np.int32)), Job(1, 0, np.array([9, 3], np.int32))], 4)[0]
        assert [x.status for x in r] == [P.OK, P.OK] and r.drafts.tolist() == want.tolist()
        assert drafter.failures_in_a_row == 0 and not fatal
        for k in range(3):  # three failed steps in a row: the supervisor hook fires on the third
            with pytest.raises(WireRemoteError):
                c.step([Block(7 + k, 0, 0, np.array([FAIL, 1], np.int32), 2)])
            assert len(fatal) == (1 if k == 2 else 0)
        assert "3 in a row" in fatal[0]
        assert core.stats["drafter_errors"] == 4 and drafter.failed_steps == 4
        c.close()
    finally:
        srv.stop()
    assert srv.active_connections() == 0 and len(core.free_rows) == 4


def test_step_failed_drops_only_the_frames_requests():
    class Flaky(LlamaDrafter):
        def run(self, jobs, n_steps):
            if any((j.tokens == FAIL).any() for j in jobs):
                raise StepFailed("collective timeout")
            return super().run(jobs, n_steps)

    _, m = tiny_pair()
    core = WorkerCore(Flaky(m, 4, 100, 4, "tiny", "", mode="eager"), max_requests=3)
    s, _ = core.open_session(P.Hello(max_requests=3, n_out_max=4))
    core.step(s, [P.Block(1, 0, 0, np.array([1, 2], np.int32), 2), P.Block(2, 0, 0, np.array([3], np.int32), 2)])
    with pytest.raises(StepFailed):
        core.step(s, [P.Block(1, 0, 2, np.array([FAIL], np.int32), 2)])
    assert set(s.requests) == {2} and core.stats["drafter_errors"] == 1  # request 2 was not in the frame


def test_worker_process_tp2_emulate_serves_then_exits_after_three_failed_steps():
    _, m = tiny_pair()
    ref = LlamaDrafter(m, 4, 256, 4, "tiny", "", mode="eager")
    w = start_worker_process(["--model", "tiny", "--device", "cpu", "--tp", "2", "--tp-mode", "emulate",
                              "--rows", "4", "--max-ctx", "256", "--n-out-max", "4",
                              "--test-tp-fail-token", str(FAIL)], timeout=120)
    try:
        assert "tp2 emulate" in w.banner
        c = DrafterClient(w.host, w.port, max_requests=2, n_out_max=4, timeout=20.0)
        prompt = np.arange(20, 45, dtype=np.int32)
        r = c.step([Block(1, 0, 0, prompt, 4)])
        assert r[0].drafts.tolist() == ref.run([Job(0, 0, prompt)], 4)[0][0].tolist()
        for _ in range(3):
            with pytest.raises(WireRemoteError) as e:
                c.step([Block(2, 0, 0, np.array([FAIL], np.int32), 4)])
            assert e.value.code == P.INTERNAL
        c.close()
        assert w.proc.wait(30) == 3
        assert "exiting for a restart" in w.log() and "3 in a row" in w.log()
    finally:
        w.stop()
