"""Forked rows (worker/fork.py): a scratch row that reads its parent's KV below a pivot computes what a
row holding a copy of that KV computes, and never writes the parent."""

from __future__ import annotations

import pytest
import torch

from conftest import run_interpreted
from draftrelay import model as M
from draftrelay.kernels import reference as R
from draftrelay.worker import fork


def _copy_below(ck, rows, pk, parent, pivot):
    """The cache a full-context copy would give: row rows[b] of ck with parent[b]'s keys below pivot[b]."""
    out = ck.clone()
    for b in range(len(rows)):
        p = int(pivot[b])
        out[int(rows[b]), :, :p] = pk[int(parent[b]), :, :p]
    return out


def test_fork_attention_is_attention_over_a_copied_row():
    g = torch.Generator().manual_seed(3)
    B, T, H, HK, D, kv = 3, 2, 4, 2, 16, 96
    q = torch.randn(B, T, H, D, generator=g)
    ck, cv = torch.randn(5, HK, kv + 4, D, generator=g), torch.randn(5, HK, kv + 4, D, generator=g)
    pk, pv = torch.randn(4, HK, kv + 4, D, generator=g), torch.randn(4, HK, kv + 4, D, generator=g)
    rows, parent = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 1])
    start, pivot = torch.tensor([70, 5, 0]), torch.tensor([70, 3, 0])  # pivot at start, below it, nothing shared
    got = fork.fork_attention_reference(q, ck, cv, rows, start, kv, pk, pv, parent, pivot)
    want = R.decode_attention(q, _copy_below(ck, rows, pk, parent, pivot), _copy_below(cv, rows, pv, parent, pivot),
                              rows, start, kv)
    assert torch.equal(got, want)
    # the parent's keys at and above the pivot are not read: changing them changes nothing
    pk2 = pk.clone()
    pk2[1, :, 70:] += 5.0
    pk2[3, :, 3:] -= 7.0
    assert torch.equal(fork.fork_attention_reference(q, ck, cv, rows, start, kv, pk2, pv, parent, pivot), got)


def test_fork_rope_setting_names_a_bad_value(monkeypatch):
    from draftrelay import SettingError

    g = torch.Generator().manual_seed(4)
    ck, cv = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    pk, pv = ck.clone() + 1, cv.clone() - 1
    kern = fork.ForkKernels(R, pk, pv, torch.tensor([0]), torch.tensor([5]))
    qkv = torch.randn(1, 1, 8 * 16, generator=g)
    inv = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
    args = (qkv, torch.tensor([9]), inv, 4, 2, ck, cv, torch.tensor([1]), 32)
    for mode in fork.FORK_ROPE_MODES:  # on a CPU both are RoPE + write, then the forked attention
        monkeypatch.setattr(fork, "FORK_ROPE", mode)
        ck2, cv2 = ck.clone(), cv.clone()
        q = R.rope_kv_write(qkv, args[1], inv, 4, 2, ck2, cv2, args[7])
        want = fork.fork_attention_reference(q, ck2, cv2, args[7], args[1], 32, pk, pv, kern._parent, kern._pivot)
        assert torch.equal(kern.rope_attention(*args), want)
    monkeypatch.setattr(fork, "FORK_ROPE", "fuse")
    with pytest.raises(SettingError, match="DRAFTRELAY_FORK_ROPE='fuse': expected one of split, fused"):
        kern.rope_attention(*args)


@pytest.mark.parametrize("int8", [False, True])
def test_fork_forward_equals_the_forward_over_a_copied_row(int8):
    """int8: the layers' int8 copies (int8_layers.py), which the forked rows read as the forward does."""
    torch.manual_seed(0)
    _, net = M.tiny_pair(M.TINY_SEED)
    net.fast = True  # the fast forward's structure (reference kernels on a CPU), what fork_forward runs
    if int8:
        from draftrelay.int8_layers import quantize_layers

        net.int8_layers = quantize_layers(net)
    parent_cache = net.new_cache(3, 64)
    ctx = torch.randint(0, net.cfg.vocab_size, (2, 20))
    net(ctx, torch.tensor([0, 0]), parent_cache, torch.tensor([0, 2]))
    before_k, before_v = parent_cache.k.clone(), parent_cache.v.clone()
    scratch = net.new_cache(4, 64)
    copied = net.new_cache(4, 64)
    rows, parent = torch.tensor([3, 1]), torch.tensor([0, 2])
    pivot = torch.tensor([17, 20])
    toks = torch.randint(0, net.cfg.vocab_size, (2, 2))
    for b in range(2):
        copied.k[:, int(rows[b]), :, :int(pivot[b])] = parent_cache.k[:, int(parent[b]), :, :int(pivot[b])]
        copied.v[:, int(rows[b]), :, :int(pivot[b])] = parent_cache.v[:, int(parent[b]), :, :int(pivot[b])]
    with torch.inference_mode():
        got = fork.fork_forward(net, toks, pivot, scratch, rows, parent_cache, parent, pivot, 32)
        want = net(toks, pivot, copied, rows, kv_len=32)
    assert torch.equal(got, want)
    assert torch.equal(parent_cache.k, before_k) and torch.equal(parent_cache.v, before_v)  # only read
    assert not scratch.k[:, :, :, :17].any()  # nothing below a pivot was written into the forked rows
    with pytest.raises(ValueError, match="exceed the fast attention"):
        fork.fork_forward(net, torch.zeros(1, 64, dtype=torch.long), torch.tensor([0]), scratch, torch.tensor([0]),
                          parent_cache, torch.tensor([0]), torch.tensor([0]), 64)


INTERPRETED = r'''
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from draftrelay.kernels import reference as R
from draftrelay.kernels import triton_ops as TO
from draftrelay.worker import fork, fork_triton as FT
g = torch.Generator().manual_seed(int(sys.argv[1]))
n = 0
made = []  # the partials each launch allocates: once, sized for every program that stores one
_partials = TO.partials
TO.partials = lambda n_parts, *a: made.append(n_parts) or _partials(n_parts, *a)
# one program per (row, kv head) and, at 2048 keys, a split over chunks with the combine kernel
for B, Tq, kv, starts, pivots in ((2, 1, 256, [100, 3], [60, 3]), (3, 2, 512, [400, 10, 0], [400, 0, 0]),
                                  (1, 5, 2048, [1500], [1200])):
    q = torch.randn(B, Tq, 4, 16, generator=g)
    ck, cv = torch.randn(B + 1, 2, kv + 8, 16, generator=g), torch.randn(B + 1, 2, kv + 8, 16, generator=g)
    pk, pv = torch.randn(5, 2, kv + 8, 16, generator=g), torch.randn(5, 2, kv + 8, 16, generator=g)
    rows, st = torch.arange(B, 0, -1), torch.tensor(starts)
    parent, pivot = torch.arange(B) % 5 + 1, torch.tensor(pivots)
    made.clear()
    torch.testing.assert_close(FT.fork_attention(q, ck, cv, rows, st, kv, pk, pv, parent, pivot),
                               fork.fork_attention_reference(q, ck, cv, rows, st, kv, pk, pv, parent, pivot),
                               atol=1e-5, rtol=1e-5)
    assert len(made) == (kv > 1024), made
    zero = torch.zeros(B, dtype=torch.long)  # pivot 0: the plain attention over the row itself
    torch.testing.assert_close(FT.fork_attention(q, ck, cv, rows, st, kv, pk, pv, parent, zero),
                               R.decode_attention(q, ck, cv, rows, st, kv), atol=1e-5, rtol=1e-5)
    n += 1
# split keys: a parent's rows in a block of G rows read its keys below their lowest pivot once (the shared
# programs), each row only its keys from there on; groups of consecutive rows, rows of one parent apart, a
# parent's rows over two blocks (T = 4: G = 8 of the ten rows) and a row alone
for Tq, starts, pivots, parent in ((1, [1500, 1502, 1501, 1505, 900, 903], [1500, 1499, 1501, 1502, 900, 890],
                                    [1, 1, 1, 1, 2, 2]),
                                   (1, [1300, 1700, 1301, 1900, 40], [1300, 1690, 1299, 1900, 0], [3, 2, 3, 4, 2]),
                                   (4, [1100 + 7 * i for i in range(10)], [1100 + 5 * i for i in range(10)], [1] * 10)):
    B, kv = len(starts), 2048
    q = torch.randn(B, Tq, 4, 16, generator=g)
    ck, cv = torch.randn(B + 1, 2, kv + 8, 16, generator=g), torch.randn(B + 1, 2, kv + 8, 16, generator=g)
    pk, pv = torch.randn(5, 2, kv + 8, 16, generator=g), torch.randn(5, 2, kv + 8, 16, generator=g)
    rows, st, par, piv = torch.arange(B, 0, -1), torch.tensor(starts), torch.tensor(parent), torch.tensor(pivots)
    assert FT.group_rows(B, 2, Tq, False) == 8
    TO.SPLIT_TILE[16, 16] = (32, 4) if Tq == 1 else (64, 4)  # the shared programs' tile is the split's
    made.clear()
    torch.testing.assert_close(FT.fork_attention(q, ck, cv, rows, st, kv, pk, pv, par, piv),
                               fork.fork_attention_reference(q, ck, cv, rows, st, kv, pk, pv, par, piv),
                               atol=1e-5, rtol=1e-5)
    assert len(made) == 1 and made[0] > B * 2, made  # one allocation: the rows' own parts and the shared ones
    n += 1
TO.SPLIT_TILE.clear()
# the 0.5B's 7 query heads a kv head: 8 rows at one token, 4 at two, none where one row fills a program
# (5 tokens: 35 query rows), where there is one row, or one chunk of keys
assert [FT.group_rows(32, 7, t, False) for t in (1, 2, 5)] == [8, 4, 0]
assert FT.group_rows(1, 7, 1, False) == FT.group_rows(32, 7, 1, True) == 0 and FT.group_rows(3, 7, 1, False) == 4
# one token per row, one chunk: RoPE, the K/V write into the forked row and its attention in one launch
inv = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
for B, kv, starts, pivots in ((3, 256, [100, 3, 0], [60, 3, 0]), (2, 1024, [1000, 700], [990, 0])):
    qkv = torch.randn(B, 1, 8 * 16, generator=g)  # 4 q heads, 2 kv heads
    ck, cv = torch.randn(B + 1, 2, kv + 8, 16, generator=g), torch.randn(B + 1, 2, kv + 8, 16, generator=g)
    pk, pv = torch.randn(5, 2, kv + 8, 16, generator=g), torch.randn(5, 2, kv + 8, 16, generator=g)
    rows, st = torch.arange(B, 0, -1), torch.tensor(starts)
    parent, pivot = torch.arange(B) % 5 + 1, torch.tensor(pivots)
    ck2, cv2 = ck.clone(), cv.clone()
    got = FT.fork_attention(qkv, ck, cv, rows, st, kv, pk, pv, parent, pivot, (inv, 4, 2))
    q = R.rope_kv_write(qkv, st, inv, 4, 2, ck2, cv2, rows)
    want = fork.fork_attention_reference(q, ck2, cv2, rows, st, kv, pk, pv, parent, pivot)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ck, ck2, atol=1e-6, rtol=1e-6)  # the rotated new keys, at their positions
    assert torch.equal(cv, cv2)
    n += 1
try:
    FT.fork_attention(qkv[:, :1].expand(B, 2, -1).contiguous(), ck, cv, rows, st, kv, pk, pv, parent, pivot,
                      (inv, 4, 2))
except ValueError as e:
    assert "T=2" in str(e), e
else:
    raise AssertionError("two tokens per row taken by the fused RoPE")
print("checked", n)
'''


def test_fork_kernel_under_the_interpreter_equals_its_definition(tmp_path):
    """The CUDA kernel run by Triton's interpreter in fp32 (bf16 runs on the GPU)."""
    out = run_interpreted(tmp_path, INTERPRETED)
    assert "checked 8" in out, out[-3000:]


def test_lean_fork_forward_equals_the_forward_over_a_copied_row():
    """LeanFork (the CPU's forked forward in the lean loop's ops): rows sharing a parent read it in place,
    rows in runs and out of order, a pivot of 0 (nothing shared): the logits of a forward over rows that
    hold a copy of the parent's KV (fp32, up to the order of sums), the parent never written, its keys at
    and above the pivot never read, nothing below a pivot written into the forked rows."""
    from draftrelay.worker import lean

    torch.manual_seed(0)
    _, net = M.tiny_pair(M.TINY_SEED)
    parent_cache = net.new_cache(3, 64)
    ctx = torch.randint(0, net.cfg.vocab_size, (2, 24))
    net(ctx, torch.tensor([0, 0]), parent_cache, torch.tensor([0, 2]))
    before_k = parent_cache.k.clone()
    rows, parent, pivot = [3, 4, 1, 6, 0], [0, 0, 2, 2, 0], [17, 19, 20, 21, 0]
    T = 2
    toks = torch.randint(0, net.cfg.vocab_size, (5, T))
    start = torch.tensor(pivot)
    # a row must not read its parent at or above its own pivot, even where a sibling with a higher pivot
    # reads it: changed values there reach only the rows whose copies hold them
    parent_cache.k[:, 0, :, 17:] += 3.0
    parent_cache.v[:, 2, :, 20:] -= 5.0
    poisoned_k, poisoned_v = parent_cache.k.clone(), parent_cache.v.clone()
    copied = net.new_cache(7, 64)
    for b in range(5):
        copied.k[:, rows[b], :, :pivot[b]] = parent_cache.k[:, parent[b], :, :pivot[b]]
        copied.v[:, rows[b], :, :pivot[b]] = parent_cache.v[:, parent[b], :, :pivot[b]]
    scratch = net.new_cache(7, 64)
    lf = fork.LeanFork(lean.LeanSteps(net, parent_cache), scratch, parent_cache)
    with torch.inference_mode():
        pos = start[:, None] + torch.arange(T)[None, :]
        got = lf.forward(toks, pos, lf.plan(rows, parent, pivot, T))
        want = net(toks, start, copied, torch.tensor(rows), kv_len=32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))
        # one more token per row (the branch run's steps), picked logits
        nxt = got[:, -1].argmax(-1)[:, None]
        got2 = lf.forward(nxt, pos[:, -1:] + 1, lf.plan(rows, parent, pivot), pick=torch.zeros(5, dtype=torch.long))
        copied.lengths[torch.tensor(rows)] = start + T
        want2 = net(nxt, start + T, copied, torch.tensor(rows), kv_len=32)[:, 0]
        torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
    assert torch.equal(parent_cache.k, poisoned_k) and torch.equal(parent_cache.v, poisoned_v)
    assert not torch.equal(poisoned_k, before_k)
    for b in range(5):  # the forked rows hold only their own positions
        assert not scratch.k[:, rows[b], :, :pivot[b]].any()
        assert scratch.k[:, rows[b], :, pivot[b]:pivot[b] + T + 1].abs().sum() > 0
    # compact rows (the lean loop's scratch, ForkSteps.scratch): position p at slot p - pivot, rows as long
    # as a branch's own positions; the same logits, the same K/V at the shifted slots
    compact = net.new_cache(7, T + 1)
    cf = fork.LeanFork(lean.LeanSteps(net, parent_cache), compact, parent_cache, compact=True)
    with torch.inference_mode():
        torch.testing.assert_close(cf.forward(toks, pos, cf.plan(rows, parent, pivot, T)), got, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cf.forward(nxt, pos[:, -1:] + 1, cf.plan(rows, parent, pivot),
                                              pick=torch.zeros(5, dtype=torch.long)), got2, rtol=1e-5, atol=1e-5)
        for b in range(5):
            torch.testing.assert_close(compact.k[:, rows[b]], scratch.k[:, rows[b], :, pivot[b]:pivot[b] + T + 1])
        with pytest.raises(ValueError, match="outside the forked rows' 3 slots"):  # never past a row's slots
            cf.forward(nxt, pos[:, -1:] + 2, cf.plan(rows, parent, pivot))
