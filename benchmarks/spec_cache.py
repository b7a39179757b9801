"""The speculation cache on a CPU: tokens/s and hit rate against the fan-out F, side by side with
sequential speculation (sync and async rounds) and target-only, with the built-in tiny pair.

One real worker process (`--model tiny`) on loopback, the real proxy process, the emulated stream.
Every configuration decodes the same prompts (greedy) in each of `--repeats` interleaved passes, so
machine noise lands on all of them alike; each pass starts a fresh engine, warms it up, then times one
`generate` of all prompts. Reported per configuration: median tokens/s over the passes (and min-max),
the step p50, drafts kept per round, and for the cache its hit rate (request-rounds whose outcome was a
pre-drafted branch), the share of verifies that did not wait for their round, and the mean time a verify
waited for its drafts. Outputs are checked identical to target-only in every pass.

The tiny pair has random weights: the 1-layer drafter is the 4-layer target's first layer, and on this
CPU the worker, the proxy, the emulated stream and the target share two cores, so the drafter does not
work "on other hardware" here: read the figures as the cost and the hit rate of the mechanism, not as
the speed-up of a real deployment (replayed real-pair acceptance on a GPU is a separate benchmark).

    python benchmarks/spec_cache.py                       # batch 1 and 4, k 4, F 1..16, 3 passes
    python benchmarks/spec_cache.py --batches 1 --fanouts 4,8 --repeats 5 --max-tokens 96
    python benchmarks/spec_cache.py --fanouts 8,16 --wait-rules all,early   # the cache under two wait rules
    python benchmarks/spec_cache.py --batches 1,4 --fanouts 8,16 --guard on,off  # with and without the guard

The cache's guard (engine/cache_guard.py, on by default) chooses per batch class between the fan-out, half
of it and plain sequential rounds by measured tokens/s: `cache F=8` is the cache as the engine runs it,
`cache F=8 noguard` every step a cache step. Each pass first decodes the prompts once untimed (`--warm-passes`,
so the guard has measured its choices, as in a server that has been running) and then times the same
prompts; the guard's choices during the timed pass (steps per choice, by batch class) and its switches
are reported.

The load average (os.getloadavg) is recorded before and after every pass: on a shared machine it says how
much else ran beside the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.handoff.procinfo import machine_info
from draftrelay.handoff.rounds import HandoffConfig
from draftrelay.model import tiny_model_id, tiny_pair
from draftrelay.worker.process import start_worker_process

PROMPTS = [b"The capital of France is", b"def fibonacci(n):", b"Speculative decoding works by",
           b"Once upon a time", b"import numpy as np", b"The quick brown fox"]


def one_pass(target, spec: dict, mode: str, fanout: int, prompts, max_tokens: int, k: int, batch: int,
             rule: str = "all", guard: bool = True, warm_passes: int = 1) -> dict:
    h = HandoffConfig(round_spec=spec, deadline_ms=2000, round_budget_ms=1500)
    cfg = EngineConfig(mode=mode, n_draft=k, max_batch=batch, max_len=512, handoff=h if mode != "off" else None,
                       spec_fanout=fanout, spec_options={"wait_rule": rule, "guard": guard} if fanout else {})
    load_before = os.getloadavg()[0]
    with Engine(target, cfg) as eng:
        eng.generate([prompts[0]], SamplingParams(max_tokens=8))  # warm-up: worker session, proxy, first forwards
        for _ in range(warm_passes):  # untimed: the same prompts (the guard measures its choices)
            eng.generate(prompts, SamplingParams(max_tokens=max_tokens))
        g = eng.spec_cache.guard if eng.spec_cache is not None else None
        g0 = {b: dict(c.chosen) for b, c in g.classes.items()} if g is not None else {}
        s0 = g.switches if g is not None else 0
        eng.reset_metrics()
        if eng.spec_cache is not None:
            eng.spec_cache.reset_stats()
        t0 = time.perf_counter()
        reqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens))
        wall = time.perf_counter() - t0
        m = eng.metrics(reqs)["total"]
    out = {"tokens_per_s": m["output_tokens"] / wall, "step_p50_ms": m["step_p50_ms"],
           "mean_accepted": m["mean_accepted"], "accept_rate_by_pos": m["accept_rate_by_pos"],
           "rounds": m["rounds"], "step_parts_p50_ms": m["step_parts_p50_ms"], "round_mode": m["round_mode"],
           "outputs": [r.output for r in reqs], "load_before": load_before, "load_after": os.getloadavg()[0]}
    if "spec_cache" in m:
        sc = m["spec_cache"]
        steps = sc["fast_steps"] + sc["waited_steps"]
        out.update(hit_rate=sc["hit_rate"], no_wait_share=sc["fast_steps"] / steps if steps else 0.0,
                   wait_ms_mean=sc["wait_ms_mean"], wait_ms_p50_hit=sc["wait_ms_p50_hit"],
                   wait_ms_p50_miss=sc["wait_ms_p50_miss"], misses=sc["misses"], spec_active=sc["active"],
                   bare_rows=sc["bare_rows"], k0_hits=sc["k0_hits"], k0_lookups=sc["k0_lookups"],
                   rows_with_drafts=sc["rows_with_drafts"], plain_steps=sc["plain_steps"])
        if g is not None:  # the guard's choices in the timed pass: steps per fan-out (0: plain) by batch class
            out["guard_chosen"] = {b: {f: n - g0.get(b, {}).get(f, 0) for f, n in c.chosen.items()
                                       if n - g0.get(b, {}).get(f, 0)} for b, c in g.classes.items()}
            out["guard_switches"] = g.switches - s0
            out["guard"] = sc["guard"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--fanouts", default="1,2,4,8,16")
    ap.add_argument("--ks", default="4", help="draft depths k")
    ap.add_argument("--configs", default="off,sync,async,cache", help="subset of off,sync,async,cache")
    ap.add_argument("--wait-rules", default="all", help="the cache's wait rules (engine.spec_cache.WAIT_RULES)")
    ap.add_argument("--guard", default="on", help="on, off or on,off: the cache with its guard and/or without")
    ap.add_argument("--warm-passes", type=int, default=1, help="untimed passes over the prompts before the timed one")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "spec_cache_cpu.json"))
    args = ap.parse_args()
    # one intra-op thread: on a shared 2-core machine torch's thread pool oversubscribes the cores the
    # worker, the proxy and the emulated stream also need, and the timings then measure the contention
    torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",")]
    fanouts = [int(x) for x in args.fanouts.split(",")]
    target, _ = tiny_pair()
    w = start_worker_process(["--model", "tiny", "--device", "cpu"], env={"OMP_NUM_THREADS": "1"})
    spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": tiny_model_id(), "max_requests": 8}
    want = args.configs.split(",")
    rules = args.wait_rules.split(",")
    guards = [x == "on" for x in args.guard.split(",")]
    if not guards or any(x not in ("on", "off") for x in args.guard.split(",")):
        ap.error("--guard: on, off or on,off")
    configs = [(m, m, 0, "all", True) for m in ("off", "sync", "async") if m in want] + \
              ([(f"cache F={f}" + ("" if r == "all" else f" {r}") + ("" if gd else " noguard"), "async", f, r, gd)
                for gd in guards for r in rules for f in fanouts] if "cache" in want else [])
    results: list[dict] = []
    try:
        for batch, k in [(b, k) for b in batches for k in (int(x) for x in args.ks.split(","))]:
            prompts = [list(p) for p in (PROMPTS * 2)[:max(batch, 4)]]
            runs: dict[str, list[dict]] = {name: [] for name, *_ in configs}
            for _ in range(args.repeats):  # interleaved passes: drift hits every configuration alike
                for name, mode, fanout, rule, gd in configs:
                    runs[name].append(one_pass(target, spec, mode, fanout, prompts, args.max_tokens, k, batch, rule,
                                               gd, args.warm_passes))
                    print(f"  batch {batch} k {k} {name}: {runs[name][-1]['tokens_per_s']:.1f} tok/s", flush=True)
            ref = runs["off"][0]["outputs"] if "off" in runs else next(iter(runs.values()))[0]["outputs"]
            for name, mode, fanout, rule, gd in configs:
                rs = runs[name]
                tps = [r["tokens_per_s"] for r in rs]
                row = {"batch": batch, "prompts": len(prompts), "config": name, "mode": mode, "fanout": fanout,
                       "wait_rule": rule if fanout else "", "guard": gd if fanout else None,
                       "load_min": min(min(r["load_before"], r["load_after"]) for r in rs),
                       "load_max": max(max(r["load_before"], r["load_after"]) for r in rs),
                       "k": k, "max_tokens": args.max_tokens, "passes": len(rs),
                       "identical_to_off": all(r["outputs"] == ref for r in rs),
                       "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
                       "tokens_per_s_max": max(tps),
                       "step_p50_ms_median": statistics.median(r["step_p50_ms"] for r in rs),
                       "mean_accepted": statistics.median(r["mean_accepted"] for r in rs),
                       "round_mode": rs[0]["round_mode"], "step_parts_p50_ms": rs[-1]["step_parts_p50_ms"]}
                if fanout:
                    row.update({key: statistics.median(r[key] for r in rs)
                                for key in ("hit_rate", "no_wait_share", "wait_ms_mean", "wait_ms_p50_hit",
                                            "wait_ms_p50_miss", "rows_with_drafts")})
                    row.update({key: sum(r[key] for r in rs) for key in ("bare_rows", "k0_hits", "k0_lookups")})
                    row["misses_last_pass"] = rs[-1]["misses"]
                    row["spec_active"] = all(r["spec_active"] for r in rs)
                    row["plain_steps"] = [r["plain_steps"] for r in rs]
                    if gd:
                        row["guard_chosen"] = [r.get("guard_chosen") for r in rs]
                        row["guard_switches"] = [r.get("guard_switches") for r in rs]
                        row["guard_last_pass"] = rs[-1].get("guard")
                results.append(row)
    finally:
        w.stop()
    base = {(r["batch"], r["k"], r["config"]): r["tokens_per_s_median"] for r in results}
    print(f"{'batch':>5} {'k':>2}  {'config':<24} {'tok/s med (min-max)':>22} {'vs off':>7} {'vs sync':>7} "
          f"{'step p50':>9} {'kept':>5} {'hit %':>6} {'no-wait %':>9} {'wait ms':>8}  {'load':>9}  same  guard")
    for r in results:
        b, k = r["batch"], r["k"]
        extra = (f"{100 * r['hit_rate']:6.1f} {100 * r['no_wait_share']:9.1f} {r['wait_ms_mean']:8.2f}"
                 if r["fanout"] else f"{'-':>6} {'-':>9} {'-':>8}")
        vs = [r["tokens_per_s_median"] / base[(b, k, c)] if (b, k, c) in base else float("nan")
              for c in ("off", "sync")]
        chosen = ""
        if r.get("guard_chosen"):  # steps per choice in the last timed pass (F: fan-out, 0: plain rounds)
            last = r["guard_chosen"][-1]
            chosen = " ".join(f"b{cb}:" + ",".join(f"{f}x{n}" for f, n in sorted(c.items()))
                              for cb, c in sorted(last.items()) if c) + f" sw {r['guard_switches'][-1]}"
        print(f"{b:>5} {k:>2}  {r['config']:<24} {r['tokens_per_s_median']:8.1f} ({r['tokens_per_s_min']:5.1f}-"
              f"{r['tokens_per_s_max']:5.1f}) {vs[0]:7.2f} {vs[1]:7.2f} {r['step_p50_ms_median']:9.2f} "
              f"{r['mean_accepted']:5.2f} {extra}  {r['load_min']:4.1f}-{r['load_max']:<4.1f}  "
              f"{'yes' if r['identical_to_off'] else 'NO'}   {chosen}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "spec_cache", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "args": vars(args), "machine": machine_info(), "pair": "tiny (random weights)",
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all(r["identical_to_off"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
