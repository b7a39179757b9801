"""`draftrelay generate`: one prompt, chosen models, round mode and sampling settings.

The text goes to stdout; progress (on runs longer than a second) and the metrics line go to stderr.
Modes sync/async start a local drafter worker unless `--worker HOST:PORT` names a running one.
A worker that is full, unreachable or does not start means target-only decoding with a warning
(`--strict`: an error instead); a drafter that cannot serve this target (another vocabulary, model or
tokenizer) is refused at start. SIGTERM stops the run like Ctrl-C (draftrelay.cli turns it into an
exception): the worker and proxy children are stopped on the way out, and they also exit on their own
if this process is killed outright (parent-death signal plus a parent check).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

LONG_PROMPT = 2048  # prompts at least this long get a prefill line on stderr


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
    p.add_argument("--draft-stop", type=float, default=0.0, metavar="P",
                   help="the worker's confidence stop: a round's drafts end after the first one the drafter "
                        "gives a probability below P, so k is a cap (0: off)")
    p.add_argument("--round-budget-ms", type=float, default=None,
                   help="what the proxy allows one round (default: from the worker's measured STEP)")
    p.add_argument("--worker-threads", type=int, default=0, help="CPU threads of the local worker (0: all cores)")
    add_drafter_quant(p)
    add_drafter_vocab(p)
    add_drafter_head_int8(p)
    add_cpu_placement(p)
    p.add_argument("--spec-cache", type=int, default=0, nargs="?", const=8, metavar="F",
                   help="speculation cache (async): the worker pre-drafts F branches per request during each "
                        "verify (no value: 8)")
    p.add_argument("--cache-guard", default="auto", choices=["auto", "on", "off"],
                   help="with --spec-cache: on, the guard measures cache steps against plain rounds and runs "
                        "whichever is faster; off, every step a cache step; auto (default): off where the "
                        "drafter has cores of its own (--drafter-cpus), on otherwise")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="watchdog deadline of an async round (default: round budget + 50 ms)")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for the verify forward (GPU)")
    p.add_argument("--slot-ring", action="store_true", help="two-slot decode-graph ring (with --graphs)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress line on stderr (auto: after the first second of decoding)")
    p.add_argument("--json", default="", metavar="PATH", help="write the metrics to this file")
    p.add_argument("--strict", action="store_true",
                   help="a worker that is full, unreachable or does not start is an error, not target-only decoding")
    p.add_argument("--secret-file", default="", metavar="PATH",
                   help="shared secret of a --worker that requires one (default: $DRAFTRELAY_SECRET)")
    p.add_argument("--tls-ca", default="", metavar="PEM",
                   help="connect to --worker over TLS, trusting this CA (or the worker's self-signed certificate)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the hand-off and recovery counters (Prometheus) on 127.0.0.1:PORT while running")


class Progress:
    """A one-line progress display on stderr, refreshed at most 5 times a second."""

    def __init__(self, total: int, mode: str, prompt_tokens: int = 0) -> None:
        self.total, self.mode = total, mode
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False
        self.prefill = prompt_tokens >= LONG_PROMPT and mode != "off"  # a long prompt: say when it is done
        if self.prefill:
            print(f"  prefilling the prompt: {prompt_tokens} tokens ...", file=sys.stderr, flush=True)
        self.prompt_tokens = prompt_tokens

    def __call__(self, eng) -> None:
        now = time.perf_counter()
        if self.prefill:
            self.prefill = False
            dt = now - self.t0
            print(f"  prefill done: {self.prompt_tokens} tokens in {dt:.1f} s ({self.prompt_tokens / dt:.0f} tok/s)",
                  file=sys.stderr, flush=True)
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


def add_drafter_quant(p: argparse.ArgumentParser) -> None:
    """--drafter-quant, as `draftrelay generate` and `draftrelay serve` take it (checked by local_quant_problems)."""
    p.add_argument("--drafter-quant", default="none", choices=["none", "int8", "int4"],
                   help="the local worker's --quant: int8 or int4 layer weights for its drafts (faster, "
                        "approximate drafts; the output is the target's either way). int4 on a CPU drafter only; "
                        "int8 on a CPU (the lean loop) or a GPU (the fast path's int8 tiles)")


def add_drafter_head_int8(p: argparse.ArgumentParser) -> None:
    """--drafter-head-int8, as `draftrelay generate` and `draftrelay serve` take it (checked by
    local_head_int8_problems): the local GPU worker's --head-int8."""
    p.add_argument("--drafter-head-int8", action="store_true",
                   help="the local GPU worker's --head-int8: its greedy drafts read the head as int8 (half its "
                        "bytes; approximate drafts, the output is the target's either way). Default: bf16")


def local_head_int8_problems(on: bool, device: str, worker: str) -> list[str]:
    """Why --drafter-head-int8 cannot apply (none when it can): a remote worker takes --head-int8 itself; the
    local worker shares the target's device, which must be a GPU."""
    if not on:
        return []
    if worker:
        return ["--drafter-head-int8: the local worker's setting; a remote worker takes --head-int8 itself"]
    if str(device) == "cpu":
        return ["--drafter-head-int8: for a GPU drafter (the fast path's int8 tile), not --device cpu"]
    return []


def add_drafter_vocab(p: argparse.ArgumentParser) -> None:
    """--drafter-vocab, as `draftrelay generate` and `draftrelay serve` take it (checked by
    local_vocab_problems): the local worker's --draft-vocab."""
    p.add_argument("--drafter-vocab", default="", metavar="N|FILE.npy[:N]",
                   help="the local worker's --draft-vocab: its drafter's head restricted to ids 0..N-1 (or a "
                        "ranking file's first N); faster drafts on a GPU (32768 on Qwen2.5), tokens outside it "
                        "never drafted; the output is the target's either way. Default: the whole head")


def local_vocab_problems(vocab: str, worker: str) -> list[str]:
    """Why --drafter-vocab cannot apply (none when it can): a remote worker takes --draft-vocab itself; the
    value is N > 0 or an existing ranking file (the worker checks it against its vocabulary)."""
    from draftrelay.draft_vocab import spec_problem

    if not vocab:
        return []
    if worker:
        return [f"--drafter-vocab {vocab}: the local worker's setting; a remote worker takes --draft-vocab itself"]
    problem = spec_problem(vocab)
    return [f"--drafter-vocab {vocab}: {problem}"] if problem else []


def add_cpu_placement(p: argparse.ArgumentParser) -> None:
    """--cpus and --drafter-cpus, as `draftrelay generate` and `draftrelay serve` take them (checked by
    cpu_placement_problems, applied by apply_cpu_placement)."""
    p.add_argument("--cpus", default="", metavar="LIST",
                   help="run the target (and its proxy) on these CPUs only, one thread a CPU (e.g. 0 or 0-3); "
                        "with --drafter-cpus on the others, the drafter works during a verify without slowing it")
    p.add_argument("--drafter-cpus", default="", metavar="LIST",
                   help="the local worker's --cpus: its drafter on these CPUs only (e.g. 1), one thread a CPU")


def cpu_placement_problems(args: argparse.Namespace) -> list[str]:
    """Why --cpus / --drafter-cpus cannot apply (none when they can): each a list of this machine's CPUs;
    --drafter-cpus sets the local worker's --cpus (a remote worker takes --cpus itself)."""
    from draftrelay import cpus

    bad = []
    for flag, value in (("--cpus", args.cpus), ("--drafter-cpus", args.drafter_cpus)):
        if value:
            try:
                cpus.parse(value)
            except ValueError as exc:
                bad.append(f"{flag}: {exc}")
    if args.drafter_cpus and getattr(args, "worker", ""):
        bad.append(f"--drafter-cpus {args.drafter_cpus}: the local worker's setting; a remote worker takes "
                   f"--cpus itself")
    return bad


def apply_cpu_placement(args: argparse.Namespace) -> int:
    """Pin this process to --cpus (before the target loads and the proxy starts: they inherit it); returns
    the thread count it implies (0: no --cpus, torch's own). ValueError where the kernel refuses them."""
    from draftrelay import cpus

    if not args.cpus:
        return 0
    chosen = cpus.parse(args.cpus)
    cpus.pin(chosen)
    import torch

    torch.set_num_threads(len(chosen))
    return len(chosen)


def local_quant_problems(quant: str, device: str, worker: str) -> list[str]:
    """Why --drafter-quant cannot apply (none when it can): it sets the local worker's --quant (int4: a CPU
    drafter only; int8: a CPU or GPU drafter); a remote worker (--worker) is started with its own. Shared with
    `draftrelay serve`."""
    if quant == "none":
        return []
    bad = []
    if worker:
        bad.append(f"--drafter-quant {quant}: the local worker's setting; a remote worker takes --quant itself")
    if quant != "int8" and str(device).startswith("cuda"):
        bad.append(f"--drafter-quant {quant}: for a CPU drafter (the local worker's lean loop), not --device {device}"
                   " (a GPU drafter takes int8)")
    return bad


def check_flags(args: argparse.Namespace) -> list[str]:
    """One message per bad flag (demo and generate share the common ones)."""
    bad = []
    if args.max_tokens < 1:
        bad.append(f"--max-tokens {args.max_tokens}: must be at least 1")
    if args.k is not None and not 0 <= args.k <= 16:
        bad.append(f"--k {args.k}: must be 0-16")
    if not 0 <= args.k_max <= 16:
        bad.append(f"--k-max {args.k_max}: must be 0-16")
    stop = getattr(args, "draft_stop", 0.0)
    if not 0.0 <= stop <= 1.0:  # also refuses NaN
        bad.append(f"--draft-stop {stop}: must be within [0, 1] (0: off)")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        bad.append(f"--temperature {args.temperature}: must be a finite number >= 0")
    if getattr(args, "top_k", 0) < 0:
        bad.append(f"--top-k {args.top_k}: must be 0 (all tokens) or more")
    for flag, v in (("--deadline-ms", args.deadline_ms), ("--round-budget-ms", args.round_budget_ms)):
        if v is not None and (not math.isfinite(v) or v <= 0):  # None: from the measured STEP
            bad.append(f"{flag} {v}: must be a positive number of milliseconds")
    if args.worker_threads < 0:
        bad.append(f"--worker-threads {args.worker_threads}: must be 0 (all cores) or more")
    bad += local_quant_problems(getattr(args, "drafter_quant", "none"), getattr(args, "device", "cpu"),
                                getattr(args, "worker", ""))
    bad += local_vocab_problems(getattr(args, "drafter_vocab", ""), getattr(args, "worker", ""))
    bad += local_head_int8_problems(getattr(args, "drafter_head_int8", False), getattr(args, "device", "cpu"),
                                    getattr(args, "worker", ""))
    if hasattr(args, "drafter_cpus"):  # generate's (demo has no placement flags)
        bad += cpu_placement_problems(args)
    if getattr(args, "metrics_port", 0) and not 0 < args.metrics_port < 65536:
        bad.append(f"--metrics-port {args.metrics_port}: must be 1-65535")
    spec_cache = getattr(args, "spec_cache", 0)
    if not 0 <= spec_cache <= 64:
        bad.append(f"--spec-cache {args.spec_cache}: must be 0-64 branches per request")
    elif spec_cache and getattr(args, "mode", "async") != "async":
        bad.append(f"--spec-cache needs --mode async (got --mode {args.mode})")
    return bad


def spec_options(args: argparse.Namespace, device_type: str) -> dict:
    """SpecCache's options for generate's --spec-cache on this device.

    On a CPU a cache step drafts the depth policy's choice with the round hidden: a verify's cost grows with
    its width there (docs/SPEC_CACHE.md, the drafter on a core of its own); on a GPU it barely does, and this
    was not measured there. --cache-guard auto turns the guard off where the drafter has cores of its own:
    its branch work then takes nothing from the target's cores, so the probes have little to protect, and
    on the 2-core VM they were most of the spread between runs (a guarded pass ran plain rounds on 58 steps
    of two code prompts and came out level with sync; unguarded the cache ran 1.07 x sync)."""
    opts: dict = {}
    if device_type == "cpu" and args.k is None:
        opts["depth"] = "policy"
    guard = getattr(args, "cache_guard", "auto")
    if guard == "auto":
        guard = "off" if getattr(args, "drafter_cpus", "") else "on"
    if guard == "off":
        opts["guard"] = False
    return opts


def k_max_of(args: argparse.Namespace) -> int:
    """The deepest draft: --k when it fixes the depth, else the policy's --k-max."""
    return args.k if args.k is not None else args.k_max


def read_prompt(arg: str) -> str:
    """The prompt argument, or stdin for '-'. ValueError for stdin that is not UTF-8."""
    if arg != "-":
        return arg
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"stdin is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                         f"({exc.reason})") from None


def handshake(spec: dict, timeout_s: float = 5.0) -> tuple[int, str, int]:
    """(0, '', the HELLO_OK's flags) if the worker accepts the spec's identity, else (ERROR code or -1 for no
    connection, why, 0)."""
    from draftrelay.wire.client import WireError, WireRemoteError
    from draftrelay.wire.roundfn import client_from_spec

    client = client_from_spec(spec)
    try:
        info = client.connect(timeout=timeout_s)
        return 0, "", info.flags
    except WireRemoteError as exc:
        return exc.code, f"worker {spec['host']}:{spec['port']}: {exc}", 0
    except WireError as exc:
        return -1, f"worker {spec['host']}:{spec['port']}: {exc}", 0
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    bad = check_flags(args)
    if args.slot_ring and not args.graphs:
        bad.append("--slot-ring needs --graphs")
    if bad:
        for line in bad:
            print(f"draftrelay generate: {line}", file=sys.stderr)
        return 2
    try:
        prompt = read_prompt(args.prompt)
    except ValueError as exc:
        print(f"draftrelay generate: {exc}", file=sys.stderr)
        return 2
    return _run(args, prompt)


def _warn_target_only(args: argparse.Namespace, why: str) -> int | None:
    """--strict: print why and return the exit code; otherwise warn and return None (decode target-only)."""
    if args.strict:
        print(f"draftrelay generate: {why}", file=sys.stderr)
        return 1
    print(f"draftrelay generate: warning: {why}; decoding target-only (--strict makes this an error)",
          file=sys.stderr)
    return None


def _run(args: argparse.Namespace, prompt: str) -> int:
    from draftrelay.model import ModelError
    from draftrelay.wire import protocol as P

    from . import loading as L
    from .engine import Engine, EngineConfig, SamplingParams

    try:
        dev = L.pick_device(args.device)
        if args.graphs and dev.type != "cuda":
            raise ValueError("--graphs needs a CUDA device")
        host, port = L.parse_hostport(args.worker) if args.worker else ("", 0)
        apply_cpu_placement(args)
        target = L.load_target(args.model, dev)
    except (ValueError, ModelError, OSError) as exc:
        print(f"draftrelay generate: {exc}", file=sys.stderr)
        return 2
    ids = target.tokenizer.encode(prompt)
    if not ids:
        print("draftrelay generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    ctx = target.model.cfg.max_position_embeddings
    if len(ids) + args.max_tokens > ctx:  # checked before anything (the KV cache) is sized from them
        print(f"draftrelay generate: the prompt ({len(ids)} tokens) + --max-tokens {args.max_tokens} = "
              f"{len(ids) + args.max_tokens} exceeds the model's context of {ctx} positions"
              + (f"; at most --max-tokens {ctx - len(ids)} fits" if len(ids) < ctx else ""), file=sys.stderr)
        return 2
    k_max = k_max_of(args)
    max_len = len(ids) + args.max_tokens + k_max + 8
    mode = args.mode
    worker = None
    try:
        h, hello_flags = None, 0
        if mode != "off":
            if not args.worker:
                try:
                    # the depth policy on a GPU: a draft-step graph for each depth it may ask (warm_depths)
                    policy = args.k is None
                    warming = policy and dev.type == "cuda" and args.progress != "off"
                    if warming:  # seconds of captures before the worker listens: say so
                        print(f"  starting the drafter worker: capturing its draft-step graphs for depths 1-{k_max}"
                              " ...", file=sys.stderr, flush=True)
                    t_start = time.perf_counter()
                    worker = L.start_local_worker(args.drafter, dev, k_max, max_len + 64, 1, args.worker_threads,
                                                  quant=args.drafter_quant, draft_vocab=args.drafter_vocab,
                                                  head_int8=args.drafter_head_int8,
                                                  cpus=args.drafter_cpus, warm_batch=1 if policy else 0,
                                                  warm_depths=policy, warm_min_kv=len(ids))
                    if warming:
                        print(f"  drafter worker ready in {time.perf_counter() - t_start:.1f} s", file=sys.stderr,
                              flush=True)
                    host, port = worker.host, worker.port
                except RuntimeError as exc:
                    rc = _warn_target_only(args, f"the local worker did not start: {exc}")
                    if rc is not None:
                        return rc
                    mode = "off"
        if mode != "off":
            spec = L.worker_spec(host, port, L.drafter_model_id(args.drafter) if not args.worker else "",
                                 target.tokenizer_hash, k_max, 1)  # one request: ask for one row
            spec["vocab_size"] = target.model.cfg.vocab_size  # a drafter of another vocabulary is refused now
            if args.worker:
                spec.update({"secret_file": args.secret_file} if args.secret_file else {})
                spec.update({"tls": True, "tls_ca": args.tls_ca} if args.tls_ca else {})
            try:
                code, why, hello_flags = handshake(spec)
            except ValueError as exc:  # the secret file or CA cannot be used
                print(f"draftrelay generate: {exc}", file=sys.stderr)
                return 2
            if code in (P.IDENTITY_MISMATCH, P.BAD_VERSION, P.OVER_LIMITS, P.AUTH_REQUIRED, P.AUTH_FAILED):
                # not a passing condition: this drafter cannot serve this target (or us) at all
                print(f"draftrelay generate: the worker cannot draft for this target: {why}", file=sys.stderr)
                return 1
            if code:
                rc = _warn_target_only(args, f"the worker refused us: {why}")
                if rc is not None:
                    return rc
                mode = "off"
            else:
                rs = L.round_settings(spec, ids, k_max, args.round_budget_ms, args.deadline_ms)
                print(f"draftrelay generate: {rs.note}", file=sys.stderr)
                h = L.handoff_config(spec, dev, rs.deadline_ms, not args.worker, round_budget_ms=rs.budget_ms)
        cfg = EngineConfig(mode=mode, n_draft=k_max, max_batch=1, max_len=max_len, handoff=h,
                           graphs=args.graphs, slot_ring=args.slot_ring,
                           depth="fixed" if args.k is not None else "auto",
                           round_costs_s=rs.round_costs_s if h else None, draft_stop=args.draft_stop,
                           # the worker says whether its drafter computes every asked draft (CUDA graphs)
                           fixed_rounds=bool(hello_flags & P.HELLO_OK_FIXED_ROUNDS),
                           spec_fanout=args.spec_cache if mode == "async" else 0,
                           spec_options=spec_options(args, dev.type))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                seed=args.seed, stop_token_ids=target.stop_ids)
        with Engine(target.model, cfg) as eng:
            progress = Progress(args.max_tokens, args.progress, len(ids))
            server = None
            if args.metrics_port:
                from draftrelay.handoff import metrics

                def stats() -> dict:
                    st = eng.rounds.stats() if eng.rounds else {"mode": "off"}
                    if eng.spec_cache is not None:
                        st["spec_cache"] = eng.spec_cache.stats()
                    return st

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
    print(f"[{mode}{refusal}] {t['output_tokens']} tokens, {t['tokens_per_s']:.1f} tok/s, "
          f"TTFT {1e3 * t['ttft_s_mean']:.1f} ms, step p50 {t['step_p50_ms']:.2f} ms, "
          f"accepted/round {t['mean_accepted']:.2f}, rounds ok/failed/watchdog/target-only "
          f"{r['ok']}/{r['failed']}/{r['watchdog']}/{r['target_only']}"
          + (f", depth chosen {t['depth']['chosen']}" if "depth" in t else "")
          + (f", CPU products on {t['cpu_linear']}" if "cpu_linear" in t else ""), file=sys.stderr)
    if t.get("speculation_warning"):
        print(f"draftrelay generate: WARNING: {t['speculation_warning']}", file=sys.stderr)
    sc = t.get("spec_cache")
    if sc:
        state = (f"hits {sc['hits']}/{sc.get('lookups', sc['request_rounds'])} ({100 * sc['hit_rate']:.0f} %), "
                 f"{sc['fast_steps']} verifies without a wait, wait mean {sc['wait_ms_mean']:.2f} ms, "
                 f"{sc['branches_per_round']:.1f} branches/round, misses {sc['misses']}") if sc["active"] \
            else f"off: {sc['refusal']}"
        print(f"[spec-cache F={sc['fanout']}] {state}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    return 0
