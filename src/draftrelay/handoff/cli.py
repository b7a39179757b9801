"""`draftrelay selftest`: start the hand-off (region, watchdog, stream backend, proxy process, start-up
self-test) and run a few deterministic rounds through it, checking every draft bit for bit.

    draftrelay selftest                       # emulated stream (CPU, no GPU needed)
    draftrelay selftest --backend cuda        # a real CUDA stream parks on the host flag
    draftrelay selftest --backend cuda --strict --rounds 1000 --json

Exit status: 0 async started and every round exact; 1 a wrong draft or a failed round;
2 async was refused (the reason is printed; the rounds then ran sync); 3 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from draftrelay.round import RoundRequest
from draftrelay.testing import deterministic_draft

from .rounds import AsyncRefused, HandoffConfig, open_rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("emulated", "cuda"), default="emulated",
                        help="engine-side stream: a CPU emulation, or a real CUDA stream (needs cuda-bindings)")
    parser.add_argument("--rounds", type=int, default=100, help="rounds to run after start-up (default 100)")
    parser.add_argument("--deadline-ms", type=float, default=200.0, help="watchdog deadline (default 200)")
    parser.add_argument("--strict", action="store_true", help="fail (exit 2) instead of falling back to sync")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--seed", type=int, default=0)


def _requests(rng: np.random.Generator, t: int, vocab: int, max_drafts: int) -> list[RoundRequest]:
    n = int(rng.integers(1, 4))
    return [RoundRequest(req_id=i, generation=1, position=int(t * 8 + i),
                         tokens=rng.integers(0, vocab, int(rng.integers(1, 9))).astype(np.int32),
                         n_out=int(rng.integers(1, max_drafts + 1))) for i in range(n)]


def run(args: argparse.Namespace) -> int:
    if args.rounds < 0 or args.rounds > 10_000_000:
        print(f"draftrelay selftest: --rounds {args.rounds} must be in [0, 10000000]", file=sys.stderr)
        return 3
    if not args.deadline_ms > 0:
        print(f"draftrelay selftest: --deadline-ms {args.deadline_ms} must be > 0", file=sys.stderr)
        return 3
    cfg = HandoffConfig(backend=args.backend, strict=args.strict, deadline_ms=args.deadline_ms, max_drafts=8)
    t_start = time.perf_counter()
    try:
        rounds = open_rounds(cfg)
    except AsyncRefused as exc:
        out = {"backend": args.backend, "mode": "refused", "refusal": str(exc)}
        print(json.dumps(out) if args.json else f"async refused (strict): {exc}")
        return 2
    start_s = time.perf_counter() - t_start
    rng = np.random.default_rng(args.seed)
    wrong = failed = 0
    first_bad = ""
    t0 = time.perf_counter()
    try:
        for _ in range(args.rounds):
            reqs = _requests(rng, rounds.stats()["rounds"] + 1, cfg.vocab_size, cfg.max_drafts)
            res = rounds.result(rounds.submit(reqs), timeout_s=10.0 + cfg.deadline_ms / 1000)
            if not res.ok:
                failed += 1
                first_bad = first_bad or f"round {res.round}: {res.status.name} {res.detail}"
                if res.counts.any():
                    wrong += 1
                continue
            for i, r in enumerate(reqs):
                want, _ = deterministic_draft(r, cfg.vocab_size)
                if res.counts[i] != r.n_out or not np.array_equal(res.drafts[i, :res.counts[i]], want):
                    wrong += 1
                    first_bad = first_bad or f"round {res.round}: request {i} drafts differ"
        elapsed = time.perf_counter() - t0
        stats = rounds.stats()
    finally:
        rounds.close()
    out = {"backend": args.backend, "mode": rounds.mode, "refusal": rounds.refusal, "rounds": args.rounds,
           "wrong": wrong, "failed": failed, "first_problem": first_bad, "start_s": round(start_s, 3),
           "rounds_per_s": round(args.rounds / elapsed, 1) if elapsed > 0 and args.rounds else None,
           "stats": stats}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"backend {args.backend}: mode {rounds.mode}, started in {start_s:.2f} s")
        if rounds.refusal:
            print(f"  async refused: {rounds.refusal}")
        print(f"  {args.rounds} rounds: {args.rounds - failed} exact, {failed} failed, {wrong} wrong"
              + (f" ({out['rounds_per_s']} rounds/s)" if out["rounds_per_s"] else ""))
        if first_bad:
            print(f"  first problem: {first_bad}")
    if wrong or failed:
        return 1
    return 2 if rounds.mode != "async" else 0
