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
    p.add_argument("--model", default="tiny", help="target: 'tiny' (built-in) or a local HF model directory")
    p.add_argument("--drafter", default="tiny", help="drafter of the local worker: 'tiny' or a local HF directory")
    p.add_argument("--worker", default="", metavar="HOST:PORT", help="use a running `draftrelay worker`")
    p.add_argument("--mode", default="async", choices=["off", "sync", "async"], help="round mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=4, help="drafts per round")
    p.add_argument("--spec-cache", type=int, default=0, nargs="?", const=8, metavar="F",
                   help="speculation cache (async): the worker pre-drafts F branches per request during each "
                        "verify (no value: 8)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--deadline-ms", type=float, default=200.0, help="watchdog deadline of an async round")
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


def check_flags(args: argparse.Namespace) -> list[str]:
    """One message per bad flag (demo and generate share the common ones)."""
    bad = []
    if args.max_tokens < 1:
        bad.append(f"--max-tokens {args.max_tokens}: must be at least 1")
    if not 0 <= args.k <= 16:
        bad.append(f"--k {args.k}: must be 0-16")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        bad.append(f"--temperature {args.temperature}: must be a finite number >= 0")
    if getattr(args, "top_k", 0) < 0:
        bad.append(f"--top-k {args.top_k}: must be 0 (all tokens) or more")
    if not math.isfinite(args.deadline_ms) or args.deadline_ms <= 0:
        bad.append(f"--deadline-ms {args.deadline_ms}: must be a positive number of milliseconds")
    if getattr(args, "metrics_port", 0) and not 0 < args.metrics_port < 65536:
        bad.append(f"--metrics-port {args.metrics_port}: must be 1-65535")
    spec_cache = getattr(args, "spec_cache", 0)
    if not 0 <= spec_cache <= 64:
        bad.append(f"--spec-cache {args.spec_cache}: must be 0-64 branches per request")
    elif spec_cache and getattr(args, "mode", "async") != "async":
        bad.append(f"--spec-cache needs --mode async (got --mode {args.mode})")
    return bad


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


def handshake(spec: dict, timeout_s: float = 5.0) -> tuple[int, str]:
    """(0, '') if the worker accepts the spec's identity, else (ERROR code or -1 for no connection, why)."""
    from draftrelay.wire.client import WireError, WireRemoteError
    from draftrelay.wire.roundfn import client_from_spec

    client = client_from_spec(spec)
    try:
        client.connect(timeout=timeout_s)
        return 0, ""
    except WireRemoteError as exc:
        return exc.code, f"worker {spec['host']}:{spec['port']}: {exc}"
    except WireError as exc:
        return -1, f"worker {spec['host']}:{spec['port']}: {exc}"
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
    max_len = len(ids) + args.max_tokens + args.k + 8
    mode = args.mode
    worker = None
    try:
        h = None
        if mode != "off":
            if not args.worker:
                try:
                    worker = L.start_local_worker(args.drafter, dev, args.k, max_len + 64, 1)
                    host, port = worker.host, worker.port
                except RuntimeError as exc:
                    rc = _warn_target_only(args, f"the local worker did not start: {exc}")
                    if rc is not None:
                        return rc
                    mode = "off"
        if mode != "off":
            spec = L.worker_spec(host, port, L.drafter_model_id(args.drafter) if not args.worker else "",
                                 target.tokenizer_hash, args.k, 1)  # one request: ask for one row
            spec["vocab_size"] = target.model.cfg.vocab_size  # a drafter of another vocabulary is refused now
            if args.worker:
                spec.update({"secret_file": args.secret_file} if args.secret_file else {})
                spec.update({"tls": True, "tls_ca": args.tls_ca} if args.tls_ca else {})
            try:
                code, why = handshake(spec)
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
                h = L.handoff_config(spec, dev, args.deadline_ms, not args.worker)
        cfg = EngineConfig(mode=mode, n_draft=args.k, max_batch=1, max_len=max_len, handoff=h,
                           graphs=args.graphs, slot_ring=args.slot_ring,
                           spec_fanout=args.spec_cache if mode == "async" else 0)
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
          f"{r['ok']}/{r['failed']}/{r['watchdog']}/{r['target_only']}", file=sys.stderr)
    sc = t.get("spec_cache")
    if sc:
        state = (f"hits {sc['hits']}/{sc['request_rounds']} ({100 * sc['hit_rate']:.0f} %), "
                 f"{sc['fast_steps']} verifies without a wait, wait mean {sc['wait_ms_mean']:.2f} ms, "
                 f"{sc['branches_per_round']:.1f} branches/round, misses {sc['misses']}") if sc["active"] \
            else f"off: {sc['refusal']}"
        print(f"[spec-cache F={sc['fanout']}] {state}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    return 0
