"""The one-card drafter's steady-state STEP against context length, with the plain forward's split-K
decode attention (model.SPLIT_KV) on and off, side by side in one process.

For each context (default 1K, 32K, 128K) one request's row is prefilled to that length, then a steady
step (keep = context, 1 new token, n_out drafts; CUDA graphs) is timed; each iteration runs both
variants in turn (their graphs captured separately), so machine drift hits both alike. At the longest
context a torch-profiler pass of each variant lists the kernels that take the time.

    python benchmarks/drafter_context.py [--contexts 1024,32768,131072] [--iters 30]
        -> benchmarks/results/drafter_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from draftrelay import model as M
from draftrelay.handoff.procinfo import machine_info
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter, load_drafter

VARIANTS = {"one_gemm": 1 << 62, "split_kv": M.SPLIT_KV}


def use(drafter, variant: str, graphs: dict) -> None:
    """Switch the attention variant: a captured graph keeps the variant it was captured with, so each
    variant gets its own table of static steps (the drafter fills whichever table it is given)."""
    M.SPLIT_KV = VARIANTS[variant]
    drafter._static = graphs[variant]


def top_kernels(drafter, job, n_out: int, k: int = 6) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            drafter.run([job()], n_out)
    ev = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:k]
    return [(e.key[:80], round(getattr(e, "device_time_total", 0) / 3, 1)) for e in ev]  # us per step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--n-out", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "drafter_context.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ctxs = sorted(int(x) for x in args.contexts.split(","))
    if args.model.startswith("random:"):  # the shape's own position limit (32K for Qwen2.5) lifted, as
        # the engine benchmark's drafter directory does: timing does not depend on it
        cfg = M.ModelConfig(**SHAPES[args.model[7:]], name=args.model[7:])
        cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, ctxs[-1] + 64))
        net = M.Transformer.random(cfg, seed=0, device=args.device, dtype=torch.bfloat16, draw_on="device")
        d = LlamaDrafter(net, 1, ctxs[-1] + 64, 8, args.model, "", "graph")
    else:
        d = load_drafter(args.model, device=args.device, dtype="bfloat16", n_rows=1, max_ctx=ctxs[-1] + 64,
                         n_out_max=8, seed=0, mode="graph")
    # the variants are the plain forward's (model.attend); the fused-kernel forward has its own attention
    # kernel and is measured by benchmarks/fast_forward.py
    d.model.fast = False
    rng = np.random.default_rng(0)
    toks = rng.integers(0, d.vocab_size, ctxs[-1] + 1).astype(np.int32)
    res = {"benchmark": "drafter_context", "command": " ".join(["python", "benchmarks/drafter_context.py"]
                                                                + (argv or sys.argv[1:])),
           "model": args.model, "info": d.info, "n_out": args.n_out, "split_chunk": M.SPLIT_CHUNK,
           "env": machine_info(), "points": []}
    have = 0
    graphs = {v: {} for v in VARIANTS}
    for ctx in ctxs:
        t0 = time.perf_counter()
        d.run([Job(0, have, toks[have:ctx])], 0)  # extend the row to ctx (eager prefill chunks)
        prefill_s = time.perf_counter() - t0
        have = ctx

        def job(c=ctx):
            return Job(0, c, toks[c:c + 1])

        times = {v: [] for v in VARIANTS}
        drafts = {}
        for v in VARIANTS:  # capture + warm
            use(d, v, graphs)
            for _ in range(2):
                drafts[v] = d.run([job()], args.n_out)[0]
        for _ in range(args.iters):
            for v in VARIANTS:
                use(d, v, graphs)
                t0 = time.perf_counter()
                d.run([job()], args.n_out)
                times[v].append(time.perf_counter() - t0)
        p = {"context": ctx, "prefill_s": round(prefill_s, 3),
             **{f"{v}_step_p50_ms": round(float(np.median(times[v])) * 1e3, 3) for v in VARIANTS},
             "drafts_equal": bool(np.array_equal(drafts["one_gemm"], drafts["split_kv"]))}
        p["split_over_one_gemm"] = round(p["split_kv_step_p50_ms"] / p["one_gemm_step_p50_ms"], 3)
        if ctx == ctxs[-1]:
            for v in VARIANTS:
                use(d, v, graphs)
                p[f"{v}_top_kernels_us_per_step"] = top_kernels(d, job, args.n_out)
        res["points"].append(p)
        print(f"context {ctx}: step p50 one GEMM {p['one_gemm_step_p50_ms']:.2f} ms | split-K "
              f"{p['split_kv_step_p50_ms']:.2f} ms ({p['split_over_one_gemm']:.2f}x) | drafts equal "
              f"{p['drafts_equal']} | prefill {prefill_s:.1f} s", flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    for v in VARIANTS:
        print(v, "top kernels (us per step):", res["points"][-1][f"{v}_top_kernels_us_per_step"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
