"""One decode step of the reference target on this CPU, interleaved step by step in one process so the
machine's load hits every variant alike: draftrelay's forward on one thread and on all of them,
transformers' forward (torch's default thread count) on the same tensors, and verifies of 5 and 7
positions on one thread and of 3, 4 and 7 on all of them, with the weight products in row blocks
(model.linear) and as one GEMM.

    python benchmarks/cpu_step.py                  # 24 steps x 2 rounds (about 4 minutes on 2 cores)
    python benchmarks/cpu_step.py --steps 8 --rounds 1

Prints p50 and min per variant with the load average; JSON: benchmarks/results/cpu_step.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import real_pair as RP  # noqa: E402  (the pair's files and loaders)
from draftrelay import cpu_linear  # noqa: E402
from interleave import interleaved  # noqa: E402
from machine import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_step.json"))
    args = ap.parse_args(argv)
    from transformers import DynamicCache

    model, tok = RP.load_pair_target(torch.float32)
    hf = RP.hf_model(model)
    ids = tok.encode(RP.PROMPTS["code0"][1])
    n_all = torch.get_num_threads()

    class Ours:
        def __init__(self, threads: int, width: int = 1, blocks: bool = True) -> None:
            self.threads, self.width, self.blocks = threads, width, blocks
            self.cache = model.new_cache(1, len(ids) + args.steps + 16)
            with torch.inference_mode():
                lg = model(torch.tensor([ids]), torch.tensor([0]), self.cache, torch.tensor([0]), last_only=True)
            self.nxt, self.pos, self.out = int(lg[0, -1].argmax()), len(ids), []

        def step(self) -> None:
            torch.set_num_threads(self.threads)
            saved = cpu_linear.CPU_BLOCK_MIN, cpu_linear.CPU_BLOCK_MIN_THREADED
            if not self.blocks:
                cpu_linear.CPU_BLOCK_MIN = cpu_linear.CPU_BLOCK_MIN_THREADED = 1 << 62
            try:
                toks = torch.tensor([[self.nxt] * self.width])
                with torch.inference_mode():
                    lg = model(toks, torch.tensor([self.pos]), self.cache, torch.tensor([0]))
            finally:
                cpu_linear.CPU_BLOCK_MIN, cpu_linear.CPU_BLOCK_MIN_THREADED = saved
            self.nxt = int(lg[0, 0].argmax())
            self.out.append(self.nxt)
            self.pos += 1
            self.cache.truncate(0, self.pos)  # keep the first position only: every step extends by one

    class HF:
        def __init__(self) -> None:
            self.cache = DynamicCache()
            torch.set_num_threads(n_all)
            with torch.inference_mode():
                o = hf(torch.tensor([ids]), cache=self.cache, use_cache=True)
            self.nxt, self.i, self.out = int(o.logits[0, -1].argmax()), 0, []

        def step(self) -> None:
            torch.set_num_threads(n_all)
            with torch.inference_mode():
                o = hf(torch.tensor([[self.nxt]]), cache=self.cache, use_cache=True, logits_to_keep=1,
                       position_ids=torch.tensor([[len(ids) + self.i]]))
            self.nxt = int(o.logits[0, -1].argmax())
            self.out.append(self.nxt)
            self.i += 1

    rows = []
    for rnd in range(args.rounds):
        v = {"ours, 1 thread": Ours(1), f"ours, {n_all} threads": Ours(n_all), "transformers": HF(),
             "verify 5, 1 thread, blocks": Ours(1, 5), "verify 5, 1 thread, one GEMM": Ours(1, 5, False),
             "verify 7, 1 thread, blocks": Ours(1, 7), "verify 7, 1 thread, one GEMM": Ours(1, 7, False),
             f"verify 3, {n_all} threads": Ours(n_all, 3),
             f"verify 4, {n_all} threads, blocks": Ours(n_all, 4),
             f"verify 4, {n_all} threads, one GEMM": Ours(n_all, 4, False),
             f"verify 7, {n_all} threads, blocks": Ours(n_all, 7),
             f"verify 7, {n_all} threads, one GEMM": Ours(n_all, 7, False)}
        loads: list[float] = []
        times = interleaved(v, args.steps, loads)
        same = v["ours, 1 thread"].out == v["transformers"].out == v[f"ours, {n_all} threads"].out
        row = {"round": rnd, "load_min": min(loads), "load_max": max(loads), "greedy_equal": same,
               "p50_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
               "min_ms": {k: 1e3 * min(t) for k, t in times.items()}}
        rows.append(row)
        print(f"round {rnd}: load {row['load_min']:.1f}-{row['load_max']:.1f}, greedy equal: {same}")
        for k in v:
            print(f"  {k:32s} p50 {row['p50_ms'][k]:7.0f} ms   min {row['min_ms'][k]:7.0f} ms")
    torch.set_num_threads(n_all)
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "cpus": n_all, "steps": args.steps, "rounds": rows}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
