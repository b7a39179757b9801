"""TP2 drafter step vs one card: graph replay, the collectives' share, STEP round trip, memory per card.

For each drafter shape (seeded random weights, bf16), requests 1-4 and n_out 4 and 5, side by side in
one process:
  one card  LlamaDrafter on cuda:0, CUDA graphs
  pair      TPDrafter, tp 2 on cuda:0 + cuda:1 with the P2P collectives, per-rank CUDA graphs
  solo      TPDrafter rank 0 alone with stand-in collectives (its compute share; pair - solo = what the
            collectives and the second rank's skew cost)
Each point: a steady-state step (every request: context 128, 3 new tokens = 2 accepted drafts + bonus,
n_out drafts) timed as (a) graph replay alone (launch every rank's graph + wait for all), (b) the whole
`run()` (pack, H2D, replay, D2H, error-word check, cross-rank token check), and (c) STEP round trip over
loopback TCP (in-process server + the numpy client, rewinding to the same context each round).
Memory: torch allocations per card after building (weights + KV rows) and after the graphs, plus the
P2P state (plain cudaMalloc, outside torch).

    python benchmarks/tp2_step.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--iters 200] [--budget-s 240] \
        [--out benchmarks/results]     # -> DIR/tp2_step.json (other shapes: DIR/tp2_step_<shapes>.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch

from draftrelay import model as M
from draftrelay.handoff.procinfo import machine_info
from draftrelay.wire import Block, DrafterClient
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter
from draftrelay.worker.server import WorkerServer
from draftrelay.worker.tp import TPDrafter

PROMPT, NEW = 128, 3


def p50(xs) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, 50))


def p99(xs) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, 99))


def sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def mem(devs) -> list[int]:
    sync_all()
    return [torch.cuda.memory_allocated(d) for d in devs]


def jobs_for(B: int, toks: np.ndarray) -> list[Job]:
    return [Job(b, PROMPT, toks[b]) for b in range(B)]


def replay_fn(drafter, key):
    """Replay every rank's graph of `key` and wait for all of them (no host packing, no checks)."""
    if isinstance(drafter, LlamaDrafter):
        g = drafter._static[key]

        def one():
            g.graph.replay()
            torch.cuda.synchronize(0)
        return one
    st = drafter._static[key]

    def many():
        drafter._replay(st, range(len(st.graphs)), copy_inputs=False)
        for s in drafter.streams:
            s.synchronize()
    return many


def time_point(drafters: dict, B: int, n_out: int, iters: int, rng) -> dict:
    toks = rng.integers(0, 256, (B, NEW)).astype(np.int32)
    key = (B, 4, n_out, 256)
    out = {}
    drafts = {}
    for name, d in drafters.items():
        jobs = jobs_for(B, toks)
        for _ in range(3):  # first use captures the graphs
            drafts[name] = d.run(jobs, n_out)[0]
        if isinstance(d, LlamaDrafter):
            assert d._static[key].graph is not None, f"{name}: no graph for {key}"
        else:
            assert d._static[key].graphs, f"{name}: no graph for {key} (settle log {d.settle_log[-3:]})"
    # interleave the drafters: drift of the machine hits all of them alike
    rep = {n: replay_fn(d, key) for n, d in drafters.items()}
    t_rep = {n: [] for n in drafters}
    t_run = {n: [] for n in drafters}
    for _ in range(iters):
        for n, d in drafters.items():
            t0 = time.perf_counter()
            rep[n]()
            t_rep[n].append(time.perf_counter() - t0)
            jobs = jobs_for(B, toks)
            t0 = time.perf_counter()
            d.run(jobs, n_out)
            t_run[n].append(time.perf_counter() - t0)
    for n in drafters:
        out[n] = {"replay_p50_ms": p50(t_rep[n]), "replay_p99_ms": p99(t_rep[n]),
                  "run_p50_ms": p50(t_run[n]), "run_p99_ms": p99(t_run[n])}
    out["pair_drafts_equal_one_card"] = bool(np.array_equal(drafts["one_card"], drafts["pair"]))
    return out


def rtt_point(port_of: dict, B: int, n_out: int, rounds: int, rng) -> dict:
    out = {}
    prompts = [rng.integers(0, 256, PROMPT).astype(np.int32) for _ in range(B)]
    new = [rng.integers(0, 256, NEW).astype(np.int32) for _ in range(B)]
    for name, port in port_of.items():
        c = DrafterClient("127.0.0.1", port, max_requests=4, n_out_max=8, timeout=30)
        base = 1000 * B + 100 * n_out
        r = c.step([Block(base + b, 0, 0, prompts[b], 0) for b in range(B)], timeout=120)  # prefill, no drafts
        assert all(x.status == 0 for x in r), [x.status for x in r]
        blocks = [Block(base + b, 0, PROMPT, new[b], n_out) for b in range(B)]  # rewinds to PROMPT every round
        rtt, wus = [], []
        for k in range(rounds + 10):
            t0 = time.perf_counter()
            r = c.step(blocks, timeout=30)
            dt = time.perf_counter() - t0
            assert all(x.status == 0 for x in r), [x.status for x in r]
            if k >= 10:
                rtt.append(dt)
                wus.append(r.worker_us * 1e-6)
        c.step([Block(base + b, 0, 0, np.zeros(0, np.int32), 0, flags=1) for b in range(B)], timeout=30)  # END
        c.close()
        out[name] = {"rtt_p50_ms": p50(rtt), "rtt_p99_ms": p99(rtt), "worker_p50_ms": p50(wus)}
    return out


def run_shape(shape: str, args, rng, deadline: float) -> dict:
    cfg = M.ModelConfig(**SHAPES[shape], name=shape)
    devs = [0, 1]
    m0 = mem(devs)
    t0 = time.perf_counter()
    model = M.Transformer.random(cfg, seed=0, device="cuda:0", dtype=torch.bfloat16, draw_on="device")
    kw = dict(n_rows=args.rows, max_ctx=args.max_ctx, n_out_max=8, model_id=shape, tokenizer_hash="")
    one = LlamaDrafter(model, kw["n_rows"], kw["max_ctx"], 8, shape, "", mode="graph")
    m_one = mem(devs)
    pair = TPDrafter(model, 2, "pair", kw["n_rows"], kw["max_ctx"], 8, shape, "", mode="graph")
    m_pair = mem(devs)
    solo = TPDrafter(model, 2, "solo", kw["n_rows"], kw["max_ctx"], 8, shape, "", mode="graph")
    m_solo = mem(devs)
    build_s = time.perf_counter() - t0
    g = pair.group
    p2p_state = int(g._lib.p2p_state_bytes(g.world_size, g.blocks, g.region))
    res = {"shape": shape, "config": SHAPES[shape], "params_M": round(cfg.n_params() / 1e6, 1), "build_s": build_s,
           "f32_partials": pair.f32_partials, "collectives_per_step": {}, "points": [],
           "shards": [{"rank": s.rank, "heads": s.heads, "kv_heads": s.kv_heads, "channels": s.channels,
                       "vocab": s.vocab, **s.nbytes()} for s in pair.shards]}
    drafters = {"one_card": one, "pair": pair, "solo": solo}
    prompts = [rng.integers(0, 256, PROMPT).astype(np.int32) for _ in range(max(args.requests))]
    for d in drafters.values():  # rows 0.. hold a PROMPT-token context; every timed step rewinds to it
        d.run([Job(b, 0, p) for b, p in enumerate(prompts)], 0)
    for n_out in args.n_out:
        res["collectives_per_step"][n_out] = {"all_reduce": 2 * cfg.n_layers * n_out + 1, "argmax_exchange": n_out}
        for B in args.requests:
            if time.monotonic() > deadline:
                res["points"].append({"requests": B, "n_out": n_out, "skipped": "budget"})
                continue
            p = {"requests": B, "n_out": n_out, **time_point(drafters, B, n_out, args.iters, rng)}
            p["pair_over_one_card_replay"] = p["pair"]["replay_p50_ms"] / p["one_card"]["replay_p50_ms"]
            p["pair_over_one_card_run"] = p["pair"]["run_p50_ms"] / p["one_card"]["run_p50_ms"]
            p["collectives_share_ms"] = p["pair"]["replay_p50_ms"] - p["solo"]["replay_p50_ms"]
            res["points"].append(p)
            print(f"[{shape}] B={B} n_out={n_out}: replay p50 one card {p['one_card']['replay_p50_ms']:.3f} ms | "
                  f"pair {p['pair']['replay_p50_ms']:.3f} ms ({p['pair_over_one_card_replay']:.2f}x) | solo rank0 "
                  f"{p['solo']['replay_p50_ms']:.3f} ms | run() p50 one {p['one_card']['run_p50_ms']:.3f} pair "
                  f"{p['pair']['run_p50_ms']:.3f} ({p['pair_over_one_card_run']:.2f}x) | drafts equal "
                  f"{p['pair_drafts_equal_one_card']}", flush=True)
            save_partial(res)
    res["settle_log"] = pair.settle_log[:8]
    res["replay_threads"] = pair._pool_threads is not None
    m_graphs = mem(devs)
    res["memory"] = {
        "note": "torch.cuda.memory_allocated deltas per card (weights + KV rows; then + graph pools of all "
                "keys above); P2P state is a plain cudaMalloc per card outside torch",
        "one_card_cuda0": m_one[0] - m0[0],
        "model_full_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "one_card_kv_bytes": one.cache.nbytes(),
        "pair_rank0_cuda0": m_pair[0] - m_one[0], "pair_rank1_cuda1": m_pair[1] - m_one[1],
        "solo_rank0_cuda0": m_solo[0] - m_pair[0], "p2p_state_per_card": p2p_state,
        "after_all_graphs_cuda0": m_graphs[0] - m0[0], "after_all_graphs_cuda1": m_graphs[1] - m0[1],
        "max_reserved": [torch.cuda.max_memory_reserved(d) for d in devs],
    }
    # STEP round trip over loopback TCP: the same server code, each drafter behind its own port
    servers = {}
    try:
        for name in ("one_card", "pair"):
            core = WorkerCore(drafters[name], max_requests=4)
            srv = WorkerServer(core, "127.0.0.1", 0)
            servers[name] = (srv, srv.start()[1])
        res["rtt"] = []
        for n_out in args.n_out:
            for B in args.requests:
                if time.monotonic() > deadline:
                    res["rtt"].append({"requests": B, "n_out": n_out, "skipped": "budget"})
                    continue
                r = {"requests": B, "n_out": n_out,
                     **rtt_point({n: p for n, (_, p) in servers.items()}, B, n_out, args.rtt_rounds, rng)}
                r["pair_over_one_card"] = r["pair"]["rtt_p50_ms"] / r["one_card"]["rtt_p50_ms"]
                res["rtt"].append(r)
                print(f"[{shape}] STEP RTT B={B} n_out={n_out}: one card {r['one_card']['rtt_p50_ms']:.3f} ms "
                      f"(worker {r['one_card']['worker_p50_ms']:.3f}) | pair {r['pair']['rtt_p50_ms']:.3f} ms "
                      f"(worker {r['pair']['worker_p50_ms']:.3f}) = {r['pair_over_one_card']:.2f}x", flush=True)
                save_partial(res)
    finally:
        for srv, _ in servers.values():
            srv.stop()
    pair.close()
    solo.close()
    del one, pair, solo, model, drafters
    torch.cuda.empty_cache()
    return res


RUN: dict = {}


def save_partial(current=None) -> None:
    out = dict(RUN)
    if current is not None:
        out["shapes"] = RUN["shapes"] + [current]
    with open(RUN["_path"], "w") as f:
        json.dump({k: v for k, v in out.items() if k != "_path"}, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--requests", default="1,2,3,4")
    ap.add_argument("--n-out", default="4,5")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rtt-rounds", type=int, default=150)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-ctx", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting new points after this (0: none)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="directory for the result JSON")
    args = ap.parse_args(argv)
    args.requests = [int(x) for x in args.requests.split(",")]
    args.n_out = [int(x) for x in args.n_out.split(",")]
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else float("inf")
    default = args.shapes == "qwen2.5-0.5b,qwen2.5-1.5b"
    name = "tp2_step.json" if default else f"tp2_step_{args.shapes.replace(',', '_')}.json"
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, name)
    RUN.update({"benchmark": "tp2_step", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "command": " ".join(["python", "benchmarks/tp2_step.py"] + (argv or sys.argv[1:])),
                "context": PROMPT, "new_tokens": NEW, "env": machine_info(), "shapes": [], "_path": out})
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        try:
            RUN["shapes"].append(run_shape(shape, args, rng, deadline))
        except Exception as exc:  # keep the other shape's figures; say what failed
            import traceback

            traceback.print_exc()
            RUN["shapes"].append({"shape": shape, "error": f"{type(exc).__name__}: {exc}"})
        save_partial()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
