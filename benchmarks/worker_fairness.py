"""Compute fairness of the worker: one session floods it with long prompts, another times its STEPs.

The flooder sends frames of `--prompts` x `--prompt-len`-token first-round prompts (a new set of
requests every frame, as engines admitting long requests do); the victim runs steady-state rounds
(1 request, `--n-out` drafts, 3 accepted tokens per round; its STEPs are first timed alone, the
host's own noise floor). Both run against one real worker
process, first with prefill slicing off (`--prefill-slice-ms -1`, the old behaviour: a frame holds
the drafter for all its prompts), then on (the default), side by side in one run. Prints the
victim's STEP round trip p50 / p99 / max and p99 / p50 for each, and writes JSON.

    python benchmarks/worker_fairness.py                       # CPU, tiny drafter, 8 x 4,000 tokens
    python benchmarks/worker_fairness.py --prompt-len 1000 --victim-steps 150   # quicker
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

import numpy as np

from draftrelay.wire import Block, DrafterClient
from draftrelay.worker.process import start_worker_process


def measure(worker_args: list[str], prompts: int, prompt_len: int, victim_steps: int, n_out: int,
            vocab: int, warmup: int = 20) -> dict:
    with start_worker_process(worker_args, timeout=120, env={"OMP_NUM_THREADS": "1"}) as w:
        victim = DrafterClient(w.host, w.port, max_requests=1, n_out_max=n_out, timeout=30.0)
        flood = DrafterClient(w.host, w.port, max_requests=prompts, n_out_max=n_out, timeout=300.0)
        rng = np.random.default_rng(0)
        ctx = 8
        r = victim.step([Block(1, 0, 0, rng.integers(0, vocab, ctx).astype(np.int32), n_out)])
        alone = []
        for k in range(warmup + victim_steps):  # the victim alone: the host's own noise floor
            toks = np.concatenate([r[0].drafts[:2], rng.integers(0, vocab, 1)]).astype(np.int32)
            t0 = time.perf_counter()
            r = victim.step([Block(1, 0, ctx, toks, n_out)])
            if k >= warmup:
                alone.append(time.perf_counter() - t0)
            ctx += 3
        stop = threading.Event()
        frames: list[float] = []

        def flooder() -> None:
            g = 0
            frng = np.random.default_rng(1)
            while not stop.is_set():
                g += 1
                blocks = [Block(100 + i, g, 0, frng.integers(0, vocab, prompt_len).astype(np.int32), n_out)
                          for i in range(prompts)]
                t0 = time.perf_counter()
                flood.step(blocks)
                frames.append(time.perf_counter() - t0)

        th = threading.Thread(target=flooder, daemon=True)
        th.start()
        time.sleep(0.2)
        rtt = []
        for _ in range(victim_steps):
            toks = np.concatenate([r[0].drafts[:2], rng.integers(0, vocab, 1)]).astype(np.int32)
            if ctx + 3 + n_out >= 2000:
                ctx = 8  # restart the request before the context ends (generation 0 -> position 0 rewind)
                toks = rng.integers(0, vocab, ctx).astype(np.int32)
                r = victim.step([Block(1, 0, 0, toks, n_out)])
                continue
            t0 = time.perf_counter()
            r = victim.step([Block(1, 0, ctx, toks, n_out)])
            rtt.append(time.perf_counter() - t0)
            ctx += 3
        stop.set()
        th.join(timeout=300)
        victim.close()
        flood.close()
    ms, ms0 = np.asarray(rtt) * 1e3, np.asarray(alone) * 1e3
    p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
    a50, a99 = float(np.percentile(ms0, 50)), float(np.percentile(ms0, 99))
    return {"victim_steps": len(rtt), "p50_ms": p50, "p99_ms": p99, "max_ms": float(ms.max()),
            "p99_over_p50": p99 / p50, "alone_p50_ms": a50, "alone_p99_ms": a99, "alone_p99_over_p50": a99 / a50,
            "flood_frames": len(frames),
            "flood_frame_s_median": float(np.median(frames)) if frames else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--victim-steps", type=int, default=300)
    ap.add_argument("--off-steps", type=int, default=40,
                    help="victim STEPs timed with slicing off (each may wait a whole flood frame)")
    ap.add_argument("--n-out", type=int, default=4)
    ap.add_argument("--slice-ms", default="-1,0", help="comma list of --prefill-slice-ms values to compare")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    base = ["--model", args.model, "--device", args.device, "--rows", str(args.prompts + 2), "--max-requests",
            str(args.prompts), "--max-ctx", str(max(4096, args.prompt_len + 64)), "--n-out-max", str(args.n_out),
            "--frame-timeout", "60"]
    vocab = 256 if args.model == "tiny" else 1000
    runs = {}
    for sl in args.slice_ms.split(","):
        name = "slicing off" if float(sl) < 0 else f"slicing on ({'auto' if float(sl) == 0 else sl + ' ms'})"
        print(f"{name} ...", file=sys.stderr, flush=True)
        runs[sl] = measure(base + ["--prefill-slice-ms", sl], args.prompts, args.prompt_len,
                           args.off_steps if float(sl) < 0 else args.victim_steps, args.n_out, vocab)
        m = runs[sl]
        print(f"  {name:24} victim STEP p50 {m['p50_ms']:.2f} ms  p99 {m['p99_ms']:.2f} ms  max {m['max_ms']:.1f} ms"
              f"  p99/p50 {m['p99_over_p50']:.2f}  ({m['victim_steps']} steps, {m['flood_frames']} flood frames; "
              f"alone: p50 {m['alone_p50_ms']:.2f} p99 {m['alone_p99_ms']:.2f} ms, p99/p50 "
              f"{m['alone_p99_over_p50']:.2f})")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "worker_fairness.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"benchmark": "worker_fairness", "model": args.model, "device": args.device,
                   "prompts": args.prompts, "prompt_len": args.prompt_len, "n_out": args.n_out, "runs": runs,
                   "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
