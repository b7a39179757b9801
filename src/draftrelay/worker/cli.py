"""`draftrelay worker`: serve a drafter over TCP (docs/CONTRACT.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="local HF model directory, a .gguf file, 'tiny' (built-in tiny drafter), 'test' "
                        "(deterministic test drafter) or 'random:SHAPE' (qwen2.5-0.5b, qwen2.5-1.5b at seeded random "
                        "weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18627, help="TCP port (0: pick a free one; printed at start)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=int, default=16, help="draft-KV rows shared by all sessions")
    p.add_argument("--max-requests", type=int, default=16, help="most requests one session may hold")
    p.add_argument("--max-ctx", type=int, default=4096, help="longest context per request, in tokens")
    p.add_argument("--n-out-max", type=int, default=8, help="most drafts per block (1-64)")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds before an idle session expires")
    p.add_argument("--max-conns", type=int, default=64)
    p.add_argument("--handshake-timeout", type=float, default=5.0, help="seconds for a new connection's HELLO")
    p.add_argument("--frame-timeout", type=float, default=5.0, help="seconds for a started frame to complete")
    p.add_argument("--max-frame", type=int, default=4 << 20, help="largest accepted frame, bytes")
    p.add_argument("--seed", type=int, default=None, help="seed of 'tiny' / 'random:' weights")
    p.add_argument("--model-id", default="", help="identity announced in the handshake (default: derived)")
    p.add_argument("--test-vocab", type=int, default=1000, help="vocabulary of the 'test' drafter")
    p.add_argument("--test-slow-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--test-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--test-fail-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="auto", choices=["auto", "eager", "static", "graph"],
                   help="draft step execution: CUDA graphs (auto on a GPU), eager (auto on CPU), or static shapes")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of the drafter (docs/TP2.md): 1 (default) one device, 2 a GPU pair")
    p.add_argument("--tp-mode", default="auto", choices=["auto", "pair", "emulate", "solo"],
                   help="with --tp: pair (one GPU per rank, P2P collectives; auto), emulate (every rank on --device, "
                        "the same bits), solo (rank 0 alone, stand-in collectives: timing); with --tp 1 a mode "
                        "runs the TP code unsplit")
    p.add_argument("--test-tp-fail-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--warm-graphs", default="",
                   help="comma list of n_out values whose draft-step graphs are captured at start (for up to "
                        "--warm-batch requests); others are captured on first use")
    p.add_argument("--warm-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: 1 for 'tiny', which runs fastest single-threaded; torch's default else)")
    p.add_argument("--log-level", default="WARNING")


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: must be 0-65535"
    for name in ("rows", "max_requests", "max_ctx", "max_conns"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive"
    if not 1 <= args.n_out_max <= 64:
        return f"--n-out-max {args.n_out_max}: must be 1-64"
    if args.max_frame < 4096:
        return f"--max-frame {args.max_frame}: must be at least 4096"
    for name in ("idle_timeout", "handshake_timeout", "frame_timeout"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive"
    if args.threads < 0:
        return f"--threads {args.threads}: must be 0 or more"
    if not 1 <= args.tp <= 8:
        return f"--tp {args.tp}: must be 1-8"
    if (args.tp > 1 or args.tp_mode != "auto") and args.model == "test":
        return "--tp needs a Llama-family model ('tiny', 'random:SHAPE' or a directory), not 'test'"
    if args.test_vocab <= 1:
        return f"--test-vocab {args.test_vocab}: must be at least 2"
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    err = _check(args)
    if err:
        print(f"draftrelay worker: {err}", file=sys.stderr)
        return 2
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.drafters import load_drafter
    from draftrelay.worker.server import WorkerServer

    device = args.device
    if args.model != "test":
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        threads = args.threads or (1 if args.model == "tiny" else 0)
        if threads:
            torch.set_num_threads(threads)
    elif device == "auto":
        device = "cpu"
    tp_used = args.tp > 1 or args.tp_mode != "auto"
    try:
        if tp_used:
            from draftrelay.worker.tp import load_tp_drafter

            drafter = load_tp_drafter(args.model, args.tp, "pair" if args.tp_mode == "auto" else args.tp_mode,
                                      device=device, dtype=args.dtype, n_rows=args.rows, max_ctx=args.max_ctx,
                                      n_out_max=args.n_out_max, seed=args.seed, model_id=args.model_id,
                                      mode=args.mode, fail_token=args.test_tp_fail_token)
        else:
            drafter = load_drafter(args.model, device=device, dtype=args.dtype, n_rows=args.rows,
                                   max_ctx=args.max_ctx, n_out_max=args.n_out_max, seed=args.seed,
                                   model_id=args.model_id, test_vocab=args.test_vocab,
                                   slow_token=args.test_slow_token, delay_ms=args.test_delay_ms,
                                   fail_token=args.test_fail_token, mode=args.mode)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"draftrelay worker: cannot load drafter: {exc}", file=sys.stderr)
        return 2
    if args.warm_graphs:
        try:
            steps = [int(x) for x in args.warm_graphs.split(",")]
        except ValueError:
            print(f"draftrelay worker: --warm-graphs {args.warm_graphs!r}: expected numbers like 4,5", file=sys.stderr)
            return 2
        if hasattr(drafter, "warm"):
            drafter.warm([n for n in steps if 1 <= n <= args.n_out_max], args.warm_batch)
    core = WorkerCore(drafter, max_requests=min(args.max_requests, args.rows), idle_timeout=args.idle_timeout,
                      max_frame=args.max_frame)
    try:
        server = WorkerServer(core, args.host, args.port, max_conns=args.max_conns,
                              handshake_timeout=args.handshake_timeout, frame_timeout=args.frame_timeout)
    except OSError as exc:
        print(f"draftrelay worker: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    fatal: list[str] = []
    if tp_used:  # a TP pair that keeps failing steps: exit nonzero so a supervisor restarts the worker

        def on_fatal(msg: str) -> None:
            fatal.append(msg)
            threading.Timer(0.3, server._stopping.set).start()  # the failing STEP's INTERNAL reply goes out first

        drafter.on_fatal = on_fatal
    host, port = server.start()
    signal.signal(signal.SIGTERM, lambda *_: server._stopping.set())
    print(f"draftrelay worker listening on {host}:{port} model_id={drafter.model_id} vocab={drafter.vocab_size} "
          f"max_ctx={drafter.max_ctx} rows={drafter.n_rows} ({drafter.info})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    if fatal:
        print(f"draftrelay worker: exiting for a restart: {fatal[0]}", file=sys.stderr)
        return 3
    return 0
