"""Registers and spills of the attention kernels (and of the skinny GEMM's pipelined dot tiles) as Triton
builds them for a Hopper GPU, on any machine.

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


def skinny_variants() -> list[tuple[str, object, int, int, int, int]]:
    """(label, plan configuration, rows, N, K, prologue) of the skinny GEMM's pipelined dot tiles at the
    7B verify's eight-row bucket (o_proj, down) and the 0.5B's four-row gate|up: the candidates' whole-K
    tile of 64 columns, its swapped form (the weight tile the dot's first operand; at 3 stages and over two K
    ranges too, and the 7B gate|up's at 4 and 3 stages) and split tiles, beside
    the rows-first tiles of 32 columns and over K ranges of ~1,024 (measured on an H100 and not kept as
    candidates: docs/FAST_FORWARD.md)."""
    from draftrelay.kernels import plan as P

    S = P.SkinnyConfig
    out = []
    for name, N, K in (("7B o_proj", 3584, 3584), ("7B down", 3584, 18944)):
        r = -(-K // 1024)
        out += [(f"{name}, 8 rows", c, 8, N, K, P.PRO_NONE)
                for c in (S(64, 128, True, 4, 4), S(64, 128, True, 4, 4, swap=True), S(64, 128, True, 4, 4, False, r),
                          S(64, 128, True, 4, 4, False, r, swap=True), S(32, 128, True, 4, 4, False, r),
                          S(16, 128, True, 4, 3, False, r), S(32, 128, True, 4, 3, False, -(-K // 2048)),
                          S(64, 128, True, 4, 3, swap=True), S(64, 128, True, 4, 4, False, 2, swap=True))]
    out += [("7B gate|up after its norm, 8 rows", c, 8, 37888, 3584, P.PRO_NONE)
            for c in (S(64, 128, True, 4, 4, swap=True), S(64, 128, True, 4, 3, swap=True))]
    out += [("0.5B gate|up after its norm, 4 rows", c, 4, 9728, 896, P.PRO_NONE)
            for c in (S(64, 128, True, 4, 4), S(64, 128, True, 4, 4, swap=True), S(32, 128, True, 4, 4))]
    return out


def skinny_rows(arch: int) -> list[dict]:
    """Registers, shared memory, grid and the PTX's async copies and tensor-core instructions of each
    skinny_variants() tile as skinny_linear launches it (the weight's N, K and range specialised)."""
    from draftrelay.kernels import offline
    from draftrelay.kernels import plan as P
    from draftrelay.kernels import triton_ops as TO

    rows = []
    for label, cfg, m, N, K, pro in skinny_variants():
        ks, n_split, c = P.launch(P.kernel_pro(pro, cfg, K), cfg, m, K, False, False)  # as skinny_linear launches
        k = offline.compile_for(TO._skinny_kernel, arch=arch, num_warps=cfg.warps, num_stages=cfg.stages,
                                ints=dict(N=N, K=K, KS=ks), IEEE=False, FIXED_TRIPS=0, PDL=True, **c)
        r = offline.resources(k, arch=arch)
        ptx = k.asm["ptx"]
        row = {"kernel": "_skinny_kernel", "label": label, "config": cfg.label(), "N": N, "K": K, "rows": m,
               "programs": -(-N // cfg.block_n) * n_split, "warps": cfg.warps, "stages": cfg.stages, **r,
               "shared_bytes": k.metadata.shared, "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
               "mma_sync": ptx.count("mma.sync"), "wgmma": ptx.count("wgmma.mma_async")}
        rows.append(row)
        print(f"{label:36s} {cfg.label():18s} {row['programs']:5d} programs, {r['registers']:3d} registers, "
              f"spills {r['spill_stores']}/{r['spill_loads']} B, {row['shared_bytes'] // 1024} KiB shared, "
              f"cp.async {row['cp_async']}, mma.sync {row['mma_sync']}, wgmma {row['wgmma']}")
    return rows


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
                          "cpu": cpu_name(), "rows": rows, "skinny": skinny_rows(args.arch)})


if __name__ == "__main__":
    main()
