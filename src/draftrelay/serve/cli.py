"""`draftrelay serve`: the OpenAI-compatible server.

    draftrelay serve --model tiny --mode async --port 8000
    draftrelay serve --model DIR --worker 10.0.0.2:18627 --api-key-file key.txt --max-batch 8

Loads the target, starts a local drafter worker unless `--worker` names a running one (modes sync
and async), warms every path up, then serves on uvicorn. The line `draftrelay serve: listening on
http://HOST:PORT` on stderr says it accepts requests (`--port 0` picks a free port).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from draftrelay.engine.cli_generate import (
    add_cpu_placement,
    add_drafter_head_int8,
    add_drafter_quant,
    add_drafter_vocab,
    apply_cpu_placement,
    cpu_placement_problems,
    local_head_int8_problems,
    local_quant_problems,
    local_vocab_problems,
)
from draftrelay.memory import KVMemoryError

# prompt tokens a round carries to the drafter by default: on a CPU a 0.5B drafter's round of 4,096 takes
# tens of seconds on one core, past any budget a steady round gives (serve then measured every round of the
# reference pair as a timeout and ran target-only); 256 keep a catch-up round within the measured budget
GPU_ROUND_TOKENS, CPU_ROUND_TOKENS = 4096, 256
DEFAULT_DEADLINE_MS = 200.0  # a GPU's: its worker's STEP is a few ms
CPU_WARMUP_PROMPT = 8192  # the warm-up's longest prompt on a CPU unless --warmup-prompt-len says


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="target: 'tiny' (built-in), a local HF model directory or a .gguf file")
    p.add_argument("--drafter", default="tiny",
                   help="drafter of the local worker: 'tiny', a local HF directory or a .gguf file")
    p.add_argument("--worker", default="", metavar="HOST:PORT", help="use a running `draftrelay worker`")
    add_drafter_quant(p)
    add_drafter_vocab(p)
    add_drafter_head_int8(p)
    add_cpu_placement(p)
    p.add_argument("--mode", default="async", choices=["off", "sync", "async"], help="round mode")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--api-key-file", default="", metavar="F",
                   help="a file holding the API key clients must send as 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default="", help="the model's name in the API (default: the model's)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (target KV rows)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="prompt + output tokens per request (default: the model's context)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--k", type=int, default=4, help="drafts per round")
    p.add_argument("--depth", default="auto", choices=["auto", "fixed"],
                   help="auto: per batch size, speculate (--k drafts) where it measures faster than plain "
                        "decoding, else not; fixed: always --k")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", default="0", metavar="N|auto",
                   help="CPU: torch threads of the target's forward (0: torch's own count; auto: one or all, "
                        "whichever the engine measures faster, per step)")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="watchdog deadline of an async round (default: on a GPU 200 ms; on a CPU from the worker's "
                        "STEP measured at start over a full batch, as generate measures it)")
    p.add_argument("--spec-cache", type=int, default=0, nargs="?", const=8, metavar="F",
                   help="speculation cache (--mode async): the worker pre-drafts F branches per request during "
                        "each verify (no value: 8); every step then asks --k drafts (--depth is not used)")
    p.add_argument("--cache-guard", default="on", choices=["on", "off"],
                   help="with --spec-cache: the guard measures cache steps against plain rounds per batch size "
                        "and runs whichever is faster (on); off: every step a cache step")
    p.add_argument("--max-round-tokens", type=int, default=None,
                   help="prompt tokens one round sends the drafter (a longer prompt catches up over several; "
                        f"default {GPU_ROUND_TOKENS} on a GPU, {CPU_ROUND_TOKENS} on a CPU, where a round of more "
                        "would outlast the measured round budget)")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for the verify forward (GPU)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up (first requests are then slower)")
    p.add_argument("--warmup-prompt-len", type=int, default=0, metavar="N",
                   help="the warm-up's long prompts: at most N tokens (default: the longest the context allows "
                        f"on a GPU, at most {CPU_WARMUP_PROMPT} on a CPU)")
    p.add_argument("--worker-warm-max-kv", type=int, default=0, metavar="N",
                   help="GPU: the local worker captures its draft-step graphs at start only for contexts up to N "
                        "tokens (0: up to --max-model-len; fewer graphs start sooner, a longer context then "
                        "waits for its capture in a round)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _check(args: argparse.Namespace) -> str:
    if args.max_batch < 1:
        return f"--max-batch must be >= 1, got {args.max_batch}"
    if args.max_queue < 0:
        return f"--max-queue must be >= 0, got {args.max_queue}"
    if args.max_model_len < 0:
        return f"--max-model-len must be >= 1 (0: the model's context), got {args.max_model_len}"
    if not 0 <= args.port < 65536:
        return f"--port must be within [0, 65535], got {args.port}"
    if not 0 <= args.k <= 16:
        return f"--k must be within [0, 16], got {args.k}"
    if args.warmup_prompt_len < 0:
        return f"--warmup-prompt-len must be >= 0, got {args.warmup_prompt_len}"
    if args.max_round_tokens is not None and args.max_round_tokens < 1:
        return f"--max-round-tokens must be >= 1, got {args.max_round_tokens}"
    if args.worker_warm_max_kv < 0:
        return f"--worker-warm-max-kv must be >= 0, got {args.worker_warm_max_kv}"
    if args.deadline_ms is not None and not args.deadline_ms > 0:
        return f"--deadline-ms must be > 0, got {args.deadline_ms}"
    if not 0 <= args.spec_cache <= 64:
        return f"--spec-cache must be 0-64 branches per request (0: off), got {args.spec_cache}"
    if args.spec_cache and args.mode != "async":
        return f"--spec-cache needs --mode async (got --mode {args.mode})"
    if not (args.threads == "auto" or (args.threads.isdigit() and int(args.threads) <= 1024)):
        return f"--threads must be 'auto' or a thread count (0: torch's own), got {args.threads!r}"
    if args.spec_cache and args.k < 1:
        return f"--spec-cache needs --k >= 1 (drafts to branch), got --k {args.k}"
    return next(iter(local_quant_problems(args.drafter_quant, args.device, args.worker)
                     + local_vocab_problems(args.drafter_vocab, args.worker)
                     + local_head_int8_problems(args.drafter_head_int8, args.device, args.worker)
                     + cpu_placement_problems(args)), "")


def fit_context(model, dev, args: argparse.Namespace, say) -> int:
    """--max-model-len 0: the model's context, or the longest whose K/V fits FIT_SHARE of the memory
    available now (draftrelay/memory.py), a multiple of 256, said when it is shorter. Counted per position: the target's
    --max-batch rows and its scratch row, and a local worker's own (its rows, at least 16, all of the
    drafter's shape: drafter_config) with its weights set aside first, and with --spec-cache F its branch
    rows, max-batch x F rounded up to a power of two and a spare: per position too on a GPU, a fixed
    COMPACT_POSITIONS each where the worker drafts in the lean loop (a CPU), whose rows hold a branch's
    own positions only. Raises KVMemoryError where not even 256 positions a row fit."""
    from draftrelay.engine import loading as L
    from draftrelay.memory import FIT_SHARE, available_bytes, fit_positions, size
    from draftrelay.model import KVCache

    ctx = model.cfg.max_position_embeddings
    avail = available_bytes(dev)
    if avail is None:
        return ctx
    per_position = KVCache.position_bytes(model.cfg, model.dtype) * (args.max_batch + 1)
    reserve, worker_note = 0, ""
    drafter = L.drafter_config(args.drafter) if args.mode != "off" and not args.worker else None
    if drafter is not None:  # the local worker: its weights and its cache, in its default dtype
        from draftrelay.checkpoint.hf import default_dtype
        from draftrelay.worker.lean import supports_shape
        from draftrelay.worker.prefetch import COMPACT_POSITIONS, scratch_size

        dtype = default_dtype(dev)
        rows = max(16, args.max_batch)
        reserve = drafter.n_params() * dtype.itemsize
        what = "weights"
        if args.spec_cache:  # its branch rows and their spare (ForkSteps.scratch)
            branch = scratch_size(args.max_batch * args.spec_cache) + 1
            if supports_shape(drafter, dev):  # compact: COMPACT_POSITIONS a row, whatever the context
                reserve += KVCache.position_bytes(drafter, dtype) * branch * COMPACT_POSITIONS
                what = "weights and branch rows"
            else:  # written at their true positions: a context each
                rows += branch
        per_position += KVCache.position_bytes(drafter, dtype) * rows
        worker_note = f", the local worker's {what} ({size(reserve)}) and K/V counted"
    extra = args.k + 1 + 64  # a row also holds the last verify's drafts; the worker's rows 64 more
    budget = FIT_SHARE * avail - reserve
    # the positions beyond the context come off the budget first: what is left is the context, in 256s
    n = fit_positions(per_position, 1, budget - extra * per_position, ctx)
    if n >= ctx:
        return ctx
    if n < 256:
        raise KVMemoryError(f"--max-batch {args.max_batch}: the K/V of even 256 positions a row does not fit "
                            f"the {size(max(budget, 0))} the caches may take of the {size(avail)} available on "
                            f"{dev}{worker_note}; fewer rows (--max-batch) or a smaller model")
    say(f"context capped to {n} tokens: the model's {ctx} at --max-batch {args.max_batch} would take "
        f"{size(per_position * (ctx + extra))} of K/V, {size(avail)} is available{worker_note}; "
        f"--max-model-len sets it, --max-batch fewer rows allow more")
    return n


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, made with protocol IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY)
    only on sockets whose proto says TCP, and socket.create_server leaves it 0. With Nagle on, a
    response's second small write waits for the client's delayed ACK: +40 ms on every request
    after the first on a kept-alive connection."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def startup_requests() -> list[tuple[str, dict | None]]:
    """What the server sends itself before it announces itself: (path, body or None for a GET).
    Every endpoint, streaming and whole, one output token (a request that ends at its prefill) and
    a few (decode steps, a text delta per step), greedy and sampled, with and without a usage chunk:
    each takes its own first-call path through routing, the request checks, the tokenizer, the chat
    template, the thread pool, the response and SSE code."""
    msgs = [{"role": "user", "content": "Hello"}]
    out: list[tuple[str, dict | None]] = [("health", None), ("v1/models", None), ("metrics", None)]
    for path, prompt in (("v1/completions", {"prompt": "Hello"}), ("v1/chat/completions", {"messages": msgs})):
        for stream in (True, False):
            for n in (1, 3):
                out.append((path, {**prompt, "max_tokens": n, "temperature": 0, "stream": stream}))
            out.append((path, {**prompt, "max_tokens": 3, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1,
                               "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}))
    return out


def self_request(host: str, port: int, api_key: str, timeout: float = 60.0) -> str:
    """The start-up requests (startup_requests) against this server, so that no client's request is
    the first through any path of the HTTP stack. '' on success, else why."""
    import urllib.request

    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    base = f"http://{'[' + local + ']' if ':' in local else local}:{port}/"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    for path, body in startup_requests():
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read().decode()
        except OSError as exc:
            return f"{path}: {exc}"
        if body is not None and body["stream"] and "data: [DONE]" not in text:
            return f"{path}: unexpected answer {text[:200]!r}"
        if body is not None and not body["stream"] and '"usage"' not in text:
            return f"{path}: unexpected answer {text[:200]!r}"
    return ""


def use_batch_depth(eng, on: bool = True) -> None:
    """`--depth auto`: the engine's steps speculate at k or not at all, by batch size, as the
    measured rates say (engine.depth.BatchDepthPolicy; the scheduler tells it the batch before each
    step and the step's time and tokens after it). The engine runs with depth "fixed" (verify graphs
    for widths 1 and k + 1 only: the two it can then run) and this policy in its `depth` slot. An
    active speculation cache drafts k at every step (its steps take no depth), so it gets none."""
    from draftrelay.engine.depth import BatchDepthPolicy

    cache = eng.spec_cache is not None and eng.spec_cache.active
    if on and eng.rounds is not None and eng.cfg.n_draft > 0 and not cache:
        eng.depth = BatchDepthPolicy(eng.cfg.n_draft)


def round_tokens(max_batch: int, max_round_tokens: int, k: int) -> int:
    """Tokens one round may carry to the drafter: every running request catching up on a long
    prompt at once (max_round_tokens each) or sending its accepted tokens (k + 1 at most). The
    hand-off region's staging is sized by it; a smaller one would refuse such a round."""
    return max_batch * (max_round_tokens + k + 1)


def cache_line(w: dict) -> str:
    """The warm-up's speculation-cache paths, for the start-up line."""
    return (f"{w['hits']}/{w['lookups']} hits, {w['fast_steps']} verifies without a wait, {w['waited_steps']} "
            f"waited, {w['cancelled_in_flight']} cancelled with a round in flight")


def _exit_on_term(signum, frame):
    raise SystemExit(0)


def read_api_key(path: str) -> str:
    try:
        with open(path) as f:
            key = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror}") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"--api-key-file {path}: the file must hold one key (no spaces), it holds "
                         f"{'nothing' if not key else 'whitespace inside the key'}")
    return key


def _chat_encoder(target, model_spec: str):
    """messages -> prompt ids, and where the template came from."""
    from draftrelay.engine import loading as L

    from .chat import compile_template, find_template

    # the tokenizer carries the checkpoint's template (tokenizer_config.json, or a GGUF file's
    # tokenizer.chat_template); a model object may carry one too
    holder = next((h for h in (target.tokenizer, target.model) if getattr(h, "chat_template", None)),
                  target.tokenizer)
    src, where, bos, eos = find_template(holder, model_spec if os.path.isdir(model_spec) else None)
    if where == "the model file":
        where = (f"{model_spec} (tokenizer.chat_template)" if L.is_gguf(model_spec)
                 else os.path.join(model_spec, "tokenizer_config.json") if os.path.isdir(model_spec) else where)
    render = compile_template(src, bos, eos)
    tok = target.tokenizer
    if isinstance(tok, L.HFTokenizer):
        def encode(text: str) -> list[int]:  # the template wrote the special tokens itself
            return tok.tok.encode(text, add_special_tokens=False).ids
    else:
        encode = tok.encode
    return (lambda msgs: encode(render(msgs))), where


def run(args: argparse.Namespace) -> int:
    why = _check(args)
    if why:
        print(f"draftrelay serve: {why}", file=sys.stderr)
        return 2
    # SIGTERM ends the server cleanly: the engine, its proxy and the local worker are stopped
    signal.signal(signal.SIGTERM, _exit_on_term)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from draftrelay import kernels
    from draftrelay.engine import loading as L
    from draftrelay.engine.engine import Engine, EngineConfig
    from draftrelay.model import ModelError

    from .app import build_app
    from .chat import TemplateError
    from .metrics import ServeMetrics, freeze_startup_objects
    from .protocol import Limits
    from .scheduler import Scheduler, probe_prompt, warm_up

    say = lambda msg: print(f"draftrelay serve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        api_key = read_api_key(args.api_key_file) if args.api_key_file else ""
        dev = L.pick_device(args.device)
        if args.graphs and dev.type != "cuda":
            raise ValueError("--graphs needs a CUDA device")
        host, port = L.parse_hostport(args.worker) if args.worker else ("", 0)
        if args.max_round_tokens is None:
            args.max_round_tokens = GPU_ROUND_TOKENS if dev.type == "cuda" else CPU_ROUND_TOKENS
        pinned = apply_cpu_placement(args)
        if pinned and args.threads == "0":  # one thread a CPU of --cpus
            args.threads = str(pinned)
        target = L.load_target(args.model, dev)
        ctx = target.model.cfg.max_position_embeddings
        if args.max_model_len > ctx:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's context of {ctx}")
        max_model_len = args.max_model_len or fit_context(target.model, dev, args, say)
        render_chat, template_from = _chat_encoder(target, args.model)
    except (ValueError, ModelError, OSError, TemplateError) as exc:
        say(str(exc))
        return 2
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        say(f"warning: listening on {args.host} without --api-key-file: anyone who reaches it may use it")
    name = args.served_model_name or target.name
    max_len = max_model_len + args.k + 1  # the engine's row also holds the last verify's drafts
    worker = None
    sock = None
    try:
        h = None
        if args.mode != "off":
            if not args.worker:
                try:
                    worker = L.start_local_worker(args.drafter, dev, args.k, max_len + 64, args.max_batch,
                                                  warm_batch=0 if args.no_warmup else args.max_batch,
                                                  warm_max_kv=args.worker_warm_max_kv, quant=args.drafter_quant,
                                                  draft_vocab=args.drafter_vocab, cpus=args.drafter_cpus,
                                                  head_int8=args.drafter_head_int8)
                except RuntimeError as exc:
                    say(f"the local worker did not start: {exc}")
                    return 1
                host, port = worker.host, worker.port
            spec = L.worker_spec(host, port, L.drafter_model_id(args.drafter) if not args.worker else "",
                                 target.tokenizer_hash, args.k, args.max_batch)
            why = L.check_worker(spec)
            if why:
                say(f"the worker refused us: {why}")
                return 1
            # the speculation cache selects its branches on the host: on a GPU its rounds run on the host
            # stream (loading.handoff_config host_rounds)
            deadline, timed = args.deadline_ms, {}
            if deadline is None and dev.type != "cuda":
                # a CPU drafter's round takes hundreds of ms to seconds, and several times longer over a full
                # batch: measured here as generate measures it, over --max-batch requests each sending a
                # catch-up round's tokens (with the GPU's fixed 200 ms every round of the reference pair timed
                # out and the server ran target-only)
                probe = probe_prompt(args.max_round_tokens, target.model.cfg.vocab_size)
                rs = L.round_settings(spec, probe, args.k, requests=args.max_batch)
                say(rs.note)
                deadline, timed = rs.deadline_ms, {"round_budget_ms": rs.budget_ms}
            h = L.handoff_config(spec, dev, deadline or DEFAULT_DEADLINE_MS, not args.worker,
                                 host_rounds=bool(args.spec_cache),
                                 max_tokens=round_tokens(args.max_batch, args.max_round_tokens, args.k), **timed)
        cfg = EngineConfig(mode=args.mode, n_draft=args.k, max_batch=args.max_batch, max_len=max_len, handoff=h,
                           graphs=args.graphs, max_round_tokens=args.max_round_tokens,
                           spec_fanout=args.spec_cache,
                           spec_options={"guard": False} if args.cache_guard == "off" else {},
                           threads=args.threads if args.threads == "auto" else int(args.threads))
        try:
            sock = listen(args.host, args.port)
        except OSError as exc:
            say(f"cannot listen on {args.host}:{args.port}: {exc.strerror}")
            return 1
        bound = sock.getsockname()[1]
        try:
            engine = Engine(target.model, cfg)
        except KVMemoryError as exc:
            say(str(exc))
            return 2
        with engine as eng:
            use_batch_depth(eng, args.depth == "auto")
            if eng.rounds is not None and eng.rounds.refusal:
                say(f"async refused, serving sync rounds: {eng.rounds.refusal}")
            if eng.spec_cache is not None and not eng.spec_cache.active:
                say(f"speculation cache off, serving ordinary async rounds: {eng.spec_cache.refusal}")
            sched = None
            metrics = ServeMetrics(name, lambda: sched.handoff if sched else {"mode": "off"})
            sched = Scheduler(eng, metrics, args.max_queue)
            # the warm-up runs on the engine thread, the one that serves (see Scheduler.start)
            try:
                if args.no_warmup:
                    sched.start()
                else:
                    # a CPU's prefill of a whole long context can take minutes: capped there by default
                    cap = args.warmup_prompt_len or (0 if dev.type == "cuda" else CPU_WARMUP_PROMPT)
                    say(f"warming up: prompts up to {min(cap or max_model_len, max_model_len)} tokens and every "
                        f"batch size to {args.max_batch} before the first client (--no-warmup skips it; on a "
                        "CPU this can take minutes)")
                    t_warm = time.monotonic()
                    w = sched.start(lambda: warm_up(
                        eng, max_model_len, long_prompt=cap,
                        progress=lambda line: say(f"warm-up {line} ({time.monotonic() - t_warm:.0f} s so far)")))
                    say(f"warmed up in {w['seconds']:.1f} s (prompts up to {w['long_prompt']} tokens"
                        f"{', drafter catch-up rounds' if w['catch_up_rounds'] else ''}"
                        + (f", speculation cache: {cache_line(w['spec_cache'])}" if "spec_cache" in w else "") + ")"
                        + ("" if w["rounds_healthy"] else "; rounds to the drafter still fail (decoding target-only "
                           "until they succeed)")
                        + (f"; {kernels.plan_stats().line()}" if "kernel_plan" in w else ""))
                lim = Limits(name, max_model_len, eng.vocab, target.stop_ids, target.tokenizer.encode, render_chat)

                def announce() -> None:
                    metrics.quiet = True  # the start-up requests are not clients' requests
                    try:
                        why = "" if args.no_warmup else self_request(args.host, bound, api_key)
                    finally:
                        metrics.quiet = False
                    # before a client may send: a full collection would otherwise walk the whole
                    # start-up heap during some request (and hold the engine thread meanwhile)
                    freeze_startup_objects()
                    metrics.gc.start()  # the pauses clients may see, from here on
                    cache = eng.spec_cache is not None and eng.spec_cache.active
                    say(f"listening on http://{args.host}:{bound} (model {name!r}, mode {eng.round_mode}"
                        f"{f' + speculation cache F={eng.spec_cache.fanout}' if cache else ''}, max "
                        f"batch {args.max_batch}, context {max_model_len}, chat template: {template_from})"
                        + (f"; warning: the start-up request failed: {why}" if why else ""))

                # the announcement waits for one request through the whole HTTP path, served once
                # uvicorn accepts (after this start-up hook returns)
                def ready() -> None:
                    threading.Thread(target=announce, name="announce", daemon=True).start()

                app = build_app(sched, lim, metrics, target.tokenizer.decode, api_key, on_ready=ready)
                server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                                       timeout_graceful_shutdown=3))
                # uvicorn handles SIGTERM itself (graceful shutdown), then raises it again once it is done:
                # it must then find a handler that lets the cleanup below run
                signal.signal(signal.SIGTERM, lambda *a: None)
                server.run(sockets=[sock])
            finally:
                metrics.gc.stop()
                sched.stop()
    finally:
        if sock is not None:
            sock.close()
        if worker is not None:
            worker.stop()
    return 0
