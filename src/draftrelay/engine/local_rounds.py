"""In-process rounds around a round function: for tests, and for a drafter inside the engine process."""

from __future__ import annotations

from collections import Counter

import numpy as np

from draftrelay.round import RoundFn, RoundRequest, RoundResult, Status


class LocalRounds:
    """draftrelay.round.Rounds around fn(t, requests, budget_s) -> [(drafts, conf)], run at submit.
    capacity None: a round carries as many blocks as the engine has rows."""

    mode = "local"
    refusal = ""
    device_replies = False
    reply_layout = None

    def __init__(self, fn: RoundFn, max_drafts: int = 16, capacity: int | None = None) -> None:
        self.fn, self.max_drafts, self.capacity = fn, max_drafts, capacity
        self._t = 0
        self._results: dict[int, RoundResult] = {}
        self._by_status: Counter = Counter()

    def submit(self, requests: list[RoundRequest]) -> int:
        self._t += 1
        n, D = len(requests), self.max_drafts
        counts, drafts, conf = np.zeros(n, np.int32), np.zeros((n, D), np.int32), np.zeros((n, D), np.float32)
        for i, (d, c) in enumerate(self.fn(self._t, requests, 1.0)):
            counts[i] = len(d)
            drafts[i, :len(d)], conf[i, :len(d)] = d, c
        self._results[self._t] = RoundResult(self._t, Status.OK, counts, drafts, conf)
        return self._t

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult:
        res = self._results.pop(t)
        self._by_status[res.status.name.lower()] += 1
        return res

    def reply_device_buffer(self, t: int) -> None:
        return None

    def stats(self) -> dict:
        return {"mode": self.mode, "refusal": "", "rounds": sum(self._by_status.values()), **self._by_status}

    def close(self) -> None:
        pass
