"""Plan every skinny product of the given model shapes on this GPU and write the choices as a plan
seed (`kernels/plans/<device name>.json`, read by `kernels.plan.PlanSeed`): a later first start on
the same kind of card checks each seeded choice once instead of timing every candidate.

The products come from one decode and one verify forward of each shape on the meta device (shapes
only; `plan_count.Recorder`); each is planned at every row bucket by the process's own planner, so
the file holds exactly what a start-up would measure. Prints the cold planning cost (what a start
without seed or cache pays) and writes the file.

    python benchmarks/plan_seed.py --shapes qwen2.5-7b,qwen2.5-0.5b@32768+int8 \
        --out src/draftrelay/kernels/plans/NVIDIA_H200.json

A shape's `@N` also plans its head restricted to a draft vocabulary of ids 0..N-1 (`draftrelay worker
--draft-vocab N`, draft_vocab.py): a product of N rows that only such a drafter runs; `+int8` the drafter's
int8 keys (dtype int8): the head (each head: with `@N` the restricted one too) read as int8 by the greedy
forwards (`worker --head-int8`, int8_head.py) and the layers' four products read as int8 (`worker --quant
int8` on a GPU, int8_layers.py). So the one command makes the whole seed a card ships.

`--repick FILE` (no GPU): choose again from the times a seed or cache file recorded, under the present
choice rule (`plan.pick`: MARGIN, CHAIN_S), and rewrite the file's choices; prints each choice it changes.

`--from-benchmark FILE --out SEED` (no GPU): a seed from the plans a `fast_forward.py` run measured (its
"plans": the planner's own times of cuBLAS and every candidate, in that process, on that run's card), each
key chosen again under the present rule among the present candidates; a key with a present candidate that
run never timed is left out (a start measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay import kernels  # noqa: E402
from draftrelay.draft_vocab import DraftVocab, DraftVocabError  # noqa: E402
from draftrelay.kernels import plan as P  # noqa: E402
from draftrelay.worker.drafters import SHAPES  # noqa: E402
from plan_count import MLP_DOWN, MLP_GATE, Recorder, meta_model, z  # noqa: E402


class _MetaInt8Head:
    """int8_head.Int8Head's interface on the meta device: the copy's shapes without quantizing anything."""

    def of(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(w.shape, dtype=torch.int8, device="meta"),
                torch.empty(w.shape[0], dtype=torch.float32, device="meta"))


def _meta_int8_layers(m) -> list:
    """int8_layers.quantize_layers' copies of meta model m: their shapes, nothing quantized."""
    from draftrelay.int8_layers import LayerInt8

    meta = _MetaInt8Head()
    return [LayerInt8(*(meta.of(t) for t in (w.wqkv, w.wo, w.wgu, w.wd))) for w in m.layer_weights()]


def shapes_of(shape: str, dtype: torch.dtype, k: int, draft_vocab: int = 0, head_int8: bool = False) -> set[tuple]:
    """The distinct planned products (pro, N, K, dtype, bias, residual) of a decode and a k+1 verify; the
    down product of norm_mlp both ways it runs (reading the activations its gate|up stored, or act_linear's
    where the gate|up is cuBLAS or DRAFTRELAY_SILU_EPILOGUE=off); draft_vocab > 0: the same again with the
    head restricted to ids 0..draft_vocab-1; head_int8 (+int8): the drafter's greedy forwards again with the
    head (each head above) and the layers' products read as int8 (worker --head-int8 and --quant int8: keys
    of dtype plan.INT8; an int8 down only reads stored activations, no int8 tile takes the SiLU prologue)."""
    rec = Recorder()
    saved = kernels.backend
    kernels.backend = lambda device: rec.module
    try:
        m = meta_model(shape, 2).to(dtype)
        cache = m.new_cache(2, 512)
        for T in (1, k + 1):
            m(z(1, T), z(1), cache, z(1), kv_len=256)
        # a drafter's greedy forwards as (vocabulary, int8 head): the restricted head is only read by the
        # pick, the int8 one only by a greedy pick; the whole bf16 head's keys are the decode's and verify's
        runs = [(draft_vocab, None)] if draft_vocab else []
        if head_int8:
            runs += [(v, _MetaInt8Head()) for v in {0, draft_vocab}]
        for vocab, qhead in runs:
            m.draft_vocab = DraftVocab.top(vocab, m.cfg.vocab_size) if vocab else None
            m.int8_head = qhead
            m.int8_layers = _meta_int8_layers(m) if qhead is not None else None
            for T in (1, k + 1):
                m(z(1, T), z(1), cache, z(1), kv_len=256, logits_at=z(1), greedy=True)
    finally:
        kernels.backend = saved
    return {(p, N, K, dt, bias, delta) for pro, _, N, K, dt, bias, delta in rec.calls
            for p in {MLP_DOWN: (P.PRO_NONE, P.PRO_SILU), MLP_GATE: (P.PRO_NORM,)}.get(pro, (pro,))
            if not (dt == P.INT8 and p == P.PRO_SILU)}


def parse_shape(spec: str) -> tuple[str, torch.dtype, int, bool]:
    """--shapes' item NAME[@N][+int8][:DTYPE] as (name, dtype, draft vocabulary size or 0, int8 head); a
    clear error names a bad one."""
    head, _, dt = spec.partition(":")
    head, plus, opt = head.partition("+")
    if plus and opt != "int8":
        raise SystemExit(f"plan_seed.py --shapes: {'+' + opt!r} in {spec!r}: the one option is +int8 "
                         "(the int8 head and layers)")
    name, at, n = head.partition("@")
    if name not in SHAPES:
        raise SystemExit(f"plan_seed.py --shapes: unknown shape {name!r} in {spec!r} (known: {', '.join(SHAPES)})")
    dtype = getattr(torch, dt or "bfloat16", None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"plan_seed.py --shapes: {dt!r} in {spec!r} is not a torch dtype")
    vocab = 0
    if at:
        try:
            vocab = int(n)
            DraftVocab.top(vocab, SHAPES[name]["vocab_size"])
        except (ValueError, DraftVocabError) as e:
            raise SystemExit(f"plan_seed.py --shapes: draft vocabulary {n!r} in {spec!r}: {e}") from None
    return name, dtype, vocab, bool(plus)


def shapes_of_specs(specs: str, k: int) -> set[tuple]:
    """Every product a comma-separated --shapes list plans (parse_shape's items, shapes_of's products), each
    once: what one run of this script puts in a seed, at every row bucket with candidates."""
    todo: set[tuple] = set()
    for spec in filter(None, specs.split(",")):
        name, dtype, vocab, head_int8 = parse_shape(spec)
        todo |= shapes_of(name, dtype, k, draft_vocab=vocab, head_int8=head_int8)
    return todo


def write_seed(path: str, meta: dict, plans: dict) -> None:
    """A plan file (PlanCache's format) at path: meta names the card, plans its entries."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"format": P.PlanCache.FORMAT, "meta": meta, "plans": plans}, f, indent=0, sort_keys=True)


def repick(path: str) -> int:
    """Rewrite the choices of plan file `path` from its recorded times under the present rule."""
    with open(path) as f:
        data = json.load(f)
    changed = 0
    for key, entry in sorted(data["plans"].items()):
        choice = P.pick_recorded(entry.get("us"))
        if choice is None:
            continue  # no cuBLAS time recorded: nothing to compare against, the choice stands
        if choice != entry["choice"]:
            us = entry["us"]
            print(f"{key}: {entry['choice']} ({us.get(entry['choice'])} us) -> {choice} ({us.get(choice)} us)")
            entry["choice"] = choice
            changed += 1
    with open(path, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
    print(f"{changed} of {len(data['plans'])} choices changed; wrote {path}")
    return 0


def from_benchmark(path: str, out: str) -> int:
    """Write seed `out` from the "plans" of fast_forward.py's result file `path` (one card, bf16 weights)."""
    with open(path) as f:
        data = json.load(f)
    gpus = set(data.get("machine", {}).get("gpus") or [])
    if len(gpus) != 1:
        raise SystemExit(f"plan_seed.py --from-benchmark {path}: its machine names the cards {sorted(gpus)!r}, "
                         "not one card")
    if "bf16" not in str(data.get("weights", "")):  # its products' activations (int8 keys: int8 weights on them)
        raise SystemExit(f"plan_seed.py --from-benchmark {path}: weights {data.get('weights')!r}, not bf16")
    pros = {name: pro for pro, name in P.PRO_NAMES.items()}
    plans, left_out = {}, []
    for row in data.get("plans", []):
        pro, M, N, K = pros[row["product"]], row["M"], row["N"], row["K"]
        dtype = row.get("dtype", "bfloat16")  # a run before rows named theirs: bf16 (int8 keys came later)
        key = P.PlanCache.entry_key((pro, M, N, K, dtype, bool(row["bias"]), bool(row["residual"])))
        us = {**row["us"], **{label: None for label in row.get("failed", [])}}  # a plan file's form: None failed
        labels = ["cublas", *(c.label() for c in P.bucket_candidates(pro, M, N, K, dtype))]
        if any(label not in us for label in labels):
            left_out.append(key)
            continue
        kept = {label: us[label] for label in labels}
        plans[key] = {"choice": P.pick_recorded(kept), "us": kept}
    if not plans:
        raise SystemExit(f"plan_seed.py --from-benchmark {path}: no plan there timed every present candidate")
    write_seed(out, {"device": gpus.pop()}, plans)
    print(f"{len(plans)} keys from {path}; left out (a present candidate untimed there): "
          f"{', '.join(left_out) or 'none'}; wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repick", metavar="FILE", help="re-choose FILE's entries from its recorded times (no GPU)")
    ap.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-0.5b",
                    help="model shapes (draftrelay.worker.drafters.SHAPES), comma separated; NAME:float32 for fp32; "
                         "NAME@N also plans the head restricted to ids 0..N-1 (--draft-vocab N); NAME+int8 the "
                         "head and the layers' products read as int8 by a drafter's greedy forwards (worker "
                         "--head-int8, --quant int8), both with @N+int8")
    ap.add_argument("--k", type=int, default=4, help="drafts per round (the verify's width is k + 1)")
    ap.add_argument("--from-benchmark", metavar="FILE",
                    help="make the seed from the plans of a fast_forward.py result file (no GPU)")
    ap.add_argument("--out", help="the seed file to write")
    args = ap.parse_args()
    if args.repick:
        return repick(args.repick)
    if args.from_benchmark:
        if not args.out:
            ap.error("--from-benchmark FILE needs --out SEED")
        return from_benchmark(args.from_benchmark, args.out)
    if not args.out:
        ap.error("--out FILE is required (or --repick FILE)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: the seed is what this card measures")
    from draftrelay.kernels import triton_ops

    todo = shapes_of_specs(args.shapes, args.k)
    t0 = time.perf_counter()
    pl = triton_ops.PLANNER
    for i, (pro, N, K, dt, bias, delta) in enumerate(sorted(todo)):
        key, cands = P.plan_key(0, pro, 1, N, K, dt, bias, delta)
        pl.choose(key, cands)  # whole shape: every bucket
        print(f"[{i + 1}/{len(todo)}] {P.PRO_NAMES[pro]} {N}x{K} {dt}: {time.perf_counter() - t0:.1f} s", flush=True)
    meta = triton_ops._plan_cache(0).meta if triton_ops._plan_cache(0) is not None else {
        "device": torch.cuda.get_device_name(0)}
    plans = {}
    for key, choice in pl.table.items():
        rep = pl.report.get(key, {})
        if not rep:  # a bucket without candidates: cuBLAS at every start, nothing measured to ship
            continue
        plans[P.PlanCache.entry_key(key[1:])] = {
            "choice": "cublas" if choice is None else choice.label(),
            "us": {k: (round(v * 1e6, 3) if v != float("inf") else None) for k, v in rep.items()}}
    write_seed(args.out, meta, plans)
    st = pl.stats
    print(f"{len(todo)} shapes, {len(plans)} keys in {time.perf_counter() - t0:.1f} s ({st.line()}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
