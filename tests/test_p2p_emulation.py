"""CPU tests of draftrelay.p2p: the emulation against the oracle, the math's contract, bad input.

The real pair (P2PGroup) runs in tests_gpu/p2p_probe.py; here the same math runs as torch ops.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftrelay.p2p import (
    ERR_INVALID_ID,
    EmulatedGroup,
    P2PError,
    P2PGroup,
    combine_argmax,
    native,
    op_tag,
    reference_all_reduce,
    reference_argmax,
    reference_shard_argmax,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    rows=st.integers(1, 40),
    hidden=st.integers(1, 700),
    bf16=st.booleans(),
    order_seed=st.integers(0, 2**31 - 1),
    inplace=st.booleans(),
)
def test_emulated_all_reduce_equals_oracle_bit_for_bit(world, rows, hidden, bf16, order_seed, inplace):
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(order_seed)
    xs = [(torch.randn(rows, hidden, generator=gen) * 10 ** (r - 1)).to(dtype) for r in range(world)]
    ref = reference_all_reduce(xs)
    group = EmulatedGroup(world)
    inputs = [x.clone() for x in xs]
    order = torch.randperm(world, generator=gen).tolist()  # the controller may issue ranks in any order
    outs: dict[int, torch.Tensor] = {}
    for r in order:
        outs[r] = group.all_reduce(r, inputs[r], out=inputs[r] if inplace else None)
    assert group.pending() == 0
    for r in range(world):
        assert _same_bits(outs[r], ref[r]), f"rank {r} differs from the oracle"
        assert _same_bits(outs[r], outs[0]), "ranks disagree"


def test_sum_is_fp32_in_rank_order_with_one_rounding():
    # three ranks where the association matters in fp32: ((a + b) + c) != (a + (b + c))
    a = torch.tensor([1.0e8, 1.0], dtype=torch.float32)
    b = torch.tensor([-1.0e8, 1.0e8], dtype=torch.float32)
    c = torch.tensor([1.0, -1.0e8], dtype=torch.float32)
    out = reference_all_reduce([a, b, c])[0]
    assert out.tolist() == [1.0, 0.0]  # (a+b)+c; a+(b+c) would give [0.0, 1.0]
    assert ((a + (b + c)) != out).any()
    # bf16 in: the sum is rounded once from fp32, not after each add
    x = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, 2.0**-9, 2.0**-9, 2.0**-9)]
    once = reference_all_reduce(x)[0]
    stepwise = ((x[0] + x[1]) + x[2]) + x[3]  # bf16 rounding after every add loses the small terms
    assert once.item() == 1.0 + 2.0**-7 and stepwise.item() == 1.0


def test_two_rank_sum_is_exactly_rounded():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen) * 1e-3
    out = reference_all_reduce([a, b])[0]
    exact = a.double() + b.double()
    assert torch.equal(out, exact.float())  # fp32 add of two fp32 values is the exact sum rounded once


def test_emulated_output_is_written_only_when_every_rank_arrived():
    group = EmulatedGroup(2)
    x0, x1 = torch.ones(8), torch.full((8,), 2.0)
    out0 = group.all_reduce(0, x0, out=torch.full((8,), float("nan")))
    assert torch.isnan(out0).all() and group.pending() == 1
    x0.fill_(100.0)  # the input was taken at call time
    out1 = group.all_reduce(1, x1)
    assert group.pending() == 0
    assert out0.tolist() == [3.0] * 8 and out1.tolist() == [3.0] * 8


def test_mismatched_collectives_poison_until_reset():
    group = EmulatedGroup(2)
    group.all_reduce(0, torch.ones(16))
    with pytest.raises(P2PError) as info:
        group.all_reduce(1, torch.ones(32))  # a different size: the pair would see another tag
    assert info.value.errors == [ERR_INVALID_ID, ERR_INVALID_ID]
    with pytest.raises(P2PError, match="poisoned"):
        group.all_reduce(0, torch.ones(16))
    group.reset()
    assert group.errors() == [0, 0]
    outs = [group.all_reduce(r, torch.full((4,), float(r + 1))) for r in range(2)]
    assert outs[0].tolist() == [3.0] * 4


def test_mixed_kinds_in_one_sequence_pair_up_by_position():
    group = EmulatedGroup(2)
    a = [torch.randn(3, 5) for _ in range(2)]
    v = [torch.tensor([1.0, 5.0]), torch.tensor([2.0, 5.0])]
    i = [torch.tensor([3, 4]), torch.tensor([103, 104])]
    outs_ar, outs_am = [], []
    for r in range(2):
        outs_ar.append(group.all_reduce(r, a[r]))
        outs_am.append(group.argmax_exchange(r, v[r], i[r], vocab=200))
    assert torch.equal(outs_ar[0], a[0] + a[1])
    for r in range(2):
        assert outs_am[r][0].tolist() == [2.0, 5.0]
        assert outs_am[r][1].tolist() == [103, 4]  # the tie at 5.0 goes to the lower id
    with pytest.raises(P2PError):
        group.all_reduce(0, torch.ones(3, 5))
        group.argmax_exchange(1, v[1], i[1], vocab=200)  # rank 1's next op is another kind


def test_invalid_id_in_argmax_exchange_sets_the_bit():
    group = EmulatedGroup(2)
    group.argmax_exchange(0, torch.zeros(2), torch.tensor([0, 1]), vocab=10)
    with pytest.raises(P2PError):
        group.argmax_exchange(1, torch.zeros(2), torch.tensor([5, 10]), vocab=10)
    assert group.errors() == [ERR_INVALID_ID, ERR_INVALID_ID]


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    rows=st.integers(1, 9),
    shard=st.integers(1, 12),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    bf16=st.booleans(),
)
def test_shard_argmax_plus_exchange_equals_global_argmax(world, rows, shard, levels, seed, bf16):
    # few distinct values: ties inside a shard and across shards are common
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    shards = [torch.randint(0, levels, (rows, shard), generator=gen).to(dtype) for _ in range(world)]
    group = EmulatedGroup(world)
    outs = []
    for r in range(world):
        v1, idx, v2 = group.shard_argmax(r, shards[r], offset=r * shard, top2=True)
        outs.append(group.argmax_exchange(r, v1, idx, v2, vocab=world * shard))
    g1, gi, g2 = reference_argmax(shards)
    for o1, oi, o2 in outs:
        assert torch.equal(o1, g1) and torch.equal(oi, gi) and torch.equal(o2, g2)
    full = torch.cat(shards, dim=1).float()
    assert torch.equal(gi, torch.tensor([row.tolist().index(row.max().item()) for row in full]))
    if world * shard >= 2:
        assert torch.equal(g2, full.topk(2, dim=1).values[:, 1])


def test_argmax_nan_wins_with_lowest_id_and_minus_inf_rows():
    logits = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [float("-inf")] * 4])
    v1, idx, _ = reference_shard_argmax(logits, offset=10)
    assert torch.isnan(v1[0]) and idx.tolist() == [11, 10] and v1[1].item() == float("-inf")
    # across ranks: a NaN on rank 1 beats a larger number on rank 0
    wv, wi, _ = combine_argmax(
        [torch.tensor([5.0]), torch.tensor([float("nan")])], [torch.tensor([1]), torch.tensor([9])], [None, None]
    )
    assert torch.isnan(wv).all() and wi.tolist() == [9]


def test_op_tags_separate_kinds_dtypes_and_sizes():
    tags = {op_tag(k, c, n) for k in (1, 2) for c in (0, 1) for n in (1, 2, 5120, 5121)}
    assert len(tags) == 16 and 0 not in tags


def test_bad_inputs_name_the_problem():
    group = EmulatedGroup(2)
    with pytest.raises(ValueError, match="dtype"):
        group.all_reduce(0, torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        group.all_reduce(0, torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="rank 2 out of range"):
        group.all_reduce(2, torch.ones(4))
    with pytest.raises(ValueError, match="idx must be"):
        group.argmax_exchange(0, torch.ones(3), torch.ones(3, dtype=torch.int32), vocab=5)
    with pytest.raises(ValueError, match="world_size"):
        EmulatedGroup(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_p2p_group_refuses_clearly_without_cuda():
    with pytest.raises(RuntimeError, match="EmulatedGroup"):
        P2PGroup([0, 1])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed here (the GPU probe builds it there)")
def test_kernels_build_load_and_host_side_abi(tmp_path, monkeypatch):
    # builds the real .so (no GPU needed to compile or dlopen it), checks every bound symbol exists and
    # the host-only entry points: state size arithmetic and the context's argument refusal
    monkeypatch.setenv("DRAFTRELAY_P2P_BUILD", str(tmp_path))
    monkeypatch.setattr(native, "_libs", {})
    lib = native.load("sm_90")
    assert lib.p2p_state_bytes(2, 64, 4096) == 256 + 2048 + 1024 + 256 + 2 * 2 * 64 * 4096
    bases = (ctypes.c_void_p * 2)(0x10000, 0x20000)
    assert lib.p2p_ctx_new(0, 2, 2, 64, 512, 4096, 10**9, bases, None, 0) is None  # rank out of range
    assert lib.p2p_ctx_new(0, 0, 2, 64, 512, 4095, 10**9, bases, None, 0) is None  # region not 16-aligned
    ctx = lib.p2p_ctx_new(0, 1, 2, 64, 512, 4096, 10**9, bases, None, 0)
    assert ctx is not None
    lib.p2p_ctx_free(ctx)
    assert native.build("sm_90") == native.build("sm_90")  # cached by source hash
    # the production build has no unfenced-flag mode: a mode bit it does not implement is refused
    assert lib.p2p_ctx_new(0, 1, 2, 64, 512, 4096, 10**9, bases, None, 32) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed here (the GPU probe builds it there)")
def test_the_unfenced_measurement_build_is_separate_and_accepts_its_mode(tmp_path, monkeypatch):
    # benchmarks/p2p_unfenced.cu includes kernels.cu and adds mode bit 32 (unsafe, only to price the fence):
    # it builds to its own library, which accepts that bit, while the production library refuses it
    from pathlib import Path

    monkeypatch.setenv("DRAFTRELAY_P2P_BUILD", str(tmp_path))
    monkeypatch.setattr(native, "_libs", {})
    unfenced = Path(__file__).resolve().parents[1] / "benchmarks" / "p2p_unfenced.cu"
    assert native.build("sm_90", unfenced) != native.build("sm_90")
    lib = native.load("sm_90", unfenced)
    bases = (ctypes.c_void_p * 2)(0x10000, 0x20000)
    ctx = lib.p2p_ctx_new(0, 1, 2, 64, 512, 4096, 10**9, bases, None, 51)
    assert ctx is not None
    lib.p2p_ctx_free(ctx)
    assert native.load("sm_90").p2p_ctx_new(0, 1, 2, 64, 512, 4096, 10**9, bases, None, 51) is None


def test_kernels_cu_numbers_match_the_python_protocol_and_carry_no_unsafe_mode():
    # the error and mode bits are written twice (kernels.cu, protocol.py): they must agree, and the
    # production file implements exactly the protocol's modes (the unfenced one lives in benchmarks/)
    import re

    from draftrelay.p2p import protocol

    text = native.SOURCE.read_text()
    defines = {m[0]: int(m[1]) for m in re.findall(r"#define ((?:ERR|M)_[A-Z_]+) (\d+)u", text)}
    for name, value in defines.items():
        assert getattr(protocol, name) == value, name
    python_modes = {k for k in dir(protocol) if re.fullmatch(r"M_[A-Z_]+", k)}
    assert {k for k in defines if k.startswith("M_")} == python_modes
    assert {v for k, v in defines.items() if k.startswith("ERR_")} == set(protocol.ERR_NAMES)  # every bit named
    assert "M_FLAG_RELAXED" not in text and "st_relaxed_sys(c.flags" not in text
    assert protocol.DEFAULT_MODE & ~sum(getattr(protocol, k) for k in python_modes) == 0
