"""Time the 0.5B drafter's int8 products (worker --quant int8 --head-int8: the layers' four and the head) with
each way of converting a swapped dot tile's int8 weights to bf16, side by side in one process, by the planner's
own measurement (`triton_ops._measure`: every candidate checked against the int8 definition, then timed in a
CUDA graph over weight copies that L2 does not hold, beside the bf16 product it would replace).

- "dot": Triton's `.to` conversion. Triton moves it after the dot operand's load, so the swapped tile reads its
  int8 operand from shared memory two bytes at a time in the warp-group dot's register layout.
- "staged": `triton_ops._i8_bf16`, the conversion in the layout the tile was loaded in (16-byte reads), the bf16
  tile staged through shared memory into the dot's layout (`DRAFTRELAY_INT8_CVT`, triton_ops.INT8_CVT_STAGED).

Only the swapped tiles differ between the two; the other candidates are timed again as a check of the noise.
Prints, per key, the best swapped tile under each and the plan's choice under each, and writes JSON.

    python benchmarks/int8_convert.py --rows 2,4,8,16 --out benchmarks/results/int8_convert.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.kernels import plan as P  # noqa: E402
from draftrelay.kernels import triton_ops  # noqa: E402
from machine import write_json  # noqa: E402

# (label, pro, N, K, bias, residual): the 0.5B's int8 products as the forward calls them (plan_seed.shapes_of)
PRODUCTS = [
    ("norm + q|k|v", P.PRO_NORM, 1152, 896, True, True),
    ("o_proj", P.PRO_NONE, 896, 896, False, False),
    ("norm + gate|up", P.PRO_NORM, 9728, 896, False, True),
    ("down", P.PRO_NONE, 896, 4864, False, False),
    ("norm + head", P.PRO_NORM, 151936, 896, False, True),
]
MODES = ("dot", "staged")


def _us(times: dict) -> dict:
    return {("cublas" if c is None else c.label()): (t * 1e6 if math.isfinite(t) else None) for c, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,4,8,16", help="row buckets to time, comma-separated (of 2, 4, 8, 16)")
    ap.add_argument("--out", default="benchmarks/results/int8_convert.json", help="JSON file to write")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows {args.rows!r}: comma-separated integers")
    bad = [r for r in rows if r not in P.ROW_BUCKETS or r == 1]
    if bad:
        ap.error(f"--rows {bad}: each one of {[b for b in P.ROW_BUCKETS if b > 1]} (one row has no dot tile)")
    if not torch.cuda.is_available():
        sys.exit("int8_convert.py: needs a CUDA GPU (the tiles are Triton kernels timed on it)")
    t0 = time.perf_counter()
    dev = torch.cuda.current_device()
    out_rows = []
    for label, pro, N, K, bias, delta in PRODUCTS:
        for M in rows:
            key = (dev, pro, M, N, K, P.INT8, bias, delta)
            cands = P.bucket_candidates(pro, M, N, K, P.INT8)
            row = {"product": label, "M": M, "N": N, "K": K, "us": {}, "choice": {}}
            for mode in MODES:
                triton_ops.INT8_CVT_STAGED = mode == "staged"
                times = triton_ops._measure(key, cands)
                row["us"][mode] = _us(times)
                chosen = P.pick(times)
                row["choice"][mode] = "bf16 product" if chosen is None else chosen.label()
            triton_ops.INT8_CVT_STAGED = True
            swapped = [c.label() for c in cands if c.swap]
            best = {m: min((v, k) for k, v in row["us"][m].items() if k in swapped and v is not None)
                    for m in MODES}
            row["best_swapped"] = {m: {"tile": k, "us": round(v, 2)} for m, (v, k) in best.items()}
            row["yardstick_us"] = round(row["us"]["staged"]["cublas"], 2)
            out_rows.append(row)
            print(f"{label:15s} {M:2d} rows: swapped dot {best['dot'][0]:7.2f} / staged {best['staged'][0]:7.2f} us; "
                  f"bf16 yardstick {row['yardstick_us']:7.2f}; choice dot {row['choice']['dot']}, "
                  f"staged {row['choice']['staged']}", flush=True)
    out = {"benchmark": "int8_convert", "machine": machine_info(), "rows": out_rows,
           "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, out)
    print(f"wrote {args.out} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
