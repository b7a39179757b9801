"""Where the host time of the worker's drafter STEP goes on a GPU (0.5B shape, graphs, fused kernels).

The STEP inside the worker (`LlamaDrafter.run` on a captured step) is the graph's replay plus host work
that does not overlap it: packing the inputs, the replay's launch (the graph holds the H2D copy of the
packed inputs and the D2H copy of the drafts), the stream synchronize and the unpacking. This benchmark
times each host call of that path separately (perf_counter around each, the calls as
`LlamaDrafter._run_static` makes them), the whole `run` beside it, the graph replayed alone, the packing
with torch scalar indexing of the row lengths (`pack_torch`, as it was), and the path before it
(`copies_apart`: the same step captured without its copies, the two copies launched around the replay,
each of its host calls timed too). The variants are interleaved (each iteration runs each once); p50
with p10 / p90. It also checks that the copies-apart graph returns the same drafts as the worker's path
for fresh inputs (the copy nodes read the pinned buffers at replay time, not at capture time).

    python benchmarks/step_host.py [--requests 1,4] [--iters 200] [--out benchmarks/results/step_host.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from draftrelay import model as M
from draftrelay.capture import GraphCapture, kv_bucket
from draftrelay.handoff.procinfo import machine_info
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import write_json  # noqa: E402


def pct(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 4), "p10_ms": round(float(np.percentile(a, 10)), 4),
            "p90_ms": round(float(np.percentile(a, 90)), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="1,4", help="batch sizes (requests per STEP), comma list")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--n-out", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "step_host.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_host.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda:0")
    cfg = M.ModelConfig(**SHAPES["qwen2.5-0.5b"], name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=0, device=dev, dtype=torch.bfloat16, draw_on="device")
    ctx, n_out = args.context, args.n_out
    d = LlamaDrafter(model, 5, ctx + 64, 8, "d", "", mode="graph")
    with torch.no_grad():
        d.cache.k[:, :, :, :ctx].normal_(0, 1)
        d.cache.v[:, :, :, :ctx].normal_(0, 1)
    out: dict = {"benchmark": "step_host", "machine": machine_info(), "context": ctx, "n_out": n_out,
                 "iters": args.iters, "weights": "random bf16, qwen2.5-0.5b shape", "rows": []}
    stream = torch.cuda.current_stream(dev)
    for B in (int(x) for x in args.requests.split(",")):
        def jobs(tok: int = 17, B=B) -> list[Job]:
            for r in range(B):
                d.cache.lens[r] = ctx  # the numpy view: a torch scalar write costs 2 us a row here
            return [Job(r, ctx, np.array([tok + r], np.int32)) for r in range(B)]

        d.run(jobs(), n_out)  # builds (captures) the static step
        key = (B, 1, n_out, kv_bucket(ctx + 1 + n_out, d.cache.max_len))
        g = d._static[key]

        # the previous path beside it: the same step captured without its copies, the two copies launched
        # apart around the replay (two more API calls a STEP, each waited behind on the stream)
        cap = GraphCapture(dev)
        with torch.inference_mode():
            cap.warm(lambda g=g: d._static_step(g))
            g2, _ = cap.capture(lambda g=g: d._static_step(g))

        def pack(tok: int, B=B, g=g) -> None:  # as LlamaDrafter._run_static packs (numpy row lengths)
            host = g.host.numpy()
            host[:] = 0
            for b, j in enumerate(jobs(tok)):
                d.cache.truncate(j.row, j.keep)
                host[b] = j.tokens[0]
                host[B + b] = j.keep
                host[2 * B + b] = j.row
                host[3 * B + b] = 0

        def pack_torch(tok: int, B=B, g=g) -> None:  # the same with torch scalar indexing of the lengths
            host = g.host.numpy()
            host[:] = 0
            lengths = d.cache.lengths
            for b, j in enumerate(jobs(tok)):
                if not 0 <= j.keep <= int(lengths[j.row]):
                    raise ValueError(j.row)
                lengths[j.row] = j.keep
                host[b] = j.tokens[0]
                host[B + b] = j.keep
                host[2 * B + b] = j.row
                host[3 * B + b] = 0

        # correctness of the copies-apart graph: fresh tokens each time, drafts equal to the worker's path
        same = 0
        for t in range(20):
            want, _ = d.run(jobs(100 + 37 * t), n_out)
            pack(100 + 37 * t)
            with torch.inference_mode():
                g.inbuf.copy_(g.host, non_blocking=True)
                g2.replay()
                g.host_out.copy_(g.out, non_blocking=True)
            stream.synchronize()
            got = g.host_out.numpy()[:, :n_out]
            same += int(np.array_equal(got, want))

        pieces = ("pack", "launch", "sync", "unpack")
        apart = ("pack", "h2d", "launch", "d2h", "sync", "unpack")
        times: dict[str, list[float]] = {k: [] for k in
                                         ("run", "replay_only", "copies_apart", "pack_torch",
                                          *(f"piece_{p}" for p in pieces), *(f"apart_{p}" for p in apart))}
        pc = time.perf_counter

        def unpack(g=g) -> None:
            res = g.host_out.numpy()
            res[:, :n_out].copy()
            res[:, n_out:2 * n_out].view(np.float32).copy()
        for it in range(args.iters + 10):
            keep = it >= 10
            torch.cuda.synchronize(dev)
            t0 = pc()
            d.run(jobs(17 + it % 5), n_out)
            t1 = pc()
            if keep:
                times["run"].append(t1 - t0)
            torch.cuda.synchronize(dev)
            t0 = pc()
            g.graph.replay()
            stream.synchronize()
            t1 = pc()
            if keep:
                times["replay_only"].append(t1 - t0)
            torch.cuda.synchronize(dev)
            t0 = pc()
            pack_torch(17 + it % 5)
            t1 = pc()
            if keep:
                times["pack_torch"].append(t1 - t0)
            torch.cuda.synchronize(dev)
            # the worker's path, each host call timed on its own
            ts = [pc()]
            with torch.inference_mode():
                pack(17 + it % 5)
                ts.append(pc())
                g.graph.replay()
                ts.append(pc())
                stream.synchronize()
                ts.append(pc())
                unpack()
                ts.append(pc())
            if keep:
                for p, a, b in zip(pieces, ts[:-1], ts[1:], strict=True):
                    times[f"piece_{p}"].append(b - a)
            torch.cuda.synchronize(dev)
            # the copies-apart path, each host call timed on its own
            ts = [pc()]
            with torch.inference_mode():
                pack(17 + it % 5)
                ts.append(pc())
                g.inbuf.copy_(g.host, non_blocking=True)
                ts.append(pc())
                g2.replay()
                ts.append(pc())
                g.host_out.copy_(g.out, non_blocking=True)
                ts.append(pc())
                stream.synchronize()
                ts.append(pc())
                unpack()
                ts.append(pc())
            if keep:
                for p, a, b in zip(apart, ts[:-1], ts[1:], strict=True):
                    times[f"apart_{p}"].append(b - a)
                times["copies_apart"].append(ts[-1] - ts[0])
        row = {"requests": B, "same_drafts_copies_apart": f"{same} of 20",
               **{k: pct(v) for k, v in times.items()}}
        out["rows"].append(row)
        print(f"B={B}: " + "  ".join(f"{k} {row[k]['p50_ms']:.3f}" for k in times)
              + f"  (copies apart: same drafts {same} of 20)", flush=True)
        del g2, cap
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
