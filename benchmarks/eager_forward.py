"""What one eager forward of the drafter costs on a GPU, and where its time goes.

A worker drafts from CUDA graphs captured at start; a request catching up on more tokens than a steady
round sends (after plain steps, or a new prompt) is first extended by one eager forward
(worker/drafters.LlamaDrafter._extend_heads). On the H200 such rounds took 70-140 ms for one to sixteen
requests against ~3 ms for a steady one (the worker's slow-STEP log). This times, side by side in one
run, the eager forward alone at several (requests x tokens) on the fast path (the fused kernels) and
the plain path (`model.fast = False`), the whole catch-up round as the worker runs it (extension, then
the captured step), and profiles one eager forward (operators by host time, kernel count).

    python benchmarks/eager_forward.py --shape qwen2.5-0.5b --out benchmarks/results/eager_forward_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from draftrelay.worker.drafters import Job, load_drafter  # noqa: E402


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, t = item.partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise SystemExit(f"--cases: {item!r} is not REQUESTSxTOKENS (e.g. 1x16)")
        out.append((int(b), int(t)))
    return out


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_forward(d, B: int, T: int, iters: int, keep: int = 64) -> list[float]:
    model, cache, dev = d.model, d.cache, d.model.device
    rng = np.random.default_rng(0)
    toks = torch.from_numpy(rng.integers(0, model.cfg.vocab_size, (B, T))).to(dev)
    rows = torch.arange(B)
    times = []
    with torch.inference_mode():
        for r in range(B):  # a context to extend, as a catch-up has
            cache.lengths[r] = 0
            model(torch.zeros((1, keep), dtype=torch.int64, device=dev), torch.tensor([0]), cache, torch.tensor([r]),
                  last_only=True)
        for i in range(iters + 2):
            for r in range(B):
                cache.truncate(r, keep)
            sync(dev)
            t0 = time.perf_counter()
            model(toks, torch.full((B,), keep), cache, rows, logits_at=torch.zeros(B, dtype=torch.int64, device=dev))
            sync(dev)
            if i >= 2:  # the first two: first use of the shape
                times.append(time.perf_counter() - t0)
    return times


def time_catch_up(d, B: int, T: int, iters: int, n_out: int, keep: int = 64) -> list[float]:
    """The worker's round for B requests each sending T tokens: _fit_built / _extend_heads, then the step."""
    rng = np.random.default_rng(1)
    times = []
    for i in range(iters + 2):
        jobs = [Job(r, keep, rng.integers(0, d.vocab_size, T).astype(np.int32)) for r in range(B)]
        for r in range(B):
            d.cache.lengths[r] = max(int(d.cache.lengths[r]), keep)
        sync(d.model.device)
        t0 = time.perf_counter()
        d.run(jobs, n_out)
        sync(d.model.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def ms(ts: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts), "n": len(ts)}


def profile(d, B: int, T: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.model.device.type == "cuda" else [])
    time_forward(d, B, T, 1)
    with prof(activities=acts) as p:
        time_forward(d, B, T, 1)
    rows = []
    for e in sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append({"op": e.key[:80], "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "device_ms": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3})
    kernels = sum(e.count for e in p.key_averages() if getattr(e, "device_type", None) is not None
                  and str(e.device_type).endswith("CUDA"))
    return {"case": f"{B}x{T}", "note": "3 forwards inside (2 warm, 1 timed) plus the context set-up",
            "top_by_self_cpu": rows, "device_kernel_events": kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="drafter shape at random weights (worker SHAPES)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="1x1,1x16,4x16,16x16,16x48,1x256",
                    help="eager forwards to time, REQUESTSxTOKENS")
    ap.add_argument("--catch-up", default="1x17,4x24,16x32", help="catch-up rounds to time, REQUESTSxTOKENS")
    ap.add_argument("--k", type=int, default=4, help="drafts per round (the worker's captured steps)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default="1x16", help="the case to profile ('' : none)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cases, catch = parse_cases(args.cases), parse_cases(args.catch_up) if args.catch_up else []
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: must be at least 1")
    n_rows = max([b for b, _ in cases + catch] + [1])
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    d = load_drafter(f"random:{args.shape}", device=str(dev), n_rows=n_rows, max_ctx=2048, n_out_max=8)
    d.plan_warm()
    result = {"command": " ".join(["python", "benchmarks/eager_forward.py", *sys.argv[1:]]), "shape": args.shape,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "drafter": d.info,
              "forward": {}, "catch_up": {}}
    for B, T in cases:
        row = {}
        for label, fast in (("fast", None), ("plain", False)):
            d.model.fast = fast
            row[label] = ms(time_forward(d, B, T, args.iters))
        d.model.fast = None
        result["forward"][f"{B}x{T}"] = row
        print(f"eager forward {B:>2} x {T:>3}: fast {row['fast']['median_ms']:7.2f} ms, "
              f"plain {row['plain']['median_ms']:7.2f} ms", flush=True)
    if catch and d.mode == "graph":
        t1 = time.perf_counter()
        built = d.warm([args.k], n_rows, 512)
        result["warm"] = {"graphs": built, "seconds": time.perf_counter() - t1}
        for B, T in catch:
            steady = ms(time_catch_up(d, B, min(T, args.k + 1), args.iters, args.k))
            row = {"steady": steady, "catch_up": ms(time_catch_up(d, B, T, args.iters, args.k)),
                   "extended": d._extended}
            result["catch_up"][f"{B}x{T}"] = row
            print(f"round {B:>2} x {T:>3}: catch-up {row['catch_up']['median_ms']:7.2f} ms, steady ({args.k + 1} "
                  f"tokens) {steady['median_ms']:6.2f} ms", flush=True)
    if args.profile:
        (B, T), = parse_cases(args.profile)
        result["profile"] = profile(d, B, T, args.top)
        for r in result["profile"]["top_by_self_cpu"][:args.top]:
            print(f"  {r['op']:<60} x{r['count']:<5} host {r['self_cpu_ms']:8.2f} ms  device {r['device_ms']:8.2f} ms")
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
