"""The shipped demo pair on this machine's CPU: what one forward of each model costs, and what
`draftrelay demo` gets from speculation with it, side by side.

1. Forward costs, interleaved (target, drafter, target verify, ... per iteration, so drift hits all
   alike): the target's decode step (3 rows x 1 token, the engine's threads) and verify step (3 rows
   x k+1 tokens), and the drafter's step (3 rows x 1 token) on one thread, as the demo's local worker
   runs it. The figure: drafter step / target decode step (the pair is sized for <= 1/8).
2. `draftrelay demo` itself, --repeats times (a fresh worker each time): tokens/s of off, sync and
   async, each speculative mode's ratio to the off run of the same repeat, acceptance by position.

    python benchmarks/demo_pair.py [--repeats 3] [--iters 200] -> benchmarks/results/demo_pair_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from draftrelay import demo_pair
from draftrelay.checkpoint.hf import load_hf_dir
from draftrelay.handoff.procinfo import machine_info


def forward_costs(iters: int, k: int, rows: int = 3, ctx: int = 48) -> dict:
    tdir, ddir = demo_pair.paths()
    target = load_hf_dir(tdir, device="cpu", dtype=torch.float32)
    drafter = load_hf_dir(ddir, device="cpu", dtype=torch.float32)
    threads = torch.get_num_threads()
    caches = {"target": target.new_cache(rows, ctx + k + 2), "drafter": drafter.new_cache(rows, ctx + k + 2)}
    r = torch.arange(rows)
    with torch.inference_mode():
        for name, net in (("target", target), ("drafter", drafter)):
            net(torch.ones(rows, ctx, dtype=torch.long), torch.zeros(rows, dtype=torch.long), caches[name], r)

        def step(net, cache, T, n_threads):
            torch.set_num_threads(n_threads)
            t0 = time.perf_counter()
            net(torch.ones(rows, T, dtype=torch.long), torch.full((rows,), ctx, dtype=torch.long), cache, r)
            return 1e3 * (time.perf_counter() - t0)

        ms: dict[str, list[float]] = {"target_decode": [], "target_verify": [], "drafter_step": []}
        for i in range(iters + 10):
            vals = (step(target, caches["target"], 1, threads), step(target, caches["target"], k + 1, threads),
                    step(drafter, caches["drafter"], 1, 1))
            if i >= 10:  # warm-up
                for key, v in zip(ms, vals, strict=True):
                    ms[key].append(v)
    torch.set_num_threads(threads)
    out = {key: {"p50_ms": statistics.median(v), "p10_ms": sorted(v)[len(v) // 10],
                 "p90_ms": sorted(v)[9 * len(v) // 10]} for key, v in ms.items()}
    out["ratio_drafter_to_target_decode"] = out["drafter_step"]["p50_ms"] / out["target_decode"]["p50_ms"]
    out["ratio_verify_to_decode"] = out["target_verify"]["p50_ms"] / out["target_decode"]["p50_ms"]
    out.update(rows=rows, context=ctx, k=k, target_threads=threads, drafter_threads=1,
               target_params=target.cfg.n_params(), drafter_params=drafter.cfg.n_params())
    return out


def demo_runs(repeats: int, k: int) -> list[dict]:
    runs = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            js = os.path.join(tmp, "demo.json")
            proc = subprocess.run([sys.executable, "-m", "draftrelay.cli", "demo", "--device", "cpu", "--k", str(k),
                                   "--json", js], capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise SystemExit(f"demo run {i} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            with open(js) as f:
                modes = json.load(f)["modes"]
        off = modes["off"]["total"]["tokens_per_s"]
        runs.append({m: {"tokens_per_s": v["total"]["tokens_per_s"], "ratio_to_off": v["total"]["tokens_per_s"] / off,
                         "step_p50_ms": v["total"]["step_p50_ms"], "mean_accepted": v["total"]["mean_accepted"],
                         "accept_rate_by_pos": v["total"]["accept_rate_by_pos"], "round_mode": v["total"]["round_mode"]}
                     for m, v in modes.items()})
        print(f"  demo run {i + 1}/{repeats}: " + ", ".join(
            f"{m} {r['tokens_per_s']:.0f} tok/s ({r['ratio_to_off']:.2f}x)" for m, r in runs[-1].items()), flush=True)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="timed forwards of each kind")
    ap.add_argument("--repeats", type=int, default=3, help="demo runs")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "demo_pair_cpu.json"))
    args = ap.parse_args(argv)
    if args.iters < 10 or args.repeats < 1 or args.k < 1:
        ap.error("need --iters >= 10, --repeats >= 1, --k >= 1")
    costs = forward_costs(args.iters, args.k)
    for key in ("target_decode", "target_verify", "drafter_step"):
        c = costs[key]
        print(f"{key:14s} p50 {c['p50_ms']:.3f} ms  (p10 {c['p10_ms']:.3f}, p90 {c['p90_ms']:.3f})")
    print(f"drafter step / target decode step: 1/{1 / costs['ratio_drafter_to_target_decode']:.1f}; "
          f"verify of {args.k + 1} tokens / decode: {costs['ratio_verify_to_decode']:.2f}")
    runs = demo_runs(args.repeats, args.k)
    summary = {}
    for m in runs[0]:
        ratios = [r[m]["ratio_to_off"] for r in runs]
        acc = [r[m]["mean_accepted"] for r in runs]
        summary[m] = {"ratio_to_off_median": statistics.median(ratios), "ratio_to_off_min": min(ratios),
                      "ratio_to_off_max": max(ratios), "mean_accepted": statistics.median(acc),
                      "tokens_per_s_median": statistics.median(r[m]["tokens_per_s"] for r in runs)}
        if m != "off":
            s = summary[m]
            print(f"{m:5s}: {s['tokens_per_s_median']:.0f} tok/s, {s['ratio_to_off_median']:.2f}x off "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(runs)} runs), "
                  f"{s['mean_accepted']:.2f} drafts accepted per round")
    res = {"machine": machine_info(), "torch": torch.__version__, "forward_costs": costs, "demo_runs": runs,
           "summary": summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
