"""A local worker's STEP at each draft depth, warmed for the deepest depth alone against every depth.

The depth policy asks any depth 1..k_max. A worker whose draft-step graphs were captured for k_max alone
runs a shallower round on the k_max step and returns the first drafts, so each depth costs the deepest
round; warmed for every depth (what `generate` and `demo` ask on a GPU under the policy:
`loading.start_local_worker(warm_depths=True)`) each runs its own step. This starts the worker both ways,
one after the other (random weights of a real shape), times its start (the warm-up included) and then the
engine's own calibration rounds (`calibrate.measure_rounds`: one request, one-token blocks, the median of
`--repeats`) at every depth, and writes the table.

    python benchmarks/depth_rounds.py [--drafter random:qwen2.5-0.5b] [--k-max 6] [--device cuda]
        [--out benchmarks/results/depth_rounds.json]

On a CPU (`--device cpu`) the worker drafts in its lean loop, which has no graphs: both rows measure the
same thing (a dry run of the script).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from draftrelay.engine import calibrate
from draftrelay.engine import loading as L
from draftrelay.handoff.procinfo import machine_info
from machine import write_json  # benchmarks/machine.py (the script's own folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="random:qwen2.5-0.5b", help="the worker's --model")
    ap.add_argument("--k-max", type=int, default=6, help="the deepest depth (the policy's --k-max)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed rounds")
    ap.add_argument("--repeats", type=int, default=9, help="rounds per depth (the median is kept)")
    ap.add_argument("--out", default="benchmarks/results/depth_rounds.json")
    args = ap.parse_args(argv)
    if not 1 <= args.k_max <= 16:
        ap.error(f"--k-max {args.k_max}: must be 1-16")
    if args.context < 1 or args.repeats < 1:
        ap.error("--context and --repeats must be positive")
    dev = torch.device(args.device)
    prompt = [int(x) for x in np.random.default_rng(0).integers(100, 20000, args.context)]
    depths = list(range(1, args.k_max + 1))
    out: dict = {"benchmark": "depth_rounds", "machine": machine_info(), "drafter": args.drafter,
                 "device": str(dev), "context": args.context, "repeats": args.repeats, "rows": []}
    for label, every in (("deepest only", False), ("every depth", True)):
        t0 = time.perf_counter()
        worker = L.start_local_worker(args.drafter, dev, args.k_max, args.context + 256, 1,
                                      warm_batch=1, warm_depths=every, warm_min_kv=args.context)
        start_s = time.perf_counter() - t0
        try:
            spec = L.worker_spec(worker.host, worker.port, "", "", args.k_max, 1)
            timing = calibrate.measure_rounds(spec, prompt, depths, repeats=args.repeats)
        finally:
            worker.stop()
        ms = {k: round(1e3 * v, 3) for k, v in sorted(timing.by_k.items())}
        out["rows"].append({"warm": label, "worker_start_s": round(start_s, 2), "step_ms_by_depth": ms})
        print(f"{label:>12}: worker start {start_s:6.1f} s; STEP ms by depth "
              + "  ".join(f"{k}: {v:.2f}" for k, v in ms.items()), flush=True)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
