"""The proxy process: waits for a staged round, does the round, publishes the reply, releases.

Run as `python -m draftrelay.handoff.proxy --fd N --spec JSON` by the engine side (rounds.py).
It imports numpy and the wire client only: no torch, no CUDA library. A CUDA call here, between the
engine's wait and the release, can deadlock against a module load in the engine (the seed's first
failure); the process refuses to serve if torch is loaded at all.

Per round t (slot s = t & 1):
  wait gathered >= t -> copy staging[s] into a private buffer (staging is never written here) ->
  check the copy was not overwritten meanwhile -> parse and validate -> run the round function ->
  validate its output -> write reply[s] -> claim round t (CAS claim[s]: <2t -> 2t) -> release.
The reply is written *before* the claim, so a claimed reply is always complete: the watchdog can
release a round the proxy claimed but had not released yet, and a proxy that lost the claim has
written only into a slot whose claim word tells the engine to ignore it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from . import native
from .region import (
    FLAG_SELFTEST,
    Counter,
    DescriptorError,
    ProxyState,
    Region,
    RegionError,
    RoundRequest,
    Status,
    W,
    unpack_staging,
    write_reply,
)

# A round function: (t, requests, budget_s) -> per request (drafts int32[<=n_out], conf float32[same]).
Drafts = list[tuple[np.ndarray, np.ndarray]]
RoundFn = Callable[[int, list[RoundRequest], float], Drafts]


class RoundFailure(Exception):
    """A round that failed in a known way; the status says how."""

    def __init__(self, status: Status, detail: str = "") -> None:
        super().__init__(detail or status.name)
        self.status = status


# ---------------------------------------------------------------------------------------------
# The built-in deterministic drafter: drafts are a pure function of the request block, so any
# party can recompute what a correct round must return (the soak and the self-test do).

_M = np.uint64(0x9E3779B97F4A7C15)


def deterministic_draft(req: RoundRequest, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        h = np.uint64(req.req_id * 1_000_003 + req.generation * 7919 + req.position * 104_729 + 17)
        if len(req.tokens):
            toks = req.tokens.astype(np.uint64)
            h ^= np.bitwise_xor.reduce(toks * (np.arange(len(toks), dtype=np.uint64) * _M + _M))
        idx = np.arange(1, req.n_out + 1, dtype=np.uint64)
        x = (h + idx * _M) * _M
        x ^= x >> np.uint64(29)
    drafts = (x % np.uint64(vocab_size)).astype(np.int32)
    conf = ((x >> np.uint64(40)) % np.uint64(1000)).astype(np.float32) / np.float32(1000.0)
    return drafts, conf


def random_requests(rng: np.random.Generator, t: int, vocab_size: int, max_req: int = 4) -> list[RoundRequest]:
    """Round t's requests for soaks against the built-in drafter: 1..max_req requests with random ids,
    generations and 0-8 tokens, each asking for 0-6 drafts (the empty cases included on purpose)."""
    n = int(rng.integers(1, max_req + 1))
    return [RoundRequest(int(rng.integers(0, 1000)), int(rng.integers(1, 5)), t * 3 + i,
                         rng.integers(0, vocab_size, int(rng.integers(0, 9))).astype(np.int32),
                         int(rng.integers(0, 7))) for i in range(n)]


def score_round(requests: list[RoundRequest], result, vocab_size: int) -> tuple[int, int]:
    """(exact drafts, wrong drafts) of a RoundResult for rounds of the built-in drafter: an OK round
    must carry each request's n_out drafts and confidences bit for bit; any other round must carry
    none (its drafts all count as wrong). Used by the self-test's peers: soaks, drills, probes."""
    if result.status != Status.OK:
        return 0, int(result.counts.sum())
    exact = wrong = 0
    for i, r in enumerate(requests):
        want, conf = deterministic_draft(r, vocab_size)
        k = int(result.counts[i])
        if k == r.n_out and np.array_equal(result.drafts[i, :k], want) and np.array_equal(result.conf[i, :k], conf):
            exact += k
        else:
            wrong += max(k, 1)
    return exact, wrong


def score_in_flight(rounds, submitted: Iterable[tuple[int, list[RoundRequest]]], vocab_size: int,
                    depth: int = 2, timeout_s: float = 10.0) -> tuple[int, int]:
    """(exact drafts, wrong drafts) of the rounds `submitted` yields as (round id, requests), pulled one at
    a time while `depth` rounds stay in flight (the engine runs two), each result scored by score_round."""
    exact = wrong = 0
    pending: collections.deque = collections.deque()

    def settle() -> None:
        nonlocal exact, wrong
        t, reqs = pending.popleft()
        e, w = score_round(reqs, rounds.result(t, timeout_s=timeout_s), vocab_size)
        exact, wrong = exact + e, wrong + w

    for item in submitted:
        pending.append(item)
        if len(pending) == depth:
            settle()
    while pending:
        settle()
    return exact, wrong


def builtin_round_fn(vocab_size: int) -> RoundFn:
    def fn(t: int, requests: list[RoundRequest], budget_s: float) -> Drafts:
        return [deterministic_draft(r, vocab_size) for r in requests]

    return fn


# ---------------------------------------------------------------------------------------------
# Fault injection (tests, drills, benchmarks). Deterministic per round so failures reproduce.

STALL_POINTS = ("read", "write", "claim", "release")


@dataclass
class FaultPlan:
    seed: int = 0
    p_delay: float = 0.0  # sleep delay_ms inside the round (beyond the deadline: a watchdog round)
    delay_ms: float = 0.0
    p_exception: float = 0.0
    p_disconnect: float = 0.0
    p_timeout: float = 0.0
    p_bad_reply: float = 0.0  # the round function returns garbage; the proxy must catch it
    p_corrupt: float = 0.0  # the proxy itself writes a corrupt OK reply; the engine must catch it
    p_stall: float = 0.0  # stop for stall_ms at one of stall_points
    stall_ms: float = 0.0
    stall_points: list[str] = field(default_factory=lambda: list(STALL_POINTS))
    every: int = 0  # if > 0, only rounds with t % every == 0 are considered
    in_selftest: bool = False  # also fault the engine's start-up self-test rounds

    def pick(self, t: int) -> tuple[str, str]:
        """(fault, stall point) for round t; ('', '') when the round runs clean."""
        if self.every and t % self.every:
            return "", ""
        rng = np.random.default_rng([self.seed, t])
        u = float(rng.random())
        for name in ("delay", "exception", "disconnect", "timeout", "bad_reply", "corrupt", "stall"):
            p = getattr(self, f"p_{name}")
            if u < p:
                point = self.stall_points[int(rng.integers(len(self.stall_points)))] if name == "stall" else ""
                return name, point
            u -= p
        return "", ""


def _faulty(fn: RoundFn, plan: FaultPlan, vocab_size: int) -> RoundFn:
    def wrapped(t: int, requests: list[RoundRequest], budget_s: float) -> Drafts:
        fault, _ = plan.pick(t)
        if fault == "delay":
            time.sleep(plan.delay_ms / 1000)
        elif fault == "exception":
            raise RuntimeError(f"injected exception in round {t}")
        elif fault == "disconnect":
            raise RoundFailure(Status.DISCONNECT, "injected disconnect")
        elif fault == "timeout":
            raise RoundFailure(Status.TIMEOUT, "injected timeout")
        out = fn(t, requests, budget_s)
        if fault == "bad_reply" and out:
            d, c = out[0]
            out[0] = (np.full(len(d) + 3, vocab_size + 5, np.int32), np.zeros(len(d) + 3, np.float32))
        return out

    return wrapped


def make_round_fn(spec: dict) -> RoundFn:
    """Build the round function a proxy (or a sync engine) runs, from a JSON-able spec."""
    kind = spec.get("kind", "builtin")
    vocab = int(spec["vocab_size"])
    if kind == "builtin":
        fn = builtin_round_fn(vocab)
    elif kind == "worker":
        from draftrelay.wire.roundfn import worker_round_fn  # numpy-only client

        fn = worker_round_fn(spec)
    else:
        raise ValueError(f"unknown round function kind {kind!r} (expected 'builtin' or 'worker')")
    faults = spec.get("faults")
    if faults:
        fn = _faulty(fn, FaultPlan(**faults), vocab)
    return fn


def check_drafts(out: object, requests: list[RoundRequest], vocab_size: int, max_drafts: int):
    """Validate a round function's output; returns (counts, drafts, conf) arrays for the reply."""
    if not isinstance(out, list) or len(out) != len(requests):
        raise RoundFailure(Status.BAD_REPLY, f"expected {len(requests)} draft blocks, got {type(out).__name__}")
    n = len(requests)
    counts = np.zeros(n, np.int32)
    drafts = np.zeros((n, max_drafts), np.int32)
    conf = np.zeros((n, max_drafts), np.float32)
    for i, (req, block) in enumerate(zip(requests, out, strict=True)):
        d, c = block
        d = np.asarray(d)
        c = np.asarray(c)
        k = len(d)
        if k > req.n_out or len(c) != k:
            raise RoundFailure(Status.BAD_REPLY, f"request {req.req_id}: {k} drafts for n_out={req.n_out}")
        if k and (d.min() < 0 or d.max() >= vocab_size):
            raise RoundFailure(Status.BAD_REPLY, f"request {req.req_id}: draft id outside [0, {vocab_size})")
        counts[i] = k
        drafts[i, :k] = d
        conf[i, :k] = c
    return counts, drafts, conf


# ---------------------------------------------------------------------------------------------
# The serving loop


def serve(region: Region, round_fn: RoundFn, *, spin_us: int = 50, nap_us: int = 20,
          round_budget_s: float = 0.15, faults: FaultPlan | None = None,
          parent_pid: int | None = None) -> None:
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

    reported_reconnects = 0
    t = native.load32(a_released) + 1
    while True:
        rc = native.wait_geq32(a_gathered, t, spin_us, nap_us, 100_000, a_stop)
        if rc == native.WAIT_ABORTED:
            return
        if rc == native.WAIT_TIMEOUT:
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # the engine is gone
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
        np.copyto(private, staging[s])
        if native.geq32(native.load32(a_gathered), t + 2):
            count(Counter.TORN_SKIPPED)  # slot s was re-staged for t+2 while we copied it
            t = native.load32(a_gathered)
            continue
        count(Counter.ROUNDS)
        status, counts, drafts, conf = Status.OK, None, None, None
        try:
            flags, requests = unpack_staging(L, private, t)
            fn = selftest_fn if flags & FLAG_SELFTEST else round_fn
            out = fn(t, requests, round_budget_s)
            counts, drafts, conf = check_drafts(out, requests, cfg.vocab_size, cfg.max_drafts)
        except DescriptorError:
            status = Status.BAD_DESC
        except RoundFailure as f:
            status = f.status
        except Exception:
            status = Status.EXCEPTION
        if status != Status.OK:
            counts = drafts = conf = None
        # The GPU acknowledged round t-2 before it staged t (stream order); re-check, bounded.
        native.wait_geq32(a_consumed, t - 2, 0, 50, 200_000, a_stop)
        stall(point, fault, "write")
        write_reply(L, replies[s], t, status, counts, drafts, conf)
        if fault == "corrupt" and counts is not None and len(counts):
            replies[s][L.reply_counts_off:L.reply_counts_off + 4].view("<i4")[0] = cfg.max_drafts + 7
        stall(point, fault, "claim")
        if native.claim32(a_claim[s], 2 * t, 2 * t):
            stall(point, fault, "release")
            native.store64(a_last_release, native.now_ns())
            native.store_max32(a_released, t)
            count(Counter.PUBLISHED)
            if status != Status.OK:
                count(Counter.FAILED)
        else:
            count(Counter.LATE_DISCARDED)
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
        round_fn = make_round_fn(spec)
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
              round_budget_s=float(spec.get("round_budget_s", 0.15)), faults=faults, parent_pid=parent)
    finally:
        if args.audit:
            _audit(args.audit)
        native.store32(a_state, ProxyState.STOPPED)
        heartbeat.stop()
    return 0


if __name__ == "__main__":
    # Run the package module's main, not this __main__ copy: round functions raise
    # draftrelay.handoff.proxy.RoundFailure, and the loop must catch that very class.
    from draftrelay.handoff import proxy as _package_module

    sys.exit(_package_module.main())
