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

Where the branches come from: `--top-m M` (one or several, comma-separated) takes the drafter's top M
candidates at each stopping place (the worker's TOP_M, 8; at most what the trace recorded, its top_f), and
`--max-fanout N` lets a request have up to N branches (the worker's MAX_FANOUT, 16). It also counts, at each
place a greedy verify of k drafts stops (teacher-forced on the trace), how often the target's token is within
the drafter's top 1, 2, 4, ... candidates there: no branch drawn from the top M can hit where it is not.

    python benchmarks/hit_curve.py --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b_top32.json --batch 4 \
        --fanout 8,16,32,48,64 --top-m 8,16,32 --max-fanout 64
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.replay import Trace, count_accepted  # noqa: E402
from draftrelay.speculation import table as TB  # noqa: E402
from draftrelay.worker import prefetch  # noqa: E402
from draftrelay.worker.prefetch import SHARE_MODES  # noqa: E402
from machine import write_json  # noqa: E402
from replay_headline import hit_curve  # noqa: E402


def stop_ranks(trace: Trace, k: int, max_tokens: int) -> dict:
    """By kind of entry: at each place a greedy verify of k drafts stops (the rounds of `count_accepted`, the
    engine's schedule on the trace: a round from position n that keeps `kept` drafts stops at n + kept), the
    share of places where the target's token is within the drafter's top m recorded there, for m = 1, 2, 4,
    ... up to the trace's top_f; and the number of places."""
    marks = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= trace.top_f]
    by: dict[str, list[int]] = {}
    for e in trace.entries:
        ranks = by.setdefault(e.name.split(":")[0] or "all", [])
        n = 1  # the first target token comes from the prefill, before any round
        for offered, kept in count_accepted(e, k, max_tokens):
            if offered:  # a plain step (no drafts left to offer) has no stopping place
                top, t = e.draft_top[n + kept], e.target[n + kept]
                ranks.append(top.index(t) if t in top else trace.top_f)
            n += kept + 1
    return {kind: {"stops": len(r), "within_top": {m: sum(x < m for x in r) / max(1, len(r)) for m in marks}}
            for kind, r in sorted(by.items())}


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
    ap.add_argument("--top-m", default="",
                    help="comma-separated: the drafter's candidates per stopping place branches are drawn from, "
                         f"each a curve (default: the worker's, {prefetch.TOP_M}, or the trace's top_f if fewer; "
                         "at most the trace's top_f)")
    ap.add_argument("--max-fanout", type=int, default=prefetch.MAX_FANOUT,
                    help="branches one request may get at most (default: the worker's, %(default)s)")
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
    if not 1 <= args.max_fanout <= TB.MAX_BRANCHES:
        ap.error(f"--max-fanout must be within 1..{TB.MAX_BRANCHES}, got {args.max_fanout}")
    trace = Trace.load(args.trace)
    try:
        top_ms = [int(x) for x in args.top_m.split(",") if x] if args.top_m else [min(prefetch.TOP_M, trace.top_f)]
    except ValueError:
        top_ms = []
    if not top_ms or any(not 1 <= m <= trace.top_f for m in top_ms):
        ap.error(f"--top-m: comma-separated integers within 1..{trace.top_f} (the trace's top_f), not {args.top_m!r}")
    if len(top_ms) > 1 and len(shares) > 1:
        ap.error("--top-m and --share: only one of them may list several values")
    logging.getLogger("draftrelay.replay").setLevel(logging.ERROR)  # each core's REPLAY label: the trace is named below
    max_tokens = args.max_tokens or min(len(e.target) for e in trace.entries)
    t0 = time.perf_counter()
    runs = {}  # (share mode, top m) -> curve; one of the two lists has a single value
    before = os.environ.get("DRAFTRELAY_BRANCH_SHARE")
    saved = prefetch.TOP_M, prefetch.MAX_FANOUT
    try:
        prefetch.MAX_FANOUT = args.max_fanout  # each core's prefetcher reads both when it is made
        for mode in shares:
            os.environ["DRAFTRELAY_BRANCH_SHARE"] = mode
            for m in top_ms:
                prefetch.TOP_M = m
                runs[mode, m] = hit_curve(trace, args.k, fans, max_tokens, args.batch)
    finally:
        prefetch.TOP_M, prefetch.MAX_FANOUT = saved
        if before is None:
            os.environ.pop("DRAFTRELAY_BRANCH_SHARE", None)
        else:
            os.environ["DRAFTRELAY_BRANCH_SHARE"] = before
    curves = {mode: runs[mode, top_ms[0]] for mode in shares}
    by_top = {m: runs[shares[0], m] for m in top_ms}
    stops = stop_ranks(trace, args.k, max_tokens)
    out = {"benchmark": "hit_curve", "machine": machine_info(), "argv": sys.argv[1:], "pair": trace.pair,
           "entries": len(trace.entries), "k": args.k, "max_tokens": max_tokens, "batch": args.batch,
           "max_fanout": args.max_fanout, "top_m": top_ms, "by_fanout": runs[shares[0], top_ms[0]],
           "by_share": curves if len(top_ms) == 1 else {}, "by_top_m": by_top,
           "stop_ranks": stops,
           "wall_s": round(time.perf_counter() - t0, 2)}
    print(f"hit rate against F, k = {args.k}, {len(trace.entries)} entries x {max_tokens} tokens, "
          f"{args.batch} at a time ({trace.pair}), at most {args.max_fanout} branches a request:")
    rows = [(f"share {mode:<3} " if args.batch > 1 else "", curve) for mode, curve in curves.items()] \
        if len(top_ms) == 1 else [(f"top {m:<2} ", curve) for m, curve in by_top.items()]
    for label, curve in rows:
        for f, v in curve.items():
            kinds = ", ".join(f"{kk} {x:.1%}" for kk, x in v["by_kind"].items())
            every = f"; all {args.batch} rows hit in {v['all_hit_rate']:.1%} of {v['steps']} steps" \
                if args.batch > 1 else ""
            print(f"  {label}F = {f:>2}: {v['hit_rate']:.1%} of {v['lookups']} lookups ({kinds}){every}")
    for kind, v in stops.items():
        print(f"  the target's token within the drafter's top m at {v['stops']} {kind} stopping places: "
              + ", ".join(f"top {m} {x:.1%}" for m, x in v["within_top"].items()))
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
