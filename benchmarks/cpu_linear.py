"""MKL against oneDNN for the layer products of a decode or verify step on this CPU (cpu_linear's choice).

Random fp32 weights of the 1.5B reference target's shapes (q|k|v 2048 x 1536 with bias, o 1536 x 1536,
gate|up 17920 x 1536, down 1536 x 8960), --layers of them (8: 1.5 GB, far above any cache, so every
product reads its weight from memory as a decode does), and its 151,936 x 1536 head. Each repeat runs
every (library, rows, threads) variant once in rotated order, so a load change lands on all alike.
MKL is `F.linear` (with cpu_linear.mkl_linear's row blocks where they apply), oneDNN `cpu_linear.onednn_linear`
on the same plain weights. Also prints what cpu_linear's own probe chose here.

    python benchmarks/cpu_linear.py                       # rows 1,2,3,4,5,7,8,16, 1 and all threads
    python benchmarks/cpu_linear.py --rows 1,4 --repeats 3

Prints the p50 per variant, the oneDNN / MKL ratio and the spread; JSON: benchmarks/results/cpu_linear.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import draftrelay.cpu_linear as C
import draftrelay.model as M

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_name, write_json  # noqa: E402

D, INTER, KV, VOCAB = 1536, 8960, 256, 151936
SHAPES = ((D + 2 * KV, D), (D, D), (2 * INTER, D), (D, INTER))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of weights (8: 1.5 GB)")
    ap.add_argument("--rows", default="1,2,3,4,5,7,8,16", help="rows per product (a verify's width)")
    ap.add_argument("--threads", default="", help="thread counts (default: 1 and all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_linear.json"))
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        n_all = torch.get_num_threads()
        threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, n_all})
    except ValueError as e:
        ap.error(f"--rows / --threads: comma-separated integers ({e})")
    if any(r < 1 for r in rows) or any(t < 1 for t in threads) or args.layers < 1 or args.repeats < 1:
        ap.error("--rows, --threads, --layers and --repeats must be positive")
    if why := C.onednn_unavailable():
        print(f"oneDNN cannot run here: {why}")
        return 1
    torch.manual_seed(0)
    gb = args.layers * sum(n * k for n, k in SHAPES) * 4 / 1e9
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {args.layers} layers of 1.5B shapes ({gb:.2f} GB) and the head",
          flush=True)
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
    biases = [torch.randn(SHAPES[0][0]) * 0.02 for _ in range(args.layers)]
    head = torch.randn(VOCAB, D) * 0.02

    def layers_once(lib: str, x: torch.Tensor, xi: torch.Tensor) -> None:
        for ws, b in zip(weights, biases, strict=True):
            for j, w in enumerate(ws):
                inp = xi if w.shape[1] == INTER else x
                bias = b if j == 0 else None
                C.onednn_linear(inp, w, bias) if lib == "onednn" else M.linear(inp, w, bias)

    def head_once(lib: str, x: torch.Tensor) -> None:
        C.onednn_linear(x, head) if lib == "onednn" else M.linear(x, head)

    C.choose("mkl")  # model.linear below is MKL's path; oneDNN is called directly
    variants = [(lib, r, t) for t in threads for r in rows for lib in ("mkl", "onednn")]
    inputs = {r: (torch.randn(r, D), torch.randn(r, INTER)) for r in rows}
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    head_times: dict[tuple, list[float]] = {v: [] for v in variants}
    loads = []
    with torch.inference_mode():
        for rep in range(args.repeats + 1):  # the first repeat warms up and is dropped
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for lib, r, t in order:
                torch.set_num_threads(t)
                x, xi = inputs[r]
                t0 = time.perf_counter()
                layers_once(lib, x, xi)
                t1 = time.perf_counter()
                head_once(lib, x)
                t2 = time.perf_counter()
                if rep:
                    times[(lib, r, t)].append((t1 - t0) * 1e3)
                    head_times[(lib, r, t)].append((t2 - t1) * 1e3)
            loads.append(os.getloadavg()[0])
            print(f"  repeat {rep}/{args.repeats} done (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
    torch.set_num_threads(n_all)

    table = []
    print(f"\nlayer products of {args.layers} layers, p50 ms (min-max), load {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'threads':>7} {'rows':>4} {'MKL':>20} {'oneDNN':>20} {'oneDNN/MKL':>10} {'oneDNN GB/s':>11}")
    for t in threads:
        for r in rows:
            m, d = times[("mkl", r, t)], times[("onednn", r, t)]
            hm, hd = head_times[("mkl", r, t)], head_times[("onednn", r, t)]
            row = {"threads": t, "rows": r,
                   "mkl_ms": statistics.median(m), "mkl_min_max": [min(m), max(m)],
                   "onednn_ms": statistics.median(d), "onednn_min_max": [min(d), max(d)],
                   "head_mkl_ms": statistics.median(hm), "head_onednn_ms": statistics.median(hd)}
            row["ratio"] = row["onednn_ms"] / row["mkl_ms"]
            table.append(row)
            print(f"{t:>7} {r:>4} {row['mkl_ms']:8.1f} ({min(m):5.1f}-{max(m):5.1f}) "
                  f"{row['onednn_ms']:8.1f} ({min(d):5.1f}-{max(d):5.1f}) {row['ratio']:10.2f} "
                  f"{gb / row['onednn_ms'] * 1e3:11.1f}")
    for t in threads:
        one = {lib: next(x for x in table if x["threads"] == t and x["rows"] == rows[0])[f"{lib}_ms"]
               for lib in ("mkl", "onednn")}
        print(f"  {t} thread(s): a product of r rows against {rows[0]} row(s): "
              + ", ".join(f"r={x['rows']} MKL {x['mkl_ms'] / one['mkl']:.2f}x "
                          f"oneDNN {x['onednn_ms'] / one['onednn']:.2f}x" for x in table if x["threads"] == t))
    C.choose("auto")
    probe_choice = C.probe()
    print(f"cpu_linear's probe here: {probe_choice} ({C.probe_times()})")
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__, "layers": args.layers,
           "layer_gb": gb, "repeats": args.repeats, "load_min": min(loads), "load_max": max(loads),
           "probe_choice": probe_choice, "probe_ms": C.probe_times(), "table": table}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
