"""Time skinny-GEMM configurations beyond the plan's candidates on the products of the 7B verify and the
0.5B's four-request STEP, each against cuBLAS, by the planner's own measurement (`triton_ops._measure`:
checked against cuBLAS's output, then timed in a CUDA graph cycling through weight copies that L2 does
not hold). Prints microseconds and achieved GB/s per configuration and writes JSON.

    python benchmarks/skinny_sweep.py --out benchmarks/results/skinny_sweep.json

The extra configurations are swapped dot tiles (the weight tile the warp-group dot's first operand) with
fewer pipeline stages (less shared memory a program, more programs resident on an SM), shorter K steps,
128 columns a program, and K cut into two ranges: the plan's swapped tile (64 x 128, 4 stages, 80 KiB)
leaves two programs an SM, so the 7B gate|up's 592 programs take 2.2 waves of an H100.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.kernels import plan as P  # noqa: E402
from draftrelay.kernels import triton_ops  # noqa: E402
from machine import write_json  # noqa: E402

# (label, pro, rows, N, K, bias, residual): the verify's eight-row bucket of the 7B, the four-row bucket of
# the 0.5B, as the forward calls them (a norm's product adds the residual first; q|k|v has a bias)
PRODUCTS = [
    ("7B norm + q|k|v", P.PRO_NORM, 8, 4608, 3584, True, True),
    ("7B o_proj", P.PRO_NONE, 8, 3584, 3584, False, False),
    ("7B norm + gate|up", P.PRO_NORM, 8, 37888, 3584, False, True),
    ("7B SiLU + down", P.PRO_SILU, 8, 3584, 18944, False, False),
    ("0.5B norm + gate|up", P.PRO_NORM, 4, 9728, 896, False, True),
    ("0.5B norm + head", P.PRO_NORM, 4, 151936, 896, False, True),
]
EXTRA = [P.SkinnyConfig(bn, bk, True, w, s, False, split, swap=True)
         for bn, bk, w, s, split in ((64, 128, 4, 2, 1), (64, 128, 4, 3, 1), (64, 64, 4, 4, 1), (64, 64, 4, 6, 1),
                                     (64, 256, 4, 2, 1), (128, 128, 4, 3, 1), (128, 128, 8, 3, 1),
                                     (64, 128, 4, 4, 2), (64, 128, 4, 2, 2))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/skinny_sweep.json", help="JSON file to write")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("skinny_sweep.py: needs a CUDA GPU (the configurations are Triton kernels timed on it)")
    t0 = time.perf_counter()
    rows = []
    for label, pro, M, N, K, bias, delta in PRODUCTS:
        cands = P.bucket_candidates(pro, M, N, K)
        extra = [c for c in EXTRA if c not in cands]
        key = (torch.cuda.current_device(), pro, M, N, K, args.dtype, bias, delta)
        times = triton_ops._measure(key, cands + extra)
        wbytes = N * K * 2
        us = {("cublas" if c is None else c.label()): (t * 1e6 if t != float("inf") else None)
              for c, t in times.items()}
        best = min((v, k) for k, v in us.items() if v is not None)
        extra_labels = {c.label() for c in extra}
        print(f"{label}, {M} rows ({wbytes / 1e6:.1f} MB): best {best[1]} {best[0]:.2f} us; "
              + "  ".join(f"{k}{'*' if k in extra_labels else ''} {v:.2f}" if v is not None else f"{k} failed"
                          for k, v in us.items()), flush=True)
        chosen = P.pick({c: t for c, t in times.items() if c is None or c in cands})  # among the plan's own
        plan_choice = "cublas" if chosen is None else chosen.label()
        rows.append({"product": label, "pro": P.PRO_NAMES[pro], "M": M, "N": N, "K": K, "us": us,
                     "GBps": {k: round(wbytes / v / 1e3, 1) for k, v in us.items() if v is not None},
                     "extra": sorted(extra_labels), "plan_choice": plan_choice})
    out = {"benchmark": "skinny_sweep", "machine": machine_info(), "dtype": args.dtype, "rows": rows,
           "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, out)
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
