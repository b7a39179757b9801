"""Record acceptance traces of a real pair (draftrelay.replay's format), for replayed benchmarks.

For each prompt: the target's greedy continuation (the engine in `off` mode: the target's own tokens)
and, at every position of it, the drafter's top-F tokens and probabilities given the true prefix (one
teacher-forced drafter forward over prompt + continuation). With these, the acceptance of any k and the
hits of any branch guess can be reconstructed (replay.count_accepted).

    python benchmarks/record_traces.py --model /work/refpair/target.gguf --drafter /work/refpair/drafter.gguf \\
        --out benchmarks/data/trace_qwen2.5-coder_0.5b-1.5b.json --max-tokens 128

A drafter with a draft vocabulary (`--draft-vocab N`, draft_vocab.py) records its own top-F over the kept
ids: the exact trace of that drafter, where replay.Trace.restricted only bounds it from the whole head's
top-F. `--targets-from TRACE` takes the prompts and the target's continuations from a trace recorded with
the same target (greedy: the same tokens) instead of decoding them again; only the drafter runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.engine.loading import load_target
from draftrelay.replay import Trace, TraceEntry, count_accepted

# (name, kind, text): code prompts and prose prompts, plain completion (no chat template)
PROMPTS = [
    ("quicksort", "code", "def quicksort(arr):\n    \"\"\"Sort a list with the quicksort algorithm.\"\"\"\n"),
    ("lru_cache", "code", "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n"
                          "    def __init__(self, capacity: int):\n"),
    ("parse_csv", "code", "import csv\n\n\ndef read_rows(path):\n"
                          "    \"\"\"Yield each row of a CSV file as a dict.\"\"\"\n"),
    ("binary_search", "code", "// Binary search in a sorted array. Returns the index or -1.\n"
                              "int binary_search(const int *a, int n, int x) {\n"),
    ("flask_app", "code", "from flask import Flask, jsonify, request\n\napp = Flask(__name__)\n\n\n"
                          "@app.route('/items', methods=['GET'])\n"),
    ("prose_printing", "prose", "The invention of the printing press changed Europe in several ways. First,"),
    ("prose_rivers", "prose", "Rivers shape the land around them. Over thousands of years, a river"),
    ("prose_email", "prose", "Dear team,\n\nThank you all for your hard work this quarter. I wanted to"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="target: a GGUF file or HF directory (not needed with --targets-from: "
                    "the target is not run, and the drafter's tokenizer encodes the prompts)")
    ap.add_argument("--drafter", required=True, help="drafter: a GGUF file or HF directory (same tokenizer)")
    ap.add_argument("--out", required=True, help="trace JSON to write")
    ap.add_argument("--max-tokens", type=int, default=128, help="target tokens per prompt (default 128)")
    ap.add_argument("--top-f", type=int, default=8, help="drafter tokens kept per position (default 8)")
    ap.add_argument("--pair", default="", help="the pair's name in the trace (default: from the files)")
    ap.add_argument("--only", default="", help="comma-separated prompt names (default: all)")
    ap.add_argument("--draft-vocab", default="", metavar="N|FILE.npy[:N]",
                    help="the drafter's head restricted to a draft vocabulary (draft_vocab.py): its top-F over "
                         "those ids")
    ap.add_argument("--targets-from", default="", metavar="TRACE",
                    help="prompts and target continuations from this trace (recorded with the same target); "
                         "the target is not run")
    args = ap.parse_args(argv)
    if not args.model and not args.targets_from:
        ap.error("--model (the target) is needed unless --targets-from gives its continuations")
    if args.max_tokens < 2:
        ap.error(f"--max-tokens {args.max_tokens}: at least 2")
    if args.top_f < 1:
        ap.error(f"--top-f {args.top_f}: at least 1")
    torch.set_num_threads(os.cpu_count() or 1)
    dev = torch.device("cpu")
    t0 = time.perf_counter()
    known = Trace.load(args.targets_from) if args.targets_from else None
    drafter = load_target(args.drafter, dev)
    target = load_target(args.model, dev) if args.model else drafter  # only its tokenizer and vocabulary then
    print(f"loaded {target.name} and {drafter.name} in {time.perf_counter() - t0:.1f} s" if args.model else
          f"loaded {drafter.name} in {time.perf_counter() - t0:.1f} s (targets from {args.targets_from})", flush=True)
    if target.model.cfg.vocab_size != drafter.model.cfg.vocab_size:
        print(f"vocabularies differ: target {target.model.cfg.vocab_size}, drafter {drafter.model.cfg.vocab_size}",
              file=sys.stderr)
        return 2
    if args.draft_vocab:
        from draftrelay.draft_vocab import DraftVocab, DraftVocabError

        try:
            drafter.model.draft_vocab = DraftVocab.parse(args.draft_vocab, drafter.model.cfg.vocab_size)
        except DraftVocabError as exc:
            ap.error(f"--draft-vocab: {exc}")
    prompts = [p for p in PROMPTS if not args.only or p[0] in args.only.split(",")]
    given = {e.name: e for e in known.entries} if known else {}
    entries = []
    for name, kind, text in prompts:
        ids = target.tokenizer.encode(text)
        t1 = time.perf_counter()
        if known:
            e0 = given.get(f"{kind}:{name}")
            if e0 is None or e0.prompt != ids:
                print(f"--targets-from {args.targets_from}: no entry {kind}:{name} with this prompt", file=sys.stderr)
                return 2
            out = e0.target
        else:
            cfg = EngineConfig(mode="off", max_batch=1, max_len=len(ids) + args.max_tokens + 8)
            with Engine(target.model, cfg) as eng:
                (req,) = eng.generate([ids], SamplingParams(max_tokens=args.max_tokens,
                                                            stop_token_ids=target.stop_ids))
            out = req.output
        seq = torch.tensor([ids + out])
        with torch.inference_mode():
            cache = drafter.model.new_cache(1, seq.shape[1] + 1)
            logits = drafter.model(seq, torch.tensor([0]), cache, torch.tensor([0]))[0]  # [N, V]
            probs = torch.softmax(logits[len(ids) - 1:len(ids) - 1 + len(out)].float(), -1)
            p, top = probs.topk(args.top_f, -1)
        e = TraceEntry(prompt=ids, target=out, draft_top=top.tolist(),
                       draft_prob=[[round(float(x), 5) for x in row] for row in p], name=f"{kind}:{name}")
        entries.append(e)
        sched = count_accepted(e, 4)
        per_round = sum(k for _, k in sched) / max(1, sum(1 for o, _ in sched if o))
        print(f"{name:16s} {len(ids):4d} prompt + {len(out):4d} tokens in {time.perf_counter() - t1:6.1f} s; "
              f"k=4 accepted {per_round:.2f}/round: {target.tokenizer.decode(out)[:60]!r}", flush=True)
    pair = args.pair or (f"{drafter.name} -> {target.name}, greedy" if args.model else known.pair)
    if drafter.model.draft_vocab is not None:
        pair += f", the drafter's head restricted to {len(drafter.model.draft_vocab)} ids"
    tr = Trace(pair=pair, top_f=args.top_f, entries=entries, vocab_size=target.model.cfg.vocab_size,
               meta={"model": os.path.basename(args.model) if args.model else known.meta.get("model", ""),
                     "drafter": os.path.basename(args.drafter), "dtype": str(drafter.model.dtype),
                     "max_tokens": args.max_tokens,
                     **({"draft_vocab": args.draft_vocab} if args.draft_vocab else {}),
                     **({"targets_from": os.path.basename(args.targets_from)} if known else {})})
    tr.validate(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tr.save(args.out)
    print(f"wrote {args.out} ({len(entries)} entries, {os.path.getsize(args.out) / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
