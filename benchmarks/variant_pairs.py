"""Two variants of fast_forward.py compared across its result files: each file's process timed every variant
side by side, so the difference of the two p50s in one row is a paired measurement; this collects those
differences over many processes, by card, forward (the drafter STEP, the target's decode or verify), context and
width (requests, tokens), and prints their median, spread and how many favour each variant. No GPU: it reads JSON.

    python benchmarks/variant_pairs.py --a graphs_fast --b graphs_fast_noprefetch \\
        [--files 'benchmarks/results/fast_forward*.json'] [--out benchmarks/results/variant_pairs.json]

A difference is a - b in ms: positive where b was faster.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# fast_forward.py's sections -> (a row's width field, the forward's name): each row (one context and width)
# times its variants under "step"; a drafter row's width is its requests (the STEP of n_out 4), a target
# row's its tokens (1: decode, 5: the verify)
SECTIONS = {"drafter_0p5b": ("requests", "drafter STEP"), "target_7b": ("tokens", "target forward")}


def card_of(result: dict) -> str:
    """The result's GPU name ("?" where the file does not say)."""
    gpus = (result.get("machine") or {}).get("gpus") or ["?"]
    return str(gpus[0])


def pair_rows(result: dict, a: str, b: str) -> list[dict]:
    """Each row of one fast_forward.py result timing both variants: card, forward, context, width (requests
    of a drafter STEP, tokens of a target forward) and a - b of their p50s (ms)."""
    out = []
    for section, (width, forward) in SECTIONS.items():
        for row in (result.get(section) or {}).get("rows", []):
            times = row.get("step")
            if not isinstance(times, dict) or a not in times or b not in times:
                continue
            out.append({"card": card_of(result), "forward": forward, "context": row.get("context"),
                        "width": f"{width} {row.get(width, 1)}",
                        "diff_ms": times[a]["p50_ms"] - times[b]["p50_ms"]})
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """The paired differences grouped by (card, forward, context, width): count, median, min, max and how
    many favour b (a - b > 0) and a (a - b < 0)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["card"], r["forward"], r["context"], r["width"]), []).append(r["diff_ms"])
    return [{"card": k[0], "forward": k[1], "context": k[2], "width": k[3], "n": len(v),
             "median_ms": round(statistics.median(v), 4), "min_ms": round(min(v), 4), "max_ms": round(max(v), 4),
             "b_faster": sum(d > 0 for d in v), "a_faster": sum(d < 0 for d in v)}
            for k, v in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0]))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="a variant's key in fast_forward.py's rows, e.g. graphs_fast")
    ap.add_argument("--b", required=True, help="the other variant, e.g. graphs_fast_noprefetch")
    ap.add_argument("--files", default=os.path.join(RESULTS, "fast_forward*.json"), help="a glob of result files")
    ap.add_argument("--out", default="", help="write the summary here as JSON")
    args = ap.parse_args(argv)
    files = sorted(glob.glob(args.files))
    if not files:
        ap.error(f"--files {args.files!r} matches no file")
    rows: list[dict] = []
    used: list[str] = []
    for path in files:
        with open(path) as f:
            got = pair_rows(json.load(f), args.a, args.b)
        if got:
            used.append(os.path.basename(path))
            rows += got
    if not rows:
        ap.error(f"no file of {len(files)} times both {args.a!r} and {args.b!r}")
    summary = summarize(rows)
    print(f"{args.a} - {args.b}, p50 ms, paired within each process; {len(used)} files")
    for s in summary:
        print(f"{s['card']:<22} {s['forward']:<14} ctx {s['context']:>6} {s['width']:<10}: n {s['n']:>3} "
              f"median {s['median_ms']:+.3f} ({s['min_ms']:+.3f} .. {s['max_ms']:+.3f}); "
              f"{args.b} faster in {s['b_faster']}, {args.a} in {s['a_faster']}")
    if args.out:
        write_json(args.out, {"benchmark": "variant_pairs", "argv": sys.argv[1:] if argv is None else argv,
                              "a": args.a, "b": args.b, "files": used, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
