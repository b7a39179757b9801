"""Registers and spills of the attention kernels as Triton builds them for a Hopper GPU, on any machine.

A program's registers bound how many programs an SM holds at once (65,536 registers an SM: a 4-warp
program at 255 registers a thread leaves room for two), and so how many key tiles are in flight in a
long context's attention. Each kernel is compiled for sm_90 on the CPU (draftrelay.kernels.offline) at the
0.5B drafter's shapes (7 query heads a kv head, head dim 64) and ptxas reports on it:

    python benchmarks/kernel_registers.py     # writes benchmarks/results/kernel_registers.json

No GPU is used: the figures are the compiler's, not a measurement of time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter (read when Triton is imported)
sys.path.insert(0, str(Path(__file__).parent))

from machine import cpu_name, write_json  # noqa: E402


def variants() -> list[tuple[str, object, int, dict]]:
    """(label, kernel, warps, constexprs) of the attention kernels' launches at the 0.5B's shapes."""
    from draftrelay.kernels import triton_ops as TO
    from draftrelay.worker import fork_triton as FT

    split = dict(REP=7, R_PAD=16, D=64, BLOCK=64, SINGLE=False, IEEE=False, FIXED_TRIPS=0, ROPE=False, PDL=True)
    one = dict(split, BLOCK=256, SINGLE=True, ROPE=True, PREFETCH=True)
    return [("attention, one chunk, RoPE fused (256-key tiles)", TO._attn_kernel, 4, one),
            ("attention, split keys (64-key tiles)", TO._attn_kernel, 4, split),
            ("forked rows, split keys, none shared", FT._fork_attn_kernel, 4, split),
            ("forked rows, shared programs of 8 rows (64 query rows), 4 warps", FT._fork_attn_kernel, 4,
             dict(split, G=8, RG_PAD=64)),
            ("forked rows, shared programs of 8 rows (64 query rows), 8 warps", FT._fork_attn_kernel, 8,
             dict(split, G=8, RG_PAD=64)),
            ("forked rows, shared programs of 4 rows (32 query rows)", FT._fork_attn_kernel, 4,
             dict(split, G=4, RG_PAD=32)),
            ("combine, head dim 64", TO._attn_combine_kernel, 4,
             dict(REP=7, R_PAD=16, D=64, S_BLK=TO.COMBINE_BLOCK[64], PDL=True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="the target's compute capability as one number (90: sm_90)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_registers.json"),
                    help="the JSON written")
    args = ap.parse_args()
    import triton

    from draftrelay.kernels import offline

    rows = []
    for label, fn, warps, c in variants():
        ints = offline.launch_ints(fn)  # specialised as a launch at 32K keys is (aligned, strides divisible by 16)
        r = offline.resources(offline.compile_for(fn, arch=args.arch, num_warps=warps, ints=ints, **c), arch=args.arch)
        per_sm = 65536 // (max(r["registers"], 1) * 32 * warps)
        rows.append({"kernel": fn.__name__, "label": label, "warps": warps, "constexprs": c, "ints": ints, **r,
                     "programs_an_sm_by_registers": per_sm})
        print(f"{label:68s} {r['registers']:3d} registers, spills {r['spill_stores']}/{r['spill_loads']} B, "
              f"{per_sm} programs an SM")
    write_json(args.out, {"benchmark": "kernel_registers", "arch": f"sm_{args.arch}", "triton": triton.__version__,
                          "cpu": cpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
