"""Load test of the HTTP server at REPLAYED acceptance: the serve stack over replay models.

The server is assembled here, in this benchmark's process, from `draftrelay.serve`'s parts (warm-up,
scheduler, metrics, app, the listening socket, the start-up request through HTTP), exactly as
`draftrelay serve` assembles them, except for the target: a Qwen2.5-7B-shaped model at random weights
whose logits are forced to a recorded trace (`draftrelay.replay.install_replay_target`), beside a
`draftrelay worker` process running `replay:TRACE:INNER` (a Qwen2.5-0.5B-shaped drafter at random
weights proposing the trace's recorded drafter tokens) on the same GPU, started with `--warm-graphs k
--warm-batch MAX_BATCH` as serve starts its local worker (`--warm-drafter 0`: graphs captured on first
use; `--warm-max-kv`: at start only for contexts up to that many tokens), and the start-up heap
frozen as serve freezes it (`--gc-freeze 0`: not). Replay models exist only here:
`draftrelay serve` cannot load one. Every figure is labelled "replayed acceptance of <pair>".

Modes: off, sync, async, and cache (async rounds with the speculation cache, `draftrelay serve
--mode async --spec-cache F`, F = `--fanout`; its rounds run on the host stream, as serve runs them,
and its branches are selected on the host). Where the drafter runs (`--placement`): `same`, the
worker process on this GPU (as serve's local worker; the cache declines such a worker, so here it is
forced on, `spec_options shared_gpu`, and its rows say so), or `emulated`, a drafter on an emulated
second device for every drafting mode: a CPU worker process `replay:TRACE:emulated=COST.json` that
spends as wall time the seconds the real drafter's STEP and branch work measured on this device
(`replay_headline.measure_costs`, run here first). The cache's figures belong to `emulated`: the
design puts the drafter on hardware of its own.

For each mode (one engine each, side by side in one run, the worker shared) the
server is warmed up and measured by `benchmarks/serve_load.py --url` in a separate process (the
client does not share this process's interpreter lock): the first request's TTFT against warm ones at
a short prompt and at `--long-len` tokens, then concurrency 1, 4, 16 of streaming requests whose
prompts are the trace's (fixed, greedy, `--max-tokens` each). Then the greedy outputs of the trace's
prompts are checked against the trace's tokens (the acceptance then is the recorded pair's). The
JSON is written after every mode.

    python benchmarks/serve_replay.py --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json     # H200
    python benchmarks/serve_replay.py --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json \\
        --modes off,sync,cache --placement emulated                               # H200, the cache's setting
    python benchmarks/serve_replay.py --device cpu --target tiny --drafter tiny --long-len 256 \\
        --trace synthetic --modes off,sync,async,cache --concurrency 1,4 --out /tmp/r.json   # CPU dry run

`--trace synthetic`: a trace of random sequences over the tiny models' vocabulary whose drafter guesses
the target's token 70 % of the time (the CPU dry run; its figures measure nothing real).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay import model as M  # noqa: E402
from draftrelay.engine import loading as L  # noqa: E402
from draftrelay.engine.engine import Engine, EngineConfig  # noqa: E402
from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.replay import Trace, install_replay_target  # noqa: E402
from draftrelay.serve.app import build_app  # noqa: E402
from draftrelay.serve.chat import CHATML, compile_template  # noqa: E402
from draftrelay.serve.cli import listen, round_tokens, self_request, use_batch_depth  # noqa: E402
from draftrelay.serve.metrics import ServeMetrics, freeze_startup_objects  # noqa: E402
from draftrelay.serve.protocol import Limits  # noqa: E402
from draftrelay.serve.scheduler import Scheduler, warm_up  # noqa: E402
from draftrelay.worker.process import start_worker_process  # noqa: E402
from engine_workloads import target_model, write_drafter_dir  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PLANE = 0x10000  # token id i is the character chr(PLANE + i): text <-> ids without a tokenizer


def decode(ids: list[int]) -> str:
    return "".join(chr(PLANE + i) for i in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) - PLANE for c in text]


def encode(text: str) -> list[int]:  # text prompts (the start-up request, the short TTFT prompt): bytes
    return list(text.encode("utf-8"))


class Served:
    """One mode's server: engine, scheduler and uvicorn on a thread of this process."""

    def __init__(self, eng: Engine, name: str, max_model_len: int) -> None:
        import uvicorn

        self.eng = eng
        self.metrics = ServeMetrics(name, lambda: self.sched.handoff)
        self.sched = Scheduler(eng, self.metrics, max_queue=256)
        # as `draftrelay serve`: the warm-up on the engine thread, before the socket is served
        self.warm = self.sched.start(lambda: warm_up(eng, max_model_len))
        lim = Limits(name, max_model_len, eng.vocab, (), encode,
                     (lambda render: lambda msgs: encode(render(msgs)))(compile_template(CHATML)))
        try:
            self.sock = listen("127.0.0.1", 0)
        except OSError:
            self.sched.stop()
            raise
        self.port = self.sock.getsockname()[1]
        app = build_app(self.sched, lim, self.metrics, decode)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise RuntimeError("uvicorn did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.metrics.gc.stop()
        # the next mode's engine replaces this one: what was frozen must be collectable again
        gc.unfreeze()
        self.server.should_exit = True
        self.thread.join(30)
        self.sched.stop()
        self.sock.close()


async def check_outputs(url: str, prompts: list[list[int]], want: list[list[int]], max_tokens: int) -> dict:
    """Greedy outputs of the trace's prompts, all at once, against the trace's tokens."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(p):
            r = await client.post(url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens,
                                                                   "temperature": 0})
            r.raise_for_status()
            return ids_of(r.json()["choices"][0]["text"])

        outs = await asyncio.gather(*(one(p) for p in prompts))
    equal = [o == w[:len(o)] and len(o) == min(max_tokens, len(w)) for o, w in zip(outs, want, strict=True)]
    return {"requests": len(prompts), "outputs_equal_trace": sum(equal)}


def emulated_worker(args, dev, inner: str, model_id: str, max_len: int, max_tokens: int, tmp: str, result: dict):
    """A drafter on an emulated second device: the real drafter's STEP and branch-work seconds measured on
    `dev` (replay_headline.measure_costs) for the batch sizes and contexts the runs reach, then a CPU
    worker process that spends them as wall time (the nearest measured entry for anything else)."""
    from replay_headline import measure_costs

    t0 = time.perf_counter()
    # few shapes (each one costs the drafter's planning and captures on a GPU): the nearest entry serves the rest
    jobs = sorted({1, min(4, args.max_batch), args.max_batch})
    contexts = [max(32, max_tokens + 64)]
    cost = measure_costs(inner, str(dev), contexts, jobs, args.k, max_len + 64, args.cost_iters, [args.fanout])
    cpath = os.path.join(tmp, "cost.json")
    cost.save(cpath)
    result["cost_measure_s"] = time.perf_counter() - t0
    result["cost_table_ms"] = {f"{j}x{n}@{kv}": 1e3 * s for (j, n, kv), s in sorted(cost.seconds.items())}
    result["prefetch_cost_ms"] = {f"{j}x{f}xk{k}@{kv}": 1e3 * s for (j, f, k, kv), s in sorted(cost.prefetch.items())}
    print(f"emulated second device: costs measured in {result['cost_measure_s']:.1f} s: "
          f"STEP {result['cost_table_ms']}, branch work {result['prefetch_cost_ms']}", flush=True)
    return start_worker_process(["--model", f"replay:{os.path.abspath(args.trace)}:emulated={cpath}",
                                 "--model-id", model_id, "--device", "cpu", "--max-ctx", str(max_len + 64),
                                 "--rows", str(2 * args.max_batch + 2), "--max-requests", str(args.max_batch),
                                 "--n-out-max", str(max(8, args.k))], timeout=120, env={"OMP_NUM_THREADS": "1"})


def synthetic_trace(path: str, n: int = 8, length: int = 160, vocab: int = 256, hit: float = 0.7) -> str:
    """`--trace synthetic`: random target sequences; the drafter's top guess is the target's token with
    probability `hit`, else its second guess is (written to `path`)."""
    from draftrelay.replay import synthetic_trace as make

    make(vocab, n, length, hit, second=True, prompt_len=(14, 2), pair="synthetic pair (random tokens, 70 % top-1)",
         prefix="s").save(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a trace file, or 'synthetic' (tiny models' vocabulary)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="qwen2.5-7b", help="qwen2.5-7b or tiny (shape of the replay target)")
    ap.add_argument("--drafter", default="qwen2.5-0.5b", help="qwen2.5-0.5b or tiny (shape of the replay drafter)")
    ap.add_argument("--modes", default="off,sync,async", help="off, sync, async, cache (async + speculation cache)")
    ap.add_argument("--fanout", type=int, default=8, help="branches per request of the cache mode")
    ap.add_argument("--cache-guard", default="on", choices=["on", "off"],
                    help="the cache mode's guard (engine/cache_guard.py: plain rounds wherever they measure "
                         "faster); off: every step a cache step")
    ap.add_argument("--placement", default="same", choices=["same", "emulated"],
                    help="same: the worker on this device; emulated: a drafter on an emulated second device "
                         "(measured costs spent as wall time by a CPU worker)")
    ap.add_argument("--cost-iters", type=int, default=5, help="repeats per measured cost of --placement emulated")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (0: serve_load's default)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (0: the trace's length)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=32768, help="prompt tokens of the long first-request TTFT")
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--deadline-ms", type=float, default=200.0, help="as `draftrelay serve --deadline-ms`")
    ap.add_argument("--no-graphs", action="store_true", help="eager verify (graphs are the GPU default)")
    ap.add_argument("--gc-freeze", type=int, default=1, help="1: freeze the start-up heap as the server does")
    ap.add_argument("--warm-drafter", type=int, default=1,
                    help="1: the worker captures its draft-step graphs at start, as serve's local worker does")
    ap.add_argument("--warm-max-kv", type=int, default=1024,
                    help="the worker captures at start only for contexts up to this many tokens (0: all; the load "
                         "levels' contexts are the trace's prompts + --max-tokens)")
    ap.add_argument("--depth", default="auto", choices=["auto", "fixed"], help="as `draftrelay serve --depth`")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop starting modes once this much wall time has gone (0: no limit)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_replay_h200_all_modes.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="draftrelay-serve-replay-")
    if args.trace == "synthetic":
        args.trace = synthetic_trace(os.path.join(tmp, "synthetic_trace.json"))
    trace = Trace.load(args.trace)
    dev = L.pick_device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    graphs = dev.type == "cuda" and not args.no_graphs
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("off", "sync", "async", "cache")]
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad} (off, sync, async, cache)")
    if not 1 <= args.fanout <= 64:
        ap.error(f"--fanout must be within [1, 64], got {args.fanout}")
    max_tokens = args.max_tokens or min(len(e.target) for e in trace.entries)
    label = f"replayed acceptance of {trace.pair}"
    result = {"label": label, "machine": {**machine_info(), "device": str(dev)}, "args": vars(args),
              "trace": {"pair": trace.pair, "entries": len(trace.entries), "file": os.path.basename(args.trace)},
              "graphs": graphs, "modes": {}}

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    longest = max(len(e.prompt) for e in trace.entries) + max_tokens
    max_model_len = max(args.long_len + 32, longest + 8)
    max_len = max_model_len + args.k + 1  # as `draftrelay serve`: the row also holds the last verify's drafts
    if args.drafter == "tiny":
        inner, model_id = "tiny", M.tiny_model_id()
    else:
        inner = os.path.join(tmp, f"random-{args.drafter}")
        write_drafter_dir(args.drafter, inner, 2)
        model_id = os.path.basename(inner)
    worker = None
    t_worker = time.perf_counter()
    if any(m != "off" for m in modes) and args.placement == "emulated":
        worker = emulated_worker(args, dev, inner, model_id, max_len, max_tokens, tmp, result)
    elif any(m != "off" for m in modes):  # started first: it loads while the target is built
        worker = start_worker_process(["--model", f"replay:{os.path.abspath(args.trace)}:{inner}", "--device", str(dev),
                                       "--max-ctx", str(max_len + 64), "--rows", str(2 * args.max_batch + 2),
                                       "--max-requests", str(args.max_batch), "--n-out-max", str(max(8, args.k)),
                                       # as `draftrelay serve` starts its local worker (loading.start_local_worker)
                                       *(["--warm-graphs", str(args.k), "--warm-batch", str(args.max_batch),
                                          "--warm-max-kv", str(args.warm_max_kv)]
                                         if dev.type == "cuda" and args.warm_drafter else [])],
                                      timeout=300, env={"OMP_NUM_THREADS": "1"} if dev.type == "cpu" else None)
    if worker is not None:  # the banner carries the worker's kernel planning (count, seconds, from the cache)
        result["worker_start_s"], result["worker_banner"] = time.perf_counter() - t_worker, worker.banner
    t_target = time.perf_counter()
    target = target_model(args.target, dev, dtype)
    if max_model_len > target.cfg.max_position_embeddings:
        ap.error(f"--long-len {args.long_len}: beyond the target's context {target.cfg.max_position_embeddings}")
    hook = install_replay_target(target, trace, n_rows=args.max_batch + 1, max_len=max_len)
    prompts = [e.prompt for e in trace.entries]
    pfile = os.path.join(tmp, "prompts.json")
    with open(pfile, "w") as f:
        json.dump(prompts, f)
    result["target_build_s"] = time.perf_counter() - t_target
    result["setup_s"] = time.perf_counter() - t_start
    log_pos = len(worker.log()) if worker is not None else 0
    try:
        for mode in modes:
            left = args.budget_s - (time.perf_counter() - t_start) if args.budget_s else 1e9
            if left < 30:
                result["modes"][mode] = {"skipped": f"the time budget ({args.budget_s:.0f} s) was spent"}
                save()
                continue
            row: dict = {}
            result["modes"][mode] = row
            h = None
            cache = mode == "cache"
            if mode != "off":
                spec = L.worker_spec(worker.host, worker.port, model_id, "", args.k, args.max_batch)
                # as `draftrelay serve --spec-cache`: the cache's rounds on the host stream
                h = L.handoff_config(spec, dev, args.deadline_ms, args.placement == "same", host_rounds=cache,
                                     max_tokens=round_tokens(args.max_batch, EngineConfig.max_round_tokens, args.k))
            cfg = EngineConfig(mode="async" if cache else mode, n_draft=args.k, max_batch=args.max_batch,
                               max_len=max_len, handoff=h, graphs=graphs, spec_fanout=args.fanout if cache else 0,
                               # a worker on this GPU: the cache would decline it; forced on, and said so
                               spec_options={**({"shared_gpu": True} if cache and args.placement == "same" else {}),
                                             **({"guard": False} if args.cache_guard == "off" else {})})
            t0 = time.perf_counter()
            try:
                with Engine(target, cfg) as eng:
                    use_batch_depth(eng, args.depth == "auto")  # as `draftrelay serve`
                    row["engine_start_s"] = time.perf_counter() - t0
                    row["round_mode"] = eng.round_mode
                    row["placement"] = args.placement if mode != "off" else ""
                    if eng.spec_cache is not None:
                        row["spec_cache_refusal"] = eng.spec_cache.refusal
                        row["spec_cache_forced_on_shared_gpu"] = args.placement == "same"
                    srv = Served(eng, f"{args.target}-replay", max_model_len)
                    row["warm_up"] = srv.warm
                    try:
                        row["startup_request"] = self_request("127.0.0.1", srv.port, "") or "ok"
                        if args.gc_freeze:  # as `draftrelay serve` does before it announces itself
                            freeze_startup_objects()
                        srv.metrics.gc.start()
                        row["ready_s"] = time.perf_counter() - t0
                        print(f"{mode}: ready in {row['ready_s']:.1f} s ({row['warm_up']})", flush=True)
                        out = os.path.join(tmp, f"{mode}.json")
                        cmd = [sys.executable, os.path.join(HERE, "serve_load.py"), "--url", srv.url, "--label", mode,
                               "--prompts", pfile, "--concurrency", args.concurrency, "--max-tokens", str(max_tokens),
                               "--requests", str(args.requests), "--ttft-repeats", str(args.ttft_repeats),
                               "--long-len", str(args.long_len), "--out", out]
                        # no budget: no limit (a huge timeout overflows the selector's poll)
                        timeout = max(30.0, left - 15) if args.budget_s else None
                        cp = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
                        sys.stdout.write(cp.stdout)
                        if cp.returncode != 0:
                            row["client_error"] = cp.stderr[-2000:]
                            print(cp.stderr[-2000:], file=sys.stderr)
                        else:
                            with open(out) as f:
                                row.update(json.load(f)["modes"][mode])
                        row["trace_check"] = asyncio.run(check_outputs(
                            srv.url, prompts, [e.target for e in trace.entries], max_tokens))
                        row["handoff"] = srv.sched.handoff
                        if eng.spec_cache is not None:
                            row["spec_cache"] = eng.spec_cache.stats()
                        if eng.depth is not None:
                            row["depth"] = eng.depth.summary()
                        row["gc"] = {"collections": list(srv.metrics.gc.count),
                                     "pause_s": list(srv.metrics.gc.seconds)}
                    finally:
                        srv.stop()
            except Exception as exc:
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["wall_s"] = time.perf_counter() - t0
            if worker is not None:  # the worker's slow-STEP reports during this mode (worker --slow-step-ms)
                wlog = worker.log()
                slow = [ln for ln in wlog[log_pos:].splitlines() if "slow STEP" in ln]
                errors = [ln for ln in wlog[log_pos:].splitlines() if " ERROR " in ln or "Error" in ln]
                row["worker_slow_steps"] = {"count": len(slow), "first": slow[:60], "last": slow[-20:],
                                            "errors": errors[:20]}
                log_pos = len(wlog)
            print(f"{mode}: {json.dumps(row.get('trace_check'))} in {row['wall_s']:.1f} s", flush=True)
            save()
            # the mode's engine and server go now, not when the next mode's names rebind: their KV cache and
            # graphs (15-30 GB at 7B shape) would otherwise sit beside the next engine's (a fourth mode ran out
            # of memory), and the cycles among them need a collection once unfrozen
            eng = srv = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    finally:
        hook.remove()
        if worker is not None:
            result["worker_log_tail"] = worker.log()[-2000:]
            worker.stop()
    result["wall_s"] = time.perf_counter() - t_start
    table = [label, "mode | concurrency | output tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | accepted/drafted | "
                    "tokens per chunk | rounds (| cache hit rate)"]
    for mode, row in result["modes"].items():
        for lv in row.get("levels", []):
            table.append(f"{mode} | {lv['concurrency']} | {lv['output_tokens_per_s']:.0f} | {lv['ttft_ms_p50']:.1f} / "
                         f"{lv['ttft_ms_p99']:.1f} | {lv['itl_ms_p50']:.1f} / {lv['itl_ms_p99']:.1f} | "
                         f"{lv['acceptance']:.2f} | {lv['tokens_per_chunk']:.2f} | {json.dumps(lv.get('rounds', {}))}"
                         + (f" | cache hits {100 * lv['cache_hit_rate']:.0f} %" if "cache_hit_rate" in lv else ""))
    result["table"] = table
    save()
    print("\n".join(table))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
