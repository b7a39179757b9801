"""Hand-off micro-benchmark on the emulated stream (CPU, no GPU needed).

Measures, over >= 20,000 rounds each for a spinning proxy, a napping one (spin 50 µs, then 20 µs naps: the
default) and a nap-only one (50 µs naps), side by side in one run:
  - engine-side enqueue: the time `AsyncRounds.submit` takes on the engine thread (staging prepared)
  - release -> resume: the proxy's clock just before it stores `released` to the stream thread's clock
    right after its wait returns (same CLOCK_MONOTONIC, both processes)
  - the proxy process's CPU use (utime + stime over wall time)

    python benchmarks/handoff.py [--rounds 20000] [--out benchmarks/results]   # -> DIR/handoff_emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from draftrelay.handoff import native
from draftrelay.handoff.procinfo import cpu_seconds
from draftrelay.handoff.region import RoundRequest, W, pack_staging
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig, open_rounds


def pct(a: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(a), q)) if a else float("nan")


def run(mode: str, n_rounds: int) -> dict:
    spin_us, nap_us = {"spin": (10_000_000, 0), "nap": (50, 20), "nap-only": (0, 50)}[mode]
    # spin/nap is the proxy's wait for `gathered`, the knob a deployment sets. The emulated stream stands
    # in for the GPU, whose wait polls without a CPU: it spins in both runs (a napping emulated stream
    # adds its own wake-up and makes the engine thread's submit pay for the stream thread's scheduling).
    cfg = HandoffConfig(vocab_size=32000, max_requests=4, max_tokens=512, max_drafts=8, spin_us=spin_us,
                        nap_us=nap_us, stream_spin_us=10_000_000, stream_nap_us=0, deadline_ms=200, wait="poll")
    r = open_rounds(cfg)
    if not isinstance(r, AsyncRounds):
        raise SystemExit(f"async refused: {r.refusal}")
    L = r.region.layout
    a_last = r.region.word_addr(W.LAST_RELEASE_NS)
    resume: list[int] = []
    r.on_resume = lambda: resume.append(native.now_ns() - native.load64(a_last))
    rng = np.random.default_rng(0)
    reqs = [RoundRequest(i, 1, 0, rng.integers(0, 32000, 4).astype(np.int32), 4) for i in range(2)]
    n_out = np.array([4, 4], np.int32)
    enqueue: list[int] = []
    pack: list[int] = []
    cpu0, wall0 = cpu_seconds(r.proxy.pid), time.monotonic()
    try:
        for _ in range(n_rounds):
            t = r._t + 1
            # perf_counter_ns, not the native clock: a ctypes call drops the GIL and would let the
            # stream thread in between, measuring the GIL hand-off instead of the submit
            p0 = time.perf_counter_ns()
            src = pack_staging(L, t, reqs)
            p1 = time.perf_counter_ns()
            r.submit(src=src, n_out=n_out)
            p2 = time.perf_counter_ns()
            pack.append(p1 - p0)
            enqueue.append(p2 - p1)
            res = r.result(t, timeout_s=10)
            assert res.ok, res
        cpu = cpu_seconds(r.proxy.pid) - cpu0
        wall = time.monotonic() - wall0
        stats = r.stats()
    finally:
        r.close()
    us = 1e-3
    return {
        "mode": mode, "spin_us": spin_us, "nap_us": nap_us, "rounds": n_rounds,
        "enqueue_us_p50": pct(enqueue, 50) * us, "enqueue_us_p99": pct(enqueue, 99) * us,
        "pack_us_p50": pct(pack, 50) * us,
        "release_to_resume_us_p50": pct(resume, 50) * us, "release_to_resume_us_p99": pct(resume, 99) * us,
        "round_trip_us_mean": wall / n_rounds * 1e6,
        "proxy_cpu_percent": 100 * cpu / wall, "watchdog": stats["watchdog"], "ok": stats["ok"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20_000)
    ap.add_argument("--out", default="benchmarks/results", help="directory for handoff_emulated.json")
    args = ap.parse_args()
    rows = []
    for mode in ("spin", "nap", "nap-only"):
        print(f"[{mode}] {args.rounds} rounds ...", file=sys.stderr, flush=True)
        rows.append(run(mode, args.rounds))
    print(f"{'proxy':8} {'enqueue p50/p99 µs':>20} {'release->resume p50/p99 µs':>28} {'round µs':>9} {'proxy CPU':>9}")
    for x in rows:
        print(f"{x['mode']:8} {x['enqueue_us_p50']:9.1f} / {x['enqueue_us_p99']:<8.1f} "
              f"{x['release_to_resume_us_p50']:13.1f} / {x['release_to_resume_us_p99']:<12.1f} "
              f"{x['round_trip_us_mean']:9.0f} {x['proxy_cpu_percent']:8.0f}%")
    out = {"benchmark": "handoff_emulated", "backend": "emulated",
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "numpy": np.__version__},
           "seed_reference": {"engine_submit_us_p50": 140, "engine_submit_us_p99": 362},
           "results": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "handoff_emulated.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
