"""The speculation cache's hit rate against the fan-out F, counted on a recorded trace alone (a CPU, no
models, seconds): each entry's rounds driven as the engine drives them at batch 1 through a worker core
with the cost-free replay drafter, every branch table checked against the next round's tokens with the
engine's own selection (`replay_headline.hit_curve`). It depends only on the trace, k and the worker's
branch choice (`speculation.table.choose_branches` with the session's `Acceptance`), so it is the
measure of a change to the branch choice. `--batch 4` drives the entries four at a time, as the engine's
batches of four requests: there a step goes without waiting for its round only when every row hits, so it
also prints how often all rows hit, with the batch's branches shared between its requests and without
(`--share on,off`: DRAFTRELAY_BRANCH_SHARE, worker/prefetch.py).

    python benchmarks/hit_curve.py --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json
    python benchmarks/hit_curve.py --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --batch 4 --share on,off
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.replay import Trace  # noqa: E402
from draftrelay.speculation import table as TB  # noqa: E402
from draftrelay.worker.prefetch import SHARE_MODES  # noqa: E402
from machine import write_json  # noqa: E402
from replay_headline import hit_curve  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a draftrelay trace (benchmarks/record_traces.py)")
    ap.add_argument("--fanout", default="1,2,4,8,16", help="comma-separated F values (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4, help="drafts per round (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="requests driven together (default: %(default)s)")
    ap.add_argument("--share", default="on", help="comma-separated DRAFTRELAY_BRANCH_SHARE modes, each a curve "
                    "(default: %(default)s; one request gets its F either way)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per entry (default: the shortest target)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "hit_curve.json"), help="the JSON written (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        fans = [int(x) for x in args.fanout.split(",") if x]
    except ValueError:
        fans = []
    if not fans or any(not 1 <= f <= TB.MAX_BRANCHES for f in fans):
        ap.error(f"--fanout: comma-separated integers within 1..{TB.MAX_BRANCHES}, not {args.fanout!r}")
    if not 1 <= args.k <= TB.MAX_K:
        ap.error(f"--k must be within 1..{TB.MAX_K}, got {args.k}")
    if not 1 <= args.batch <= 64:
        ap.error(f"--batch must be within 1..64, got {args.batch}")
    shares = [x for x in args.share.split(",") if x]
    if not shares or any(x not in SHARE_MODES for x in shares):
        ap.error(f"--share: comma-separated modes of {', '.join(SHARE_MODES)}, not {args.share!r}")
    trace = Trace.load(args.trace)
    logging.getLogger("draftrelay.replay").setLevel(logging.ERROR)  # each core's REPLAY label: the trace is named below
    max_tokens = args.max_tokens or min(len(e.target) for e in trace.entries)
    t0 = time.perf_counter()
    curves = {}
    before = os.environ.get("DRAFTRELAY_BRANCH_SHARE")
    try:
        for mode in shares:  # each core's prefetcher reads the mode when it is made
            os.environ["DRAFTRELAY_BRANCH_SHARE"] = mode
            curves[mode] = hit_curve(trace, args.k, fans, max_tokens, args.batch)
    finally:
        if before is None:
            os.environ.pop("DRAFTRELAY_BRANCH_SHARE", None)
        else:
            os.environ["DRAFTRELAY_BRANCH_SHARE"] = before
    out = {"benchmark": "hit_curve", "machine": machine_info(), "argv": sys.argv[1:], "pair": trace.pair,
           "entries": len(trace.entries), "k": args.k, "max_tokens": max_tokens, "batch": args.batch,
           "by_fanout": curves[shares[0]], "by_share": curves, "wall_s": round(time.perf_counter() - t0, 2)}
    print(f"hit rate against F, k = {args.k}, {len(trace.entries)} entries x {max_tokens} tokens, "
          f"{args.batch} at a time ({trace.pair}):")
    for mode, curve in curves.items():
        for f, v in curve.items():
            kinds = ", ".join(f"{kk} {x:.1%}" for kk, x in v["by_kind"].items())
            every = f"; all {args.batch} rows hit in {v['all_hit_rate']:.1%} of {v['steps']} steps" \
                if args.batch > 1 else ""
            label = f"share {mode:<3} " if args.batch > 1 else ""
            print(f"  {label}F = {f:>2}: {v['hit_rate']:.1%} of {v['lookups']} lookups ({kinds}){every}")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
