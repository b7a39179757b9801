"""The proxy's half of the speculation cache: rounds that ask the worker for a branch table, and the
write of that table into the engine's table memory right after the round was released.

`BranchRounds(inner, spec, vocab)` wraps the worker round function: its STEP asks for `fanout`
branches, and `after_release(t, next_round)` (called by the proxy loop once round t is released, so the
engine's verify is already running) reads the worker's BRANCHES frame, validates it
(draftrelay.speculation.table.decode) and writes it into the table slot of round t. It waits for the
frame until `branch_budget_s` passes or the engine posts its next round (`next_round()`), whichever is
first: then the proxy sends that round's STEP at once, so the worker finds it waiting and cuts branch
work that would come too late (worker/prefetch.py), and a BRANCHES frame that still arrives ahead of that
STEP's reply is written then (the client's on_late_branches): the engine waits for a table until its
next round is answered. Any failure here (timeout, disconnect, bad bytes, no room) just leaves no table:
the engine's next round is then an ordinary one. Fault injection for tests (`push_faults`): drop, late
(written one round later), duplicate (the previous table again), reorder (the previous table after the
current one), corrupt (bytes changed after the crc), forge (a wrong but well-formed, checksummed table).

spec["spec_cache"]: {"fd": memfd of the table slots (inherited), "fanout": F, "branch_budget_s": s,
"push_faults": {...}}. numpy + the wire client only.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from draftrelay.handoff.branch_shm import TableShm
from draftrelay.speculation import table as TB
from draftrelay.wire import protocol as P
from draftrelay.wire.client import WireTimeout


@dataclass
class PushFaults:
    seed: int = 0
    p_drop: float = 0.0
    p_late: float = 0.0  # held back and written one round later, after the engine needed it
    p_duplicate: float = 0.0
    p_reorder: float = 0.0
    p_corrupt: float = 0.0
    p_forge: float = 0.0

    def pick(self, t: int) -> str:
        u = float(np.random.default_rng([self.seed, t, 77]).random())
        for name in ("drop", "late", "duplicate", "reorder", "corrupt", "forge"):
            p = getattr(self, f"p_{name}")
            if u < p:
                return name
            u -= p
        return ""


# how often the wait for a BRANCHES frame looks whether the engine posted its next round: that round's STEP
# then goes out at once (a table that comes later than a round would be no use; the worker cuts its work)
SLICE_S = 0.0005


class BranchRounds:
    def __init__(self, inner, spec: dict, vocab_size: int) -> None:
        self.inner = inner
        self.client = inner.client
        self.fanout = int(spec.get("fanout", 8))
        self.budget_s = float(spec.get("branch_budget_s", 0.05))
        self.vocab = vocab_size
        self.shm = TableShm.open(int(spec["fd"]))
        self.faults = PushFaults(**spec["push_faults"]) if spec.get("push_faults") else None
        self._want = False
        self._t = 0  # the round being answered (set by __call__)
        self._pending: tuple[int, int] | None = None  # (round, STEP seq) whose BRANCHES frame is still due
        self._prev = b""
        self._held: tuple[int, bytes] | None = None
        self.stats = {"tables": 0, "missing": 0, "bad": 0, "too_big": 0, "paused_steps": 0, "left_pending": 0,
                      "late_written": 0}
        self.client.on_late_branches = self._late
        step = self.client.step
        fanout = self.fanout

        def step_with_branches(blocks, timeout=None, **kw):
            f = self.shm.fanout(fanout)  # the engine's choice (engine/cache_guard.py), else the spec's
            if f == 0:  # the engine measured its steps faster without tables: no branch work
                self.stats["paused_steps"] += 1
                return step(blocks, timeout)
            reply = step(blocks, timeout, fanout=min(f, P.MAX_FANOUT))
            self._want = True  # the STEP went through: its BRANCHES frame follows
            self._pending = (self._t, self.client.last_seq)
            return reply

        self.client.step = step_with_branches  # the inner round function sends its STEP through this

    @property
    def reconnects(self) -> int:
        return getattr(self.inner, "reconnects", 0)

    def keepalive(self) -> bool:
        ka = getattr(self.inner, "keepalive", None)
        return bool(ka()) if ka is not None else False

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __call__(self, t, requests, budget_s):
        self._want = False
        self._t = t
        return self.inner(t, requests, budget_s)

    def after_release(self, t: int, next_round: Callable[[], bool] = lambda: False) -> None:
        """Round t's table, read and written while the engine verifies round t. next_round() True: the
        engine has posted its next round (its verify is done): stop waiting here, the frame is still
        taken if it comes ahead of that round's reply."""
        if not self._want:
            return
        self._want = False
        deadline = time.monotonic() + self.budget_s
        while True:
            left = deadline - time.monotonic()
            try:
                body = bytes(self.client.recv_branches(min(left, SLICE_S)))
                break
            except WireTimeout:
                if left <= SLICE_S:
                    self.stats["missing"] += 1
                    return  # (still pending: a frame that comes later is taken as late as it is useful)
                if next_round():
                    self.stats["left_pending"] += 1
                    return
            except Exception:  # a disconnect or a bad frame: no table this round
                self._pending = None
                self.stats["missing"] += 1
                return
        self._pending = None
        self._publish(t, body)

    def _late(self, seq: int, payload: memoryview) -> None:
        """The client met a BRANCHES frame while awaiting a later reply: round t's, if it is the one due."""
        pending, self._pending = self._pending, None
        if pending is None or pending[1] != seq:
            return
        try:
            self._publish(pending[0], bytes(payload))
            self.stats["late_written"] += 1
        except Exception:  # nothing here may fail the round it arrived in
            self.stats["bad"] += 1

    def _publish(self, t: int, body: bytes) -> None:
        try:
            TB.decode(body, self.vocab)  # validate before it goes anywhere near the engine
        except TB.TableError:
            self.stats["bad"] += 1
            return
        fault = self.faults.pick(t) if self.faults else ""
        prev, self._prev = self._prev, body
        held, self._held = self._held, None
        crc = None
        if held is not None:  # a table held back one round ("late") arrives now, after its round was used
            self.shm.write(*held)
        if fault == "drop":
            return
        if fault == "late":
            self._held = (t, body)
            return
        if fault == "duplicate" and prev:
            body = prev
        elif fault == "corrupt" and len(body) > TB.TABLE_HEAD.size:
            crc = zlib.crc32(body)
            b = bytearray(body)
            b[-1] ^= 0x5A
            body = bytes(b)
        elif fault == "forge":
            body = _forged(body, self.vocab)
        if not self.shm.write(t, body, crc):
            self.stats["too_big"] += 1
            return
        if fault == "reorder" and prev:
            self.shm.write(t, prev)  # the older table lands after the newer one
        self.stats["tables"] += 1


def _forged(body: bytes, vocab: int) -> bytes:
    """A well-formed table with every branch's drafts shifted: the prefixes still match real outcomes,
    so the engine selects branches whose drafts are wrong. Verification must still keep the output."""
    t = TB.decode(body, vocab)
    for e in t.entries:
        e.branch_drafts = ((e.branch_drafts + 1) % vocab).astype(np.int32)
    return TB.encode(t)


def with_branches(fn, spec: dict, vocab_size: int) -> BranchRounds:
    return BranchRounds(fn, spec, vocab_size)


def wrap_for(spec: dict) -> tuple[list[BranchRounds], object]:
    """For make_round_fn's `wrap_worker`: ([], None) without spec["spec_cache"]; else a list that will
    hold the BranchRounds made, and the wrapper that makes it (the proxy loop calls its after_release)."""
    sc = spec.get("spec_cache")
    if not sc:
        return [], None
    made: list[BranchRounds] = []

    def wrap(fn):
        made.append(with_branches(fn, sc, int(spec["vocab_size"])))
        return made[-1]

    return made, wrap
