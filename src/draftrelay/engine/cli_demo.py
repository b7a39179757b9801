"""`draftrelay demo`: a local drafter worker + the proxy on loopback, the same prompts decoded in
off, sync and async round modes, outputs and a side-by-side table.

With no arguments it uses the built-in tiny pair (a 4-layer target and a 1-layer drafter made from
its first layer, random weights: the text is arbitrary bytes, but it is the same text in every mode,
and the drafter agrees with the target often enough to show what speculation does). It runs on a
CPU in well under a minute and uses the GPU when there is one. `--model DIR --drafter DIR` serve
real checkpoints (Llama-family HF directories with the same tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding works by",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="target: 'tiny' (built-in) or a local HF model directory")
    p.add_argument("--drafter", default="tiny", help="drafter for the local worker: 'tiny' or a local HF directory")
    p.add_argument("--worker", default="", metavar="HOST:PORT",
                   help="use a running `draftrelay worker` instead of starting one")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: three built-in)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    p.add_argument("--k", type=int, default=4, help="drafts per request per round")
    p.add_argument("--modes", default="off,sync,async",
                   help="comma-separated subset of off,sync,async,cache (cache: async + the speculation cache)")
    p.add_argument("--spec-cache", type=int, default=0, nargs="?", const=8, metavar="F",
                   help="add a 'cache' row: async rounds with the speculation cache, F branches per request "
                        "(no value: 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs identical across modes)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--deadline-ms", type=float, default=200.0, help="watchdog deadline of an async round")
    p.add_argument("--json", default="", metavar="PATH", help="also write every mode's metrics to this file")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("off", "sync", "async", "cache")]
    if bad or not modes:
        print(f"draftrelay demo: --modes {args.modes!r}: each must be off, sync, async or cache", file=sys.stderr)
        return 2
    if args.spec_cache and "cache" not in modes:
        modes.append("cache")  # async rounds + the speculation cache
    from .cli_generate import check_flags

    bad = check_flags(args)  # one message per bad flag
    for line in bad:
        print(f"draftrelay demo: {line}", file=sys.stderr)
    if bad:
        return 2
    import torch

    from draftrelay.model import ModelError

    from . import loading as L
    from .engine import Engine, EngineConfig, SamplingParams

    t_start = time.perf_counter()
    try:
        dev = L.pick_device(args.device)
        host, port = L.parse_hostport(args.worker) if args.worker else ("", 0)
        target = L.load_target(args.model, dev)
    except (ValueError, ModelError, OSError) as exc:
        print(f"draftrelay demo: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEFAULT_PROMPTS
    ids = [target.tokenizer.encode(p) for p in prompts]
    if any(not x for x in ids):
        print("draftrelay demo: a prompt encodes to no tokens", file=sys.stderr)
        return 2
    max_len = max(len(x) for x in ids) + args.max_tokens + args.k + 8
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop_token_ids=target.stop_ids)
    print(f"draftrelay demo: target {target.name} ({target.model.cfg.n_params() / 1e6:.2f}M params) on {dev}, "
          f"drafter {args.drafter if not args.worker else args.worker}, k={args.k}, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens")

    worker = None
    try:
        if any(m != "off" for m in modes):
            if not args.worker:
                try:
                    worker = L.start_local_worker(args.drafter, dev, args.k, max_len + 64, len(prompts))
                except RuntimeError as exc:
                    print(f"draftrelay demo: the local worker did not start: {exc}", file=sys.stderr)
                    return 1
                host, port = worker.host, worker.port
                print(f"  worker: {worker.banner}")
            spec = L.worker_spec(host, port, L.drafter_model_id(args.drafter) if not args.worker else "",
                                 target.tokenizer_hash, args.k, max(8, len(prompts)))
            spec["vocab_size"] = target.model.cfg.vocab_size  # a drafter of another vocabulary is refused now
            why = L.check_worker(spec)
            if why:
                print(f"draftrelay demo: the worker refused us: {why}", file=sys.stderr)
                return 1
        results: dict[str, dict] = {}
        outputs: dict[str, list[list[int]]] = {}
        for mode in modes:
            h = L.handoff_config(spec, dev, args.deadline_ms, not args.worker) if mode != "off" else None
            cache = (args.spec_cache or 8) if mode == "cache" else 0
            cfg = EngineConfig(mode="async" if cache else mode, n_draft=args.k, max_batch=len(prompts),
                               max_len=max_len, handoff=h, spec_fanout=cache)
            with Engine(target.model, cfg) as eng:
                eng.generate([ids[0]], SamplingParams(max_tokens=min(4, args.max_tokens)))  # warm-up
                eng.reset_metrics()
                reqs = eng.generate(ids, params)
                results[mode] = eng.metrics(reqs)
            outputs[mode] = [r.output for r in reqs]
            t = results[mode]["total"]
            note = f" (async refused: {t['refusal']})" if t["refusal"] else ""
            print(f"  [{mode}] {t['output_tokens']} tokens in {t['wall_s']:.2f} s{note}")
    finally:
        if worker is not None:
            worker.stop()

    first = modes[0]
    print("\noutputs:")
    for i, p in enumerate(prompts):
        text = target.tokenizer.decode(outputs[first][i])
        print(f"  {p!r}\n      -> {L.printable(text, 100)}")
    exact = target.model.dtype == torch.float32  # bf16: differently shaped GEMMs may round differently
    same = all(outputs[m] == outputs[first] for m in modes)
    if len(modes) > 1 and args.temperature == 0:
        note = "" if same or exact else " (bf16: verify and decode GEMMs of different shapes can round near-ties " \
                                        "differently; fp32 is exact)"
        print(f"  identical in {', '.join(modes)}: {'yes' if same else 'NO'}{note}")
    print()
    print(format_table(results))
    print(f"\n(total {time.perf_counter() - t_start:.1f} s; step p50 = median over requests of each request's "
          f"per-step p50; accepted = drafts kept per round; rounds ok/failed/watchdog/target-only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "modes": results}, f, indent=1)
    if len(modes) > 1 and args.temperature == 0 and exact and not same:
        return 1
    return 0


def format_table(results: dict[str, dict]) -> str:
    head = ["mode", "rounds by", "tok/s", "step p50 ms", "TTFT ms", "accepted", "tok/step", "accept by position",
            "rounds ok/fail/wd/t-o"]
    caches = any("spec_cache" in m["total"] for m in results.values())
    if caches:
        head += ["cache hits", "no-wait verifies", "wait ms"]
    rows = [head]
    for mode, m in results.items():
        t = m["total"]
        r = t["rounds"]
        rows.append([
            mode, t["round_mode"], f"{t['tokens_per_s']:.0f}", f"{t['step_p50_ms']:.2f}",
            f"{1e3 * t['ttft_s_mean']:.1f}",
            f"{t['mean_accepted']:.2f}" if mode != "off" else "-", f"{t['tokens_per_step']:.2f}",
            " ".join(f"{a:.2f}" for a in t["accept_rate_by_pos"]) or "-",
            f"{r['ok']}/{r['failed']}/{r['watchdog']}/{r['target_only']}" if mode != "off" else "-",
        ])
        if caches:
            sc = t.get("spec_cache")
            if sc and sc["active"]:
                steps = sc["fast_steps"] + sc["waited_steps"]
                rows[-1] += [f"{100 * sc['hit_rate']:.0f} %", f"{sc['fast_steps']}/{steps}",
                             f"{sc['wait_ms_mean']:.2f}"]
            else:
                rows[-1] += ["-", "-", "-"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
