"""What an idle pause costs the work of a request on this machine, without the server.

After a pause of 0, 0.05, 0.3 and 1 s: (1) the engine's prefill of a 25-token prompt (one output
token) on the tiny target, torch on one and on two threads, and on one thread right after reading
every weight once (870 KB for the tiny target: warm data) or right after a one-token forward (warm
code paths); (2) the wake-up of another Python thread (threading.Event.set -> the waiter running: the
hand-off the server makes between its event loop and its engine thread); (3) a fixed piece of
pure-Python work (no torch, no threads). Each kind interleaved with the others, `--repeats` times;
medians and ranges, ms. A first request always comes after a pause (the server sits idle between its
announcement and a client's first request), so this is the part of its TTFT that no warm-up removes.

    python benchmarks/serve_idle_cost.py --repeats 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time

import torch

from draftrelay.engine import loading as L
from draftrelay.engine.engine import Engine, EngineConfig
from draftrelay.engine.request import SamplingParams
from draftrelay.handoff.procinfo import machine_info
from machine import write_json  # benchmarks/machine.py (the script's own folder)

GAPS = (0.0, 0.05, 0.3, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "serve_idle_cost_cpu.json"))
    args = ap.parse_args()
    target = L.load_target("tiny", torch.device("cpu"))
    prompt = target.tokenizer.encode("Hello there, how are you?")
    ev, back, stamp = threading.Event(), threading.Event(), [0.0]

    def waiter() -> None:
        while True:
            ev.wait()
            ev.clear()
            stamp[0] = time.perf_counter()
            back.set()

    threading.Thread(target=waiter, daemon=True).start()

    def wake() -> float:
        back.clear()
        t0 = time.perf_counter()
        ev.set()
        back.wait()
        return stamp[0] - t0

    def work() -> float:
        t0 = time.perf_counter()
        s = 0
        for i in range(20000):
            s += i * i % 7
        return time.perf_counter() - t0

    threads0 = torch.get_num_threads()
    out: dict[str, dict[float, list[float]]] = {}
    with Engine(target.model, EngineConfig(mode="off", max_batch=2, max_len=600)) as eng:
        def prefill() -> float:
            t0 = time.perf_counter()
            eng.generate([prompt], SamplingParams(max_tokens=1))
            return time.perf_counter() - t0

        params = list(target.model.parameters())

        def after_touch() -> float:  # the weights read once (sum), then the prefill (timed alone)
            with torch.inference_mode():
                for q in params:
                    q.sum()
            return prefill()

        def after_forward() -> float:  # a one-token forward first, then the prefill (timed alone)
            eng.generate([prompt[:1]], SamplingParams(max_tokens=1))
            return prefill()

        for _ in range(20):
            prefill()
        load0 = list(os.getloadavg())
        kinds = (("prefill, 1 thread", prefill, 1), ("prefill, 2 threads", prefill, 2),
                 ("prefill after reading the weights", after_touch, 1),
                 ("prefill after a 1-token forward", after_forward, 1),
                 ("thread wake-up", wake, 1), ("python work", work, 1))
        for _ in range(args.repeats):
            for name, fn, n in kinds:
                torch.set_num_threads(n)
                for _ in range(5):
                    fn()
                for gap in GAPS:
                    if gap:
                        time.sleep(gap)
                    out.setdefault(name, {}).setdefault(gap, []).append(1e3 * fn())
    torch.set_num_threads(threads0)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "machine": machine_info(), "load_average_start": load0,
           "load_average_end": list(os.getloadavg()), "pauses_s": list(GAPS),
           "median_ms": {n: {str(g): statistics.median(v) for g, v in d.items()} for n, d in out.items()},
           "range_ms": {n: {str(g): [min(v), max(v)] for g, v in d.items()} for n, d in out.items()}}
    for n, d in res["median_ms"].items():
        base = d["0.0"]
        print(f"{n:34s} " + "  ".join(f"after {g} s: {v:7.3f} ms (x{v / base:.2f})" for g, v in d.items()))
    print(f"load average {res['load_average_start']} -> {res['load_average_end']}")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
