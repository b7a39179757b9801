"""StandInGroup: the collectives of one rank alone, the identity.

Exact for world 1 (the TP drafter's unsplit code); for `solo` (rank 0 of a larger split) it only stands
in, to time one rank's own share of the work. The same methods as EmulatedGroup and P2PGroup.
"""

from __future__ import annotations


class StandInGroup:
    """Collectives for one rank alone: the identity. Exact for world 1 (the unsplit code); for `solo`
    (rank 0 of a larger split) it only stands in, to time a rank's own work."""

    world_size = 1

    def all_reduce(self, rank, x, out=None, stream=None):
        return x if out is None else out.copy_(x)

    def shard_argmax(self, rank, logits, offset, top2=False, stream=None):
        v, i = logits.max(dim=-1)  # the first maximal index, as argmax
        return v.float(), i + offset, None

    def argmax_exchange(self, rank, val, idx, val2=None, *, vocab, out=None, stream=None):
        return val, idx, val2

    def errors(self):
        return [0]

    def check(self):
        return None

    def reset(self, *a, **k):
        return None

    def cancel(self):
        return None

    def close(self):
        return None
