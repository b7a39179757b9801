"""The speculation cache's branch work on a GPU, piece by piece, beside the drafter's own STEP.

After a STEP answered from a branch, the worker's table for the next round waits for the branch run
(F forked rows drafted k deep in one graph) and, before it, the bonus forward of the previous table
(queued behind it on the device). At one request that device work is what a hit step waits for
(docs/SPEC_CACHE.md), so each piece is timed here with its graph replayed alone, and profiled: kernels,
their count and where the device time goes. The drafter STEP (one request, n_out k) is timed the same
way beside them, so the pieces read as multiples of the drafter's own forward. Random bf16 weights of the
Qwen2.5-0.5B shape; the KV filled with random values to the context.

Also timed side by side at the branch run's shapes: the candidates at a stopping place as the branch
steps take them (kernels.greedy_top: the greedy pick and the top m in two launches) against greedy_pick
followed by torch.topk over the vocabulary, and a two-stage top-m in torch ops.

    python benchmarks/branch_work.py                  # H200: writes benchmarks/results/branch_work.json
    python benchmarks/branch_work.py --fanout 4,8,16 --contexts 128,32768
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import numpy as np
import torch

from draftrelay import model as M
from draftrelay.handoff.procinfo import machine_info
from draftrelay.speculation.table import Acceptance
from draftrelay.wire import protocol as P
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter
from draftrelay.worker.prefetch import Prefetcher

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks' own helpers

from machine import positive_ints  # noqa: E402


def pieces(pf: Prefetcher, d: LlamaDrafter, B: int, ctx: int, k: int, F: int, rng) -> dict:
    """One table's branch work after a STEP of B requests (the real Prefetcher path, bonus waited for):
    µs of each piece."""
    jb = [Job(r, ctx, rng.integers(0, d.vocab_size, 3).astype(np.int32)) for r in range(B)]
    for r in range(B):
        d.cache.lens[r] = ctx  # the numpy view: a torch scalar write costs 2 us a row here
    drafts, _ = d.run(jb, k)
    blocks = [P.Block(r, 1, ctx, jb[r].tokens, k) for r in range(B)]
    res = types.SimpleNamespace(drafts=drafts)
    todo = [(r, types.SimpleNamespace(row=r, ctx_len=ctx + 3), k) for r in range(B)]
    before = {p: pf.stats[f"{p}_us"] for p in ("stops", "choose", "run", "bonus", "entries")}
    torch.cuda.synchronize()
    pf._draft(blocks, res, todo, Acceptance(), F)
    return {p: pf.stats[f"{p}_us"] - v for p, v in before.items()}


def top_two_stage(x: torch.Tensor, m: int, chunk: int = 1024):
    """top-m over the last dim as per-chunk top-m then the top-m of the candidates (same values as
    torch.topk up to the order of ties)."""
    *lead, V = x.shape
    n = -(-V // chunk)
    pad = n * chunk - V
    xp = torch.nn.functional.pad(x, (0, pad), value=float("-inf")) if pad else x
    v1, i1 = xp.view(*lead, n, chunk).topk(m, dim=-1)
    i1 = i1 + (torch.arange(n, device=x.device) * chunk)[:, None]
    v2, j = v1.reshape(*lead, n * m).topk(m, dim=-1)
    return v2, i1.reshape(*lead, n * m).gather(-1, j)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="128", help="comma-separated context lengths the KV is filled to")
    ap.add_argument("--fanout", default="8", help="comma-separated branches per request (F)")
    ap.add_argument("--requests", default="1,4", help="comma-separated numbers of requests drafted together")
    ap.add_argument("--k", type=int, default=4, help="draft depth of each branch and of the STEP (n_out)")
    ap.add_argument("--iters", type=int, default=30, help="graph replays timed per piece")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "branch_work.json"), help="the JSON written (default: %(default)s)")
    args = ap.parse_args(argv)

    def ints(name: str, text: str) -> list[int]:
        try:
            return positive_ints(text)
        except ValueError as e:
            ap.error(f"--{name} takes {e}")

    ctxs, fans, reqs = ints("contexts", args.contexts), ints("fanout", args.fanout), ints("requests", args.requests)
    if args.k < 1 or args.iters < 1:
        ap.error(f"--k and --iters must be positive (got {args.k}, {args.iters})")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    # fast_forward's timing and profiling helpers (it imports Triton: only where a GPU runs this)
    from draftrelay import kernels
    from fast_forward import interleaved, kernel_count

    K = kernels.backend("cuda")

    t_start = time.perf_counter()
    dev = torch.device("cuda:0")
    k = args.k
    out: dict = {"benchmark": "branch_work", "machine": machine_info(), "k": k, "iters": args.iters,
                 "weights": "random bf16, Qwen2.5-0.5B shape", "argv": sys.argv[1:], "rows": []}

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    cfg = M.ModelConfig(**{**SHAPES["qwen2.5-0.5b"], "max_position_embeddings": 131072}, name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=0, device=dev, dtype=torch.bfloat16, draw_on="device")
    rng = np.random.default_rng(0)
    # top-m alone at the branch run's shapes (B*k rows of the vocabulary, bf16) and the bonus's (B rows)
    tops = {}
    for rows in sorted({b * f * k for b in reqs for f in fans} | {b * f for b in reqs for f in fans}):
        x = torch.randn(rows, cfg.vocab_size, device=dev, dtype=torch.bfloat16)
        a, b = x.topk(8, dim=-1), top_two_stage(x, 8)
        c = K.greedy_top(x, 8)
        same = bool(torch.equal(a[0], b[0])) and bool(torch.equal(x.float().gather(-1, c[2]), a[0].float()))
        t = interleaved({"torch_topk": lambda x=x: x.topk(8, dim=-1),
                         "pick_then_topk": lambda x=x: (K.greedy_pick(x), x.topk(8, dim=-1)),
                         "two_stage": lambda x=x: top_two_stage(x, 8),
                         "greedy_top": lambda x=x: K.greedy_top(x, 8)}, args.iters)
        tops[rows] = {"values_equal": same, **t}
        print(f"top-8 over {rows} x {cfg.vocab_size}: " + ", ".join(f"{n} {v['p50_ms'] * 1e3:.1f} us"
                                                                    for n, v in t.items())
              + f" (equal values: {same})", flush=True)
    out["top_m"] = tops
    save()
    for ctx in ctxs:
        max_ctx = ctx + 64
        for B in reqs:
            d = LlamaDrafter(model, B + 1, max_ctx, 8, "d", "", mode="graph")
            with torch.no_grad():
                d.cache.k[:, :, :, :ctx].normal_(0, 1)
                d.cache.v[:, :, :, :ctx].normal_(0, 1)
            for F in fans:
                pf = Prefetcher(d, max_fanout=max(fans))
                pf.sync_bonus = True
                got = [pieces(pf, d, B, ctx, k, F, rng) for _ in range(args.iters // 3 + 3)][3:]
                wall = {p: round(float(np.median([g[p] for g in got])) / 1e3, 4) for p in got[0]}
                # the graphs of each piece, replayed alone (the STEP's own graph beside them)
                fk = pf.fork
                # the STEP's own static step (B requests, n_out k; 3 new tokens in their token bucket): the
                # smallest token and kv buckets
                step_key = min((kk for kk in d._static if kk[0] == B and kk[2] == k), key=lambda kk: (kk[1], kk[-1]))
                graphs = {"drafter_step": d._static[step_key].graph}
                for key in sorted(fk._steps, key=lambda kk: kk[-1]):  # the smallest kv bucket: the one run
                    g = fk._steps[key]
                    if g.graph is not None and key[0] not in graphs:
                        graphs[key[0]] = g.graph
                alone = interleaved({n: g.replay for n, g in graphs.items()}, args.iters)
                prof = {n: kernel_count(g.replay) for n, g in graphs.items()}
                row = {"context": ctx, "requests": B, "fanout": F, "rows": B * F, "pieces_wall_ms": wall,
                       "replay_alone": alone, "kernels": prof}
                out["rows"].append(row)
                save()
                print(f"ctx {ctx} B={B} F={F}: wall " + " ".join(f"{p} {v:.2f}" for p, v in wall.items())
                      + " | alone " + " ".join(f"{n} {v['p50_ms']:.3f}" for n, v in alone.items())
                      + " | kernels " + " ".join(f"{n} {v['kernels']}" for n, v in prof.items()), flush=True)
                for n, v in prof.items():
                    print(f"  {n}: {v['kernels']} kernels, {v['device_us']} us of device time; top: "
                          + "; ".join(f"{name} x{c} {t} us" for name, c, t in v["top_by_time"][:8]), flush=True)
                del pf
            del d
            torch.cuda.empty_cache()
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(f"wrote {args.out} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
