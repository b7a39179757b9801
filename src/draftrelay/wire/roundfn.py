"""The round functions a proxy (or a sync engine) runs, built from a JSON-able spec: numpy + the wire
client only.

`make_round_fn(spec)` is the one factory: kind "builtin" (the deterministic drafter, draftrelay.testing)
or "worker" (a remote drafter worker), optionally wrapped in a fault plan (spec["faults"]).

`worker_round_fn(spec)` returns fn(t, requests, budget_s) -> [(drafts int32, conf float32)] per
request (a draftrelay.round.RoundFn). One round is one STEP frame; every way it can fail becomes a
RoundFailure with the matching status, so the proxy releases the stream with zero drafts:

  WireTimeout -> TIMEOUT      WireDisconnected -> DISCONNECT     WireBreakerOpen -> BREAKER
  WireBadReply / WireRemoteError -> BAD_REPLY                    encoding error -> ENQUEUE

A block the worker refused (UNKNOWN_REQUEST after a reconnect, STALE_GENERATION, ...) comes back as
zero drafts for that request only; the engine then restarts the request with a higher generation
from position 0. A request with n_out == 0 and no tokens is the engine saying "finished": it is
sent as an END block so the worker frees the request's draft KV.

spec keys (JSON): host, port, and optionally model_id, vocab_size, tokenizer_hash, n_out_max,
max_requests, connect_timeout_s, breaker_failures, breaker_cooldown_s, client_name, the round's
size-following budget (`RoundBudget`): budget_per_catch_up_ms, budget_per_token_us, and draft_stop (the
confidence stop every block carries unless its request sets one: the worker ends a request's drafts
after the first one it is less sure of than this; 0, the default, is off).

The budget a round gets follows its size: the caller's budget is what a steady round (every request
sending its k + 1 accepted tokens) may take; a round that also carries requests catching up (a new
request's prompt, a request the drafter lost) makes the worker prefill those tokens first, on its
eager path, so such a round gets more time for each of them (RoundBudget). A fixed budget timed such
rounds out: a batch of new requests then never reached the drafter, every retry carried more, and
the client's breaker opened.
This module must not import torch: the proxy process refuses to serve if torch is loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from draftrelay.round import RoundFailure, RoundFn, RoundRequest, Status
from draftrelay.testing import FaultPlan, builtin_round_fn, faulty
from draftrelay.wire import protocol as P
from draftrelay.wire.client import (
    DrafterClient,
    WireBadReply,
    WireBreakerOpen,
    WireDisconnected,
    WireError,
    WireTimeout,
    security_from_spec,
)

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


def client_from_spec(spec: dict) -> DrafterClient:
    if "port" not in spec:
        raise ValueError("worker round spec needs 'port' (and usually 'host')")
    return DrafterClient(
        str(spec.get("host", "127.0.0.1")), int(spec["port"]),
        model_id=str(spec.get("model_id", "")), vocab_size=int(spec.get("vocab_size", 0)),
        tokenizer_hash=str(spec.get("tokenizer_hash", "")), n_out_max=int(spec.get("n_out_max", 8)),
        max_requests=int(spec.get("max_requests", 8)), client_name=str(spec.get("client_name", "draftrelay-proxy")),
        connect_timeout=float(spec.get("connect_timeout_s", 1.0)),
        breaker_failures=int(spec.get("breaker_failures", 3)),
        breaker_cooldown=float(spec.get("breaker_cooldown_s", 1.0)), **security_from_spec(spec))


def to_blocks(requests: list[RoundRequest], min_conf: float = 0.0) -> list[P.Block]:
    """The STEP blocks of a round; min_conf: the confidence stop of requests that do not set their own."""
    out = []
    for r in requests:
        end = r.n_out == 0 and len(r.tokens) == 0
        stop = min_conf if r.min_conf is None or end else r.min_conf
        out.append(P.Block(int(r.req_id), int(r.generation), int(r.position), np.asarray(r.tokens, np.int32),
                           int(r.n_out), P.FLAG_END if end else 0, 0.0 if end else float(stop)))
    return out


CATCH_UP_TOKENS = 16  # a request sending more tokens than this is catching up (the worker's PAD_LIMIT)


class RoundBudget:
    """The time one round may take: the steady budget plus per_catch_up_s for every request that
    sends more than CATCH_UP_TOKENS tokens (the worker prefills it alone, eagerly: a fixed cost per
    request on a launch-bound GPU) and per_token_s for each of its tokens beyond those."""

    PER_CATCH_UP_MS, PER_TOKEN_US = 10.0, 20.0  # the defaults (spec keys budget_per_catch_up_ms, _per_token_us)

    def __init__(self, per_catch_up_s: float = PER_CATCH_UP_MS / 1e3, per_token_s: float = PER_TOKEN_US / 1e6) -> None:
        if not (per_catch_up_s >= 0 and per_token_s >= 0):
            raise ValueError(f"RoundBudget: per_catch_up_s and per_token_s must be >= 0, got "
                             f"{per_catch_up_s}, {per_token_s}")
        self.per_catch_up_s, self.per_token_s = per_catch_up_s, per_token_s

    def __call__(self, steady_s: float, requests: list[RoundRequest]) -> float:
        extra = 0.0
        for r in requests:
            n = len(r.tokens)
            if n > CATCH_UP_TOKENS:
                extra += self.per_catch_up_s + self.per_token_s * (n - CATCH_UP_TOKENS)
        return steady_s + extra

    def extra_us(self, requests: list[RoundRequest]) -> int:
        """Microseconds the round gets beyond a steady one (the async watchdog's deadline extension),
        within a u32."""
        return min(0xFFFFFFFF, int(self(0.0, requests) * 1e6))

    @classmethod
    def from_spec(cls, spec: dict) -> RoundBudget:
        return cls(float(spec.get("budget_per_catch_up_ms", cls.PER_CATCH_UP_MS)) / 1e3,
                   float(spec.get("budget_per_token_us", cls.PER_TOKEN_US)) / 1e6)


class WorkerRoundFn:
    """The round function (a callable): one STEP per round through one DrafterClient, with the
    time the round's size needs (RoundBudget)."""

    def __init__(self, client: DrafterClient, budget: RoundBudget | None = None, draft_stop: float = 0.0) -> None:
        """draft_stop: the confidence stop of every block whose request sets none (0: off)."""
        self.client = client
        self.budget = budget or RoundBudget()
        self.draft_stop = P.check_min_conf(draft_stop, "draft_stop")

    @property
    def reconnects(self) -> int:
        """Connections opened after the first one (each one is a new worker session)."""
        return max(0, self.client.stats["connects"] - 1)

    def close(self) -> None:
        """End the worker session now (BYE): its draft-KV rows are reserved until then."""
        self.client.close()

    def keepalive(self) -> bool:
        """Between rounds: keep the worker session from expiring while no round runs (DrafterClient)."""
        return self.client.keepalive()

    def __call__(self, t: int, requests: list[RoundRequest], budget_s: float) -> list[tuple[np.ndarray, np.ndarray]]:
        if not requests:
            return []
        try:
            blocks = to_blocks(requests, self.draft_stop)
            reply = self.client.step(blocks, timeout=self.budget(budget_s, requests))
        except WireTimeout as exc:
            raise RoundFailure(Status.TIMEOUT, str(exc)) from None
        except WireBreakerOpen as exc:
            raise RoundFailure(Status.BREAKER, str(exc)) from None
        except WireDisconnected as exc:
            raise RoundFailure(Status.DISCONNECT, str(exc)) from None
        except WireBadReply as exc:
            raise RoundFailure(Status.BAD_REPLY, str(exc)) from None
        except WireError as exc:  # WireRemoteError: an ERROR frame instead of a reply
            raise RoundFailure(Status.BAD_REPLY, str(exc)) from None
        except (ValueError, OverflowError) as exc:  # a block that cannot be encoded
            raise RoundFailure(Status.ENQUEUE, str(exc)) from None
        out = []
        for i in range(len(requests)):
            st, n = int(reply.status[i]), int(reply.counts[i])
            if st in (P.OK, P.PARTIAL) and n:
                out.append((reply.drafts[i, :n].copy(), reply.confidences[i, :n].copy()))
            else:
                out.append((_EMPTY_I, _EMPTY_F))
        return out


def worker_round_fn(spec: dict, client: DrafterClient | None = None) -> RoundFn:
    stop = P.check_min_conf(spec.get("draft_stop", 0.0), "round spec draft_stop")  # before connecting
    return WorkerRoundFn(client or client_from_spec(spec), RoundBudget.from_spec(spec), stop)


def make_round_fn(spec: dict, wrap_worker: Callable[[WorkerRoundFn], RoundFn] | None = None) -> RoundFn:
    """Build the round function a proxy (or a sync engine) runs, from a JSON-able spec. wrap_worker:
    applied to a worker round function before any fault plan (the proxy's speculation-cache push,
    handoff/branch_push.py, which needs the worker's client)."""
    kind = spec.get("kind", "builtin")
    vocab = int(spec["vocab_size"])
    if kind == "builtin":
        fn = builtin_round_fn(vocab)
    elif kind == "worker":
        fn = worker_round_fn(spec)
        if wrap_worker is not None:
            fn = wrap_worker(fn)
    else:
        raise ValueError(f"unknown round function kind {kind!r} (expected 'builtin' or 'worker')")
    faults = spec.get("faults")
    if faults:
        fn = faulty(fn, FaultPlan(**faults), vocab)
    return fn
