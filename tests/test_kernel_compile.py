"""The attention kernels (the logits' first passes, the skinny GEMM's pipelined dot tiles) compile for a Hopper
GPU (sm_90) on a machine without one (draftrelay.kernels.offline: Triton's compiler runs to the cubin on the
CPU). The interpreter tests (test_fast_forward.py, test_fork.py) check what the kernels compute, but the
interpreter runs a kernel as Python: a name bound only in a branch the compiler also builds, or a shape the
compiler refuses, passes there and fails only on the GPU."""

from __future__ import annotations

from conftest import run_interpreted

COMPILE = r'''
from draftrelay.kernels import offline
from draftrelay.kernels import triton_ops as TO
from draftrelay.worker import fork_triton as FT

n = 0
FORK_INTS = offline.launch_ints(FT._fork_attn_kernel)  # specialised as a launch at 32K (pipelined loops)
attn = dict(REP=7, R_PAD=16, D=64, BLOCK=64, SINGLE=False, IEEE=False, FIXED_TRIPS=0, ROPE=False, PDL=True)
one = dict(attn, BLOCK=256, SINGLE=True, ROPE=True, PREFETCH=True)  # one chunk, RoPE fused, the prefetch
for c in (attn, one):
    offline.compile_for(TO._attn_kernel, ints=offline.launch_ints(TO._attn_kernel), **c)
    n += 1
for c in (attn, one, dict(attn, G=8, RG_PAD=64), dict(attn, G=4, RG_PAD=64, PDL=False)):
    offline.compile_for(FT._fork_attn_kernel, ints=FORK_INTS, **c)  # G: the split keys shared by a parent's rows
    n += 1
for blk, warps in ((32, 8), (128, 8)):  # attention_tiles.py's candidates (triton_ops.SPLIT_TILE) where rows share
    offline.compile_for(FT._fork_attn_kernel, num_warps=warps, ints=FORK_INTS, **dict(attn, BLOCK=blk, G=8, RG_PAD=64))
    n += 1
offline.compile_for(TO._pick_part_kernel, CHUNK=TO.PICK_CHUNK, PDL=True, num_warps=8)  # the logits' first passes
offline.compile_for(TO._top_part_kernel, M=8, CHUNK=TO.TOP_CHUNK, PDL=True, num_warps=8)
n += 2
for D in (64, 128):
    k = offline.compile_for(TO._attn_combine_kernel, ints=offline.launch_ints(TO._attn_combine_kernel), REP=7,
                            R_PAD=16, D=D, S_BLK=TO.COMBINE_BLOCK[D], PDL=True)
    n += 1
r = offline.resources(k)
assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0, r
try:
    offline.compile_for(TO._attn_combine_kernel, REP=7, R_PAD=16, D=64, PDL=True)
except ValueError as e:
    assert "S_BLK" in str(e), e
else:
    raise AssertionError("a constexpr without a value was not named")
try:
    offline.compile_for(TO._attn_combine_kernel, ints={"D": 64}, REP=7, R_PAD=16, D=64, S_BLK=64, PDL=True)
except ValueError as e:
    assert "not integer arguments: D" in str(e), e
else:
    raise AssertionError("a constexpr given as an integer argument was not named")
split = offline.compile_for(TO._attn_kernel, ints=offline.launch_ints(TO._attn_kernel), **attn)
assert "cp.async" in split.asm["ptx"], "the split attention's key loop is not pipelined as launched"
# the skinny GEMM's pipelined dot tile at the 7B's eight-row o_proj: rows first it runs mma.sync, swapped
# (the weight tile the dot's first operand) the warp-group dot, both with the weight loads pipelined
from draftrelay.kernels import plan as P
run = dict(IEEE=False, FIXED_TRIPS=0, PDL=True)  # what the launch adds to plan.launch's constexprs
for swap in (False, True):
    ks, _, skinny = P.launch(P.PRO_NONE, P.SkinnyConfig(64, 128, True, 4, 4, swap=swap), 8, 3584, False, False)
    ptx = offline.compile_for(TO._skinny_kernel, num_stages=4, ints=dict(N=3584, K=3584, KS=ks), **run,
                              **skinny).asm["ptx"]
    assert "cp.async" in ptx and ("wgmma.mma_async" in ptx) == swap and ("mma.sync" in ptx) != swap, swap
    n += 1
# the multiply-and-sum tile over one tile of K (the 0.5B's one-row o_proj, sum16x1024w8): launched with
# K_UNROLL 1 (plan.k_unroll) its weight tile is loaded before the PDL wait, as a one-trip loop's is not
cfg = P.SkinnyConfig(16, 1024, False, 8, 1)
ks, _, one = P.launch(P.PRO_NONE, cfg, 1, 896, False, False)
assert one["K_UNROLL"] == 1, one
for k_unroll in (0, 1):
    ptx = offline.compile_for(TO._skinny_kernel, num_warps=8, num_stages=1, ints=dict(N=896, K=896, KS=ks), **run,
                              **dict(one, K_UNROLL=k_unroll)).asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == bool(k_unroll), k_unroll
    n += 1
assert P.k_unroll(P.PRO_NONE, cfg, 1024) == 1 and P.k_unroll(P.PRO_SILU, cfg, 1024) == 1
assert P.k_unroll(P.PRO_NORM, cfg, 1024) == 0 and P.k_unroll(P.PRO_NONE, cfg, 2048) == 0  # the norm's; a loop
# the gate|up products storing SiLU * up (norm_mlp), as the H100 seed chose them: the 7B's eight-row swapped
# tile at 3 stages (its norm a launch before: the plain tile), the 7B's and 0.5B's one-row norm tiles (two and
# four columns a program). The swapped tile keeps its pipelined warp-group dot; nothing spills
for pro, cfg, M, N, K in ((P.PRO_NONE, P.SkinnyConfig(64, 128, True, 4, 3, swap=True), 8, 37888, 3584),
                          (P.PRO_NORM, P.SkinnyConfig(2, 4096, False, 4, 1), 1, 37888, 3584),
                          (P.PRO_NORM, P.SkinnyConfig(4, 1024, False, 4, 1), 1, 9728, 896)):
    ks, _, c = P.launch(pro, cfg, M, K, pro == P.PRO_NORM, False, silu_out=True)
    assert c["SILU_OUT"], c
    k = offline.compile_for(TO._skinny_kernel, num_warps=cfg.warps, num_stages=cfg.stages,
                            ints=dict(N=N, K=K, KS=ks, M=M), **run, **c)
    r = offline.resources(k)
    assert r["spill_stores"] == 0, (cfg, r)
    assert not cfg.swap or ("wgmma.mma_async" in k.asm["ptx"] and "cp.async" in k.asm["ptx"]), cfg
    n += 1
# the int8 head's tiles (int8_head.py: W_SCALE, the weight int8), as the 0.5B's one-row head runs them: the
# norm's whole-row tile and the plain one over one tile of K; each loads its weight tile before the PDL wait
# and spills nothing
for pro, cfg in ((P.PRO_NORM, P.SkinnyConfig(4, 1024, False, 4, 1)),
                 (P.PRO_NONE, P.SkinnyConfig(4, 1024, False, 4, 2))):
    ks, _, c = P.launch(pro, cfg, 1, 896, pro == P.PRO_NORM, False, w_scale=True)
    assert c["W_SCALE"], c
    k = offline.compile_for(TO._skinny_kernel, num_warps=cfg.warps, num_stages=cfg.stages, types={"w_ptr": "*i8"},
                            ints=dict(N=151936, K=896, KS=ks, M=1), **run, **c)
    ptx = k.asm["ptx"]
    assert "ld.global" in ptx[:ptx.index("griddepcontrol.wait")], pro
    assert offline.resources(k)["spill_stores"] == 0, (cfg, offline.resources(k))
    n += 1
# and at four rows, where the 0.5B's head takes a looped dot (the norm its own launch first): the int8 tile
# converted to bf16 before the dot, the swapped tile's still Hopper's warp-group dot, nothing spilled
for cfg in (P.SkinnyConfig(64, 128, True, 4, 4, swap=True), P.SkinnyConfig(64, 128, True, 4, 4)):
    ks, _, c = P.launch(P.kernel_pro(P.PRO_NORM, cfg, 896), cfg, 4, 896, False, False, w_scale=True)
    assert c["W_SCALE"] and c["PRO"] == P.PRO_NONE, c
    k = offline.compile_for(TO._skinny_kernel, num_warps=cfg.warps, num_stages=cfg.stages, types={"w_ptr": "*i8"},
                            ints=dict(N=151936, K=896, KS=ks, M=4), **run, **c)
    ptx = k.asm["ptx"]
    assert ("wgmma.mma_async" if cfg.swap else "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16") in ptx, cfg
    assert offline.resources(k)["spill_stores"] == 0, (cfg, offline.resources(k))
    n += 1
# the int8 layers' products (int8_layers.py, worker --quant int8) on the tiles the H100 seed chose for their bf16
# keys, W_SCALE on: q|k|v with its bias, gate|up storing SiLU * up of the scaled columns, down; nothing spills
for pro, M, N, K, bias, silu, label in ((P.PRO_NORM, 1, 1152, 896, True, False, "sum16x1024w8s1"),
                                        (P.PRO_NORM, 4, 1152, 896, True, False, "dot32x1024w8s1"),
                                        (P.PRO_NORM, 1, 9728, 896, False, True, "sum4x1024w4s1"),
                                        (P.PRO_NORM, 4, 9728, 896, False, True, "dot64x128w4s4sw"),
                                        (P.PRO_NONE, 1, 896, 4864, False, False, "sum4x4096w8s1uk2"),
                                        (P.PRO_NONE, 4, 896, 4864, False, False, "dot64x256w4s1uk19")):
    cfg = next(c for c in P.bucket_candidates(pro, M, N, K, P.INT8) if c.label() == label)
    kpro = P.kernel_pro(pro, cfg, K)
    ks, _, c = P.launch(kpro, cfg, M, K, kpro == P.PRO_NORM, bias, silu_out=silu, w_scale=True)
    k = offline.compile_for(TO._skinny_kernel, num_warps=cfg.warps, num_stages=cfg.stages, types={"w_ptr": "*i8"},
                            ints=dict(N=N, K=K, KS=ks, M=M), **run, **c)
    assert c["W_SCALE"] and c["SILU_OUT"] == silu and c["HAS_BIAS"] == bias, c
    assert offline.resources(k)["spill_stores"] == 0, (label, offline.resources(k))
    n += 1
try:
    offline.compile_for(TO._skinny_kernel, types={"v_ptr": "*i8"}, **run, **c)
except ValueError as e:
    assert "no such arguments: v_ptr" in str(e), e
else:
    raise AssertionError("a type for an argument the kernel lacks was not named")

print("compiled", n)
'''


def test_attention_kernels_compile_for_sm90(tmp_path):
    out = run_interpreted(tmp_path, COMPILE, interpret=False)
    assert "compiled 29" in out, out[-3000:]
