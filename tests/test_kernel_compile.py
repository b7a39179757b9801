"""The attention kernels compile for a Hopper GPU (sm_90) on a machine without one: Triton's compiler runs
to the cubin on the CPU. The interpreter tests (test_fast_forward.py, test_fork.py) check what the kernels
compute, but the interpreter runs a kernel as Python: a name bound only in a branch the compiler also
builds, or a shape the compiler refuses, passes there and fails only on the GPU."""

from __future__ import annotations

from conftest import run_interpreted

COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter (read at import)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from draftrelay.kernels import triton_ops as TO
from draftrelay.worker import fork_triton as FT

FP32 = {"acc_ptr", "ml_ptr", "inv_ptr"}
INT64 = {"rows_ptr", "start_ptr", "parent_ptr", "pivot_ptr"}


def build(fn, **constexprs):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*fp32" if p.name in FP32 else "*i64" if p.name in INT64 else "*bf16"
        else:
            sig[p.name] = "fp32" if p.name == "scale" else "i32"
    names = [p.name for p in fn.params]
    missing = {p.name for p in fn.params if p.is_constexpr and not p.has_default} - set(constexprs)
    assert not missing, missing
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


n = 0
attn = dict(REP=7, R_PAD=16, D=64, BLOCK=64, SINGLE=False, IEEE=False, FIXED_TRIPS=0, ROPE=False, PDL=True)
one = dict(attn, BLOCK=256, SINGLE=True, ROPE=True, PREFETCH=True)  # one chunk, RoPE fused, the prefetch
for c in (attn, one):
    build(TO._attn_kernel, **c)
    n += 1
for c in (attn, one, dict(attn, G=8, RG_PAD=64), dict(attn, G=4, RG_PAD=64, PDL=False)):
    build(FT._fork_attn_kernel, **c)  # G: the split keys shared by a parent's rows
    n += 1
for D in (64, 128):
    build(TO._attn_combine_kernel, REP=7, R_PAD=16, D=D, S_BLK=TO.COMBINE_BLOCK[D], PDL=True)
    n += 1
print("compiled", n)
'''


def test_attention_kernels_compile_for_sm90():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = run_interpreted(pathlib.Path(d), COMPILE)
    assert "compiled 8" in out, out[-3000:]
