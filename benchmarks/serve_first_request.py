"""First-request TTFT of `draftrelay serve` against a warm request: a fresh server per measurement.

For each repeat, mode and prompt kind (short, and the longest prompt the context allows), a new
server process starts (with its warm-up, or `--no-warmup` for the modes in `--cold-modes`); its
first request is that prompt with one output token (so the request's whole time is its TTFT), then
the same request `--warm` times more. Measured by the client (request sent -> response read, over a
kept-alive connection opened by two GETs before) and by the server (its TTFT histogram: request
checked -> first token out). Per (mode, kind): first / warm-median ratio of every repeat, its median
and range. Modes and kinds are interleaved within each repeat, so drift of a shared machine hits
them alike. JSON under benchmarks/results/.

    python benchmarks/serve_first_request.py                           # CPU, tiny pair
    python benchmarks/serve_first_request.py --model DIR --drafter DIR --device cuda --graphs
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from machine import write_json  # noqa: E402
from serve_load import Server, timed  # noqa: E402

SHORT = "Hello there, how are you?"


async def gc_pause_s(client: httpx.AsyncClient, url: str) -> float:
    """The server's garbage-collector pauses so far (all generations), from /metrics."""
    text = (await client.get(url + "/metrics")).text
    return sum(float(v) for v in re.findall(r"^draftrelay_gc_pause_seconds_total\{[^}]*\} (\S+)$", text, re.M))


def long_prompt(n: int) -> list[int]:
    return [(i * 7 + 3) % 200 + 32 for i in range(n)]


async def first_then_warm(url: str, prompt, warm: int, idle_repeats: int, gap_s: float) -> dict:
    t_setup = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(2):  # the client's own first-use costs (connection, lazy imports) are not the server's
            await client.get(url + "/health")
            await client.get(url + "/metrics")
        t_ready = time.perf_counter()
        gc0 = await gc_pause_s(client, url)
        first = await timed(client, url, prompt)
        gc1 = await gc_pause_s(client, url)
        reps = [await timed(client, url, prompt) for _ in range(warm)]
        gc2 = await gc_pause_s(client, url)
        # the same request after the server sat idle as long as before the first (>= 0.5 s): what
        # an idle pause costs any request (cold caches, sleeping threads), not only the first
        idle = []
        for _ in range(idle_repeats):
            await asyncio.sleep(max(0.5, gap_s))
            idle.append(await timed(client, url, prompt))
    w = [r[0] for r in reps]
    ws = [r[1] for r in reps]

    def phases(rs) -> dict:  # the server's TTFT split: queue (arrival -> engine thread), prefill (-> token out)
        return {"queue_ms": statistics.median(1e3 * r[2] for r in rs),
                "prefill_ms": statistics.median(1e3 * r[3] for r in rs),
                "outside_ms": statistics.median(1e3 * (r[0] - r[1]) for r in rs)}  # HTTP, client, event loop

    return {"first_ms": 1e3 * first[0], "first_server_ms": 1e3 * first[1],
            "phases": {"first": phases([first]), "warm": phases(reps), "after_idle": phases(idle) if idle else {}},
            "warm_ms": [1e3 * x for x in w], "warm_server_ms": [1e3 * x for x in ws],
            "after_idle_ms": [1e3 * x[0] for x in idle], "after_idle_server_ms": [1e3 * x[1] for x in idle],
            "idle_s": max(0.5, gap_s), "client_setup_s": t_ready - t_setup,
            # garbage-collector pauses of the server during the first request (and the scrapes around
            # it), and during all the warm ones
            "gc_pause_first_ms": 1e3 * (gc1 - gc0), "gc_pause_warm_ms": 1e3 * (gc2 - gc1),
            "first_over_warm": first[0] / statistics.median(w),
            "first_over_warm_server": first[1] / statistics.median(ws) if statistics.median(ws) > 0 else 0.0}


def summary(runs: list[dict]) -> dict:
    r = [x["first_over_warm"] for x in runs]
    rs = [x["first_over_warm_server"] for x in runs]
    extra = [x["first_ms"] - statistics.median(x["warm_ms"]) for x in runs]
    idle = [x["first_ms"] / statistics.median(x["after_idle_ms"]) for x in runs if x["after_idle_ms"]]
    return {"repeats": len(runs), "first_over_warm_median": statistics.median(r), "first_over_warm_min": min(r),
            "first_over_after_idle_median": statistics.median(idle) if idle else 0.0,
            "first_over_after_idle_min": min(idle, default=0.0), "first_over_after_idle_max": max(idle, default=0.0),
            "first_over_warm_max": max(r), "server_first_over_warm_median": statistics.median(rs),
            "server_first_over_warm_min": min(rs), "server_first_over_warm_max": max(rs),
            "first_minus_warm_ms_median": statistics.median(extra),
            "warm_ms_median": statistics.median(statistics.median(x["warm_ms"]) for x in runs),
            "within_10_percent": sum(x <= 1.10 for x in r)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--drafter", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="off,async",
                    help="serve modes (off, sync, async, cache); MODE:tN runs it with `--threads N` (N or auto)")
    ap.add_argument("--cold-modes", default="", help="modes also measured without the warm-up")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--warm", type=int, default=5, help="warm requests after the first")
    ap.add_argument("--idle", type=int, default=3, help="requests after an idle pause as long as the first's")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "serve_first_request_cpu.json"))
    args = ap.parse_args()
    args.max_round_tokens = 0
    variants = [(m, True) for m in args.modes.split(",") if m] + [(m, False) for m in args.cold_modes.split(",") if m]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:], "machine": machine_info(), "runs": {}, "summary": {}}
    t0 = time.perf_counter()
    result["load_average_start"] = list(os.getloadavg())
    for rep in range(args.repeats):
        for mode, warm in variants:
            name = mode if warm else f"{mode}, no warm-up"
            for kind in ("short", "long"):
                srv = Server(args, mode, warmup=warm)
                try:
                    prompt = SHORT if kind == "short" else long_prompt(srv.ctx - 1)  # one output token fits
                    gap = time.perf_counter() - srv.t_ready
                    run = asyncio.run(first_then_warm(srv.url, prompt, args.warm, args.idle, gap))
                finally:
                    srv.stop()
                run.update({"load_average": list(os.getloadavg()), "start_s": srv.start_s,
                             "prompt_tokens": len(prompt) if kind == "long" else len(SHORT)})
                result["runs"].setdefault(name, {}).setdefault(kind, []).append(run)
                print(f"[{rep}] {name:18s} {kind:5s} ({run['prompt_tokens']} tokens): first {run['first_ms']:8.1f} ms, "
                      f"warm median {statistics.median(run['warm_ms']):8.1f} ms (x{run['first_over_warm']:.2f}; "
                      f"server x{run['first_over_warm_server']:.2f}; after idle "
                      f"{statistics.median(run['after_idle_ms'] or [0]):8.1f} ms; GC {run['gc_pause_first_ms']:.1f} / "
                      f"{run['gc_pause_warm_ms']:.1f} ms; queue/prefill/outside ms: first "
                      + "/".join(f"{v:.1f}" for v in run["phases"]["first"].values()) + ", warm "
                      + "/".join(f"{v:.1f}" for v in run["phases"]["warm"].values()) + ", after idle "
                      + "/".join(f"{v:.1f}" for v in run["phases"]["after_idle"].values()) + ")", flush=True)
    for name, kinds in result["runs"].items():
        result["summary"][name] = {kind: summary(runs) for kind, runs in kinds.items()}
        for kind, s in result["summary"][name].items():
            print(f"{name:18s} {kind:5s}: first/warm median x{s['first_over_warm_median']:.2f} "
                  f"(x{s['first_over_warm_min']:.2f}-x{s['first_over_warm_max']:.2f}), server "
                  f"x{s['server_first_over_warm_median']:.2f} (x{s['server_first_over_warm_min']:.2f}-"
                  f"x{s['server_first_over_warm_max']:.2f}); first - warm {s['first_minus_warm_ms_median']:+.1f} ms; "
                  f"first/after-idle x{s['first_over_after_idle_median']:.2f} (x{s['first_over_after_idle_min']:.2f}-"
                  f"x{s['first_over_after_idle_max']:.2f}); "
                  f"{s['within_10_percent']}/{s['repeats']} within 10 %")
    result["wall_s"] = time.perf_counter() - t0
    result["load_average_end"] = list(os.getloadavg())
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
