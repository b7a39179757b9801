"""How often the drafter's head read as int8 (`draftrelay worker --head-int8`, int8_head.py) changes its greedy
draft, on the real reference drafter (Qwen2.5-Coder 0.5B Instruct, GGUF) over the recorded trace's contexts.

For each trace entry the drafter runs once over its prompt and the target's recorded continuation (the
contexts a drafter meets in that run); at every position of the continuation its next-token pick is taken
from the head as the GPU drafter reads it in bf16 (the head rounded to bf16) and from the int8 copy of that
bf16 head (quantize_rows: one fp32 scale per row; the product as reference.int8_linear computes it, here
through the dequantized rows, the same sums up to fp32 rounding). Reports, per entry and over all: the
positions where the two picks differ, how many of the picks equal the target's next token (the first
draft's acceptance, each way), and the largest change of the pick's softmax probability (the confidence).
The rest of the drafter runs in fp32 on this CPU; the GPU drafter's bf16 layers move its hidden states by
more than this, so the figure isolates the head's rounding.

    python benchmarks/int8_head_agreement.py --drafter /work/refpair/qwen2.5-coder-0.5b-instruct.gguf

`--layers` (`draftrelay worker --quant int8` on a GPU, int8_layers.py): the layers' four products a layer
read as int8 too. The baseline is then the drafter with every layer weight rounded to bf16 (as the GPU holds
them) and the bf16 head; against it, the int8 copies of those bf16 layers (dequantized: the sums of
reference.int8_linear up to fp32 rounding) with the bf16 head, and with the int8 head as well (everything a
`--quant int8 --head-int8` drafter reads as int8). Each way's picks also give, through the engine's greedy
schedule (replay.count_accepted, `--k` drafts a step), the drafts a verify step keeps on the trace: a REPLAYED
acceptance (the picks along the target's recorded continuation are the drafts each step would offer). Written
to `int8_layers_agreement.json` by default.

(`python3 scripts/fetch_reference_pair.py --dest /work/refpair` fetches the GGUF files.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.checkpoint import gguf  # noqa: E402
from draftrelay.int8_head import quantize_rows  # noqa: E402
from draftrelay.int8_layers import dequantized, linears  # noqa: E402
from draftrelay.replay import TraceEntry, count_accepted  # noqa: E402
from machine import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def picks(model, ids: list[int], head: torch.Tensor, n_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, its softmax probability) of `head` over the final-norm hidden states at the positions that
    predict the continuation's tokens (n_prompt - 1 .. len(ids) - 2)."""
    model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    model.lm_head.weight.data = head
    cache = model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.tensor([0]), cache, torch.tensor([0]))[0].float()
    lg = logits[n_prompt - 1:len(ids) - 1]
    return lg.argmax(-1), torch.softmax(lg, -1).max(-1).values


def bf16_layers(model):
    """A copy of model whose layers' four products hold their bf16 rounding (as the GPU holds them)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for blk in out.layers:
            for lin in linears(blk):
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    return out


def verify_steps(prompt: list[int], cont: list[int], pick: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """REPLAYED acceptance: the engine's greedy schedule over the trace entry with the drafter's picks as its
    drafts (replay.count_accepted: [(offered, kept)] per verify step). Along an accepted prefix the drafter's
    contexts are the target's, so the picks taken with the target's continuation in context are the drafts
    each step would offer."""
    return count_accepted(TraceEntry(prompt, cont, [[int(t)] for t in pick]), k)


def layers_main(args, model, bf16: torch.Tensor, int8: torch.Tensor, trace: dict, t0: float) -> int:
    """--layers: picks of the bf16-rounded drafter against its int8 layers (bf16 head) and int8 everything."""
    base = bf16_layers(model)

    def count(steps: list[tuple[int, int]], way: str) -> dict:
        return {f"steps_k{args.k}_{way}": len(steps), f"kept_k{args.k}_{way}": sum(kept for _, kept in steps)}

    q_layers = dequantized(base)  # int8_layers' copies of the bf16 weights (quantize_rows reads them in fp32)
    ways = {"int8_layers": (q_layers, bf16), "int8_all": (q_layers, int8)}
    rows = []
    total = {"positions": 0, "target_bf16": 0, **{f"{k}_{m}": 0 for k in ways for m in ("differ", "target")},
             **{f"{m}_k{args.k}_{k}": 0 for k in ("bf16", *ways) for m in ("steps", "kept")}}
    for e in trace["entries"]:
        prompt, cont = list(e["prompt"]), list(e["target"])
        ids, want = prompt + cont, torch.tensor(cont)
        tb, _ = picks(base, ids, bf16, len(prompt))
        row = {"name": e["name"], "positions": len(cont), "target_bf16": int((tb == want).sum()),
               **count(verify_steps(prompt, cont, tb, args.k), "bf16")}
        for k, (m, head) in ways.items():
            t, _ = picks(m, ids, head, len(prompt))
            row[f"{k}_differ"], row[f"{k}_target"] = int((t != tb).sum()), int((t == want).sum())
            row.update(count(verify_steps(prompt, cont, t, args.k), k))
        rows.append(row)
        for k in total:
            total[k] += row[k]
        print(f"{row['name']:24s} positions {row['positions']:4d}  first draft = target: bf16 "
              f"{row['target_bf16']:4d}  " + "  ".join(f"{k}: differ {row[k + '_differ']:3d}, = target "
                                                       f"{row[k + '_target']:4d}" for k in ways), flush=True)
    n = total["positions"]
    per_step = {k: round(total[f"kept_k{args.k}_{k}"] / total[f"steps_k{args.k}_{k}"], 3) for k in ("bf16", *ways)}
    print(f"all: {n} positions; first draft = target: bf16 {total['target_bf16']}; "
          + "; ".join(f"{k}: {total[k + '_differ']} picks differ ({100 * total[k + '_differ'] / n:.2f} %), "
                      f"= target {total[k + '_target']}" for k in ways))
    print(f"REPLAYED acceptance, k = {args.k}: drafts kept per verify step "
          + ", ".join(f"{k} {v:.3f}" for k, v in per_step.items()))
    total[f"kept_per_step_k{args.k}"] = per_step
    nb = sum(lin.weight.numel() for blk in model.layers for lin in linears(blk))
    write_json(args.out, {"benchmark": "int8_layers_agreement", "drafter": os.path.basename(args.drafter),
                          "trace": os.path.basename(args.trace), "layer_bytes": {"bf16": 2 * nb, "int8": nb},
                          "rows": rows, "all": total, "wall_s": round(time.perf_counter() - t0, 1)})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="/work/refpair/qwen2.5-coder-0.5b-instruct.gguf",
                    help="the reference drafter's GGUF file (scripts/fetch_reference_pair.py)")
    ap.add_argument("--trace", default=os.path.join(HERE, "data", "trace_qwen2.5-coder-0.5b-1.5b.json"))
    ap.add_argument("--layers", action="store_true",
                    help="the layers' products as int8 too (worker --quant int8 on a GPU), against bf16 layers")
    ap.add_argument("--k", type=int, default=4, help="with --layers: drafts a verify step offers, for the REPLAYED "
                                                     "acceptance's drafts kept per step (default 4)")
    ap.add_argument("--out", default=None, help="the JSON written (default: benchmarks/results/"
                                                "int8_head_agreement.json, with --layers int8_layers_agreement.json)")
    args = ap.parse_args()
    if args.k < 1:
        ap.error(f"--k {args.k}: at least 1 draft a round")
    args.out = args.out or os.path.join(HERE, "results", "int8_layers_agreement.json" if args.layers
                                        else "int8_head_agreement.json")
    if not os.path.exists(args.drafter):
        ap.error(f"--drafter {args.drafter}: no such file (python3 scripts/fetch_reference_pair.py --dest DIR)")
    t0 = time.perf_counter()
    model = gguf.load_gguf(args.drafter, dtype=torch.float32)
    model.fast = False
    tied = model.head_weight().detach()
    bf16 = tied.to(torch.bfloat16).float()  # the head as the GPU drafter holds it
    q, s = quantize_rows(tied.to(torch.bfloat16))
    int8 = q.float() * s[:, None]
    with open(args.trace) as f:
        trace = json.load(f)
    if args.layers:
        return layers_main(args, model, bf16, int8, trace, t0)
    rows, total = [], {"positions": 0, "differ": 0, "target_bf16": 0, "target_int8": 0, "max_conf_change": 0.0}
    for e in trace["entries"]:
        prompt, cont = list(e["prompt"]), list(e["target"])
        ids = prompt + cont
        tb, cb = picks(model, ids, bf16, len(prompt))
        ti, ci = picks(model, ids, int8, len(prompt))
        want = torch.tensor(cont)
        row = {"name": e["name"], "positions": len(cont), "differ": int((tb != ti).sum()),
               "target_bf16": int((tb == want).sum()), "target_int8": int((ti == want).sum()),
               "max_conf_change": round(float((cb - ci).abs().max()), 5)}
        rows.append(row)
        for k in ("positions", "differ", "target_bf16", "target_int8"):
            total[k] += row[k]
        total["max_conf_change"] = max(total["max_conf_change"], row["max_conf_change"])
        print(f"{row['name']:24s} positions {row['positions']:4d}  picks differ {row['differ']:3d}  "
              f"first draft = target: bf16 {row['target_bf16']:4d}  int8 {row['target_int8']:4d}  "
              f"max |conf change| {row['max_conf_change']:.4f}", flush=True)
    print(f"all: {total['differ']} of {total['positions']} picks differ "
          f"({100 * total['differ'] / total['positions']:.2f} %); first draft = target: bf16 {total['target_bf16']}, "
          f"int8 {total['target_int8']}; max |conf change| {total['max_conf_change']:.4f}")
    write_json(args.out, {"benchmark": "int8_head_agreement", "drafter": os.path.basename(args.drafter),
                          "trace": os.path.basename(args.trace), "head_bytes": {"bf16": tied.numel() * 2,
                                                                                 "int8": q.numel() + 4 * s.numel()},
                          "rows": rows, "all": total, "wall_s": round(time.perf_counter() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
