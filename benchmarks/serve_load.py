"""Load test of `draftrelay serve`: streaming clients at concurrency 1, 4, 16, per round mode.

Every mode's server process starts on loopback (all up at once, in one run); then
  * first-request TTFT against a warm one: the first request after start, then the same request
    again (median of 5), at a short prompt and at the longest the context allows, one output token
    each (the server started with and without its warm-up, `--cold-modes`);
  * load: at each concurrency C, `--requests` (default 2 C, at least 8) streaming requests of
    fixed prompts, at most C in flight, greedy, `--max-tokens` each, in every mode back to back
    before the next level (interleaved: a shared machine's drift hits the modes alike).
Modes: off, sync, async, and cache (async with the speculation cache, `serve --spec-cache F`: the
worker pre-drafts `--fanout` branches per request during each verify; its rows also give the cache's
hit rate from each response's usage). Per level: output tokens/s (all completion tokens over the
level's wall time), TTFT p50/p99 (to
the first chunk with text: a partial UTF-8 character is held back until complete),
inter-token latency p50/p99 (gaps between a stream's chunks: one chunk per engine step, which
carries 1 + accepted drafts tokens), TPOT (e2e - TTFT over tokens - 1), acceptance (accepted /
draft tokens, from the usage of each response). JSON under benchmarks/results/.

    python benchmarks/serve_load.py                                       # CPU, tiny pair
    python benchmarks/serve_load.py --model DIR --drafter DIR --device cuda --max-tokens 256
    python benchmarks/serve_load.py --url http://HOST:PORT --label NAME --out R.json   # a running server

`--url` measures a server that is already running (one row, named by `--label`; the first request
it sees should be this script's, for the first-request TTFT to mean one). `--prompts FILE`: a JSON
list of prompts (strings or token-id lists) the load levels cycle through instead of the built-in ones.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

from draftrelay.handoff.procinfo import machine_info
from machine import write_json  # benchmarks/machine.py (the script's own folder, or its importer's path)

_LISTEN = re.compile(r"listening on (http://[\d.]+:\d+)")
SEEDS = ["Once upon a time", "The quick brown fox jumps over", "In the beginning", "Speculative decoding is",
         "def fibonacci(n):", "A remote drafter runs on", "Dear colleagues, ", "The weather today"]


def prompts(n: int, fixed: list | None = None) -> list:
    if fixed:
        return [fixed[i % len(fixed)] for i in range(n)]
    return [f"{SEEDS[i % len(SEEDS)]} [{i}]" for i in range(n)]


class Server:
    def __init__(self, args, mode: str, warmup: bool) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="serve-load-", suffix=".log")
        # a mode named MODE-fixed is MODE at --depth fixed (always k drafts), beside MODE at --depth auto;
        # cache is async with the speculation cache (`--spec-cache --fanout`: every step asks k drafts);
        # MODE:tN is MODE with `--threads N` (N or auto: the target's torch threads)
        mode, _, threads = mode.partition(":t")
        mode, depth = mode.split("-", 1) if "-" in mode else (mode, "auto")
        cache = ["--spec-cache", str(args.fanout)] if mode == "cache" else []
        mode = "async" if cache else mode
        cmd = [sys.executable, "-m", "draftrelay", "serve", "--port", "0", "--mode", mode, "--depth", depth, *cache,
               *(["--threads", threads] if threads else []),
               "--model", args.model,
               "--drafter", args.drafter, "--device", args.device, "--max-batch", str(args.max_batch),
               "--max-queue", "256", "--k", str(args.k), *(["--max-model-len", str(args.max_model_len)]
                                                        if args.max_model_len else []),
               *(["--max-round-tokens", str(args.max_round_tokens)] if args.max_round_tokens else []),
               *([] if warmup else ["--no-warmup"])]
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        self.t_start = time.perf_counter()
        deadline = time.monotonic() + 300
        self.url = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            with open(self.log_path, errors="replace") as f:
                m = _LISTEN.search(f.read())
            if m:
                self.url = m.group(1)
                self.t_ready = time.perf_counter()
                break
            time.sleep(0.05)
        self.start_s = time.perf_counter() - self.t_start
        if not self.url:
            self.stop()
            raise RuntimeError(f"server ({mode}) did not start")
        self.ctx = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)


async def stream_one(client: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev["choices"] and ev["choices"][0]["text"]:
                times.append(time.perf_counter())
    t1 = time.perf_counter()
    n = usage["completion_tokens"]
    ttft = times[0] - t0 if times else t1 - t0
    return {"ttft_s": ttft, "e2e_s": t1 - t0, "gaps_s": list(np.diff(times)), "tokens": n,
            "tpot_s": (t1 - t0 - ttft) / (n - 1) if n > 1 else 0.0, "spec": usage["spec_decode"]}


def p(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else 0.0


def counters(text: str, name: str) -> dict[str, float]:
    """A labelled counter family of a /metrics text: {label values joined: value} (model_name left out)."""
    out = {}
    for labels, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        key = ",".join(x.split("=", 1)[1].strip('"') for x in labels.split(",") if not x.startswith("model_name"))
        out[key or "all"] = float(v)
    return out


async def load_level(url: str, conc: int, n_req: int, max_tokens: int, fixed: list | None = None) -> dict:
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(pr):
            async with sem:
                return await stream_one(client, url, pr, max_tokens)

        before = counters((await client.get(url + "/metrics")).text, "draftrelay_rounds_total")
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(pr) for pr in prompts(n_req, fixed)))
        wall = time.perf_counter() - t0
        after = counters((await client.get(url + "/metrics")).text, "draftrelay_rounds_total")
    # the rounds to the drafter during this level, by outcome (ok, timeout, breaker, watchdog, ...)
    rounds = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}
    ttft = [r["ttft_s"] for r in res]
    gaps = [g for r in res for g in r["gaps_s"]]
    drafted = sum(r["spec"]["num_draft_tokens"] for r in res)
    accepted = sum(r["spec"]["num_accepted_tokens"] for r in res)
    steps = sum(r["spec"]["num_drafts"] for r in res)
    tokens = sum(r["tokens"] for r in res)
    # the speculation cache's lookups and hits of these requests (their usage; cache servers only)
    cache = [r["spec"]["spec_cache"] for r in res if "spec_cache" in r["spec"]]
    lookups = sum(c["lookups"] for c in cache)
    return {"concurrency": conc, "requests": n_req, "wall_s": wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall, "ttft_ms_p50": p(ttft, 50), "ttft_ms_p99": p(ttft, 99),
            "itl_ms_p50": p(gaps, 50), "itl_ms_p99": p(gaps, 99),
            "tpot_ms_mean": 1e3 * statistics.mean(r["tpot_s"] for r in res),
            "e2e_ms_p50": p([r["e2e_s"] for r in res], 50),
            "acceptance": accepted / drafted if drafted else 0.0,
            "accepted_per_draft_step": accepted / steps if steps else 0.0,
            "tokens_per_chunk": tokens / max(1, len(gaps) + len(res)), "rounds": rounds,
            **({"cache_lookups": lookups, "cache_hits": sum(c["hits"] for c in cache),
                "cache_hit_rate": sum(c["hits"] for c in cache) / lookups if lookups else 0.0} if cache else {})}


PHASES = ("time_to_first_token", "request_queue_time", "request_prefill_time")


async def phase_sums(client: httpx.AsyncClient, url: str) -> list[float]:
    """The server's sums of TTFT, queue time and prefill time (seconds) so far, from /metrics."""
    text = (await client.get(url + "/metrics")).text
    out = []
    for name in PHASES:
        m = re.search(rf"^draftrelay_{name}_seconds_sum\{{[^}}]*\}} (\S+)$", text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out


async def timed(client: httpx.AsyncClient, url: str, prompt) -> tuple[float, float, float, float]:
    """(the client's time for a 1-token request, the server's own TTFT of it, of which queue time
    (arrival to the engine thread) and prefill time (to the first token out)), from /metrics."""
    before = await phase_sums(client, url)
    e2e = (await stream_one(client, url, prompt, 1))["e2e_s"]
    after = await phase_sums(client, url)
    return (e2e, *(a - b for a, b in zip(after, before, strict=True)))


async def ttft_first_vs_warm(url: str, ctx: int, repeats: int, long_len: int = 0) -> dict:
    out = {}
    long_len = min(long_len, ctx - 16) if long_len > 0 else max(16, ctx - 16)
    cases = {"short": "Hello there, how are you?", "long": [(i * 7 + 3) % 200 + 32 for i in range(long_len)]}
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(2):  # the client's own first-use costs (connection, lazy imports) are not the server's
            await client.get(url + "/health")
            await client.get(url + "/metrics")
        for name, pr in cases.items():
            # one output token: the request's whole time is its TTFT (no text held back for a
            # partial character), as a client sees it
            first, first_srv, first_q, first_p = await timed(client, url, pr)
            warm, warm_srv, warm_q, warm_p = zip(*[await timed(client, url, pr) for _ in range(repeats)], strict=True)
            # the same request after an idle second: what a pause costs any request (clocks, caches,
            # sleeping threads), against what only the first one pays
            await asyncio.sleep(1.0)
            idle, idle_srv, idle_q, idle_p = await timed(client, url, pr)
            out[name] = {"prompt_tokens": len(pr) if isinstance(pr, list) else len(pr.encode()),
                         "first_server_ms": 1e3 * first_srv, "warm_server_ms_median": 1e3 * statistics.median(warm_srv),
                         # the server's TTFT split: queue (arrival -> engine thread), prefill (-> first token out)
                         "first_queue_ms": 1e3 * first_q, "first_prefill_ms": 1e3 * first_p,
                         "warm_queue_ms_median": 1e3 * statistics.median(warm_q),
                         "warm_prefill_ms_median": 1e3 * statistics.median(warm_p),
                         "after_idle_ms": 1e3 * idle, "after_idle_server_ms": 1e3 * idle_srv,
                         "after_idle_prefill_ms": 1e3 * idle_p,
                         "first_ms": 1e3 * first, "warm_ms_median": 1e3 * statistics.median(warm),
                         "warm_ms_min": 1e3 * min(warm), "warm_ms_max": 1e3 * max(warm),
                         "first_over_warm": first / statistics.median(warm)}
    return out


def measure_ttft(url: str, ctx: int, args, label: str, row: dict) -> None:
    row["ttft_first_vs_warm"] = t = asyncio.run(ttft_first_vs_warm(url, ctx, args.ttft_repeats, args.long_len))
    print(f"{label:5s} TTFT first/warm: short {t['short']['first_ms']:.1f}/{t['short']['warm_ms_median']:.1f} ms "
          f"(server {t['short']['first_server_ms']:.1f}/{t['short']['warm_server_ms_median']:.1f}), "
          f"long ({t['long']['prompt_tokens']}) {t['long']['first_ms']:.1f}/{t['long']['warm_ms_median']:.1f} ms "
          f"(server {t['long']['first_server_ms']:.1f}/{t['long']['warm_server_ms_median']:.1f}); short prefill "
          f"first/warm/after 1 s idle {t['short']['first_prefill_ms']:.1f}/{t['short']['warm_prefill_ms_median']:.1f}/"
          f"{t['short']['after_idle_prefill_ms']:.1f} ms, client after idle {t['short']['after_idle_ms']:.1f} ms",
          flush=True)


def measure_level(url: str, c: int, args, fixed: list | None, label: str, row: dict) -> None:
    n = args.requests or max(8, 2 * c)
    lv = asyncio.run(load_level(url, c, n, args.max_tokens, fixed))
    row.setdefault("levels", []).append(lv)
    print(f"{label:5s} c={c:2d}: {lv['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
          f"{lv['ttft_ms_p50']:7.1f}/{lv['ttft_ms_p99']:7.1f} ms  ITL p50/p99 {lv['itl_ms_p50']:6.1f}/"
          f"{lv['itl_ms_p99']:6.1f} ms  TPOT {lv['tpot_ms_mean']:5.1f} ms  acceptance "
          f"{lv['acceptance']:.2f} ({lv['accepted_per_draft_step']:.2f}/step, {lv['tokens_per_chunk']:.2f} tokens "
          f"per chunk)  rounds {json.dumps(lv['rounds'])}"
          + (f"  cache hits {lv['cache_hits']}/{lv['cache_lookups']}" if "cache_lookups" in lv else ""), flush=True)


def measure(url: str, ctx: int, args, fixed: list | None, label: str, row: dict) -> dict:
    """First-request TTFT, then every load level, on the server at url (filled into row)."""
    measure_ttft(url, ctx, args, label, row)
    for c in [int(c) for c in args.concurrency.split(",")]:
        measure_level(url, c, args, fixed, label, row)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--drafter", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="off,sync,async",
                    help="round modes (off, sync, async, cache: async with the speculation cache); MODE-fixed: "
                         "that mode at --depth fixed (the others run --depth auto)")
    ap.add_argument("--fanout", type=int, default=8, help="branches per request of the cache mode (--spec-cache F)")
    ap.add_argument("--cold-modes", default="async", help="modes also started without warm-up (TTFT only)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every level this many times (interleaved: all levels and modes, then again); "
                         "each mode's row then gets per level the median and range of its output tok/s")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (0: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-round-tokens", type=int, default=0, help="passed to the server (0: its default)")
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--long-len", type=int, default=0,
                    help="tokens of the long first-request prompt (0: the longest the context allows)")
    ap.add_argument("--url", default="", help="measure this running server instead of starting servers")
    ap.add_argument("--label", default="server", help="the row's name with --url")
    ap.add_argument("--prompts", default="", metavar="FILE", help="JSON list of prompts for the load levels")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "serve_load_cpu_interleaved.json"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    fixed = None
    if args.prompts:
        with open(args.prompts) as f:
            fixed = json.load(f)
        if not isinstance(fixed, list) or not fixed:
            ap.error(f"--prompts {args.prompts}: expected a JSON list of prompts")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:], "machine": machine_info(), "modes": {}}
    if args.url:
        ctx = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        result["modes"][args.label] = measure(args.url, ctx, args, fixed, args.label, {"context": ctx})
        modes = []
    if modes:
        # every mode's server up at once; each load level then runs in every mode back to back (the
        # order rotated from level to level), so a shared machine's drift hits the modes alike
        servers: dict[str, Server] = {}
        try:
            for mode in modes:
                servers[mode] = Server(args, mode, warmup=True)
            rows = {m: {"start_s": srv.start_s, "context": srv.ctx} for m, srv in servers.items()}
            result["load_average_start"] = list(os.getloadavg())
            for mode, srv in servers.items():  # each server's first request is this one
                measure_ttft(srv.url, srv.ctx, args, mode, rows[mode])
            levels = [int(c) for c in args.concurrency.split(",")]
            for rep in range(args.repeats):
                for i, c in enumerate(levels):
                    j = (i + rep) % len(modes)
                    for mode in modes[j:] + modes[:j]:
                        measure_level(servers[mode].url, c, args, fixed, mode, rows[mode])
                        rows[mode]["levels"][-1]["repeat"] = rep
            for mode in modes:  # per level: the median output rate over the repeats and its range
                rows[mode]["by_level"] = {}
                for c in levels:
                    xs = [lv["output_tokens_per_s"] for lv in rows[mode]["levels"] if lv["concurrency"] == c]
                    rows[mode]["by_level"][c] = {"output_tokens_per_s_median": statistics.median(xs),
                                                 "min": min(xs), "max": max(xs), "repeats": len(xs)}
            for c in levels:
                print(f"c={c:2d} output tok/s median (range) over {args.repeats}: " + ", ".join(
                    f"{m} {rows[m]['by_level'][c]['output_tokens_per_s_median']:.0f} "
                    f"({rows[m]['by_level'][c]['min']:.0f}-{rows[m]['by_level'][c]['max']:.0f})" for m in modes))
            result["load_average_end"] = list(os.getloadavg())
        finally:
            for srv in servers.values():
                srv.stop()
        for mode in modes:
            row = rows[mode]
            if mode in args.cold_modes.split(","):
                cold = Server(args, mode, warmup=False)
                try:
                    row["ttft_first_vs_warm_no_warmup"] = t = asyncio.run(
                        ttft_first_vs_warm(cold.url, cold.ctx, args.ttft_repeats, args.long_len))
                    row["start_s_no_warmup"] = cold.start_s
                finally:
                    cold.stop()
                print(f"{mode:5s} without warm-up, TTFT first/warm: short {t['short']['first_ms']:.1f}/"
                      f"{t['short']['warm_ms_median']:.1f} ms, long {t['long']['first_ms']:.1f}/"
                      f"{t['long']['warm_ms_median']:.1f} ms", flush=True)
            result["modes"][mode] = row
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
