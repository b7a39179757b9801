"""STEP round trip over loopback TCP: what one remote drafting round costs the engine.

Starts a real worker process (`python -m draftrelay.worker`), connects the numpy-only client and
runs steady-state rounds at 1 and 4 requests: each round every request sends the tokens it
"accepted" (`--accept` drafts + a bonus token) and asks for `--n-out` drafts, as the engine does.
Prints p50/p99 of the client-side round trip, the worker's own drafting time (worker_us, from the
reply) and the empty-frame PING round trip (pure transport), then writes JSON.

    python benchmarks/wire_step.py                                   # CPU, built-in tiny drafter
    python benchmarks/wire_step.py --model random:qwen2.5-0.5b --device cuda --modes graph,eager --budget-s 100
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

from draftrelay.handoff.procinfo import machine_info
from draftrelay.wire import Block, DrafterClient
from draftrelay.worker.process import start_worker_process


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def run_point(client: DrafterClient, n_req: int, n_out: int, accept: int, rounds: int, warmup: int,
              vocab: int, prompt_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)  # the same token stream in every mode, while drafts agree
    base = 1000 * n_req + 100 * n_out  # fresh request ids per point
    ctx = {base + i: 0 for i in range(n_req)}
    pending = {rid: rng.integers(0, vocab, prompt_len).astype(np.int32) for rid in ctx}
    # first round: the prompts (a prefill), not timed
    r = client.step([Block(rid, 0, 0, pending[rid], n_out) for rid in ctx], timeout=120)
    rtt, wus, drafts = [], [], []
    for k in range(warmup + rounds):
        for i, rid in enumerate(ctx):
            ctx[rid] += len(pending[rid])
            d = r[i].drafts
            pending[rid] = np.concatenate([d[:accept], rng.integers(0, vocab, 1)]).astype(np.int32)
        blocks = [Block(rid, 0, ctx[rid], pending[rid], n_out) for rid in ctx]
        t0 = time.perf_counter()
        r = client.step(blocks, timeout=60)
        dt = time.perf_counter() - t0
        assert all(b.status == 0 for b in r), [b.status for b in r]
        drafts.append(r.drafts[:, :n_out].tolist())
        if k >= warmup:
            rtt.append(dt)
            wus.append(r.worker_us * 1e-6)
    return {"requests": n_req, "n_out": n_out, "accept": accept, "rounds": rounds,
            "rtt_p50_ms": pct(rtt, 50), "rtt_p99_ms": pct(rtt, 99), "rtt_mean_ms": float(np.mean(rtt) * 1e3),
            "worker_p50_ms": pct(wus, 50), "worker_p99_ms": pct(wus, 99),
            "transport_p50_ms": pct(np.asarray(rtt) - np.asarray(wus), 50), "_drafts": drafts}


def gpu_memory_used() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_mode(args, mode: str, save=None) -> dict:
    n_outs = [int(x) for x in args.n_out.split(",")]
    reqs = [int(x) for x in args.requests.split(",")]
    wargs = ["--model", args.model, "--device", args.device, "--rows", "8", "--max-requests", "8",
             "--max-ctx", str(args.max_ctx), "--n-out-max", "8", "--mode", mode]
    if mode == "graph":
        wargs += ["--warm-graphs", args.n_out, "--warm-batch", str(max(reqs))]
    t0 = time.perf_counter()
    w = start_worker_process(wargs, timeout=600)
    start_s = time.perf_counter() - t0
    log_tail = ""
    try:
        client = DrafterClient(w.host, w.port, max_requests=8, n_out_max=8, timeout=10)
        info = client.connect(timeout=30)
        pings = [client.ping() for _ in range(args.warmup + args.rounds)][args.warmup:]
        points = []
        for n_out in n_outs:
            for n_req in reqs:
                if time.monotonic() > args.deadline:
                    print(f"[{mode}] budget spent: {n_req} request(s), n_out {n_out} skipped", flush=True)
                    points.append({"requests": n_req, "n_out": n_out, "skipped": "--budget-s spent", "_drafts": []})
                    continue
                p = run_point(client, n_req, n_out, min(args.accept, n_out), args.rounds, args.warmup,
                              info.vocab_size, args.prompt_len, seed=n_req * 100 + n_out)
                points.append(p)
                if save:
                    save({"mode": mode, "worker": w.banner, "points": points, "partial": True})
                print(f"[{mode}] {n_req} request(s), n_out {n_out}: STEP round trip p50 {p['rtt_p50_ms']:.3f} ms "
                      f"p99 {p['rtt_p99_ms']:.3f} ms | worker drafting p50 {p['worker_p50_ms']:.3f} ms | "
                      f"transport+codec p50 {p['transport_p50_ms']:.3f} ms", flush=True)
        print(f"[{mode}] PING round trip p50 {pct(pings, 50):.3f} ms p99 {pct(pings, 99):.3f} ms", flush=True)
        mem = gpu_memory_used() if args.device.startswith("cuda") else ""
        client.close()
    finally:
        log_tail = w.log()[-3000:]
        w.stop()
    if log_tail.strip():
        print(f"[{mode}] worker log tail:\n{log_tail}", flush=True)
    return {"mode": mode, "worker": w.banner, "worker_start_s": start_s, "gpu_memory_used": mem,
            "ping_p50_ms": pct(pings, 50), "ping_p99_ms": pct(pings, 99), "points": points}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="eager", help="comma list of worker --mode values (eager, static, graph)")
    ap.add_argument("--requests", default="1,4")
    ap.add_argument("--n-out", default="4")
    ap.add_argument("--accept", type=int, default=2, help="drafts accepted per round (+1 bonus token)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop starting new points after this many seconds (0: no limit); the JSON names the skipped")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else float("inf")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"wire_step_{'gpu' if args.device.startswith('cuda') else 'cpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    runs, failed = [], []

    def save(current=None) -> None:  # after every point: a run cut short still leaves its figures
        done = [{**r, "points": [{k: v for k, v in p.items() if k != "_drafts"} for p in r["points"]]}
                for r in runs + ([current] if current else [])]
        with open(out, "w") as f:
            json.dump({"benchmark": "wire_step", "partial": True, "model": args.model, "device": args.device,
                       "runs": done, "failed": failed, "env": machine_info()}, f, indent=1)

    for m in args.modes.split(","):
        try:
            runs.append(run_mode(args, m, save))
        except Exception as exc:  # keep the other modes' figures; say what failed
            print(f"[{m}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append({"mode": m, "error": f"{type(exc).__name__}: {exc}"})
    # parity between modes: same drafts round by round (same inputs while they agree)
    parity = []
    for other in runs[1:]:
        for p0, p1 in zip(runs[0]["points"], other["points"], strict=True):
            a, b = p0["_drafts"], p1["_drafts"]
            if not a or not b:
                continue  # a skipped point
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            parity.append({"modes": [runs[0]["mode"], other["mode"]], "requests": p0["requests"],
                           "n_out": p0["n_out"], "rounds": len(a), "first_mismatch_round": first})
            print(f"parity {runs[0]['mode']} vs {other['mode']} ({p0['requests']} req, n_out {p0['n_out']}): "
                  + ("identical drafts in all rounds" if first is None else f"first differing round {first}"))
    for r in runs:
        for p in r["points"]:
            del p["_drafts"]
    result = {"benchmark": "wire_step", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python", "benchmarks/wire_step.py"] + (argv if argv is not None else sys.argv[1:])),
              "model": args.model, "device": args.device, "accept": args.accept, "prompt_len": args.prompt_len,
              "runs": runs, "failed": failed, "parity": parity, "env": machine_info()}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
