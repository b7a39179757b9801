"""A Triton kernel compiled for a GPU target on a machine without that GPU (or any): Triton's compiler runs
to the cubin on the CPU. Two uses: a check that a kernel compiles at all for each specialisation that
matters (the interpreter runs a kernel as Python, so a name bound only in a branch the compiler also builds
passes there and fails only on the GPU: tests/test_kernel_compile.py), and ptxas' resource report of the
kernel as built (registers, spills: benchmarks/kernel_registers.py), which bounds how many programs an SM
holds. Imports Triton; the caller sees to TRITON_INTERPRET being unset before Triton is first imported."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

# the kernels' pointer arguments by element type (the rest bf16: activations, weights, logits, caches; the
# skinny GEMM's split partials `ws_ptr` and an int8 weight's row scales `s_ptr` are fp32, its counts `cnt_ptr`
# int32; compile_for's `types` names others, e.g. an int8 weight's "*i8"); `scale` (the attention's)
# and `eps` (the norm's) are the float scalars
FP32_PTRS = frozenset({"acc_ptr", "ml_ptr", "inv_ptr", "pm_ptr", "ps_ptr", "tv_ptr", "ws_ptr", "s_ptr"})
INT32_PTRS = frozenset({"pi_ptr", "ti_ptr", "cnt_ptr"})
FP32_SCALARS = frozenset({"scale", "eps"})
INT64_PTRS = frozenset({"rows_ptr", "start_ptr", "parent_ptr", "pivot_ptr"})


def signature(fn) -> dict[str, str]:
    """Triton's signature of a jit function of this package: constexprs as such, pointers by their names,
    `scale` and `eps` fp32, every other scalar i32."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = ("*fp32" if p.name in FP32_PTRS else "*i32" if p.name in INT32_PTRS
                           else "*i64" if p.name in INT64_PTRS else "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in FP32_SCALARS else "i32"
    return sig


def launch_ints(fn, kv_len: int = 32768, head_dim: int = 64, n_kv: int = 2) -> dict[str, int]:
    """Representative values of an attention kernel's integer arguments at the 0.5B drafter's shapes (a cache
    of [rows, n_kv, kv_len, head_dim], one token a row, 14 query heads, 1,024-key chunks; the forked rows with
    shared reads: one own program a row, four requests' 32 rows): what `compile_for` specialises as a launch
    would. Arguments it has no rule for are left out (no specialisation)."""
    pos = head_dim  # the caches' position stride: one head vector
    rule = {"T": 1, "H": 7 * n_kv, "chunk": 1024, "chunk_s": 1024, "n_split": 33, "n_own": 1, "B": 32}
    for kind in ("c", "v", "p", "q"):  # the cache's keys and values, the parent's keys and values (s_q*)
        rule.update({f"s_{kind}row": n_kv * kv_len * pos, f"s_{kind}head": kv_len * pos, f"s_{kind}pos": pos})
    return {p.name: rule[p.name] for p in fn.params if not p.is_constexpr and p.name in rule}


def compile_for(fn, arch: int = 90, num_warps: int = 4, num_stages: int = 2, ints: dict[str, int] | None = None,
                types: dict[str, str] | None = None, **constexprs):
    """fn compiled for sm_<arch> with these constexprs (every one without a default must be given:
    ValueError naming those missing; the others take their defaults), specialised as Triton's launcher
    specialises a launch: every pointer
    16-byte aligned (torch's allocations are), and each integer argument named in `ints` by its value there:
    1 a constant, a multiple of 16 marked divisible by 16. Without those marks the compiler knows nothing of
    the loads' alignment: it neither vectorises them nor pipelines the loops through shared memory, and the
    registers and spills ptxas reports are not those of the kernel a GPU runs (an attention kernel at
    64-key tiles: 197 registers unmarked, 64 as launched). types: arguments' Triton types in place of
    `signature`'s (e.g. {"w_ptr": "*i8"}: the skinny GEMM on an int8 weight)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = sorted(p.name for p in fn.params if p.is_constexpr and not p.has_default and p.name not in constexprs)
    if missing:
        raise ValueError(f"compile_for({fn.__name__}): constexprs without a value: {', '.join(missing)}")
    sig = signature(fn)
    bad = sorted(set(types or {}) - set(sig))
    if bad:
        raise ValueError(f"compile_for({fn.__name__}): no such arguments: {', '.join(bad)}")
    sig.update(types or {})
    ints = dict(ints or {})
    unknown = sorted(set(ints) - {n for n, t in sig.items() if t == "i32"})
    if unknown:
        raise ValueError(f"compile_for({fn.__name__}): not integer arguments: {', '.join(unknown)}")
    names = [p.name for p in fn.params]
    # a constexpr left out takes its default, as a launch's does (Triton's source object alone would leave it None)
    consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    attrs = {}
    for i, name in enumerate(names):
        if sig[name].startswith("*") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints.get(name) == 1:
            sig[name], consts[name] = "constexpr", 1
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(kernel, arch: int = 90) -> dict[str, int]:
    """ptxas' report on a compiled kernel's PTX (Triton's own ptxas, the newest it ships): registers a thread
    and spill stores / loads in bytes. RuntimeError with ptxas' message where it fails."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")
                  if os.path.exists(os.path.join(bindir, n))), "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if r.returncode != 0 or regs is None or spill is None:
        raise RuntimeError(f"ptxas on {kernel.name}: {text.strip()[-500:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2))}
