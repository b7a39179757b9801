"""`draftrelay generate`: one prompt, chosen models, round mode and sampling settings.

The text goes to stdout; progress (on runs longer than a second) and the metrics line go to stderr.
Modes sync/async start a local drafter worker unless `--worker HOST:PORT` names a running one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--model", default="tiny",
                   help="target: 'tiny' (built-in), a local HF model directory or a .gguf file")
    p.add_argument("--drafter", default="tiny",
                   help="drafter of the local worker: 'tiny', a local HF directory or a .gguf file")
    p.add_argument("--worker", default="", metavar="HOST:PORT", help="use a running `draftrelay worker`")
    p.add_argument("--mode", default="async", choices=["off", "sync", "async"], help="round mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=None,
                   help="drafts per round, fixed (default: the depth policy picks 0..--k-max each step)")
    p.add_argument("--k-max", type=int, default=6, help="deepest draft the depth policy may ask")
    p.add_argument("--round-budget-ms", type=float, default=None,
                   help="what the proxy allows one round (default: from the worker's measured STEP)")
    p.add_argument("--worker-threads", type=int, default=0, help="CPU threads of the local worker (0: all cores)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="watchdog deadline of an async round (default: round budget + 50 ms)")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for the verify forward (GPU)")
    p.add_argument("--slot-ring", action="store_true", help="two-slot decode-graph ring (with --graphs)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress line on stderr (auto: after the first second of decoding)")
    p.add_argument("--json", default="", metavar="PATH", help="write the metrics to this file")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the hand-off and recovery counters (Prometheus) on 127.0.0.1:PORT while running")


class Progress:
    """A one-line progress display on stderr, refreshed at most 5 times a second."""

    def __init__(self, total: int, mode: str) -> None:
        self.total, self.mode = total, mode
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, eng) -> None:
        now = time.perf_counter()
        if self.mode == "off" or now - self.last < 0.2 or (self.mode == "auto" and now - self.t0 < 1.0):
            return
        self.last = now
        reqs = eng.running + eng.finished
        done = sum(len(r.output) for r in reqs)
        kept = [k for r in reqs for k in r.kept]
        acc = f"  accepted/round {sum(kept) / len(kept):.2f}" if kept else ""
        rate = done / (now - self.t0)
        print(f"\r  {done}/{self.total} tokens  {rate:.1f} tok/s{acc}   ", end="", file=sys.stderr, flush=True)
        self.shown = True

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    k_max = args.k if args.k is not None else args.k_max
    if args.max_tokens < 1 or not 0 <= k_max <= 16 or args.temperature < 0 or args.top_k < 0:
        print("draftrelay generate: need --max-tokens >= 1, 0 <= --k (--k-max) <= 16, --temperature >= 0, "
              "--top-k >= 0", file=sys.stderr)
        return 2
    if any(x is not None and x <= 0 for x in (args.round_budget_ms, args.deadline_ms)) or args.worker_threads < 0:
        print("draftrelay generate: --round-budget-ms and --deadline-ms must be > 0, --worker-threads >= 0",
              file=sys.stderr)
        return 2
    if args.slot_ring and not args.graphs:
        print("draftrelay generate: --slot-ring needs --graphs", file=sys.stderr)
        return 2
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    from draftrelay.model import ModelError

    from . import loading as L
    from .engine import Engine, EngineConfig, SamplingParams

    try:
        dev = L.pick_device(args.device)
        if args.graphs and dev.type != "cuda":
            raise ValueError("--graphs needs a CUDA device")
        host, port = L.parse_hostport(args.worker) if args.worker else ("", 0)
        target = L.load_target(args.model, dev)
    except (ValueError, ModelError, OSError) as exc:
        print(f"draftrelay generate: {exc}", file=sys.stderr)
        return 2
    ids = target.tokenizer.encode(prompt)
    if not ids:
        print("draftrelay generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    max_len = len(ids) + args.max_tokens + k_max + 8
    worker = None
    try:
        h = None
        if args.mode != "off":
            if not args.worker:
                try:
                    worker = L.start_local_worker(args.drafter, dev, k_max, max_len + 64, 1, args.worker_threads)
                except RuntimeError as exc:
                    print(f"draftrelay generate: the local worker did not start: {exc}", file=sys.stderr)
                    return 1
                host, port = worker.host, worker.port
            spec = L.worker_spec(host, port, L.drafter_model_id(args.drafter) if not args.worker else "",
                                 target.tokenizer_hash, k_max, 8)
            why = L.check_worker(spec)
            if why:
                print(f"draftrelay generate: the worker refused us: {why}", file=sys.stderr)
                return 1
            rs = L.round_settings(spec, ids, k_max, args.round_budget_ms, args.deadline_ms)
            print(f"draftrelay generate: {rs.note}", file=sys.stderr)
            h = L.handoff_config(spec, dev, rs.deadline_ms, not args.worker, round_budget_ms=rs.budget_ms)
        cfg = EngineConfig(mode=args.mode, n_draft=k_max, max_batch=1, max_len=max_len, handoff=h,
                           graphs=args.graphs, slot_ring=args.slot_ring,
                           depth="fixed" if args.k is not None else "auto",
                           round_costs_s=rs.round_costs_s if h else None)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                seed=args.seed, stop_token_ids=target.stop_ids)
        progress = Progress(args.max_tokens, args.progress)
        with Engine(target.model, cfg) as eng:
            server = None
            if args.metrics_port:
                from draftrelay.handoff import metrics

                stats = lambda: eng.rounds.stats() if eng.rounds else {"mode": "off"}  # noqa: E731
                server, _ = metrics.serve(args.metrics_port, stats)
            try:
                (req,) = eng.generate([ids], params, on_step=progress)
            finally:
                progress.close()
                if server is not None:
                    server.shutdown()
            m = eng.metrics([req])
    finally:
        if worker is not None:
            worker.stop()
    print(prompt + target.tokenizer.decode(req.output) if isinstance(target.tokenizer, L.HFTokenizer)
          else L.printable(prompt + target.tokenizer.decode(req.output)))
    t = m["total"]
    r = t["rounds"]
    refusal = f" (async refused: {t['refusal']})" if t["refusal"] else ""
    print(f"[{args.mode}{refusal}] {t['output_tokens']} tokens, {t['tokens_per_s']:.1f} tok/s, "
          f"TTFT {1e3 * t['ttft_s_mean']:.1f} ms, step p50 {t['step_p50_ms']:.2f} ms, "
          f"accepted/round {t['mean_accepted']:.2f}, rounds ok/failed/watchdog/target-only "
          f"{r['ok']}/{r['failed']}/{r['watchdog']}/{r['target_only']}"
          + (f", depth chosen {t['depth']['chosen']}" if "depth" in t else ""), file=sys.stderr)
    if t.get("speculation_warning"):
        print(f"draftrelay generate: WARNING: {t['speculation_warning']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    return 0
