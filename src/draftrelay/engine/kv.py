"""The target KV cache's rows: the one place a row is taken and given back.

The cache has `n` rows for requests plus one spare past them, which the decode-graph path pads
batches with (its contents are never read back) and which is never handed out. A row is reset
when it is taken and when it is given back, so a stale length can never leak into the next request.
"""

from __future__ import annotations

import bisect

from draftrelay.model import KVCache


class KVRows:
    def __init__(self, cache: KVCache, n: int) -> None:
        self.cache = cache
        self.n = n
        self._free = list(range(n))  # sorted: the lowest free row is taken first

    @property
    def free(self) -> list[int]:
        return list(self._free)

    def __bool__(self) -> bool:
        """Whether a row is free."""
        return bool(self._free)

    def is_free(self, row: int) -> bool:
        return row in self._free

    def alloc(self) -> int:
        row = self._free.pop(0)
        self.cache.reset(row)
        return row

    def release(self, row: int) -> None:
        """Give `row` back (idempotent)."""
        if not 0 <= row < self.n:
            raise ValueError(f"KV row {row} is not one of the engine's rows [0, {self.n})")
        self.cache.reset(row)
        if row not in self._free:
            bisect.insort(self._free, row)

    def set_len(self, row: int, n: int) -> None:
        """Roll the row to `n` valid positions: eager forwards advanced it to start + T, graph
        replays did not touch lengths at all, and only the accepted positions count."""
        self.cache.lengths[row] = n
