"""`draftrelay worker`: serve a drafter over TCP (docs/CONTRACT.md, docs/WORKER.md).

Security (docs/CONTRACT.md §8): a worker bound to a non-loopback address needs a shared secret
(`--secret-file` or $DRAFTRELAY_SECRET) unless `--insecure-no-auth` says otherwise; `--tls-cert` /
`--tls-key` encrypt the link. Each GPU the worker uses is locked for its lifetime (gpulock.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import NoReturn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="local HF model directory, a .gguf file, 'tiny' (built-in tiny drafter), 'test' "
                        "(deterministic test drafter) or 'random:SHAPE' (qwen2.5-0.5b, qwen2.5-1.5b at seeded random "
                        "weights)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs a shared secret (or --insecure-no-auth)")
    p.add_argument("--secret-file", default="", metavar="PATH",
                   help="file holding the shared secret clients must prove (mode 600; default: $DRAFTRELAY_SECRET)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without a shared secret: anyone who reaches the port may "
                        "use the drafter")
    p.add_argument("--tls-cert", default="", metavar="PEM", help="serve TLS with this certificate (chain)")
    p.add_argument("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--share-gpu", action="store_true",
                   help="run even if another draftrelay worker holds this GPU's lock")
    p.add_argument("--gpu-status", action="store_true",
                   help="print which PID holds the lock of --device's GPU(s) and exit (never waits, takes nothing)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve the worker's counters (Prometheus) on --metrics-host:PORT")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18627, help="TCP port (0: pick a free one; printed at start)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                   help="the drafter's layer products on quantized weights. On a CPU (its lean loop): int8 (one "
                        "scale per row, a quarter of fp32's bytes; 1.4x faster drafts on the reference 0.5B) or int4 "
                        "(groups of 32, an eighth; 1.9x, its drafts less like the fp32 drafter's). On a GPU: int8 "
                        "(one scale per row, half of bf16's bytes, the fast path's int8 tiles where they beat the "
                        "bf16 product; the bf16 weights stay loaded too). The drafts are approximate, the target's "
                        "verify keeps its output")
    p.add_argument("--draft-vocab", default="", metavar="N|FILE.npy[:N]",
                   help="restrict the drafter's head to a draft vocabulary: N = ids 0..N-1 (a byte-level BPE "
                        "numbers tokens in merge order, frequent ones first; 32768 on Qwen2.5: a head 4.6x "
                        "smaller), or FILE.npy[:N], the first N ids of a ranking file (most frequent first). "
                        "Tokens outside it are never drafted (lower acceptance); the output is the target's "
                        "either way. Default: the whole head")
    p.add_argument("--head-int8", action="store_true",
                   help="a CUDA drafter's greedy forwards read its head (the draft vocabulary's rows, if any) as "
                        "int8 with one scale per row: half the bytes of the largest product of a one-request "
                        "draft step. The drafts are approximate (a near-tie can go the other way), the target's "
                        "verify keeps its output. Default: the bf16 head")
    p.add_argument("--rows", type=int, default=16, help="draft-KV rows shared by all sessions")
    p.add_argument("--max-requests", type=int, default=0,
                   help="most requests (rows) one session may hold (0: half of --rows, so one client cannot take "
                        "every row)")
    p.add_argument("--row-lease", type=float, default=10.0,
                   help="seconds without a STEP after which a session's rows may go to a new session (PING "
                        "keeps the connection, not the rows)")
    p.add_argument("--prefill-slice-ms", type=float, default=0.0,
                   help="drafter time one prefill slice may take while other sessions wait (0: about one "
                        "ordinary STEP; -1: never slice)")
    p.add_argument("--slow-step-ms", type=float, default=50.0, metavar="MS",
                   help="log every STEP slower than this with what it did (graphs built, kernels planned, "
                        "waiting for the drafter); 0: never")
    p.add_argument("--max-ctx", type=int, default=4096, help="longest context per request, in tokens")
    p.add_argument("--n-out-max", type=int, default=8, help="most drafts per block (1-64)")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds before an idle session expires")
    p.add_argument("--max-conns", type=int, default=64)
    p.add_argument("--max-conns-per-peer", type=int, default=16, help="connections one client address may hold")
    p.add_argument("--handshake-timeout", type=float, default=5.0, help="seconds for a new connection's HELLO")
    p.add_argument("--frame-timeout", type=float, default=5.0, help="seconds for a started frame to complete")
    p.add_argument("--max-frame", type=int, default=4 << 20, help="largest accepted frame, bytes")
    p.add_argument("--seed", type=int, default=None, help="seed of 'tiny' / 'random:' weights")
    p.add_argument("--model-id", default="", help="identity announced in the handshake (default: derived)")
    p.add_argument("--test-vocab", type=int, default=1000, help="vocabulary of the 'test' drafter")
    p.add_argument("--test-slow-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--test-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--test-fail-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="auto", choices=["auto", "eager", "lean", "static", "graph"],
                   help="draft step execution: CUDA graphs (auto on a GPU), lean (auto on CPU: eager's ops without "
                        "the general forward's per-call overhead), eager, or static shapes")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of the drafter (docs/TP2.md): 1 (default) one device, 2 a GPU pair")
    p.add_argument("--tp-mode", default="auto", choices=["auto", "pair", "emulate", "solo"],
                   help="with --tp: pair (one GPU per rank, P2P collectives; auto), emulate (every rank on --device, "
                        "the same bits), solo (rank 0 alone, stand-in collectives: timing); with --tp 1 a mode "
                        "runs the TP code unsplit")
    p.add_argument("--test-tp-fail-token", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--warm-graphs", default="",
                   help="comma list of n_out values whose draft-step graphs are captured at start (for up to "
                        "--warm-batch requests); others are captured on first use, except that a round asking "
                        "fewer drafts than a built step runs that step (list every depth a depth policy asks: "
                        "1,2,3,4)")
    p.add_argument("--warm-batch", type=int, default=4)
    p.add_argument("--warm-min-kv", type=int, default=0, metavar="N",
                   help="capture the --warm-graphs only for contexts of at least N tokens (0: from the "
                        "smallest; a client whose prompt is N tokens long never uses a shorter one)")
    p.add_argument("--warm-max-kv", type=int, default=0, metavar="N",
                   help="capture the --warm-graphs only for contexts up to N tokens (0: up to --max-ctx); "
                        "longer contexts are captured on first use")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: 1 for 'tiny', which runs fastest single-threaded; one a CPU of --cpus "
                        "where given; torch's default else)")
    p.add_argument("--cpus", default="", metavar="LIST",
                   help="run on these CPUs only (e.g. 1 or 2-3 or 0,2): the drafter on cores of its own, beside a "
                        "target on the others, so its work during a verify does not slow the verify (cpus.py)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--log-every", type=float, default=5.0,
                   help="seconds between WARNING lines of one kind (refusals, malformed frames, expiry)")
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)  # exit when this process dies
    p.add_argument("--parent-log", default="", help=argparse.SUPPRESS)  # its log file: ours to delete if it dies
    p.add_argument("--test-gpu-uuid", default="", help=argparse.SUPPRESS)  # lock this (fake) GPU UUID on a CPU


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: must be 0-65535"
    for name in ("rows", "max_ctx", "max_conns", "max_conns_per_peer"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive"
    if args.max_requests < 0:
        return f"--max-requests {args.max_requests}: must be positive (0: half of --rows)"
    for name in ("warm_min_kv", "warm_max_kv"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0"
    if not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port {args.metrics_port}: must be 0-65535"
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert and --tls-key go together"
    if not 1 <= args.n_out_max <= 64:
        return f"--n-out-max {args.n_out_max}: must be 1-64"
    if args.max_frame < 4096:
        return f"--max-frame {args.max_frame}: must be at least 4096"
    for name in ("idle_timeout", "handshake_timeout", "frame_timeout", "row_lease", "log_every"):
        if not getattr(args, name) > 0 or not math.isfinite(getattr(args, name)):
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive number"
    if not math.isfinite(args.prefill_slice_ms):
        return f"--prefill-slice-ms {args.prefill_slice_ms}: must be 0 (auto), a positive number or -1 (off)"
    if not (math.isfinite(args.slow_step_ms) and args.slow_step_ms >= 0):
        return f"--slow-step-ms {args.slow_step_ms}: must be 0 (never) or a positive number"
    if args.threads < 0:
        return f"--threads {args.threads}: must be 0 or more"
    if args.cpus:
        from draftrelay import cpus

        try:
            cpus.parse(args.cpus)
        except ValueError as exc:
            return f"--cpus: {exc}"
    if not 1 <= args.tp <= 8:
        return f"--tp {args.tp}: must be 1-8"
    if (args.tp > 1 or args.tp_mode != "auto") and args.model == "test":
        return "--tp needs a Llama-family model ('tiny', 'random:SHAPE' or a directory), not 'test'"
    if args.test_vocab <= 1:
        return f"--test-vocab {args.test_vocab}: must be at least 2"
    if args.draft_vocab and (args.tp > 1 or args.tp_mode != "auto"):
        return f"--draft-vocab {args.draft_vocab}: for a one-card drafter, not with --tp"
    if args.draft_vocab and args.model == "test":
        return f"--draft-vocab {args.draft_vocab}: the 'test' drafter has no head to restrict"
    if args.head_int8 and (args.tp > 1 or args.tp_mode != "auto"):
        return "--head-int8: for a one-card drafter, not with --tp"
    if args.head_int8 and (args.model == "test" or args.device == "cpu"):
        return f"--head-int8: for a CUDA drafter with a head, not --model {args.model} --device {args.device}"
    if args.quant != "none" and (args.tp > 1 or args.tp_mode != "auto"):
        return f"--quant {args.quant}: for a one-card drafter, not with --tp"
    if args.quant == "int4" and args.device not in ("cpu", "auto"):
        return f"--quant {args.quant}: for a CPU drafter (its lean loop), not --device {args.device} (a GPU takes int8)"
    if args.quant != "none" and args.model == "test":
        return f"--quant {args.quant}: the 'test' drafter has no weights to quantize"
    return None


class WarmProgress:
    """The warm-up's progress on stderr: a line as it starts (how many draft-step graphs), one every
    `every_s` seconds while it captures (at a 32K context a GPU worker captures hundreds: minutes of
    start-up), and one when it is done."""

    def __init__(self, steps: str, every_s: float = 10.0, out=None) -> None:
        self.steps, self.every_s, self.out = steps, every_s, out
        self.t0 = self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        out = self.out or sys.stderr
        if done == 0:
            self.t0 = self.last = now
            print(f"draftrelay worker: capturing {total} draft-step graphs (--warm-graphs {self.steps})",
                  file=out, flush=True)
        elif done == total:
            print(f"draftrelay worker: {total} draft-step graphs captured in {now - self.t0:.1f} s",
                  file=out, flush=True)
        elif now - self.last >= self.every_s:
            self.last = now
            print(f"draftrelay worker: {done} / {total} draft-step graphs, {now - self.t0:.0f} s",
                  file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    err = _check(args)
    if err:
        print(f"draftrelay worker: {err}", file=sys.stderr)
        return 2
    from draftrelay.worker.process import die_with_parent

    if args.parent_pid and not die_with_parent(args.parent_pid):
        print(f"draftrelay worker: the parent (PID {args.parent_pid}) is gone; exiting", file=sys.stderr)
        _drop_parent_log(args)
        return 1
    from draftrelay.wire import security

    try:
        secret = security.load_secret(args.secret_file)
        tls = security.server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    except ValueError as exc:
        print(f"draftrelay worker: {exc}", file=sys.stderr)
        return 2
    if secret is None and not args.insecure_no_auth and not security.is_loopback(args.host):
        print(f"draftrelay worker: --host {args.host} is reachable from other hosts, and no shared secret is set: "
              f"give one (--secret-file PATH or ${security.SECRET_ENV}; clients then need the same), or pass "
              f"--insecure-no-auth to serve anyone who can reach the port", file=sys.stderr)
        return 2
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.drafters import load_drafter
    from draftrelay.worker.server import WorkerServer

    device = args.device
    pinned: list[int] = []
    if args.cpus:  # before torch starts its thread pool, so every thread inherits the mask
        from draftrelay import cpus

        pinned = cpus.parse(args.cpus)
        try:
            cpus.pin(pinned)
        except ValueError as exc:
            print(f"draftrelay worker: --cpus: {exc}", file=sys.stderr)
            return 2
    if args.model != "test":
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        threads = args.threads or (1 if args.model == "tiny" else len(pinned))
        if threads:
            torch.set_num_threads(threads)
    elif device == "auto":
        device = "cpu"
    from draftrelay.worker import gpulock

    tp_used = args.tp > 1 or args.tp_mode != "auto"
    if args.gpu_status:
        uuids = [args.test_gpu_uuid] if args.test_gpu_uuid else gpulock.gpu_uuids(device)
        for u in uuids:
            pid = gpulock.holder(u)
            print(f"{u}: " + ("free" if pid is None else f"held by PID {pid}" if pid else "held"))
        if not uuids:
            print(f"{device}: no GPU")
        return 0
    try:  # before the model loads: a second worker on a held GPU must not allocate anything there
        if args.test_gpu_uuid:
            uuids = [args.test_gpu_uuid]
        elif tp_used and args.tp_mode in ("auto", "pair"):  # rank r runs on cuda:r
            uuids = sorted({u for r in range(args.tp) for u in gpulock.gpu_uuids(f"cuda:{r}")})
        else:
            uuids = gpulock.gpu_uuids(device)
        gpu_locks, notes = gpulock.acquire_all(uuids, args.share_gpu)
    except gpulock.GpuBusy as exc:
        print(f"draftrelay worker: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        logging.getLogger("draftrelay.worker").warning("%s", note)
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
                                   fail_token=args.test_fail_token, mode=args.mode, quant=args.quant,
                                   draft_vocab=args.draft_vocab, head_int8=args.head_int8)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"draftrelay worker: cannot load drafter: {exc}", file=sys.stderr)
        return 2
    if hasattr(drafter, "plan_warm"):  # kernel plans for every batch size now, not inside the first rounds
        drafter.plan_warm()
    if args.warm_graphs:
        try:
            steps = [int(x) for x in args.warm_graphs.split(",")]
        except ValueError:
            print(f"draftrelay worker: --warm-graphs {args.warm_graphs!r}: expected numbers like 4,5", file=sys.stderr)
            return 2
        if hasattr(drafter, "warm"):
            drafter.warm([n for n in steps if 1 <= n <= args.n_out_max], args.warm_batch, args.warm_max_kv,
                         progress=WarmProgress(args.warm_graphs), min_kv=args.warm_min_kv)
    per_session = min(args.max_requests, args.rows) if args.max_requests else max(1, args.rows // 2)
    core = WorkerCore(drafter, max_requests=per_session, idle_timeout=args.idle_timeout, max_frame=args.max_frame,
                      row_lease=args.row_lease, prefill_slice_ms=args.prefill_slice_ms,
                      slow_step_ms=args.slow_step_ms)
    try:
        server = WorkerServer(core, args.host, args.port, max_conns=args.max_conns,
                              handshake_timeout=args.handshake_timeout, frame_timeout=args.frame_timeout,
                              secret=secret, tls=tls, max_conns_per_peer=args.max_conns_per_peer,
                              log_every_s=args.log_every)
    except OSError as exc:
        print(f"draftrelay worker: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        from draftrelay.worker import metrics

        try:
            metrics.serve(server, args.metrics_port, args.metrics_host)
        except OSError as exc:
            print(f"draftrelay worker: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                  file=sys.stderr)
            server.stop()
            return 2
    fatal: list[str] = []
    if tp_used:  # a TP pair that keeps failing steps: exit nonzero so a supervisor restarts the worker

        def on_fatal(msg: str) -> None:
            fatal.append(msg)
            threading.Timer(0.3, server._stopping.set).start()  # the failing STEP's INTERNAL reply goes out first

        drafter.on_fatal = on_fatal
    host, port = server.start()

    def on_term(*_) -> None:
        # SIGTERM: the supervisor's stop, or the parent's death (PR_SET_PDEATHSIG). The alarm bounds the
        # clean stop: SIGALRM's default action ends the process if anything below hangs. The event is set
        # from another thread: Event.set here could deadlock on the condition lock this same (main)
        # thread holds inside Event.wait when the signal lands.
        signal.alarm(STOP_BOUND_S)
        threading.Thread(target=server._stopping.set, name="worker-term", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    from draftrelay.kernels import plan_stats

    planned = plan_stats()  # what the start-up's warm-up spent measuring kernels (CUDA only)
    print(f"draftrelay worker listening on {host}:{port} model_id={drafter.model_id} vocab={drafter.vocab_size} "
          f"max_ctx={drafter.max_ctx} rows={drafter.n_rows} per-session={per_session} "
          f"auth={'secret' if secret else 'none'} tls={'on' if tls else 'off'} ({drafter.info}"
          + ("" if planned is None else f"; {planned.line()}") + ")", flush=True)
    calls = None
    if getattr(drafter, "model", None) is not None and getattr(drafter.model, "device", None) is not None \
            and drafter.model.device.type == "cpu" and hasattr(drafter, "calls"):
        from draftrelay.worker.mainthread import MainThreadCalls

        calls = drafter.calls = MainThreadCalls()  # the drafter's steps on this thread (mainthread.py: why)
    try:
        if calls is not None:
            calls.serve(server._stopping)
        else:
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        for lk in gpu_locks:
            lk.release()
    if fatal:
        print(f"draftrelay worker: exiting for a restart: {fatal[0]}", file=sys.stderr)
    _leave(3 if fatal else 0, server.active_connections(), args)


STOP_BOUND_S = 15  # a clean stop (connections closed and joined, GPU locks released) takes well under this


def _leave(rc: int, busy: int, args: argparse.Namespace) -> NoReturn:
    """End the process without Python's interpreter teardown. A connection thread can still be inside a
    drafter step (stop() waits for each only so long, and it is a daemon); tearing the interpreter down
    around such a thread was seen to spin forever in the garbage collector (gc_list_size under
    interpreter_clear) after the parent was SIGKILLed on a loaded host, leaving an orphaned worker.
    Everything the worker owns is released by now (sockets, GPU locks; the kernel frees the rest), and
    nothing it runs registers atexit work."""
    if busy:
        logging.getLogger("draftrelay.worker").warning(
            "%d connection thread(s) still in a step; exiting without interpreter teardown", busy)
    _drop_parent_log(args)
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def _drop_parent_log(args: argparse.Namespace) -> None:
    """A parent that died (SIGKILL) could not delete the log file it gave us as stderr: we do."""
    if args.parent_log and args.parent_pid and os.getppid() != args.parent_pid:
        try:
            os.unlink(args.parent_log)
        except OSError:
            pass
