"""The headline: tokens/s of speculative decoding against target-only, at REPLAYED acceptance of a real pair.

Target: a Qwen2.5-7B-shaped model at random weights whose logits are forced to a recorded trace
(draftrelay.replay: the real forward runs, so its cost is the shape's). Drafter: a Qwen2.5-0.5B-shaped
model at random weights in a real `draftrelay worker` process, proposing the trace's recorded drafter
tokens (its real forward runs too). Engine, proxy, worker and wire run unmodified between them, so the
acceptance is the recorded pair's and every cost is the shapes'.

Modes: off (target only), sync, async (CUDA rounds), async-stream (async with the stream staging,
announcing and parking every round and the proxy's short spin: HandoffConfig.host_staging and .park off,
the comparison for them), async-host (the host park: HandoffConfig.park = "host"), cache (the
speculation cache: async rounds on the host stream, "host selection", with F pre-drafted branches per
request; `--fanout 4,8` gives one cache mode per F, named cacheF). The cache runs with its guard
(engine/cache_guard.py: per batch class, F, F/2 or plain sequential rounds, whichever measures faster;
`--guard depth` also chooses the depth of cache steps, k or k - 1; `--guard off` runs every step as a cache
step; several, e.g. `--guard on,depth,off`, one cache mode each, named ...-depth, ...-raw).
The guard starts each workload afresh (what it learns carries over between the repeats of a workload) and
starts with plain rounds where the worker shares the engine's GPU (`same`); the choices it made in each
timed window (steps per choice: F, F@k for a shallower depth, 0 = plain rounds) and its switches are
reported beside the figures.
`--hit-curve F1,F2,..` first counts, on the CPU and without models, the hit rate of every F on the trace
itself (a worker core with the replay drafter, driven like the engine at batch 1): the curve of hit rate
against F.

Placements: `same` = the worker on the engine's GPU (the two processes time-slice it); `emulated` = a
worker that spends, as wall time and without touching the GPU, the drafter STEP times measured in this
run on this GPU (a drafter on an emulated second device). Figures from it say so.

For each workload (context, requests), every mode decodes the same prompts from one prefill (the
modes are interleaved and repeated, so drift hits them alike). Timed: the decode after the drafter
has caught up on the context (and a few warm-up steps) to the end of the trace.

    python benchmarks/replay_headline.py --trace benchmarks/data/trace_qwen2.5-coder.json      # H200 defaults
    python benchmarks/replay_headline.py --device cpu --target tiny --drafter tiny --trace T.json \\
        --workloads short:1 --repeats 1                                                      # CPU dry run
    python benchmarks/replay_headline.py --device cpu --target tiny --drafter tiny --trace synthetic \\
        --workloads short:1,short:4 --repeats 1 --placements emulated,same --modes off,sync,cache \\
        --out /tmp/replay_smoke.json                          # CPU smoke: a synthetic trace in the tiny vocabulary

`--trace synthetic` makes a trace in the target's vocabulary (random sequences; the drafter's top-1 is the
target's token 75 % of the time, its second choice otherwise): a smoke test of the whole path, not a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import types

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draftrelay import model as M  # noqa: E402
from draftrelay.capture import kv_bucket  # noqa: E402  (the bucket the drafter itself uses)
from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from draftrelay.engine.loading import handoff_config  # noqa: E402
from draftrelay.engine.spec_cache import DEFAULT_FANOUT, WAIT_RULES, SpecCache  # noqa: E402
from draftrelay.handoff.procinfo import machine_info  # noqa: E402
from draftrelay.handoff.rounds import SyncRounds, open_rounds  # noqa: E402
from draftrelay.replay import CostTable, ReplayDrafter, Trace, install_replay_target, with_fillers  # noqa: E402
from draftrelay.speculation import table as TB  # noqa: E402
from draftrelay.speculation.table import Acceptance  # noqa: E402
from draftrelay.wire import protocol as P  # noqa: E402
from draftrelay.worker.core import WorkerCore  # noqa: E402
from draftrelay.worker.drafters import Job, load_drafter  # noqa: E402
from draftrelay.worker.prefetch import BONUS, DEVICE_PIECES, Prefetcher, branches_payload  # noqa: E402
from draftrelay.worker.process import start_worker_process  # noqa: E402
from engine_workloads import TARGET_SHAPES, prefill_held, target_model, write_drafter_dir  # noqa: E402

CONTEXTS = {"short": 0, "32k": 32768}


def synthetic_trace(vocab: int, n: int = 4, length: int = 96, seed: int = 0) -> Trace:
    """The smoke path's trace (--trace synthetic): code and prose entries of random tokens within `vocab`;
    the drafter's top-1 is the target's token 75 % of the time (else its second choice)."""
    from draftrelay.replay import synthetic_trace as make

    tr = make(vocab, n, length, 0.75, seed=seed, second=True, prompt_len=(8, 4), pair="synthetic (smoke)")
    for i, e in enumerate(tr.entries):  # the replay's split by kind, and probabilities to rank branches by
        e.name = f"{'code' if i % 2 == 0 else 'prose'}:synthetic{i}"
        e.draft_prob = [[0.6, 0.3, 0.07, 0.03] for _ in e.target]
    return tr


def p50(xs) -> float:
    return statistics.median(xs) if xs else 0.0


# the cache's guard per cache mode: fan-out (the default), fan-out and depth (k or k - 1), none
GUARDS = ("on", "depth", "off")


def measure_costs(ddir: str, dev: str, contexts: list[int], jobs: list[int], k: int, max_ctx: int,
                  iters: int, fanouts: list[int], depths: list[int] | None = None, draft_vocab: str = "",
                  quant: str = "none", head_int8: bool = False) -> CostTable:
    """The real drafter's STEP seconds (median of `iters`) for every (jobs, n_steps <= k, context) the
    runs use, and the seconds of the device pieces of its speculation-cache branch work
    (worker.prefetch.Prefetcher, DEVICE_PIECES: the forward over the k + 1 stopping places, recorded
    apart too, and one batched run over jobs x F forked rows) for every F of `fanouts` and every depth
    of `depths` (default: k; the guard's cache steps may ask one shallower), in this process on this
    GPU: the emulated second device spends them as wall time and does the host pieces
    (choose_branches, the entries, the encoding) itself. draft_vocab: the drafter's head restricted so; quant /
    head_int8: its layer products / head read as int8 (worker --quant int8 / --head-int8)."""
    d = load_drafter(ddir, device=dev, n_rows=max(jobs) + 1, max_ctx=max_ctx, n_out_max=max(8, k),
                     draft_vocab=draft_vocab, quant=quant, head_int8=head_int8)
    if dev.startswith("cuda") and hasattr(d, "warm"):
        # the static steps a worker the engine starts has built before its first round (engine.loading: its
        # --warm-graphs k): a round asking fewer than k drafts then runs the k-step graph and returns the
        # first ones, as there. A cold drafter timed n = 1 first extended each 3-token job eagerly on every
        # call (its T bucket never built for one step: 15.8 ms for four requests on an H100 against 3.5 for k
        # = 4), and the emulated device charged that to every one-draft round.
        d.plan_warm()
        d.warm([k], max(jobs), max(contexts) + 16)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    rng = np.random.default_rng(0)
    out: dict[tuple[int, int, int], float] = {}
    pre: dict[tuple[int, int, int, int], float] = {}
    pre_stops: dict[tuple[int, int, int, int], float] = {}
    pre_bonus: dict[tuple[int, int, int, int], float] = {}
    pf = Prefetcher(d, max_fanout=max(fanouts, default=1))
    pf.sync_bonus = True  # the bonus place's forward timed as its own piece
    failed: list[str] = []
    for ctx in contexts:
        for b in jobs:
            for r in range(b):  # each row holds a context of `ctx` tokens
                toks = rng.integers(0, d.vocab_size, max(ctx, 16)).astype(np.int32)
                for s in range(0, len(toks), 4096):
                    d.run([Job(r, s, toks[s:s + 4096])], 0)
            L = max(ctx, 16)
            for n in range(1, k + 1):
                times = []
                for _ in range(iters + 2):
                    jb = [Job(r, L, rng.integers(0, d.vocab_size, 3).astype(np.int32)) for r in range(b)]
                    sync()
                    t0 = time.perf_counter()
                    d.run(jb, n)
                    sync()
                    times.append(time.perf_counter() - t0)
                out[(b, n, kv_bucket(L + 3 + n, d.cache.max_len))] = p50(times[2:])
            for F, kk in ((F, kk) for F in fanouts for kk in depths or [k]):
                # the branch work after a STEP of b requests with kk drafts each
                times, stops, bonus = [], [], []
                for _ in range(iters + 2) if not failed else ():
                    jb = [Job(r, L, rng.integers(0, d.vocab_size, 3).astype(np.int32)) for r in range(b)]
                    drafts, _ = d.run(jb, kk)
                    blocks = [P.Block(r, 1, L, jb[r].tokens, kk) for r in range(b)]
                    res = types.SimpleNamespace(drafts=drafts)
                    todo = [(r, types.SimpleNamespace(row=r, ctx_len=L + 3), kk) for r in range(b)]
                    sync()
                    before = sum(pf.stats[f"{p}_us"] for p in DEVICE_PIECES)
                    before_stops, before_bonus = pf.stats["stops_us"], pf.stats["bonus_us"]
                    try:
                        pf._draft(blocks, res, todo, Acceptance(), F)
                    except Exception:  # no prefetch entries: the emulated worker then answers empty tables
                        traceback.print_exc()
                        failed.append(f"{b}x{F}xk{kk}@{ctx}")
                        break
                    # the device pieces only (each ends in a host read): the emulated worker spends these
                    # and runs the host pieces (choose, entries, encode) itself, for real
                    times.append(1e-6 * (sum(pf.stats[f"{p}_us"] for p in DEVICE_PIECES) - before))
                    stops.append(1e-6 * (pf.stats["stops_us"] - before_stops))
                    bonus.append(1e-6 * (pf.stats["bonus_us"] - before_bonus))
                if len(times) > 2:
                    key = (b, F, kk, kv_bucket(L + 3 + kk, d.cache.max_len))
                    pre[key], pre_stops[key], pre_bonus[key] = p50(times[2:]), p50(stops[2:]), p50(bonus[2:])
    del d, pf
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return CostTable(out, source=f"measured in this run on {dev}", prefetch=pre, prefetch_stops=pre_stops,
                     prefetch_bonus=pre_bonus, bonus_mode=BONUS)


def batch_groups(trace: Trace, batch: int) -> list[list]:
    """The trace's entries in groups of `batch` (the last may be smaller), kinds taken in turn (code, prose,
    code, ...) so a group mixes them as the engine's batches of several requests do."""
    kinds: dict[str, list] = {}
    for e in trace.entries:
        kinds.setdefault(e.name.split(":")[0], []).append(e)
    order, queues = [], [list(v) for v in kinds.values()]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def hit_curve(trace: Trace, k: int, fanouts: list[int], max_tokens: int, batch: int = 1) -> dict:
    """Hit rate against F counted on the trace alone: for each group of `batch` entries (batch_groups), a
    worker core with a cost-free replay drafter, driven as the engine drives it (greedy; each round carries
    the accepted drafts and the target's token; the group's requests in one STEP), its branch table checked
    against the next round's tokens with the engine's own selection. A request-round that has a table is
    a lookup; its first round has none. With several requests a step goes without waiting for its round
    only when every row hits (the engine's wait rule "all"): `all_hit_rate` counts those steps. A group runs
    until its first request reaches the end of its trace (the engine's benchmark stops there too)."""
    out = {}
    for F in fanouts:
        cost = CostTable({(b, k, 256): 0.0 for b in range(1, batch + 1)},
                         prefetch={(b, F, k, 256): 0.0 for b in range(1, batch + 1)})
        by_kind: dict[str, list[int]] = {}
        steps = all_hit = 0
        for group in batch_groups(trace, batch):
            rd = ReplayDrafter(trace, cost=cost, n_rows=len(group) + 1,
                               max_ctx=max(len(e.sequence) for e in group) + 64, vocab_size=trace.vocab_size)
            core = WorkerCore(rd, max_requests=len(group))
            session, _ = core.open_session(P.Hello(max_requests=len(group), n_out_max=8))
            ends = [min(max_tokens, len(e.target)) for e in group]
            held = [len(e.prompt) + 1 for e in group]
            n, pos, table = [1] * len(group), [0] * len(group), None
            while all(n[r] < ends[r] - 1 for r in range(len(group))):
                blocks = [P.Block(r + 1, 1, pos[r], np.asarray(e.sequence[pos[r]:held[r]], np.int32),
                                  min(k, ends[r] - n[r] - 1)) for r, e in enumerate(group)]
                if table is not None:
                    hit = [TB.select(table.entry(r + 1), r + 1, 1, pos[r], b.tokens) >= 0 for r, b in enumerate(blocks)]
                    for e, h in zip(group, hit, strict=True):
                        acc = by_kind.setdefault(e.name.split(":")[0] or "all", [0, 0])
                        acc[0] += h
                        acc[1] += 1
                    steps += 1
                    all_hit += all(hit)
                res = core.step(session, blocks)
                table = TB.decode(branches_payload(core, session, blocks, res, F), rd.vocab_size)
                for r, e in enumerate(group):
                    f = res.drafts[r, :blocks[r].n_out].tolist()
                    kept = 0
                    while kept < len(f) and f[kept] == e.sequence[held[r] + kept]:
                        kept += 1
                    pos[r], held[r], n[r] = held[r], held[r] + kept + 1, n[r] + kept + 1
        tot = [sum(v[0] for v in by_kind.values()), sum(v[1] for v in by_kind.values())]
        out[F] = {"hit_rate": tot[0] / max(1, tot[1]), "lookups": tot[1],
                  "by_kind": {kk: v[0] / max(1, v[1]) for kk, v in sorted(by_kind.items())},
                  "steps": steps, "all_hit_rate": all_hit / max(1, steps)}
    return out


def reset_cache_stats(sc: SpecCache) -> None:
    """Count only the timed steps (the cache's counters otherwise run across every run)."""
    sc.reset_stats()


def guard_choices(sc: SpecCache) -> dict:
    """The guard's steps per choice so far, by batch class, and its switches."""
    g = sc.guard
    return {"chosen": {b: {a.label: n for a, n in c.chosen.items()} for b, c in g.classes.items()},
            "switches": g.switches}


def decode_modes(eng: Engine, prompts: list[list[int]], modes: dict, max_tokens: int, warmup: int,
                 repeats: int, caches: dict | None = None) -> dict:
    """Prefill once, then decode the prompts in every mode from that KV, interleaved, `repeats` times.
    caches: mode -> the SpecCache its rounds were opened with (the engine uses it for that mode only);
    each cache's guard starts this workload afresh."""
    # rows must outlive every mode's run: no request may finish (that frees its row); the loop below
    # stops while every request is still inside the trace
    caches = caches or {}
    params = SamplingParams(max_tokens=max_tokens + 64)
    stop_at = max_tokens - eng.cfg.n_draft - 1
    reqs, ttft = prefill_held(eng, prompts, params)
    out = {"ttft_s": ttft, "modes": {m: [] for m in modes}}
    for sc in caches.values():
        if sc.guard is not None:
            sc.guard.reset()
    for _ in range(repeats):
        for name, rounds in modes.items():
            sc = caches.get(name)
            eng.spec_cache = sc
            eng.set_rounds(rounds)
            for v in eng.timing.values():
                v.clear()
            live = [eng.resume(r) for r in reqs]
            # untimed: the drafter catches up on the context (rounds that ask no drafts), then warm-up
            steps, caught, k0 = 0, None, [0] * len(live)
            # rounds that fail never offer drafts: the timed window then starts where catching up ends
            catchup = -(-(max(len(p) for p in prompts) + 1) // eng.cfg.max_round_tokens) + 1
            t0, n0, timed = time.perf_counter(), 0, False
            fast_ms, waited_ms = [], []  # step wall times (the engine syncs every step) by kind
            while max(len(r.output) for r in live) < stop_at:
                # caught up: every request has been offered drafts once (off: at once)
                if caught is None and (rounds is None or all(r.kept for r in live) or steps >= catchup):
                    caught = steps
                if caught is not None and steps == caught + warmup:
                    if eng.stream is not None:
                        torch.cuda.synchronize()
                    t0, n0, k0 = time.perf_counter(), sum(len(r.output) for r in live), [len(r.kept) for r in live]
                    for v in eng.timing.values():
                        v.clear()
                    if sc is not None:
                        reset_cache_stats(sc)
                        g0 = guard_choices(sc) if sc.guard is not None else None
                    timed = True
                fast0 = sc.c["fast_steps"] if sc is not None else 0
                ts = time.perf_counter()
                eng.step()
                if timed and sc is not None:
                    (fast_ms if sc.c["fast_steps"] > fast0 else waited_ms).append(1e3 * (time.perf_counter() - ts))
                steps += 1
            if eng.stream is not None:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n_tok = sum(len(r.output) for r in live) - n0
            kept = [x for r, a in zip(live, k0, strict=True) for x in r.kept[a:]]
            rep = {
                "round_mode": eng.round_mode, "tokens_per_s": n_tok / dt if dt > 0 else 0.0,
                "timed_tokens": n_tok, "timed_steps": len(eng.timing["step"]),
                "mean_accepted": float(np.mean(kept)) if kept else 0.0,
                "parts_p50_ms": {k: 1e3 * p50(v) for k, v in eng.timing.items()},
                "rounds": [dict(r.rounds) for r in live],
                "outputs_equal_trace": None,  # filled by the caller
                "outputs": [r.output for r in live]}
            if sc is not None:
                rep["spec_cache"] = {**sc.stats(), "step_ms_p50_fast": p50(fast_ms),
                                     "step_ms_p50_waited": p50(waited_ms)}
                if sc.guard is not None and timed:  # what the guard chose in the timed window
                    g1 = guard_choices(sc)
                    rep["spec_cache"]["guard_timed"] = {
                        "chosen": {b: {f: n - g0["chosen"].get(b, {}).get(f, 0) for f, n in c.items()
                                       if n - g0["chosen"].get(b, {}).get(f, 0)} for b, c in g1["chosen"].items()},
                        "switches": g1["switches"] - g0["switches"]}
            out["modes"][name].append(rep)
            for r in live:
                eng.cancel(r, keep_row=True)
            eng.set_rounds(None)  # settles a round the cache left in flight, with its own rounds
            eng.spec_cache = None
    for r in reqs:
        eng.release_row(r.row)
    eng.set_rounds(None)
    return out


PLACEMENTS = ("same", "emulated", "gpu1")

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a draftrelay trace (benchmarks/record_traces.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="qwen2.5-7b", help="qwen2.5-7b or tiny (shape of the replay target)")
    ap.add_argument("--drafter", default="qwen2.5-0.5b", help="qwen2.5-0.5b or tiny (shape of the replay drafter)")
    ap.add_argument("--workloads", default="short:1,short:1@1,short:4,32k:1,32k:4",
                    help="CONTEXT:REQUESTS[@FIRST], comma-separated; requests take --entries from position FIRST on")
    ap.add_argument("--entries", default="",
                    help="trace entry indices in the order requests take them (default: code and prose alternating)")
    ap.add_argument("--modes", default="off,sync,async,cache")
    ap.add_argument("--fanout", default=str(DEFAULT_FANOUT),
                    help="branches per request of the cache mode; a list (4,8) runs one cache mode per F")
    ap.add_argument("--wait-rules", default="all",
                    help="the cache's wait rule(s) (all, the engine's default: a step waits when any row missed; "
                         "rows: only when no row has drafts; early: the table looked up before the round is sent, "
                         "a row that missed verifies without drafts); with several, one cache mode per rule: cacheF "
                         "for rows, cacheF-all for all, cacheF-early for early")
    ap.add_argument("--guard", default="on",
                    help="the cache's guard: on (default: the fan-out per batch class, cache steps at k), depth "
                         "(fan-out and depth, k or k - 1), off; several comma-separated, one cache mode each")
    ap.add_argument("--hit-curve", default="",
                    help="F values: first count the hit rate of each on the trace itself (CPU, no models)")
    ap.add_argument("--placements", default="same,emulated",
                    help="same (worker on this GPU), emulated (drafter on an emulated second device) and/or "
                         "gpu1 (the worker on the next GPU, --worker-device: the real placement, two GPUs needed)")
    ap.add_argument("--worker-device", default="cuda:1", help="the gpu1 placement's worker device")
    ap.add_argument("--draft-vocab", default="", metavar="N",
                    help="the drafter's head restricted to a draft vocabulary, ids 0..N-1 (draft_vocab.py): "
                         "its cost measured so, the trace's drafts restricted to those ids (replay.Trace.restricted)")
    ap.add_argument("--drafter-quant", default="none", choices=["none", "int8"],
                    help="a CUDA drafter's layer products on int8 copies (worker --quant int8): its STEP and branch "
                         "work measured so; the acceptance stays the trace's, recorded with the bf16 drafter "
                         "(benchmarks/int8_head_agreement.py --layers measures how little int8 moves it)")
    ap.add_argument("--head-int8", action="store_true",
                    help="a CUDA drafter's greedy forwards read its head as int8 (worker --head-int8); as "
                         "--drafter-quant, the acceptance stays the trace's")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default: the trace's length)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the drafter has caught up")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cost-iters", type=int, default=10)
    ap.add_argument("--no-graphs", action="store_true", help="eager verify (graphs are the GPU default)")
    ap.add_argument("--deadline-ms", type=float, default=3000.0)
    ap.add_argument("--max-round-tokens", type=int, default=4096,
                    help="tokens one round sends the drafter: a long context reaches it over several untimed rounds")
    ap.add_argument("--out", default="benchmarks/results/replay_headline.json")
    ap.add_argument("--plot", default="", help="PNG of tokens/s bars (default: beside --out)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    guards = [g for g in args.guard.split(",") if g]
    if not guards or any(g not in GUARDS for g in guards):
        ap.error(f"--guard: comma-separated values of {', '.join(GUARDS)}, got {args.guard!r}")
    trace = None if args.trace == "synthetic" else Trace.load(args.trace)
    vocab_flag = []
    if args.draft_vocab and trace is not None:
        from draftrelay.draft_vocab import DraftVocab, DraftVocabError

        try:
            vocab = DraftVocab.parse(args.draft_vocab, trace.vocab_size)
        except DraftVocabError as exc:
            ap.error(f"--draft-vocab: {exc}")
        if vocab is not None:
            trace, vocab_flag = trace.restricted(vocab.ids.numpy()), ["--draft-vocab", args.draft_vocab]
    elif args.draft_vocab:
        ap.error("--draft-vocab needs a real trace (the synthetic one has the tiny vocabulary)")
    dev = torch.device(args.device)
    if (args.drafter_quant != "none" or args.head_int8) and dev.type != "cuda":
        ap.error(f"--drafter-quant {args.drafter_quant} / --head-int8: a CUDA drafter's int8 products, not "
                 f"--device {args.device}")
    int8_flag = (["--quant", args.drafter_quant] if args.drafter_quant != "none" else []) + \
        (["--head-int8"] if args.head_int8 else [])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    graphs = dev.type == "cuda" and not args.no_graphs
    if trace is None:  # the smoke path: a trace in the target's own vocabulary
        trace = synthetic_trace(M.tiny_config().vocab_size if args.target == "tiny"
                                else int(TARGET_SHAPES[args.target]["vocab_size"]))
    plan = []
    kinds = [e.name.split(":")[0] for e in trace.entries]
    code = [i for i, k in enumerate(kinds) if k != "prose"]
    prose = [i for i, k in enumerate(kinds) if k == "prose"]
    alternating = [x for pair in zip(code, prose + [None] * len(code), strict=False) for x in pair if x is not None]
    order = [int(x) for x in args.entries.split(",") if x] if args.entries else alternating + prose[len(code):]
    if any(not 0 <= i < len(trace.entries) for i in order):
        ap.error(f"--entries: indices must be within 0..{len(trace.entries) - 1}")
    first_of = {}
    for item in [w for w in args.workloads.split(",") if w]:
        spec, _, first = item.partition("@")
        ctx, _, n = spec.partition(":")
        if ctx not in CONTEXTS or not n.isdigit() or not 1 <= int(n) <= 8 or (first and not first.isdigit()):
            ap.error(f"--workloads: {item!r} is not CONTEXT:REQUESTS[@FIRST] with CONTEXT in {list(CONTEXTS)}, "
                     "1..8 requests")
        plan.append((item, CONTEXTS[ctx], int(n)))
        first_of[item] = int(first or 0)
    placements = [p for p in args.placements.split(",") if p]
    for p in placements:
        if p not in PLACEMENTS:
            ap.error(f"--placements: {p!r} is not one of {PLACEMENTS}")
    if "gpu1" in placements and (not torch.cuda.is_available() or args.device == args.worker_device
                                 or torch.device(args.worker_device).index is None
                                 or torch.device(args.worker_device).index >= torch.cuda.device_count()):
        ap.error(f"--placements gpu1: --worker-device {args.worker_device!r} must be a CUDA device other than "
                 f"--device {args.device!r} ({torch.cuda.device_count()} GPU(s) here)")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("off", "sync", "async", "async-stream", "async-host", "cache"):
            ap.error(f"--modes: {m!r} is not off, sync, async, async-stream, async-host or cache")
    try:
        fanouts = [int(x) for x in args.fanout.split(",") if x] if "cache" in modes else []
        curve_fs = [int(x) for x in args.hit_curve.split(",") if x]
    except ValueError:
        ap.error("--fanout / --hit-curve: comma-separated integers")
    wait_rules = [w for w in args.wait_rules.split(",") if w]
    if not wait_rules or any(w not in WAIT_RULES for w in wait_rules):
        ap.error(f"--wait-rules: each must be one of {WAIT_RULES}")
    if any(not 1 <= f <= TB.MAX_BRANCHES for f in fanouts + curve_fs):
        ap.error(f"--fanout / --hit-curve: F must be within 1..{TB.MAX_BRANCHES}")
    max_tokens = args.max_tokens or min(len(e.target) for e in trace.entries)
    label = f"replayed acceptance of {trace.pair}"
    if int8_flag:  # the costs are the int8 drafter's, the acceptance the bf16 drafter's trace
        label += f"; drafter timed with {' '.join(int8_flag)} (acceptance as recorded in bf16)"
    result = {"label": label, "env": {**machine_info(), "device": str(dev)}, "args": vars(args),
              "trace": {"pair": trace.pair, "entries": len(trace.entries), "file": os.path.basename(args.trace)},
              "workloads": {}}

    if curve_fs:
        t0 = time.perf_counter()
        result["hit_curve"] = {"k": args.k, "max_tokens": max_tokens, "by_fanout": hit_curve(trace, args.k, curve_fs,
                                                                                             max_tokens)}
        print(f"hit rate against F (k = {args.k}, counted on the trace, {time.perf_counter() - t0:.1f} s): " +
              ", ".join(f"F={f} {v['hit_rate']:.1%}" for f, v in result["hit_curve"]["by_fanout"].items()), flush=True)

    def save() -> None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    target = target_model(args.target, dev, dtype)
    V = target.cfg.vocab_size
    if trace.max_token() >= V:
        ap.error(f"--trace: token {trace.max_token()} is outside the {args.target} vocabulary {V}")
    tmp = tempfile.mkdtemp(prefix="draftrelay-replay-")
    ctx_max = max(c for _, c, _ in plan)
    max_row = ctx_max + max(len(e.prompt) for e in trace.entries) + max_tokens + 64 + 2 * args.k + 32
    n_max = max(n for _, _, n in plan)
    if args.drafter == "tiny":
        inner, model_id = "tiny", M.tiny_model_id()
    else:
        inner = os.path.join(tmp, f"random-{args.drafter}")
        write_drafter_dir(args.drafter, inner, 2)
        model_id = os.path.basename(inner)
    rng = np.random.default_rng(0)
    # one derived trace for every workload: entry (workload, request) = that request's prompt behind its filler
    derived, index = [], {}
    for item, ctx, n in plan:
        for i in range(n):
            e = trace.entries[order[(first_of[item] + i) % len(order)]]
            filler = rng.integers(0, V, max(0, ctx - len(e.prompt))).tolist() if ctx else []
            index[(item, i)] = len(derived)
            derived.append((filler, e))
    big = with_fillers(Trace(trace.pair, trace.top_f, [e for _, e in derived], trace.vocab_size),
                       [f for f, _ in derived])
    big_path = os.path.join(tmp, "trace_workloads.json")
    big.save(big_path)
    wdev = str(dev)
    cost = None
    workers, rounds, caches = {}, {}, {}
    stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
    hook = install_replay_target(target, big, n_rows=n_max + 1, max_len=max_row)
    try:
        # every speculative mode holds its own worker session of n_max rows
        sessions = sum(len(fanouts) * len(wait_rules) * len(guards) if m == "cache" else 1 for m in modes
                       if m != "off")
        # --prefill-slice-ms -1: the modes run one at a time, so no session ever waits for another's prefill;
        # slicing (on whenever a worker has several sessions) would cut a 4096-token catch-up round at 32K
        # into ~16-token forwards, which on a GPU shared with the target outlast the round budget
        common = ["--max-ctx", str(max_row + 64), "--rows", str(max(2, sessions) * n_max + 2),
                  "--max-requests", str(n_max), "--prefill-slice-ms", "-1",
                  "--n-out-max", str(max(8, args.k))]
        env = {"OMP_NUM_THREADS": "1"} if dev.type == "cpu" else None
        if "same" in placements:
            workers["same"] = start_worker_process(["--model", f"replay:{big_path}:{inner}", "--device", wdev,
                                                    *common, *vocab_flag, *int8_flag], timeout=300, env=env)
        if "gpu1" in placements:  # the product's placement: the drafter on its own GPU, loopback TCP
            workers["gpu1"] = start_worker_process(["--model", f"replay:{big_path}:{inner}", "--device",
                                                    args.worker_device, *common, *vocab_flag, *int8_flag],
                                                   timeout=300, env=env)
        if "emulated" in placements:
            t0 = time.perf_counter()
            # the branch work of every F a cache mode may run: the guard's F / 2 too (CacheGuard's default arms)
            guarded = any(g != "off" for g in guards)
            cost_fanouts = sorted(set(fanouts) | ({f // 2 for f in fanouts if f >= 2} if guarded else set()))
            # and every depth it may ask: k and k - 1 (--guard depth)
            cost_depths = [args.k, args.k - 1] if "depth" in guards and args.k >= 2 else [args.k]
            cost = measure_costs(inner, wdev, sorted({max(c, 16) for _, c, _ in plan}), sorted({n for *_, n in plan}),
                                 args.k, max_row + 64, args.cost_iters, cost_fanouts,
                                 cost_depths, args.draft_vocab, args.drafter_quant, args.head_int8)
            cpath = os.path.join(tmp, "cost.json")
            cost.save(cpath)
            result["cost_table_ms"] = {f"{j}x{n}@{kv}": 1e3 * s for (j, n, kv), s in sorted(cost.seconds.items())}
            result["prefetch_cost_ms"] = {f"{j}x{f}xk{k}@{kv}": 1e3 * s
                                          for (j, f, k, kv), s in sorted(cost.prefetch.items())}
            result["prefetch_stops_ms"] = {f"{j}x{f}xk{k}@{kv}": 1e3 * s
                                           for (j, f, k, kv), s in sorted(cost.prefetch_stops.items())}
            result["prefetch_bonus_ms"] = {f"{j}x{f}xk{k}@{kv}": 1e3 * s
                                           for (j, f, k, kv), s in sorted(cost.prefetch_bonus.items())}
            print(f"branch work measured: {result['prefetch_cost_ms']} (stopping places {result['prefetch_stops_ms']}, "
                  f"bonus forward {result['prefetch_bonus_ms']})", flush=True)
            print(f"drafter STEP table measured in {time.perf_counter() - t0:.1f} s: {result['cost_table_ms']}",
                  flush=True)
            workers["emulated"] = start_worker_process(["--model", f"replay:{big_path}:emulated={cpath}",
                                                        "--model-id", model_id, "--device", "cpu", *common],
                                                       timeout=120)
        for p, w in workers.items():
            print(f"[{p}] {w.banner}", flush=True)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p, w in workers.items():
                spec = {"kind": "worker", "host": w.host, "port": w.port, "model_id": model_id,
                        "n_out_max": args.k, "max_requests": n_max}
                h = handoff_config(spec, dev, args.deadline_ms, p == "same", vocab_size=V, max_drafts=max(8, args.k),
                                   max_requests=n_max, max_tokens=max(65536, n_max * (args.max_round_tokens + 64)),
                                   round_budget_ms=args.deadline_ms * 0.9)
                for m in modes:
                    if m in ("sync", "async"):
                        rounds[f"{m}@{p}"] = SyncRounds(h) if m == "sync" else open_rounds(h)
                    elif m == "async-stream":  # the stream stages, announces and parks every round;
                        # the proxy spins 50 µs, then naps (HandoffConfig.host_staging and .park off)
                        rounds[f"{m}@{p}"] = open_rounds(dataclasses.replace(h, host_staging=False, park="stream",
                                                                             spin_us=50))
                    elif m == "async-host":  # the host park: nothing on the stream while the round is out
                        rounds[f"{m}@{p}"] = open_rounds(dataclasses.replace(h, park="host"))
                    elif m == "cache":  # async rounds on the host stream, the cache's table memfd to the proxy
                        for F, rule, gd in ((F, rule, gd) for F in fanouts for rule in wait_rules for gd in guards):
                            tag = {"all": "-all", "rows": ""}.get(rule, f"-{rule}") if len(wait_rules) > 1 else ""
                            name = (f"cache{F}" if len(fanouts) > 1 else "cache") + tag + \
                                   ({"off": "-raw", "depth": "-depth"}.get(gd, "") if len(guards) > 1 else "") + \
                                   f"@{p}"
                            # shared_gpu: run on the shared GPU too (to measure the split; the guard starts
                            # there with plain rounds)
                            opts = {"depths": [None, args.k - 1]} if gd == "depth" and args.k >= 2 else {}
                            sc = caches[name] = SpecCache(F, wait_rule=rule, shared_gpu=True, guard=gd != "off",
                                                          guard_options=opts)
                            hh = handoff_config(spec, dev, args.deadline_ms, p == "same", host_rounds=True,
                                                vocab_size=V, max_drafts=max(8, args.k), max_requests=n_max,
                                                max_tokens=max(65536, n_max * (args.max_round_tokens + 64)),
                                                round_budget_ms=args.deadline_ms * 0.9)
                            hh.round_spec = sc.round_spec(hh.round_spec, hh.round_budget_ms)
                            rounds[name] = open_rounds(hh)
        runs = {"off": None} if "off" in modes else {}
        runs.update(rounds)
        for item, ctx, n in plan:
            t0 = time.perf_counter()
            eng = None
            try:
                cfg = EngineConfig(mode="off", n_draft=args.k, max_batch=n, max_len=max_row, prefill_chunk=4096,
                                   max_round_tokens=args.max_round_tokens, graphs=graphs)
                eng = Engine(target, cfg, stream=stream)
                prompts = [big.entries[index[(item, i)]].prompt for i in range(n)]
                res = decode_modes(eng, prompts, runs, max_tokens, args.warmup, args.repeats, caches)
                want = [big.entries[index[(item, i)]].target[:max_tokens] for i in range(n)]
                for reps in res["modes"].values():
                    for rep in reps:
                        outs = rep.pop("outputs")
                        rep["outputs_equal_trace"] = all(o == w[:len(o)] for o, w in zip(outs, want, strict=True))
                names = [big.entries[index[(item, i)]].name for i in range(n)]
                result["workloads"][item] = {"context": ctx, "requests": n, "graphs": graphs, "entries": names, **res,
                                             "wall_s": time.perf_counter() - t0}
                if cost is not None:
                    result["workloads"][item]["cache_bound"] = cache_bound(res, cost, n, ctx, args.k)
            except Exception as exc:
                traceback.print_exc()
                result["workloads"][item] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                if eng is not None:
                    eng.rounds = None  # shared rounds and caches: closed below
                    eng.spec_cache = None
                    eng.close()
                del eng
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            print(format_row(item, result["workloads"][item], list(runs)), flush=True)
            save()
        result["handoff"] = {m: r.stats() for m, r in rounds.items()}
    finally:
        hook.remove()
        for r in rounds.values():
            r.close()
        for sc in caches.values():
            sc.shm.close()
        for p, w in workers.items():
            result.setdefault("worker_log_tail", {})[p] = w.log()[-2000:]
            w.stop()
    result["table"] = [f"{label}; tokens/s median (min-max) over repeats, x = vs off"] + [
        format_row(item, w, list(runs)) for item, w in result["workloads"].items()]
    result["wall_s"] = time.perf_counter() - t_start
    save()
    print("\n".join(result["table"]))
    plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    with contextlib.suppress(Exception):
        write_plot(result, list(runs), plot, label)
        print(f"wrote {plot}")
    print(f"wrote {args.out}")
    return 0


def cache_bound(res: dict, cost: CostTable, n: int, ctx: int, k: int) -> dict:
    """Per cache mode: the step time on hits (verifies that did not wait) against max(verify, drafter
    STEP), with the verify of the same run and the drafter STEP (and branch work) from the cost table."""
    out = {}
    L = max(ctx, 16) + 64
    for name, reps in res["modes"].items():
        if not reps or "spec_cache" not in reps[0]:
            continue
        fast = p50([r["spec_cache"]["step_ms_p50_fast"] for r in reps])
        verify = p50([r["parts_p50_ms"]["verify"] for r in reps])
        step = 1e3 * cost.lookup(n, k, L)
        F = reps[0]["spec_cache"]["fanout"]
        branch = 1e3 * cost.lookup_prefetch(n, F, k, L) if cost.prefetch else 0.0
        # after a hit: no forward over the stopping places; the bonus forward after the table is out (queued)
        # or before the run (lazy: on the way to the table)
        behind = cost.lookup_prefetch_bonus(n, F, k, L) if cost.bonus_mode == "queued" else 0.0
        after_hit = (branch - 1e3 * (cost.lookup_prefetch_stops(n, F, k, L) + behind) if cost.prefetch else 0.0)
        bound = max(verify, step)
        out[name] = {**ceilings(reps, bound), "hit_rate": p50([r["spec_cache"]["hit_rate"] for r in reps]),
                     "fast_step_fraction": p50([r["spec_cache"]["fast_steps"] / max(1, r["timed_steps"])
                                                for r in reps]),
                     "step_ms_on_hits": fast, "verify_ms": verify, "drafter_step_ms": step, "branch_work_ms": branch,
                     "branch_work_after_hit_ms": after_hit,
                     "bound_ms": bound, "hit_step_over_bound": fast / bound if bound else 0.0}
    return out


def ceilings(reps: list[dict], bound_ms: float) -> dict:
    """What a cache mode's tokens/s would be with faster steps, from its own repeats (median over them):
    `ceiling_all_hits_tok_s`, every step a hit at the bound (its tokens per step, each step max(verify,
    drafter STEP): what no hit rate or branch work can beat at this acceptance); `ceiling_hits_at_bound_tok_s`,
    its own hits at the bound and its other steps as they ran (the run's time less, per hit, the p50 hit
    step's excess over the bound: what meeting the hit-step goal would give at the measured hit rate). Both
    read a step that did not wait as a hit: right for the rules "all" and "early", not for "rows", whose
    steps that verify a missed row without drafts also do not wait (and make fewer tokens)."""
    every, at_bound = [], []
    for r in reps:
        tokens, steps, fast = r["timed_tokens"], r["timed_steps"], r["spec_cache"]["fast_steps"]
        if not tokens or not steps or not r["tokens_per_s"] or bound_ms <= 0:
            continue
        run_s = tokens / r["tokens_per_s"]
        every.append(tokens / (steps * bound_ms / 1e3))
        excess = max(0.0, r["spec_cache"]["step_ms_p50_fast"] - bound_ms) / 1e3
        at_bound.append(tokens / max(run_s - fast * excess, 1e-9))
    return {"ceiling_all_hits_tok_s": p50(every) if every else 0.0,
            "ceiling_hits_at_bound_tok_s": p50(at_bound) if at_bound else 0.0}


def summary(w: dict, mode: str) -> tuple[float, float, float]:
    xs = [rep["tokens_per_s"] for rep in w["modes"][mode]]
    return statistics.median(xs), min(xs), max(xs)


def format_row(item: str, w: dict, modes: list[str]) -> str:
    if "modes" not in w:
        return f"{item:<9} {w.get('error', 'skipped')}"
    base = summary(w, "off")[0] if "off" in w["modes"] else 0.0
    cells = []
    for m in modes:
        med, lo, hi = summary(w, m)
        acc = statistics.mean(rep["mean_accepted"] for rep in w["modes"][m])
        ok = all(rep["outputs_equal_trace"] for rep in w["modes"][m])
        rel = f" {med / base:.2f}x" if base else ""
        sc = [rep["spec_cache"] for rep in w["modes"][m] if "spec_cache" in rep]
        hit = f" hit {p50([x['hit_rate'] for x in sc]):.0%}" if sc else ""
        gt = [x["guard_timed"] for x in sc if "guard_timed" in x]
        if gt:  # the guard's share of plain-round steps in the timed windows, and its switches
            n = sum(v for g in gt for c in g["chosen"].values() for v in c.values())
            plain = sum(c.get("0", 0) for g in gt for c in g["chosen"].values())
            hit += f" plain {plain / max(1, n):.0%} sw {sum(g['switches'] for g in gt)}"
        cb = w.get("cache_bound", {}).get(m)
        if cb and base and "ceiling_all_hits_tok_s" in cb:  # x off: every step a hit at the bound / hits at it
            hit += (f" ceiling {cb['ceiling_all_hits_tok_s'] / base:.2f}x"
                    f" / {cb['ceiling_hits_at_bound_tok_s'] / base:.2f}x")
        cells.append(f"{m} {med:.1f} ({lo:.1f}-{hi:.1f}){rel} acc {acc:.2f}{hit}{'' if ok else ' OUTPUT DIFFERS'}")
    return f"{item:<9} " + " | ".join(cells)


def write_plot(result: dict, modes: list[str], path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [i for i, w in result["workloads"].items() if "modes" in w]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(items) * max(1, len(modes)) / 3, 4))
    width = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        vals = [summary(result["workloads"][i], m) for i in items]
        x = np.arange(len(items)) + j * width
        ax.bar(x, [v[0] for v in vals], width,
               yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]], label=m.replace("@", " @ "))
    ax.set_xticks(np.arange(len(items)) + width * (len(modes) - 1) / 2, items)
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_title(label, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
