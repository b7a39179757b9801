"""`draftrelay demo`: a local drafter worker + the proxy on loopback, the same prompts decoded in
off, sync and async round modes, outputs and a side-by-side table.

With no arguments it uses the demo pair shipped in the package (`draftrelay.demo_pair`): a small
Python code model (24 layers) and a one-layer drafter an eighth of its size, trained on CPython's
standard library: the continuations of the code prompts read as Python and the drafter's guesses are
often right.
`--model tiny` runs the built-in random tiny pair instead (arbitrary bytes, the unit tests' pair).
It runs on a CPU in well under a minute and uses the GPU when there is one. `--model DIR --drafter
DIR` serve real checkpoints (Llama-family HF directories with the same tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The demo pair on a 2-core CPU (benchmarks/demo_pair.py, benchmarks/demo_round.py): one thread each for
# the target and the local worker. The target's forwards (3 rows x 160 wide, 24 layers) are bound by
# dispatch and memory, a second thread gains the wide verify little and costs the decode step, and under
# other load two threads thrash; the one-layer drafter is all dispatch.
CPU_THREADS = 1
# One prompt at a time on a CPU: speculation buys per-request speed, and the demo target's verify of
# k + 1 tokens costs 1.3x its decode step at one row against 1.4x at three (the drafter's round about the
# same), so the speculative step gains most there; `--batch 3` decodes the prompts together (more tokens/s
# for every mode, a smaller ratio).
CPU_BATCH = 1
# The shipped pair's drafts, by position, are kept .74 .57 .50 .29 of the time: on this CPU every one of the
# four pays for its share of the round and the wider verify. A fixed depth, because on a shared 2-core
# machine the depth policy's running cost estimates are at the mercy of other load (docs/ENGINE.md).
DEMO_PAIR_CPU_K = 4

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="target: 'demo' (the shipped code pair), 'tiny' (random, built-in), a local HF directory "
                        "or a .gguf file")
    p.add_argument("--drafter", default="",
                   help="drafter for the local worker: 'demo', 'tiny', a local HF directory or a .gguf file "
                        "(default: the pair of --model; needed with --model DIR)")
    p.add_argument("--worker", default="", metavar="HOST:PORT",
                   help="use a running `draftrelay worker` instead of starting one")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: three built-in)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--k", type=int, default=None,
                   help="drafts per request per round, fixed (default: 4 with the shipped demo pair on a CPU, else the "
                        "depth policy picks 0..--k-max)")
    p.add_argument("--k-max", type=int, default=6, help="deepest draft the depth policy may ask")
    p.add_argument("--round-budget-ms", type=float, default=None,
                   help="what the proxy allows one round (default: from the worker's measured STEP)")
    p.add_argument("--batch", type=int, default=0,
                   help="prompts decoded at once (0: one at a time on a CPU, all of them on a GPU)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of the target (0: one on a CPU, where the demo's small forwards run fastest on "
                        "one thread and the worker takes turns with it)")
    p.add_argument("--worker-threads", type=int, default=0,
                   help="CPU threads of the local worker (0: one on a CPU, as the target)")
    p.add_argument("--modes", default="off,sync,async",
                   help="comma-separated subset of off,sync,async,cache (cache: async + the speculation cache)")
    p.add_argument("--spec-cache", type=int, default=0, nargs="?", const=8, metavar="F",
                   help="add a 'cache' row: async rounds with the speculation cache, F branches per request "
                        "(no value: 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs identical across modes)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="watchdog deadline of an async round (default: round budget + 50 ms)")
    p.add_argument("--json", default="", metavar="PATH", help="also write every mode's metrics to this file")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("off", "sync", "async", "cache")]
    if bad or not modes:
        print(f"draftrelay demo: --modes {args.modes!r}: each must be off, sync, async or cache", file=sys.stderr)
        return 2
    if args.spec_cache and "cache" not in modes:
        modes.append("cache")  # async rounds + the speculation cache
    from .cli_generate import check_flags, k_max_of

    bad = check_flags(args)  # one message per bad flag
    if args.threads < 0:
        bad.append(f"--threads {args.threads}: must be 0 (one on a CPU) or more")
    if args.batch < 0:
        bad.append(f"--batch {args.batch}: must be 0 (auto) or more")
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
        model, drafter = pair_specs(args.model, args.drafter, bool(args.worker))
        dev = L.pick_device(args.device)
        if args.threads or dev.type == "cpu":
            torch.set_num_threads(args.threads or CPU_THREADS)
        host, port = L.parse_hostport(args.worker) if args.worker else ("", 0)
        target = L.load_target(model, dev)
        if args.model == "demo":
            target.name = "demo-target"
    except (ValueError, ModelError, OSError) as exc:
        print(f"draftrelay demo: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEFAULT_PROMPTS
    batch = min(args.batch or (CPU_BATCH if dev.type == "cpu" else len(prompts)), len(prompts))
    if args.k is None and args.model == "demo" and not args.drafter and dev.type == "cpu":
        args.k = DEMO_PAIR_CPU_K
    ids = [target.tokenizer.encode(p) for p in prompts]
    if any(not x for x in ids):
        print("draftrelay demo: a prompt encodes to no tokens", file=sys.stderr)
        return 2
    k_max = k_max_of(args)
    max_len = max(len(x) for x in ids) + args.max_tokens + k_max + 8
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop_token_ids=target.stop_ids)
    shown = args.worker or drafter_label(args.drafter or args.model)
    print(f"draftrelay demo: target {target.name} ({target.model.cfg.n_params() / 1e6:.2f}M params) on {dev}, "
          f"drafter {shown}, k={args.k if args.k is not None else f'policy 0..{k_max}'}, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, {batch} at a time")

    worker = None
    try:
        if any(m != "off" for m in modes):
            if not args.worker:
                try:
                    # the depth policy on a GPU: a draft-step graph for each depth it may ask (warm_depths)
                    worker = L.start_local_worker(drafter, dev, k_max, max_len + 64, batch,
                                                  args.worker_threads or CPU_THREADS,
                                                  warm_batch=batch if args.k is None else 0,
                                                  warm_depths=args.k is None)
                except RuntimeError as exc:
                    print(f"draftrelay demo: the local worker did not start: {exc}", file=sys.stderr)
                    return 1
                host, port = worker.host, worker.port
                print(f"  worker: {worker.banner}")
            spec = L.worker_spec(host, port, L.drafter_model_id(drafter) if not args.worker else "",
                                 target.tokenizer_hash, k_max, max(8, len(prompts)))
            spec["vocab_size"] = target.model.cfg.vocab_size  # a drafter of another vocabulary is refused now
            why = L.check_worker(spec)
            if why:
                print(f"draftrelay demo: the worker refused us: {why}", file=sys.stderr)
                return 1
            rs = L.round_settings(spec, max(ids, key=len), k_max, args.round_budget_ms, args.deadline_ms)
            print(f"  {rs.note}")
        results: dict[str, dict] = {}
        outputs: dict[str, list[list[int]]] = {}
        for mode in modes:
            h = L.handoff_config(spec, dev, rs.deadline_ms, not args.worker, round_budget_ms=rs.budget_ms) \
                if mode != "off" else None
            cache = (args.spec_cache or 8) if mode == "cache" else 0
            cfg = EngineConfig(mode="async" if cache else mode, n_draft=k_max, max_batch=batch,
                               max_len=max_len, handoff=h, depth="fixed" if args.k is not None else "auto",
                               round_costs_s=rs.round_costs_s if h else None, spec_fanout=cache)
            with Engine(target.model, cfg) as eng:
                eng.generate([ids[0]], SamplingParams(max_tokens=min(4, args.max_tokens)))  # warm-up
                eng.reset_metrics()
                reqs = eng.generate(ids, params)
                results[mode] = eng.metrics(reqs)
            outputs[mode] = [r.output for r in reqs]
            t = results[mode]["total"]
            note = f" (async refused: {t['refusal']})" if t["refusal"] else ""
            print(f"  [{mode}] {t['output_tokens']} tokens in {t['wall_s']:.2f} s{note}"
                  + (f", depth chosen {t['depth']['chosen']}" if "depth" in t else ""))
            if t.get("speculation_warning"):
                print(f"  WARNING [{mode}]: {t['speculation_warning']}")
    finally:
        if worker is not None:
            worker.stop()

    first = modes[0]
    print("\noutputs:")
    for i, p in enumerate(prompts):
        print(format_output(i + 1, p, target.tokenizer.decode(outputs[first][i])))
    exact = target.model.dtype == torch.float32  # bf16: differently shaped GEMMs may round differently
    same = all(outputs[m] == outputs[first] for m in modes)
    if len(modes) > 1 and args.temperature == 0:
        note = "" if same or exact else " (bf16: verify and decode GEMMs of different shapes can round near-ties " \
                                        "differently; fp32 is exact)"
        print(f"  identical in {', '.join(modes)}: {'yes' if same else 'NO'}{note}")
    print()
    print(format_table(results))
    best = best_mode(results)
    if best:
        print(f"\nfastest: {best[0]}, {best[1]:.2f} x the tokens/s of off")
    print(f"\n(total {time.perf_counter() - t_start:.1f} s; step p50 = median over requests of each request's "
          f"per-step p50; accepted = drafts kept per round; rounds ok/failed/watchdog/target-only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "best": list(best) if best else None, "modes": results}, f, indent=1)
    if len(modes) > 1 and args.temperature == 0 and exact and not same:
        return 1
    return 0


def best_mode(results: dict[str, dict]) -> tuple[str, float] | None:
    """(the speculative mode with the most tokens/s, its ratio to off) when off ran too."""
    if "off" not in results or len(results) < 2:
        return None
    off = results["off"]["total"]["tokens_per_s"]
    mode = max((m for m in results if m != "off"), key=lambda m: results[m]["total"]["tokens_per_s"])
    return mode, results[mode]["total"]["tokens_per_s"] / off if off > 0 else float("inf")


def pair_specs(model: str, drafter: str, remote_worker: bool) -> tuple[str, str]:
    """(target spec, drafter spec) for the loaders: 'demo' becomes the shipped pair's directories,
    an empty --drafter the pair of --model (a directory target needs its drafter named)."""
    if model == "demo" or drafter == "demo":
        from draftrelay import demo_pair

        tdir, ddir = demo_pair.paths()
    if not drafter and model in ("demo", "tiny"):
        drafter = model
    elif not drafter and not remote_worker and os.path.isdir(model):
        raise ValueError(f"--model {model!r}: name its drafter with --drafter DIR ('demo' and 'tiny' bring "
                         "their own)")
    return (tdir if model == "demo" else model), (ddir if drafter == "demo" else drafter)


def drafter_label(spec: str) -> str:
    return "demo-drafter" if spec == "demo" else spec


def format_output(n: int, prompt: str, text: str, width: int = 100) -> str:
    """One prompt's result as the code it is: the prompt quoted, then prompt + continuation line by
    line, indented (characters a terminal would act on escaped, long lines cut)."""
    from .loading import printable

    lines = [f"  [{n}] prompt {prompt!r}"]
    lines += ["      " + printable(line, width) for line in (prompt + text).split("\n")]
    return "\n".join(lines)


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
