"""The engine workload table: off / sync / async round modes side by side, per workload.

Workloads (the seed's shape): short prompts x 3, 32K x 3, 32K with 3 concurrent requests, 128K x 2.
Target: a Qwen2.5-7B-shaped model (7.6B, the 0.5B drafter's vocabulary) at random weights (decode
timing does not depend on weight values); drafter: a Qwen2.5-0.5B-shaped model at random weights
served by a real `draftrelay worker` process on loopback TCP, through the real proxy process.

For every request: one prefill (TTFT), then the same prefilled KV is decoded in each mode in turn
(the modes are interleaved per request, so drift hits them alike): `--warmup` steps first (they also
cover the drafter catching up on a long context, in bounded rounds), then `--steps` timed steps.
Reported per request: the direct per-step timer p50 (engine step wall time; with random weights
nearly nothing is accepted, so this is the cost of one speculative step), and the median split of
a step into submit / wait / verify / host (see engine/metrics.py).

    python benchmarks/engine_workloads.py                       # GPU defaults (H200-sized)
    python benchmarks/engine_workloads.py --device cpu --target tiny --drafter tiny --ctx-scale 1024 --steps 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

from draftrelay import model as M
from draftrelay.checkpoint.hf import save_hf_dir
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.engine.loading import handoff_config
from draftrelay.handoff.procinfo import machine_info
from draftrelay.handoff.rounds import SyncRounds, open_rounds
from draftrelay.worker.drafters import SHAPES
from draftrelay.worker.process import start_worker_process

# Qwen2.5-7B (its vocabulary is the 0.5B's: the handshake requires the same one), at the full context
TARGET_SHAPES = {"qwen2.5-7b": {**SHAPES["qwen2.5-7b"], "max_position_embeddings": 262144}}
DRAFTER_SHAPES = {"qwen2.5-0.5b": {**SHAPES["qwen2.5-0.5b"], "max_position_embeddings": 262144}}
# name -> (context tokens, requests, concurrent?)
WORKLOADS = {"short": (32, 3, False), "32k": (32768, 3, False), "32k-conc3": (32768, 3, True),
             "128k": (131072, 2, False)}


@torch.no_grad()
def random_model(cfg: M.ModelConfig, dev: torch.device, dtype: torch.dtype, seed: int) -> M.Transformer:
    """Random weights drawn on the device (timing does not depend on their values)."""
    with torch.device("meta"):
        model = M.Transformer(cfg).to(dtype)
    model = model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def target_model(shape: str, dev: torch.device, dtype: torch.dtype) -> M.Transformer:
    """The benchmark target: the tiny pair's target, or random weights of a TARGET_SHAPES shape."""
    if shape == "tiny":
        return M.tiny_pair(device=dev, dtype=dtype)[0]
    return random_model(M.ModelConfig(**TARGET_SHAPES[shape], name=shape), dev, dtype, 1)


def write_drafter_dir(shape: str, path: str, seed: int) -> None:
    cfg = M.ModelConfig(**DRAFTER_SHAPES[shape], name=shape)
    model = random_model(cfg, torch.device("cpu"), torch.bfloat16, seed)
    save_hf_dir(model, path)


def p50(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def prefill_held(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list[float]]:
    """Prefill the prompts together and keep their rows, so every mode can `resume` from the same KV:
    (the requests, their TTFT in seconds)."""
    reqs = [eng.add_request(p, params) for p in prompts]
    if eng.stream is not None:
        torch.cuda.synchronize()
    eng.prefill_waiting()
    ttft = [r.t_first - r.t_arrive for r in reqs]
    for r in reqs:
        eng.cancel(r, keep_row=True)
    return reqs, ttft


def run_group(eng: Engine, prompts: list[list[int]], modes: dict, warmup: int, steps: int, k: int) -> dict:
    """Prefill the prompts together, then decode them in each mode in turn from the same KV."""
    # untimed: the warm-up steps plus the rounds in which the drafter catches up on the context
    warmup += -(-(max(len(p) for p in prompts) + 1) // eng.cfg.max_round_tokens)
    params = SamplingParams(max_tokens=(warmup + steps + 2) * (k + 1) + 2)
    reqs, ttft = prefill_held(eng, prompts, params)
    out = {"ttft_s": ttft, "modes": {}}
    for name, rounds in modes.items():
        eng.set_rounds(rounds)
        for v in eng.timing.values():
            v.clear()
        live = [eng.resume(r) for r in reqs]
        for _ in range(warmup + steps):
            eng.step()
        t = {k2: v[-steps:] for k2, v in eng.timing.items()}
        out["modes"][name] = {
            "round_mode": eng.round_mode,
            "refusal": rounds.refusal if rounds is not None else "",
            "step_p50_ms": [1e3 * p50(r.step_s[-steps:]) for r in live],
            "parts_p50_ms": {k2: 1e3 * p50(v) for k2, v in t.items()},
            "tokens_per_step": [(len(r.output) - 1) / len(r.step_s) for r in live],
            "rounds": [dict(r.rounds) for r in live],
            "first_tokens": [r.output[:8] for r in live],
        }
        for r in live:
            eng.cancel(r, keep_row=True)
    for r in reqs:
        eng.release_row(r.row)
    eng.set_rounds(None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="qwen2.5-7b", help="qwen2.5-7b (random weights) or tiny")
    ap.add_argument("--drafter", default="qwen2.5-0.5b", help="qwen2.5-0.5b (random weights) or tiny")
    ap.add_argument("--workloads", default="short,32k-conc3,32k,128k",
                    help="comma-separated; NAME:graphs runs it with decode graphs (GPU), NAME:ring with the ring")
    ap.add_argument("--ctx-scale", type=int, default=1, help="divide every context length by this (CPU tests)")
    ap.add_argument("--modes", default="off,sync,async")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps (plus the drafter's catch-up rounds)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per request and mode")
    ap.add_argument("--max-round-tokens", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--deadline-ms", type=float, default=2000.0,
                    help="watchdog deadline (generous: catch-up rounds prefill up to max-round-tokens)")
    ap.add_argument("--worker-device", default="",
                    help="the drafter worker's device (default: --device); e.g. cuda:1 puts it on the second GPU")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="skip workloads that would start after this")
    ap.add_argument("--out", default="benchmarks/results/engine_workloads.json")
    args = ap.parse_args()

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    modes = [m for m in args.modes.split(",") if m]
    scale = max(1, args.ctx_scale)
    plan = []  # (label, workload, graphs, ring)
    for item in [w for w in args.workloads.split(",") if w]:
        name, _, opt = item.partition(":")
        if name not in WORKLOADS or opt not in ("", "graphs", "ring"):
            ap.error(f"--workloads: unknown item {item!r} (known: {', '.join(WORKLOADS)}, with :graphs or :ring)")
        plan.append((item, name, opt in ("graphs", "ring"), opt == "ring"))

    def ctx_of(name: str) -> int:
        return max(1, WORKLOADS[name][0] // scale)

    def row_len(name: str) -> int:
        catch_up = -(-(ctx_of(name) + 1) // args.max_round_tokens)
        return ctx_of(name) + (args.warmup + catch_up + args.steps + 4) * (args.k + 1) + 16

    max_row = max(row_len(name) for _, name, _, _ in plan)
    result = {"env": {**machine_info(), "device": str(dev)}, "args": vars(args), "workloads": {}}

    def save() -> None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    target = target_model(args.target, dev, dtype)
    result["target"] = {"shape": args.target, "params": target.cfg.n_params(), "dtype": str(dtype)}
    tmp = tempfile.mkdtemp(prefix="draftrelay-bench-")
    if args.drafter == "tiny":
        wargs, model_id = ["--model", "tiny"], M.tiny_model_id()
    else:
        ddir = os.path.join(tmp, f"random-{args.drafter}")
        write_drafter_dir(args.drafter, ddir, 2)
        wargs, model_id = ["--model", ddir], os.path.basename(ddir)
    wdev = args.worker_device or str(dev)
    result["worker_device"] = wdev
    worker = start_worker_process(wargs + ["--device", wdev, "--max-ctx", str(max_row + 64), "--rows", "8",
                                           "--max-requests", "4", "--n-out-max", str(max(8, args.k))],
                                  timeout=300, env={"OMP_NUM_THREADS": "1"} if dev.type == "cpu" else None)
    result["worker"] = worker.banner
    print(worker.banner, flush=True)
    wd = torch.device(wdev)
    same_gpu = wd.type == dev.type and (wd.index or 0) == (dev.index or 0)
    # sync and async rounds are open at once: two worker sessions, each reserving max_requests rows
    spec = {"kind": "worker", "host": worker.host, "port": worker.port, "model_id": model_id,
            "n_out_max": args.k, "max_requests": 4}
    h = handoff_config(spec, dev, args.deadline_ms, same_gpu, vocab_size=target.cfg.vocab_size,
                       max_drafts=max(8, args.k), max_requests=4, max_tokens=max(32768, args.max_round_tokens * 4),
                       round_budget_ms=args.deadline_ms * 0.9)
    result["cuda_wait"] = h.cuda_wait or "auto"
    # one engine stream for every engine: the CUDA hand-off enqueues on the stream current at its start
    stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
    rounds: dict = {}
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for m in modes:
                rounds[m] = None if m == "off" else (SyncRounds(h) if m == "sync" else open_rounds(h))
        result["async_refusal"] = rounds["async"].refusal if rounds.get("async") is not None else ""
        gen = torch.Generator().manual_seed(0)
        V = target.cfg.vocab_size
        for label, name, graphs, ring in plan:
            if time.perf_counter() - t_start > args.time_budget_s:
                result["workloads"][label] = {"skipped": "time budget"}
                save()
                continue
            ctx, n, conc = WORKLOADS[name]
            L = ctx_of(name)
            groups = [[torch.randint(0, V, (L,), generator=gen).tolist() for _ in range(n)]] if conc else \
                [[torch.randint(0, V, (L,), generator=gen).tolist()] for _ in range(n)]
            t0 = time.perf_counter()
            eng = None
            try:
                # a cache sized for this workload (graphs attend over the whole row, so size matters)
                cfg = EngineConfig(mode="off", n_draft=args.k, max_batch=n if conc else 1, max_len=row_len(name),
                                   prefill_chunk=args.prefill_chunk, max_round_tokens=args.max_round_tokens,
                                   graphs=graphs, slot_ring=ring)
                eng = Engine(target, cfg, stream=stream)
                runs = [run_group(eng, g, rounds, args.warmup, args.steps, args.k) for g in groups]
                result["workloads"][label] = {"context": L, "requests": n, "concurrent": conc, "graphs": graphs,
                                              "ring": ring, "runs": runs, "wall_s": time.perf_counter() - t0}
            except Exception as exc:  # record and go on with the next workload (e.g. out of memory)
                traceback.print_exc()
                result["workloads"][label] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                if eng is not None:
                    eng.close()  # the rounds came in through set_rounds: the benchmark closes them below
                del eng
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            print(format_row(label, result["workloads"][label], modes), flush=True)
            save()
        result["handoff"] = {m: r.stats() for m, r in rounds.items() if r is not None}
    finally:
        for r in rounds.values():
            if r is not None:
                r.close()  # a worker session included
        result["worker_log_tail"] = worker.log()[-3000:]  # e.g. a graph capture that fell back to eager
        worker.stop()
    result["wall_s"] = time.perf_counter() - t_start
    result["table"] = [header(modes)] + [format_row(n, w, modes) for n, w in result["workloads"].items()]
    result["split"] = ["step split, median ms (submit / wait / verify / host = step)"] + [
        format_split(n, w, modes) for n, w in result["workloads"].items() if "runs" in w]
    save()
    print("\n".join([""] + result["table"] + [""] + result["split"]))
    print(f"wrote {args.out}")
    return 0


def header(modes: list[str]) -> str:
    return "workload        " + "  ".join(f"{m + ' step p50 ms':>26}" for m in modes) + "  async vs sync   TTFT s"


def format_split(name: str, w: dict, modes: list[str]) -> str:
    cells = []
    for m in modes:
        parts = [run["modes"][m]["parts_p50_ms"] for run in w["runs"]]
        avg = {k: statistics.mean(p[k] for p in parts) for k in ("submit", "wait", "verify", "host", "step")}
        cells.append(f"{m}: {avg['submit']:.2f}/{avg['wait']:.2f}/{avg['verify']:.2f}/{avg['host']:.2f}"
                     f"={avg['step']:.2f}")
    return f"{name:<15} " + "   ".join(cells)


def format_row(name: str, w: dict, modes: list[str]) -> str:
    if "runs" not in w:
        return f"{name:<15} {w.get('error') or w.get('skipped') or 'skipped'}"
    per_mode = {m: [x for run in w["runs"] for x in run["modes"][m]["step_p50_ms"]] for m in modes}
    cells = ["/".join(f"{x:.1f}" for x in per_mode[m]).rjust(26) for m in modes]
    gain = ""
    if "sync" in per_mode and "async" in per_mode:
        s, a = statistics.mean(per_mode["sync"]), statistics.mean(per_mode["async"])
        gain = f"{100 * (a - s) / s:+.1f} %"
    ttft = [x for run in w["runs"] for x in run["ttft_s"]]
    return f"{name:<15} " + "  ".join(cells) + f"  {gain:>13}   {min(ttft):.2f}-{max(ttft):.2f}"


if __name__ == "__main__":
    sys.exit(main())
