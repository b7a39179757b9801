"""The proxy process: waits for a staged round, does the round, publishes the reply, releases.

Run as `python -m draftrelay.handoff.proxy --fd N --spec JSON` by the engine side (rounds.py).
It imports numpy, the round vocabulary (draftrelay.round, draftrelay.testing) and the wire round
functions only: no torch, no CUDA library. A CUDA call here, between the engine's wait and the
release, can deadlock against a module load in the engine; the process refuses to serve if torch
is loaded at all.

Per round t (slot s = t & 1):
  wait gathered >= t -> copy staging[s] into a private buffer (staging is never written here) ->
  check the copy was not overwritten meanwhile -> parse and validate -> run the round function ->
  validate its output -> write reply[s] -> claim round t (CAS claim[s]: <2t -> 2t) -> release.
The reply is written *before* the claim, so a claimed reply is always complete: the watchdog can
release a round the proxy claimed but had not released yet, and a proxy that lost the claim has
written only into a slot whose claim word tells the engine to ignore it.

With the speculation cache (spec["spec_cache"], branch_push.py) the worker round function asks each
STEP for a branch table too, and once round t is released (the engine's verify is running) the loop
reads that table and writes it into the engine's table memory, before it waits for round t + 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable

import numpy as np

from draftrelay.round import RoundFailure, RoundFn, Status, check_drafts
from draftrelay.testing import FaultPlan, builtin_round_fn
from draftrelay.wire.roundfn import RoundBudget, make_round_fn

from . import branch_push, native
from .region import (
    FLAG_SELFTEST,
    Counter,
    DescriptorError,
    Layout,
    ProxyState,
    Region,
    RegionError,
    W,
    unpack_staging,
    write_reply,
)
from .stream import ExpectedWait

# ---------------------------------------------------------------------------------------------
# The serving loop


def answer(L: Layout, private: np.ndarray, t: int, selftest_fn: RoundFn, round_fn: RoundFn, budget_s: float,
           sized: Callable[[int, list], None] | None = None):
    """Round t's reply from a private copy of its staging: parse it, run the round function (the
    built-in one for the engine's self-test rounds), check the output. Returns (status, counts,
    drafts, conf, detail); every failure is a status with no drafts (None) and what it said (the
    engine's rounds keep the first per reason: a timeout names the part of the round that ran out)."""
    cfg = L.cfg
    try:
        flags, requests = unpack_staging(L, private, t)
        if sized is not None:  # before the round: the watchdog's deadline follows the round's size
            sized(t, requests)
        fn = selftest_fn if flags & FLAG_SELFTEST else round_fn
        out = fn(t, requests, budget_s)
        return (Status.OK, *check_drafts(out, requests, cfg.vocab_size, cfg.max_drafts), "")
    except DescriptorError as exc:
        return Status.BAD_DESC, None, None, None, f"staging: {exc}"
    except RoundFailure as f:
        return f.status, None, None, None, str(f)
    except Exception as exc:
        return Status.EXCEPTION, None, None, None, f"{type(exc).__name__}: {exc}"


def copy_staged(L: Layout, private: np.ndarray, staged: np.ndarray) -> None:
    """Copy what a staged round uses into `private`: the descriptor and request table, then the tokens
    the copied descriptor counts (clamped to the slot; a torn or bad count is the parse's to refuse).
    A whole slot is 4 bytes per token of max_tokens (256 KB at 64K), copied on every round's critical
    path; the torn-copy check after it covers these bytes as it covered the whole slot."""
    tok = L.staging_tok_off
    np.copyto(private[:tok], staged[:tok])
    n_tok = min(int(private[8:12].view("<u4")[0]), L.cfg.max_tokens)
    np.copyto(private[tok:tok + 4 * n_tok], staged[tok:tok + 4 * n_tok])


def serve(region: Region, round_fn: RoundFn, *, spin_us: int = 50, nap_us: int = 20,
          round_budget_s: float = 0.15, faults: FaultPlan | None = None,
          parent_pid: int | None = None, wait: str = "poll", wait_slice_us: int = 2000,
          after_release: Callable[[int, Callable[[], bool]], None] | None = None, wake_release: bool = False,
          budget: RoundBudget | None = None, spin_window_us: int = 0) -> None:
    """The proxy's loop. wait "block": sleep on `gathered` (an emulated stream wakes it) and wake the
    stream with the release; "poll": spin_us, then nap_us naps (a GPU writes `gathered`, no wake).
    wake_release: wake the release word in poll mode too (an engine thread sleeps on it: the host park).
    after_release(t, next_round): called after round t is released (the speculation cache's branch push;
    next_round() says whether the engine has posted round t + 1).
    budget: each parsed round's time beyond a steady round's goes to the watchdog's deadline.
    spin_window_us (wait "block"): sleep until that long before the next round is expected (the running
    average of release -> next announcement), then spin through twice that (stream.ExpectedWait)."""
    L, cfg, base = region.layout, region.cfg, region.base
    a_gathered = base + L.word(W.GATHERED)
    a_released = base + L.word(W.RELEASED)
    a_consumed = base + L.word(W.CONSUMED)
    a_stop = base + L.word(W.STOP)
    a_last_release = base + L.word(W.LAST_RELEASE_NS)
    a_claim = [base + L.claim(s) for s in (0, 1)]
    staging = [region.staging_view(s) for s in (0, 1)]
    replies = [region.reply_view(s) for s in (0, 1)]
    private = np.empty(L.staging_size, np.uint8)
    selftest_fn = builtin_round_fn(cfg.vocab_size)

    def count(c: Counter, n: int = 1) -> None:
        native.add32(base + L.counter(c), n)

    def stall(point: str, fault: str, where: str) -> None:
        if fault == "stall" and point == where and faults is not None:
            time.sleep(faults.stall_ms / 1000)

    def sized(t: int, requests: list) -> None:  # round t's time beyond a steady round's, for the watchdog
        native.store64(base + L.word(W.ROUND_BUDGET), (t & 0xFFFFFFFF) << 32 | budget.extra_us(requests))

    keepalive = getattr(round_fn, "keepalive", None)
    blocking = wait == "block"
    release = native.store_max32_wake if blocking or wake_release else native.store_max32
    reported_reconnects = 0
    t = native.load32(a_released) + 1
    spin = spin_us  # spin for the next round after a round only: once a wait timed out, rounds stopped
    window = ExpectedWait(spin_window_us) if blocking and spin_window_us > 0 else None
    t_wait = None  # when the wait for the next round began (after a release)
    while True:
        if window is not None and t_wait is not None and not native.geq32(native.load32(a_gathered), t):
            spin = window.before(a_gathered, t, a_stop, wait_slice_us, None)
        if blocking:
            rc = native.wait_geq32_block(a_gathered, t, spin, wait_slice_us, 100_000, a_stop)
        else:
            rc = native.wait_geq32(a_gathered, t, spin, nap_us, 100_000, a_stop)
        if rc == native.WAIT_ABORTED:
            return
        spin = spin_us if rc == native.WAIT_OK else 0  # (a 20 ms spin per 100 ms timeout: 20 % of a core idle)
        if window is not None and t_wait is not None:
            if rc == native.WAIT_OK:  # the gap from a release to the next round (a pause between requests
                window.observe(time.monotonic() - t_wait)  # ends in a timeout: not counted)
            t_wait = None
        if rc == native.WAIT_TIMEOUT:
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # the engine is gone
            if keepalive is not None:  # no round for 100 ms: keep the worker session from expiring
                keepalive()
            continue
        g = native.load32(a_gathered)
        if g != t and native.geq32(g, t):
            count(Counter.SKIPPED, (g - t) & 0xFFFFFFFF)
            t = g  # rounds before g were released by the watchdog without us
        s = t & 1
        fault, point = faults.pick(t) if faults else ("", "")
        if fault and not faults.in_selftest and staging[s][12:16].view("<u4")[0] & FLAG_SELFTEST:
            fault, point = "", ""  # a peek at the flags word; the real parse is on the private copy
        stall(point, fault, "read")
        copy_staged(L, private, staging[s])
        if native.geq32(native.load32(a_gathered), t + 2):
            count(Counter.TORN_SKIPPED)  # slot s was re-staged for t+2 while we copied it
            t = native.load32(a_gathered)
            continue
        count(Counter.ROUNDS)
        status, counts, drafts, conf, detail = answer(L, private, t, selftest_fn, round_fn, round_budget_s,
                                                      sized if budget is not None else None)
        # The GPU acknowledged round t-2 before it staged t (stream order); re-check, bounded.
        native.wait_geq32(a_consumed, t - 2, 0, 50, 200_000, a_stop)
        stall(point, fault, "write")
        write_reply(L, replies[s], t, status, counts, drafts, conf, detail)
        if fault == "corrupt" and counts is not None and len(counts):
            replies[s][L.reply_counts_off:L.reply_counts_off + 4].view("<i4")[0] = cfg.max_drafts + 7
        stall(point, fault, "claim")
        if native.claim32(a_claim[s], 2 * t, 2 * t):
            stall(point, fault, "release")
            native.store64(a_last_release, native.now_ns())
            release(a_released, t)
            count(Counter.PUBLISHED)
            if status != Status.OK:
                count(Counter.FAILED)
        else:
            count(Counter.LATE_DISCARDED)
        if after_release is not None:  # the speculation cache: round t's branch table, written while the
            # engine verifies round t (off its critical path; branch_push.py), waited for until the engine
            # posts round t + 1
            after_release(t, lambda nxt=t + 1: native.geq32(native.load32(a_gathered), nxt))
        t_wait = time.monotonic()
        reconnects = getattr(round_fn, "reconnects", 0)
        if reconnects != reported_reconnects:
            count(Counter.RECONNECTS, reconnects - reported_reconnects)
            reported_reconnects = reconnects
        t += 1


def _audit(path: str) -> None:
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line})
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "modules": sorted(sys.modules), "libraries": libs}, f)


FORBIDDEN_MODULES = ("torch", "cuda", "cupy", "pycuda", "triton", "jax", "tensorflow", "numba")


def forbidden_loaded() -> list[str]:
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN_MODULES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftrelay.handoff.proxy",
                                 description="draftrelay proxy process (started by the engine, not by hand)")
    ap.add_argument("--fd", type=int, required=True, help="the shared region's memfd, inherited")
    ap.add_argument("--spec", required=True, help="JSON: round function, waits, faults")
    ap.add_argument("--audit", default="", help="write loaded modules and libraries to this file")
    ap.add_argument("--parent-pid", type=int, default=0, help="the engine's PID (checked right after the prctl)")
    args = ap.parse_args(argv)
    try:
        libc = __import__("ctypes").CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the engine
    except Exception:
        pass
    # an engine that died before the prctl sends no signal: we were already reparented
    parent = args.parent_pid or os.getppid()
    if os.getppid() != parent:
        print(f"draftrelay proxy: the engine (PID {parent}) is gone; exiting", file=sys.stderr)
        return 5
    native.set_timer_slack_ns(1000)
    try:
        region = Region.open(args.fd)
    except RegionError as exc:
        print(f"draftrelay proxy: {exc}", file=sys.stderr)
        return 3
    a_state = region.word_addr(W.PROXY_STATE)
    native.store32(a_state, ProxyState.STARTING)
    native.store32(region.word_addr(W.PROXY_PID), os.getpid())
    try:
        spec = json.loads(args.spec)
        pushes, wrap = branch_push.wrap_for(spec)
        round_fn = make_round_fn(spec, wrap_worker=wrap)
        bad = forbidden_loaded()
        if bad:
            raise RuntimeError(f"the proxy must not load {bad}")
    except Exception as exc:
        print(f"draftrelay proxy: cannot start: {exc}", file=sys.stderr)
        native.store32(a_state, ProxyState.FAILED)
        region.close()
        return 4
    heartbeat = native.Heartbeat(region.word_addr(W.HEARTBEAT), int(spec.get("heartbeat_us", 20_000)))
    if args.audit:
        _audit(args.audit)
    faults = FaultPlan(**spec["faults"]) if spec.get("faults") else None
    if faults:
        faults.pick(0)  # warm numpy.random's lazy import before the first (timed) round
    native.store32(a_state, ProxyState.READY)
    try:
        serve(region, round_fn, spin_us=int(spec.get("spin_us", 50)), nap_us=int(spec.get("nap_us", 20)),
              round_budget_s=float(spec.get("round_budget_s", 0.15)), faults=faults, parent_pid=parent,
              wait=str(spec.get("wait", "poll")), wait_slice_us=int(spec.get("wait_slice_us", 2000)),
              after_release=pushes[0].after_release if pushes else None,
              wake_release=bool(spec.get("wake_release", False)), budget=RoundBudget.from_spec(spec),
              spin_window_us=int(spec.get("spin_window_us", 0)))
    finally:
        if args.audit:
            _audit(args.audit)
        native.store32(a_state, ProxyState.STOPPED)
        heartbeat.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
