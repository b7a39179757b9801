"""The round vocabulary: what one drafting round asks, what it answers, and how it can fail.

Every party speaks it: the engine (plans rounds, reads results), the proxy process (runs a round
function between the engine's stream wait and its release), the wire round function (one STEP per
round) and the tests. It is numpy-only and imports nothing else of the package, so the torch-free
proxy and the wire client can use it, and no module has to import a peer to learn a round's shape.

    RoundRequest   one request's block: tokens the drafter has not seen, where they go, drafts wanted
    RoundFn        (t, requests, budget_s) -> per request (drafts int32, confidences float32)
    RoundFailure   a round function's known failure; its Status goes into the reply
    check_drafts   a round function's output checked and laid out as reply arrays
    RoundResult    what the engine uses from round t (zero drafts unless the status is OK)
    Rounds         the interface the engine drives: LocalRounds, SyncRounds, AsyncRounds
    StampedRounds  Rounds run by a proxy process whose results carry stamps (AsyncRounds)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np


class Status(IntEnum):
    """Round outcome, as written in a reply (or derived by the engine when it refuses one)."""

    NONE = 0
    OK = 1
    WATCHDOG = 2  # the watchdog claimed the round: zero drafts
    TIMEOUT = 3
    DISCONNECT = 4
    BAD_REPLY = 5  # the worker's reply, or the reply slot itself, failed validation
    EXCEPTION = 6
    BREAKER = 7  # circuit breaker open: failing fast
    BAD_DESC = 8  # the proxy refused the round's descriptor
    ENQUEUE = 9  # could not send the request
    STALE = 10  # the reply slot did not belong to this round (engine-side verdict)
    UNAVAILABLE = 11  # no proxy / async off for this round


@dataclass
class RoundRequest:
    """One request's block in a round: what the drafter needs to extend its KV and draft.
    n_out == 0 with no tokens is the engine saying "finished" (an END block)."""

    req_id: int
    generation: int
    position: int  # position of tokens[0] in the request's sequence
    tokens: np.ndarray  # int32: tokens accepted since the last round (the prompt on the first)
    n_out: int
    # the confidence stop: the drafter ends this request's drafts after the first one it is less sure of
    # than this (0: off; None: the round function's own setting). Fewer than n_out drafts may come back.
    min_conf: float | None = None


def end_block(req_id: int, generation: int, position: int) -> RoundRequest:
    """The block that lets the drafter free a finished or cancelled request's KV."""
    return RoundRequest(req_id, generation, position, np.zeros(0, np.int32), 0)


@dataclass
class RoundResult:
    """What the engine uses from round t. counts[i] == 0 for every request unless status is OK."""

    round: int
    status: Status
    counts: np.ndarray  # int32 [n_req]
    drafts: np.ndarray  # int32 [n_req, max_drafts]; only drafts[i, :counts[i]] are meaningful
    conf: np.ndarray  # float32 [n_req, max_drafts]
    detail: str = ""
    # where an async round ran: the stream round it used and the proxy generation that answered it.
    # Side data the proxy writes per round (the speculation cache's branch tables) carry these stamps.
    stream_round: int | None = None
    proxy_generation: int = 0

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


def zero_result(t: int, n_req: int, max_drafts: int, status: Status, detail: str = "") -> RoundResult:
    """A round that yields no drafts, and why."""
    return RoundResult(t, status, np.zeros(n_req, np.int32), np.zeros((n_req, max_drafts), np.int32),
                       np.zeros((n_req, max_drafts), np.float32), detail)


# A round function: (t, requests, budget_s) -> per request (drafts int32[<=n_out], conf float32[same]).
Drafts = list[tuple[np.ndarray, np.ndarray]]
RoundFn = Callable[[int, list[RoundRequest], float], Drafts]


class RoundFailure(Exception):
    """A round that failed in a known way; the status says how."""

    def __init__(self, status: Status, detail: str = "") -> None:
        super().__init__(detail or status.name)
        self.status = status


def check_drafts(out: object, requests: list[RoundRequest], vocab_size: int,
                 max_drafts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a round function's output; returns (counts, drafts, conf) arrays for the reply.
    Anything off (block count, more drafts than n_out, ids outside the vocabulary) is BAD_REPLY."""
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


@runtime_checkable
class Rounds(Protocol):
    """Where the engine's drafts come from. `submit` starts round t (sync: runs it; async: only
    enqueues it on the stream) and returns its id; `result(t)` is its RoundResult, once.

    The device path (CUDA async rounds): when `device_replies` is true, `reply_device_buffer(t)`
    is the device memory (uint8) the stream copies round t's reply slot into, laid out as
    `reply_layout` (a handoff.region.Layout); the engine enqueues its verify right behind it.
    Otherwise `reply_device_buffer` returns None and the engine verifies on the host's drafts."""

    mode: str  # "local" | "sync" | "async"
    refusal: str  # why async was refused ("" when it was not)

    @property
    def capacity(self) -> int | None:
        """Blocks one round may carry (the engine's requests plus END blocks); None: no limit of
        its own (the engine then sends at most as many blocks as it has KV rows)."""
        ...

    @property
    def device_replies(self) -> bool: ...

    @property
    def reply_layout(self) -> Any: ...

    def submit(self, requests: list[RoundRequest]) -> int: ...

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult: ...

    def reply_device_buffer(self, t: int) -> Any | None: ...

    def stats(self) -> dict: ...

    def close(self) -> None:
        """Free everything, the drafter session included (a worker reserves KV rows per session)."""
        ...


@runtime_checkable
class StampedRounds(Rounds, Protocol):
    """Rounds a proxy process runs, whose results carry `stream_round` and `proxy_generation`: what the
    speculation cache (engine/spec_cache.py) needs to match a branch table the proxy wrote after a
    round to that round. `result(t, timeout_s)` raises TimeoutError when round t is not done in time
    (and round t stays collectable)."""

    generation: int  # the proxy's incarnation: bumped by every respawn, carried as proxy_generation

    @property
    def round_spec(self) -> dict:
        """The spec the proxy's round function was built from (draftrelay.wire.roundfn)."""
        ...

    @property
    def deadline_s(self) -> float:
        """The watchdog deadline of a round: no round stays in flight much longer."""
        ...
