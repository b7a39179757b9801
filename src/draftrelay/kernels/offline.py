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

# the kernels' pointer arguments by element type (the rest bf16: activations, weights, logits, caches);
# `scale` is the one float scalar
FP32_PTRS = frozenset({"acc_ptr", "ml_ptr", "inv_ptr", "pm_ptr", "ps_ptr", "tv_ptr"})
INT32_PTRS = frozenset({"pi_ptr", "ti_ptr"})
INT64_PTRS = frozenset({"rows_ptr", "start_ptr", "parent_ptr", "pivot_ptr"})


def signature(fn) -> dict[str, str]:
    """Triton's signature of a jit function of this package: constexprs as such, pointers by their names,
    `scale` fp32, every other scalar i32."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = ("*fp32" if p.name in FP32_PTRS else "*i32" if p.name in INT32_PTRS
                           else "*i64" if p.name in INT64_PTRS else "*bf16")
        else:
            sig[p.name] = "fp32" if p.name == "scale" else "i32"
    return sig


def compile_for(fn, arch: int = 90, num_warps: int = 4, num_stages: int = 2, **constexprs):
    """fn compiled for sm_<arch> with these constexprs (every one without a default must be given:
    ValueError naming those missing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = sorted(p.name for p in fn.params if p.is_constexpr and not p.has_default and p.name not in constexprs)
    if missing:
        raise ValueError(f"compile_for({fn.__name__}): constexprs without a value: {', '.join(missing)}")
    names = [p.name for p in fn.params]
    src = ASTSource(fn, signature(fn), constexprs={(names.index(k),): v for k, v in constexprs.items()})
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
