"""Round planning: what each request sends the drafter this step and how many drafts it asks, and
the drafter bookkeeping a round's result implies.

Per request the engine knows what the drafter holds (`synced`: the position of the next block) and
which incarnation it is (`generation`). A round sends each request the tokens the drafter has not
seen, at most `max_round_tokens` of them, so a long prompt reaches the drafter over several rounds
(target-only steps meanwhile) and no round has to prefill 100K tokens within its deadline; a request
still catching up asks for no drafts. After the round:

  failed / watchdog   no drafts; nothing moves, the next round resends from `synced`
  OK with drafts      `synced` advances by what was sent
  OK, none asked for  the drafter does not know the request (a new session) or refused the block:
                      restart it from position 0 with the next generation; after 3 restarts in a
                      row without a single draft, stop asking

Finished and cancelled requests the drafter has seen leave an END block, sent in a later round
where there is room, so the worker frees their draft KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from draftrelay.round import RoundRequest, RoundResult, end_block

from .request import Request


@dataclass
class RoundPlan:
    batch: list[Request]
    wanted: list[int]  # drafts each request would take now (0: target-only for it)
    send: list[list[int]]  # tokens each request sends the drafter
    n_out: list[int]  # drafts asked: `wanted`, or 0 while the drafter catches up on the context

    @property
    def asks(self) -> bool:
        """Whether this step has a round at all."""
        return any(self.wanted)

    @property
    def width(self) -> int:
        """Verify width if every asked draft comes: the pending token + the most drafts asked."""
        return 1 + max(self.n_out)


class RoundPlanner:
    def __init__(self, n_draft: int, max_round_tokens: int) -> None:
        self.n_draft, self.max_round_tokens = n_draft, max_round_tokens
        self._ends: list[RoundRequest] = []  # finished requests the drafter may forget

    def wanted(self, req: Request, k: int | None = None) -> int:
        if req.no_drafts:
            return 0
        # never draft past max_tokens: the last token of a request is always the target's own
        return max(0, min(self.n_draft if k is None else k, req.params.max_tokens - len(req.output) - 1))

    def plan(self, batch: list[Request], drafting: bool, k: int | None = None) -> RoundPlan:
        """k: this step's depth (the depth policy's choice; None: n_draft)."""
        lens = [r.seq_len for r in batch]
        wanted = [self.wanted(r, k) for r in batch] if drafting else [0] * len(batch)
        M = self.max_round_tokens
        send = [r.tokens(r.synced, min(n, r.synced + M)) for r, n in zip(batch, lens, strict=True)]
        n_out = [w if r.synced + len(x) == n else 0 for r, n, x, w in zip(batch, lens, send, wanted, strict=True)]
        return RoundPlan(batch, wanted, send, n_out)

    def blocks(self, plan: RoundPlan, capacity: int) -> list[RoundRequest]:
        """The round's blocks: one per request of the batch, then END blocks while there is room."""
        reqs = [RoundRequest(r.id, r.generation, r.synced, np.asarray(x, np.int32), n)
                for r, x, n in zip(plan.batch, plan.send, plan.n_out, strict=True)]
        room = max(0, capacity - len(reqs))
        ends, self._ends = self._ends[:room], self._ends[room:]
        return reqs + ends

    def end(self, req: Request) -> None:
        """`req` is finished or cancelled: tell the drafter in a later round (if it ever saw it)."""
        if req.synced:
            self._ends.append(end_block(req.id, req.generation, req.synced))

    def forget_ends(self) -> None:
        """The drafter changed (set_rounds): END blocks for the old one are moot."""
        self._ends.clear()

    def settle(self, plan: RoundPlan, res: RoundResult, vocab: int) -> list[list[int]]:
        """The drafts usable for each request, and the drafter bookkeeping the round implies."""
        out = []
        for i, r in enumerate(plan.batch):
            if not res.ok:  # failed / watchdog: target-only; resend from r.synced next round
                out.append([])
                continue
            n_out = plan.n_out[i]
            c = int(res.counts[i])
            d = res.drafts[i, :min(c, n_out)]
            if len(d) and (d.min() < 0 or d.max() >= vocab):  # never trust a draft id
                d = d[:0]
            if n_out and c == 0:
                r.restarts += 1
                r.no_drafts = r.restarts > 3
                r.generation += 1
                r.synced = 0
            else:
                r.synced += len(plan.send[i])
                if c:
                    r.restarts = 0
            out.append(d.tolist())
        return out
