"""The shipped demo pair on this machine's CPU: what one forward of each model costs, and what
`draftrelay demo` gets from speculation with it, side by side.

1. Forward costs, interleaved (target, drafter, target verify, ... per iteration, so drift hits all
   alike): the target's decode step (3 rows x 1 token) and verify step (3 rows x k+1 tokens) on the
   demo's target threads, and the drafter's step (3 rows x 1 token) on one thread, as the demo's local
   worker runs it. The figure: drafter step / target decode step (the pair is sized for <= 1/8).
2. `draftrelay demo` itself, --repeats times per configuration (a fresh worker each time), the
   configurations interleaved within each repeat so that the machine's load drifts over all of them
   alike: tokens/s of off, sync and async, each speculative mode's ratio to the off run of the same demo
   run, acceptance by position, and the load average around each run (a shared machine says so here).

    python benchmarks/demo_pair.py [--repeats 3] [--iters 200] [--configs "|--k 3|--k 4"]
        -> benchmarks/results/demo_pair_cpu.json
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
from draftrelay.engine.cli_demo import CPU_THREADS
from draftrelay.handoff.procinfo import machine_info


def forward_costs(iters: int, k: int, rows: int = 3, ctx: int = 48, threads: int = CPU_THREADS) -> dict:
    tdir, ddir = demo_pair.paths()
    target = load_hf_dir(tdir, device="cpu", dtype=torch.float32)
    drafter = load_hf_dir(ddir, device="cpu", dtype=torch.float32)
    default_threads = torch.get_num_threads()
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
    torch.set_num_threads(default_threads)
    out = {key: {"p50_ms": statistics.median(v), "p10_ms": sorted(v)[len(v) // 10],
                 "p90_ms": sorted(v)[9 * len(v) // 10]} for key, v in ms.items()}
    out["ratio_drafter_to_target_decode"] = out["drafter_step"]["p50_ms"] / out["target_decode"]["p50_ms"]
    out["ratio_verify_to_decode"] = out["target_verify"]["p50_ms"] / out["target_decode"]["p50_ms"]
    out.update(rows=rows, context=ctx, k=k, target_threads=threads, drafter_threads=1,
               target_params=target.cfg.n_params(), drafter_params=drafter.cfg.n_params())
    return out


def demo_run(extra: list[str], max_tokens: int, src: str = "") -> dict:
    """One `draftrelay demo` run (its own worker) with these extra flags: per mode tokens/s, its ratio to the
    same run's off, step p50 and acceptance; the load average before and after. src: run the package from
    this source tree instead (another checkout, e.g. the code before a change)."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "demo.json")
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "draftrelay.cli", "demo", "--device", "cpu", "--max-tokens",
                               str(max_tokens), *extra, "--json", js], capture_output=True, text=True, timeout=600,
                              env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"demo {' '.join(extra)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        with open(js) as f:
            modes = json.load(f)["modes"]
    off = modes["off"]["total"]["tokens_per_s"]
    out = {m: {"tokens_per_s": v["total"]["tokens_per_s"], "ratio_to_off": v["total"]["tokens_per_s"] / off,
               "step_p50_ms": v["total"]["step_p50_ms"], "mean_accepted": v["total"]["mean_accepted"],
               "tokens_per_step": v["total"]["tokens_per_step"], "accept_rate_by_pos": v["total"]["accept_rate_by_pos"],
               "round_mode": v["total"]["round_mode"], "depth_chosen": v["total"].get("depth", {}).get("chosen")}
           for m, v in modes.items()}
    return {"modes": out, "loadavg_1m_before": load0, "loadavg_1m_after": os.getloadavg()[0], "demo_wall_s": wall}


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for m in runs[0]["modes"]:
        ratios = [r["modes"][m]["ratio_to_off"] for r in runs]
        summary[m] = {"ratio_to_off_median": statistics.median(ratios), "ratio_to_off_min": min(ratios),
                      "ratio_to_off_max": max(ratios),
                      "mean_accepted": statistics.median(r["modes"][m]["mean_accepted"] for r in runs),
                      "tokens_per_s_median": statistics.median(r["modes"][m]["tokens_per_s"] for r in runs),
                      "step_p50_ms_median": statistics.median(r["modes"][m]["step_p50_ms"] for r in runs)}
        if m != "off":  # the same figure from step times: less exposed to the run's fixed costs
            summary[m]["step_ratio_median"] = statistics.median(
                r["modes"][m]["tokens_per_step"] * r["modes"]["off"]["step_p50_ms"] / r["modes"][m]["step_p50_ms"]
                for r in runs)
    if "sync" in runs[0]["modes"] and "async" in runs[0]["modes"]:  # the two round modes, run by run
        per = [r["modes"]["async"]["tokens_per_s"] / r["modes"]["sync"]["tokens_per_s"] for r in runs]
        summary["async_over_sync"] = {"median": statistics.median(per), "min": min(per), "max": max(per),
                                      "runs": per}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="timed forwards of each kind")
    ap.add_argument("--repeats", type=int, default=3, help="demo runs per configuration")
    ap.add_argument("--k", type=int, default=4, help="the verify width of part 1 is k + 1")
    ap.add_argument("--max-tokens", type=int, default=64, help="the demo's tokens per prompt")
    ap.add_argument("--configs", default="--k 4",
                    help="'|'-separated demo flag sets, one configuration each ('' = the demo's defaults)")
    ap.add_argument("--baseline", default="", metavar="SRC_DIR[|FLAGS]",
                    help="one more configuration: the demo from another source tree (its src/ directory) with "
                         "these flags, e.g. the code before a change")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "demo_pair_cpu.json"))
    args = ap.parse_args(argv)
    if args.iters < 10 or args.repeats < 1 or args.k < 1:
        ap.error("need --iters >= 10, --repeats >= 1, --k >= 1")
    load0 = os.getloadavg()
    costs = forward_costs(args.iters, args.k)
    for key in ("target_decode", "target_verify", "drafter_step"):
        c = costs[key]
        print(f"{key:14s} p50 {c['p50_ms']:.3f} ms  (p10 {c['p10_ms']:.3f}, p90 {c['p90_ms']:.3f})")
    print(f"drafter step / target decode step: 1/{1 / costs['ratio_drafter_to_target_decode']:.1f}; "
          f"verify of {args.k + 1} tokens / decode: {costs['ratio_verify_to_decode']:.2f} "
          f"(target on {costs['target_threads']} thread(s))")
    configs = {c.strip(): (c.split(), "") for c in args.configs.split("|")}  # name -> (flags, source tree)
    if args.baseline:
        src, _, flags = args.baseline.partition("|")
        configs[f"baseline {src} {flags}".strip()] = (flags.split(), os.path.abspath(src))
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for i in range(args.repeats):
        for c, (flags, src) in configs.items():  # interleaved: the load drifts over every configuration alike
            r = demo_run(flags, args.max_tokens, src)
            runs[c].append(r)
            print(f"  [{c or 'defaults'}] run {i + 1}/{args.repeats} (load {r['loadavg_1m_before']:.1f}): " + ", ".join(
                f"{m} {v['tokens_per_s']:.0f} tok/s ({v['ratio_to_off']:.2f}x)" for m, v in r["modes"].items()),
                flush=True)
    summary = {c: summarize(rs) for c, rs in runs.items()}
    for c, sm in summary.items():
        for m, s_ in sm.items():
            if m == "async_over_sync":
                print(f"[{c or 'defaults'}] async / sync: {s_['median']:.2f} (range {s_['min']:.2f}-{s_['max']:.2f}: "
                      + ", ".join(f"{x:.2f}" for x in s_["runs"]) + ")")
            elif m != "off":
                print(f"[{c or 'defaults'}] {m:5s}: {s_['tokens_per_s_median']:.0f} tok/s, "
                      f"{s_['ratio_to_off_median']:.2f}x "
                      f"off (range {s_['ratio_to_off_min']:.2f}-{s_['ratio_to_off_max']:.2f} over {len(runs[c])} runs; "
                      f"from step times {s_['step_ratio_median']:.2f}x), {s_['mean_accepted']:.2f} drafts accepted "
                      f"per round")
    res = {"machine": machine_info(), "torch": torch.__version__, "command": " ".join(
               ["python", "benchmarks/demo_pair.py", *(argv if argv is not None else sys.argv[1:])]),
           "max_tokens": args.max_tokens, "loadavg_1_5_15_before": list(load0),
           "loadavg_1_5_15_after": list(os.getloadavg()), "forward_costs": costs,
           "configs": {c or "defaults": {"flags": " ".join(configs[c][0]), "source": configs[c][1] or "this tree",
                                         "runs": runs[c], "summary": summary[c]} for c in configs}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} (load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
