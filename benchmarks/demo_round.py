"""Where one speculative round of the demo pair goes on this CPU, hop by hop.

The demo's step is round + verify: the engine sends each request's accepted tokens, the local worker
extends its draft KV and drafts k tokens, the engine verifies k + 1. This benchmark replays that
pattern (`--rows` requests, the demo's batch on a CPU by default; each sends `--accept` of its drafts
+ 1 token per round and asks k; a target verify of k + 1 tokens in this process after every round, as
the engine runs it) and splits the round:

1. forwards (this process, one thread): a target decode and verify step; a drafter forward; the
   drafter's whole STEP computation (`LlamaDrafter.run`: extension + k - 1 decode steps) back to back
   and right after a target verify (the verify streams the target's weights through the caches), for
   each drafter mode.
2. sync rounds per configuration (worker threads W, engine threads E, worker drafter mode): the
   client's STEP round trip, the worker's own time (`worker_us`, from the reply: validation, KV
   rollback, drafting) and the rest (codec, sockets, thread wake-ups).
3. async rounds, the same configurations, as the demo opens them on a CPU (the engine thread stages and
   announces the round and runs the stream's part of it itself: EmulatedStream.inline), once with the
   stream thread doing that part, once with HandoffConfig's default periodic wake-ups: the round split
   from stamps on one clock (CLOCK_MONOTONIC in both processes) into submit, the proxy's part up to its
   release (its clock right before the store: its wake-up, parse, the STEP round trip, the reply write)
   and release -> result (the engine side's wake-up, the reply copy, the decode).
   The wait of the emulated stream and the proxy: `block` (futex sleep) or `poll` (spin, nap); and a row
   whose waits spin in a 400 us window each side of the moment they expect their word, asleep before and
   after it (HandoffConfig.spin_window_us: for a core the target and the worker leave idle).

    python benchmarks/demo_round.py [--steps 200] [--k 4] -> benchmarks/results/demo_round_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from draftrelay import demo_pair
from draftrelay.checkpoint.hf import load_hf_dir
from draftrelay.engine import loading as L
from draftrelay.engine.cli_demo import CPU_BATCH
from draftrelay.handoff import native
from draftrelay.handoff.procinfo import machine_info
from draftrelay.handoff.region import W
from draftrelay.handoff.rounds import AsyncRounds, HandoffConfig, open_rounds
from draftrelay.round import RoundRequest
from draftrelay.wire import Block, DrafterClient
from draftrelay.worker.drafters import Job, LlamaDrafter
from draftrelay.worker.lean import LeanSteps
from draftrelay.worker.process import start_worker_process

ROWS = CPU_BATCH  # requests per round: the demo's on a CPU (--rows)
PROMPT = 12  # tokens of a first round (not timed)
EPISODE = 48  # rounds before the requests start over (the demo's contexts stay short)
WARMUP = 20  # untimed rounds at the start of each run
SPIN_WINDOW_US = 400  # the async_spare_core row's HandoffConfig.spin_window_us


def p50(xs) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def spread(xs) -> dict:
    a = np.asarray(xs) * 1e3
    return {"p10": float(np.percentile(a, 10)), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90))} if len(a) else {}


class Target:
    """The demo target in this process with a KV of ROWS rows; verify(T) runs the engine's verify shape
    (T new tokens per row at the rows' positions) and rolls the rows back, so the context stays put."""

    def __init__(self, ctx: int = 48) -> None:
        tdir, _ = demo_pair.paths()
        self.net = load_hf_dir(tdir, device="cpu", dtype=torch.float32)
        self.cache = self.net.new_cache(ROWS, 256)
        self.rows = torch.arange(ROWS)
        self.ctx = ctx
        with torch.inference_mode():
            self.net(torch.ones(ROWS, ctx, dtype=torch.long), torch.zeros(ROWS, dtype=torch.long), self.cache,
                     self.rows)

    def verify(self, T: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.net(torch.ones(ROWS, T, dtype=torch.long), torch.full((ROWS,), self.ctx), self.cache, self.rows)
        for r in range(ROWS):
            self.cache.truncate(r, self.ctx)
        return time.perf_counter() - t0


class Pattern:
    """The demo's round pattern: per round each request sends `accept` of its last drafts + 1 token at
    its position and asks k; every EPISODE rounds the requests start over with fresh ids."""

    def __init__(self, k: int, accept: int, seed: int = 0) -> None:
        self.k, self.accept = k, accept
        self.rng = np.random.default_rng(seed)
        self.episode = 0
        self._start()

    def _start(self) -> None:
        self.episode += 1
        self.ids = [1000 * self.episode + i for i in range(ROWS)]
        self.pos = [0] * ROWS
        self.send = [self.rng.integers(1, 2048, PROMPT).astype(np.int32) for _ in range(ROWS)]
        self.accepted = [0] * ROWS  # drafts at the head of each request's next send
        self.n = 0

    def first(self) -> bool:
        return self.n == 0

    def blocks(self) -> list[tuple[int, int, np.ndarray, int]]:
        return [(self.ids[i], self.pos[i], self.send[i], self.k) for i in range(ROWS)]

    def advance(self, drafts: list[np.ndarray]) -> None:
        self.n += 1
        if self.n >= EPISODE:
            self._start()
            return
        for i in range(ROWS):
            self.pos[i] += len(self.send[i])
            d = np.asarray(drafts[i][:self.accept], np.int32)
            self.accepted[i] = len(d)
            self.send[i] = np.concatenate([d, self.rng.integers(1, 2048, 1 + self.accept - len(d))]).astype(np.int32)


def forwards(k: int, accept: int, iters: int, modes: list[str]) -> dict:
    """In this process, one thread: target decode/verify, one drafter forward, the drafter's run()."""
    torch.set_num_threads(1)
    _, ddir = demo_pair.paths()
    tgt = Target()
    out: dict = {}
    dec, ver = [], []
    for i in range(iters + 5):
        a, b = tgt.verify(1), tgt.verify(k + 1)
        if i >= 5:
            dec.append(a)
            ver.append(b)
    out["target_decode_ms"], out["target_verify_ms"] = spread(dec), spread(ver)
    net = load_hf_dir(ddir, device="cpu", dtype=torch.float32)
    for mode in modes:
        d = LlamaDrafter(net, 16, 512, 8, "demo-drafter", "", mode=mode)
        pat = Pattern(k, accept)
        warm, cold, fwd = [], [], []
        for i in range(2 * iters + 10):
            # as WorkerCore plans it: the accepted drafts' K/V are in the row already (it holds the first
            # k - 1 drafts), so only what follows them is fed
            jobs = []
            for j, (_, p, toks, _) in enumerate(pat.blocks()):
                c = 0 if pat.first() else min(pat.accepted[j], k - 1, len(toks) - 1)
                jobs.append(Job(ROWS * (pat.episode % 2) + j, p + c, toks[c:]))
            if pat.first():
                for j in jobs:
                    d.cache.lengths[j.row] = 0
            if i % 2:
                tgt.verify(k + 1)  # caches as the worker finds them after the engine's verify
            t0 = time.perf_counter()
            drafts, _ = d.run(jobs, k)
            dt = time.perf_counter() - t0
            if i >= 10 and not pat.first():
                (cold if i % 2 else warm).append(dt)
            pat.advance(list(drafts))
        cache = net.new_cache(ROWS, 256)
        rows = torch.arange(ROWS)
        lean = LeanSteps(net, cache) if mode == "lean" else None
        one = torch.ones(ROWS, 1, dtype=torch.long)
        at = torch.full((ROWS,), 40)
        with torch.inference_mode():
            net(torch.ones(ROWS, 40, dtype=torch.long), torch.zeros(ROWS, dtype=torch.long), cache, rows)
            for i in range(iters + 5):
                t0 = time.perf_counter()
                if lean is None:  # one decode forward of the mode: the model's own, or the lean loop's
                    net(one, at, cache, rows)
                else:
                    pos = at[:, None]
                    lean.forward(one, pos, lean.tables(pos, 41), list(range(ROWS)), 41)
                if i >= 5:
                    fwd.append(time.perf_counter() - t0)
                for r in range(ROWS):
                    cache.truncate(r, 40)
        out[f"drafter_{mode}"] = {"run_back_to_back_ms": spread(warm), "run_after_verify_ms": spread(cold),
                                  "one_forward_ms": spread(fwd)}
    return out


def start_worker(threads: int, mode: str, wait_policy: str):
    _, ddir = demo_pair.paths()
    env = {"OMP_NUM_THREADS": str(threads)}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    return start_worker_process(["--model", ddir, "--device", "cpu", "--threads", str(threads), "--mode", mode,
                                 "--max-ctx", "1024", "--rows", "16", "--max-requests", "16", "--n-out-max", "8"],
                                env=env)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process pid onto cpus (threads made later inherit it from their creator)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def sync_rounds(w, tgt: Target, k: int, accept: int, steps: int) -> dict:
    c = DrafterClient(w.host, w.port, max_requests=8, n_out_max=8, timeout=10, client_name="demo_round")
    c.connect(timeout=30)
    pat = Pattern(k, accept)
    rtt, wus, ver = [], [], []
    n = 0
    try:
        while len(rtt) < steps:
            n += 1
            first = pat.first() or n <= WARMUP
            blocks = [Block(rid, 0, p, toks, n) for rid, p, toks, n in pat.blocks()]
            t0 = time.perf_counter()
            rep = c.step(blocks, timeout=10)
            dt = time.perf_counter() - t0
            v = tgt.verify(k + 1)
            if not first:
                rtt.append(dt)
                wus.append(rep.worker_us * 1e-6)
                ver.append(v)
            pat.advance([rep[i].drafts for i in range(ROWS)])
    finally:
        c.close()
    rest = [a - b for a, b in zip(rtt, wus, strict=True)]
    return {"round_ms": spread(rtt), "worker_step_ms": spread(wus), "transport_codec_wakeups_ms": spread(rest),
            "verify_ms": spread(ver), "step_ms_p50": p50([a + b for a, b in zip(rtt, ver, strict=True)])}


def async_rounds(w, tgt: Target, k: int, accept: int, steps: int, wait: str, inline: bool = True,
                 cli_settings: bool = True, spare_core: bool = False) -> dict:
    """Async rounds as `draftrelay demo` opens them on a CPU (host staging, the stream's part run inline by
    the engine thread), or with the stream thread doing its part (inline False). The hops from stamps on
    one clock (CLOCK_MONOTONIC in both processes): submit (staging, announcement); the proxy's part up to
    its release (its wake-up, parse, the STEP round trip, the reply write: the proxy stamps its clock
    right before the release store); release -> result (the engine side's wake-up, reply copy, decode)."""
    spec = {"kind": "worker", "host": w.host, "port": w.port, "n_out_max": 8, "max_requests": 8,
            "client_name": "demo_round"}
    spin, nap = (0, 200) if wait == "block" else (50, 20)
    # spare_core: the waits spin in a window around the expected wake-up (HandoffConfig.spin_window_us)
    window = SPIN_WINDOW_US if spare_core else 0
    # the periodic wake-ups as `draftrelay demo` sets them on a CPU (engine.loading.handoff_config), or
    # HandoffConfig's defaults
    periodic = dict(wait_slice_us=L.CPU_WAIT_SLICE_US, supervise_ms=L.CPU_SUPERVISE_MS,
                    heartbeat_ms=L.CPU_HEARTBEAT_MS) if cli_settings else {}
    cfg = HandoffConfig(max_requests=8, max_tokens=4096, max_drafts=8, vocab_size=2048, deadline_ms=500,
                        round_budget_ms=400, spin_us=spin, nap_us=nap, stream_spin_us=spin, stream_nap_us=nap,
                        wait=wait, round_spec=spec, strict=True, watchdog_poll_us=5000, stream_inline=inline,
                        spin_window_us=window, **periodic)
    r = open_rounds(cfg)
    assert isinstance(r, AsyncRounds)
    a_last = r.region.word_addr(W.LAST_RELEASE_NS)
    pat = Pattern(k, accept)
    rows: dict[str, list[float]] = {"round": [], "submit": [], "proxy_to_release": [], "release_to_result": [],
                                    "verify": []}
    n = 0
    try:
        while len(rows["round"]) < steps:
            n += 1
            first = pat.first() or n <= WARMUP
            reqs = [RoundRequest(rid, 0, p, toks, n) for rid, p, toks, n in pat.blocks()]
            t0 = time.monotonic_ns()
            t = r.submit(reqs)
            t1 = time.monotonic_ns()
            res = r.result(t, timeout_s=5.0)
            t2 = time.monotonic_ns()
            v = tgt.verify(k + 1)
            if not res.ok:
                raise SystemExit(f"async round failed: {res.status.name} {res.detail}")
            if not first:
                rel = native.load64(a_last)
                rows["round"].append((t2 - t0) * 1e-9)
                rows["submit"].append((t1 - t0) * 1e-9)
                rows["proxy_to_release"].append((rel - t1) * 1e-9)
                rows["release_to_result"].append((t2 - rel) * 1e-9)
                rows["verify"].append(v)
            pat.advance([res.drafts[i, :res.counts[i]] for i in range(ROWS)])
        inline_runs = getattr(r.stream, "inline_runs", 0)
    finally:
        r.close()
    out = {f"{k_}_ms": spread(v) for k_, v in rows.items() if v}
    out["step_ms_p50"] = p50([a + b for a, b in zip(rows["round"], rows["verify"], strict=True)])
    out["inline_runs"] = inline_runs
    return out


def parse_config(s: str) -> dict:
    """'w1e1:eager:block' -> worker threads 1, engine threads 1, drafter mode eager, wait block; a trailing
    ':pin' puts this process on CPU 0 and the worker on CPU 1."""
    pinned = s.endswith(":pin")
    parts = s.removesuffix(":pin").split(":")
    wt, et = parts[0].lstrip("w").split("e")
    return {"name": s, "worker_threads": int(wt), "engine_threads": int(et),
            "drafter_mode": parts[1] if len(parts) > 1 else "eager", "wait": parts[2] if len(parts) > 2 else "block",
            "omp_wait_policy": parts[3] if len(parts) > 3 else "", "pin": pinned}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="timed rounds per configuration and round kind")
    ap.add_argument("--iters", type=int, default=100, help="timed forwards of each kind (part 1)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accept", type=int, default=2, help="drafts each request keeps per round (+1 token)")
    ap.add_argument("--modes", default="eager", help="drafter modes for part 1 (comma list)")
    ap.add_argument("--configs", default="w1e1:eager:block,w2e2:eager:block,w1e1:eager:poll",
                    help="comma list of wWeE:drafter-mode:wait[:OMP_WAIT_POLICY]")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the configurations (interleaved)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "demo_round_cpu.json"))
    ap.add_argument("--rows", type=int, default=CPU_BATCH, help="requests per round")
    args = ap.parse_args(argv)
    global ROWS
    ROWS = args.rows
    configs = [parse_config(s) for s in args.configs.split(",") if s]
    load0 = os.getloadavg()
    res: dict = {"benchmark": "demo_round", "k": args.k, "accept": args.accept, "rows": ROWS,
                 "command": " ".join(["python", "benchmarks/demo_round.py", *(argv or sys.argv[1:])]),
                 "machine": machine_info()}
    res["forwards"] = fw = forwards(args.k, args.accept, args.iters, args.modes.split(","))
    print(f"target decode p50 {fw['target_decode_ms']['p50']:.2f} ms, verify of {args.k + 1} "
          f"{fw['target_verify_ms']['p50']:.2f} ms (1 thread)")
    for m in args.modes.split(","):
        d = fw[f"drafter_{m}"]
        print(f"drafter [{m}]: one forward {d['one_forward_ms']['p50']:.3f} ms; run() back to back "
              f"{d['run_back_to_back_ms']['p50']:.2f} ms, after a target verify "
              f"{d['run_after_verify_ms']['p50']:.2f} ms")
    runs = []
    for rep in range(args.repeats):
        for c in configs:
            torch.set_num_threads(c["engine_threads"])
            tgt = Target()
            w = start_worker(c["worker_threads"], c["drafter_mode"], c["omp_wait_policy"])
            every = os.sched_getaffinity(0)
            if c["pin"]:
                pin(os.getpid(), {0})
                pin(w.pid, {1})
            try:
                row = {"config": c, "repeat": rep, "loadavg_1m_before": os.getloadavg()[0],
                       "sync": sync_rounds(w, tgt, args.k, args.accept, args.steps),
                       "async": async_rounds(w, tgt, args.k, args.accept, args.steps, c["wait"]),
                       "async_spare_core": async_rounds(w, tgt, args.k, args.accept, args.steps, c["wait"],
                                                        spare_core=True),
                       "async_stream_thread": async_rounds(w, tgt, args.k, args.accept, args.steps, c["wait"],
                                                           inline=False),
                       "async_default_periodic": async_rounds(w, tgt, args.k, args.accept, args.steps, c["wait"],
                                                              cli_settings=False)}
            finally:
                w.stop()
                if c["pin"]:
                    pin(os.getpid(), every)
            runs.append(row)
            s, a, at, ad = row["sync"], row["async"], row["async_stream_thread"], row["async_default_periodic"]
            asp = row["async_spare_core"]
            print(f"[{c['name']}] sync: round {s['round_ms']['p50']:.2f} ms = worker {s['worker_step_ms']['p50']:.2f} "
                  f"+ rest {s['transport_codec_wakeups_ms']['p50']:.2f}; verify {s['verify_ms']['p50']:.2f}; "
                  f"step {s['step_ms_p50']:.2f}")
            for name, x in (("async", a), ("async, spinning on a spare core", asp), ("async, stream thread", at),
                            ("async, default wake-ups", ad)):
                print(f"[{c['name']}] {name}: round {x['round_ms']['p50']:.2f} ms = submit "
                      f"{x['submit_ms']['p50']:.3f} + proxy to release {x['proxy_to_release_ms']['p50']:.2f} + "
                      f"release to result {x['release_to_result_ms']['p50']:.3f}; verify {x['verify_ms']['p50']:.2f}; "
                      f"step {x['step_ms_p50']:.2f} (inline runs {x['inline_runs']})")
            print(f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    res["runs"] = runs
    res["loadavg_1_5_15_before"], res["loadavg_1_5_15_after"] = list(load0), list(os.getloadavg())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} (load average before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
