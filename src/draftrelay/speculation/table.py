"""Branch tables: what the worker pre-drafts for round t+1 while the target verifies round t.

After answering a request's round t with drafts f1..fk from context C (|C| = base), the worker
guesses what the verify will accept: `a` of the k drafts, then the target's own token y (the
correction at position a, which differs from f_{a+1}, or the bonus after all k). Each guess (a, y)
is a *branch*: its prefix is f1..fa, y and its drafts are the drafter's k greedy tokens after
C + prefix, i.e. exactly what a round t+1 would return if the verify accepts that prefix.

The engine may use a branch only if
  - the entry names the request, its generation and base == the position the drafter holds, and
  - the tokens the engine appended since base equal the branch's prefix, token for token.
Both are checked in `select`. Since the engine only ever sends true tokens, base + prefix then pin
the drafter's context to the true sequence: the branch's drafts are the drafter's continuation of
what the target actually produced, so using them is the same as a just-in-time round (and drafts
are verified anyway: a wrong one costs speed, never a token).

A round that asked a request for no drafts (k = 0: a verify of that request without drafts, the target's
one token y) gets an entry too: its branches are the drafter's likely next tokens y (accepted 0), each
with its own drafts. So the number of drafts per branch (kb) is its own field: the depth the round asked
(k, or more where the worker's confidence stop ended round t's drafts early), the frame's depth for a
k = 0 entry. Under the confidence stop a branch also says how many of its kb drafts a round would return
(`n`: up to and including its first unsure draft, draft_stop.stop_counts); without it n = kb.

Wire/shared-memory format (little endian), shared by the BRANCHES frame and the table slots:
    head    n_entries u16, k_max u16 (the largest k or kb), worker_us u32, session_id u64
    entry   request_id u64, generation u32, base u32, k u16, n_branches u16, kb u16, reserved u16,
            drafts i32[k], then n_branches x (accepted u16, n u16, token i32, drafts i32[kb])
This module is numpy-only: the proxy imports it.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass

import numpy as np

TABLE_HEAD = struct.Struct("<HHIQ")
ENTRY_HEAD = struct.Struct("<QIIHHHH")
BRANCH_HEAD = struct.Struct("<HHi")
MAX_BRANCHES = 64
MAX_K = 64


class TableError(ValueError):
    """Bytes that are not a well-formed branch table."""


@dataclass
class Entry:
    request_id: int
    generation: int
    base: int  # context length the branches continue (the drafter's position after round t)
    drafts: np.ndarray  # int32 [k]: round t's drafts f1..fk
    accepted: np.ndarray  # int32 [n]: branch b assumes f[:accepted[b]] were kept ...
    token: np.ndarray  # int32 [n]: ... followed by token[b]
    branch_drafts: np.ndarray  # int32 [n, kb]: round t+1's drafts for that outcome (kb >= k)
    # int32 [n]: how many of a branch's kb drafts round t+1 would return (the confidence stop); None: all kb
    branch_counts: np.ndarray | None = None

    @property
    def n_branches(self) -> int:
        return len(self.accepted)

    @property
    def kb(self) -> int:
        """Drafts per branch."""
        return int(self.branch_drafts.shape[1]) if self.branch_drafts.ndim == 2 else 0

    def counts(self) -> np.ndarray:
        """Drafts each branch offers (kb each without the confidence stop)."""
        if self.branch_counts is None:
            return np.full(self.n_branches, self.kb, np.int32)
        return np.asarray(self.branch_counts, np.int32)

    def drafts_of(self, b: int, n_max: int) -> list[int]:
        """Branch b's drafts, at most n_max of them: what round t+1 returns for that outcome."""
        return self.branch_drafts[b, :min(int(self.counts()[b]), n_max)].tolist()

    def prefix(self, b: int) -> np.ndarray:
        a = int(self.accepted[b])
        return np.concatenate([self.drafts[:a], self.token[b:b + 1]]).astype(np.int32)


@dataclass
class Table:
    entries: list[Entry]
    worker_us: int = 0
    session_id: int = 0

    def entry(self, request_id: int) -> Entry | None:
        for e in self.entries:
            if e.request_id == request_id:
                return e
        return None


def encode(table: Table) -> bytes:
    k_max = max((max(len(e.drafts), e.kb) for e in table.entries), default=0)
    parts = [TABLE_HEAD.pack(len(table.entries), k_max, min(int(table.worker_us), 0xFFFFFFFF),
                             int(table.session_id))]
    for e in table.entries:
        k, n, kb = len(e.drafts), len(e.accepted), e.kb
        cnt = e.counts()
        if (k > MAX_K or kb > MAX_K or n > MAX_BRANCHES or e.branch_drafts.shape != (n, kb)
                or (k and kb < k) or cnt.shape != (n,) or (n and (int(cnt.min()) < 0 or int(cnt.max()) > kb))):
            raise TableError(f"entry {e.request_id}: k={k}, {n} branches, drafts {e.branch_drafts.shape}, "
                             f"counts {cnt.tolist()}")
        parts.append(ENTRY_HEAD.pack(int(e.request_id), int(e.generation), int(e.base), k, n, kb, 0))
        parts.append(np.ascontiguousarray(e.drafts, "<i4").tobytes())
        rec = np.zeros(n, _branch_dtype(kb))
        rec["accepted"], rec["n"], rec["token"] = e.accepted, cnt, e.token
        if kb:
            rec["drafts"] = e.branch_drafts
        parts.append(rec.tobytes())
    return b"".join(parts)


def _branch_dtype(k: int) -> np.dtype:
    """One branch record as numpy reads it: BRANCH_HEAD (accepted, n, token) then k int32 drafts."""
    fields = [("accepted", "<u2"), ("n", "<u2"), ("token", "<i4")]
    return np.dtype(fields + ([("drafts", "<i4", (k,))] if k else []))


def decode(buf, vocab_size: int) -> Table:
    """Parse and validate: counts within limits, accepted <= k, every token id inside the vocabulary,
    no trailing bytes, no request twice. Raises TableError naming what is wrong."""
    n_buf = len(buf)
    if n_buf < TABLE_HEAD.size:
        raise TableError(f"{n_buf} bytes, need at least {TABLE_HEAD.size}")
    n_entries, k_max, worker_us, session_id = TABLE_HEAD.unpack_from(buf, 0)
    off = TABLE_HEAD.size
    entries: list[Entry] = []
    seen: set[int] = set()
    for i in range(n_entries):
        if off + ENTRY_HEAD.size > n_buf:
            raise TableError(f"entry {i}: header truncated")
        rid, gen, base, k, n, kb, _ = ENTRY_HEAD.unpack_from(buf, off)
        off += ENTRY_HEAD.size
        if max(k, kb) > min(k_max, MAX_K) or n > MAX_BRANCHES:
            raise TableError(f"entry {i}: k={k}, kb={kb} (table k_max {k_max}), {n} branches "
                             f"(limit {MAX_BRANCHES})")
        if k and kb < k:
            raise TableError(f"entry {i}: {kb} drafts per branch after a round of k={k}")
        if rid in seen:
            raise TableError(f"entry {i}: request {rid} appears twice")
        seen.add(rid)
        need = 4 * k + n * (BRANCH_HEAD.size + 4 * kb)
        if off + need > n_buf:
            raise TableError(f"entry {i}: {n} branches of k={k} do not fit in the {n_buf - off} bytes left")
        drafts = np.frombuffer(buf, "<i4", k, off).astype(np.int32)
        off += 4 * k
        rec = np.frombuffer(buf, _branch_dtype(kb), n, off)
        off += n * (BRANCH_HEAD.size + 4 * kb)
        acc = rec["accepted"].astype(np.int32)
        tok = rec["token"].astype(np.int32)
        bd = rec["drafts"].astype(np.int32).reshape(n, kb) if kb else np.zeros((n, 0), np.int32)
        if n and int(acc.max()) > k:
            raise TableError(f"entry {i}: a branch keeps {int(acc.max())} of {k} drafts")
        cnt = rec["n"].astype(np.int32)
        if n and int(cnt.max()) > kb:
            raise TableError(f"entry {i}: a branch offers {int(cnt.max())} of its {kb} drafts")
        for name, arr in (("draft", drafts), ("branch token", tok), ("branch draft", bd)):
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
                raise TableError(f"entry {i}: {name} id outside [0, {vocab_size})")
        entries.append(Entry(rid, gen, base, drafts, acc, tok, bd, cnt))
    if off != n_buf:
        raise TableError(f"{n_buf - off} trailing bytes after {n_entries} entries")
    return Table(entries, worker_us, session_id)


def select(entry: Entry | None, request_id: int, generation: int, base: int, new_tokens) -> int:
    """Index of the branch whose prefix is exactly `new_tokens` (what the engine appended since `base`),
    or -1. The entry must name the request, its generation and the same base."""
    if entry is None or entry.request_id != request_id or entry.generation != generation or entry.base != base:
        return -1
    new = np.asarray(new_tokens, np.int64)
    a = len(new) - 1
    if a < 0 or a > len(entry.drafts) or not np.array_equal(new[:a], entry.drafts[:a]):
        return -1
    for b in range(entry.n_branches):
        if int(entry.accepted[b]) == a and int(entry.token[b]) == int(new[a]):
            return b
    return -1


def choose_branches(top_tokens: np.ndarray, top_probs: np.ndarray, drafts: np.ndarray, accept: np.ndarray,
                    fanout: int) -> list[tuple[int, int, float]]:
    """The `fanout` most likely outcomes (accepted a, token y, estimated probability), most likely first.

    top_tokens/top_probs [k+1, m]: the drafter's m most likely tokens at each position (position j is
    the token after f1..fj; position k is the bonus). accept [k]: the estimated chance that draft j is
    kept given the ones before it were. P(a, y) = P(exactly a kept) * P(y | a), where a rejection at
    position a means the target's token there is not f_{a+1}: the drafter's distribution there is
    renormalised without f_{a+1}.
    """
    k = len(drafts)
    if top_tokens.shape[0] != k + 1 or len(accept) < k:
        raise ValueError(f"need k+1 = {k + 1} rows of candidates and {k} acceptance rates")
    cands: list[tuple[float, int, int]] = []
    reach = 1.0  # P(the first a drafts were all kept)
    for a in range(k + 1):
        stop = 1.0 - float(accept[a]) if a < k else 1.0  # P(draft a+1 rejected | reached a)
        p_here = reach * stop
        toks, probs = top_tokens[a], top_probs[a]
        if a < k:
            excl = float(probs[toks == drafts[a]].sum())
            norm = max(1e-9, 1.0 - excl)
        else:
            norm = 1.0
        for y, py in zip(toks.tolist(), probs.tolist(), strict=True):
            if a < k and y == int(drafts[a]):
                continue
            cands.append((p_here * float(py) / norm, a, int(y)))
        if a < k:
            reach *= float(accept[a])
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(a, y, p) for p, a, y in cands[:fanout]]


def allot_branches(probs: list[list[float]], total: int) -> list[int]:
    """How many of each request's candidate outcomes (each list most likely first, `choose_branches`'
    estimates) to branch on, at most `total` in all.

    Under the engine's wait rule a step goes without waiting for its round only when every request of
    the batch hits, so the allotment maximises the estimated chance of that, prod_r (sum of request r's
    chosen p), not each request's own hit rate: a request whose top few outcomes already cover it gives
    its later branches to one that is unsure. Greedy on the gain in log: each added branch shrinks a
    request's next gain (its candidates are sorted), so the greedy allotment is the best one. Ties go to
    the earlier request, so it is deterministic."""
    eps = 1e-12
    n = [0] * len(probs)
    s = [0.0] * len(probs)
    heap = [(-np.log((ps[0] + eps) / eps), r) for r, ps in enumerate(probs) if ps]
    heapq.heapify(heap)
    left = max(0, int(total))
    while left and heap:
        _, r = heapq.heappop(heap)
        s[r] += float(probs[r][n[r]])
        n[r] += 1
        left -= 1
        if n[r] < len(probs[r]):
            nxt = float(probs[r][n[r]])
            heapq.heappush(heap, (-float(np.log((s[r] + nxt + eps) / (s[r] + eps))), r))
    return n


def draft_confs(top_tokens: np.ndarray, top_probs: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The drafter's probability of each draft at the stopping place before it: row j of the candidates
    [k+1, m] is the distribution after f1..fj, so its probability of f_{j+1} (0 where f_{j+1} is not
    among the m candidates)."""
    d = np.asarray(drafts)
    k = len(d)
    return (np.asarray(top_probs[:k], np.float64) * (np.asarray(top_tokens[:k]) == d[:, None])).sum(-1)


class Acceptance:
    """P(a draft is kept | the drafts before it were kept), as a function of the drafter's own probability
    of that draft (its confidence, `draft_confs`), calibrated on the session's outcomes: `bins` equal bins
    of confidence, each opened at its own mid confidence (the drafter taken at its word, worth `weight`
    drafts) and moved by the drafts offered at that confidence and whether they were kept. Shared by a
    worker session's requests (they see the same target).

    Why by confidence and not by position: which drafts a verify keeps follows how sure the drafter was of
    each, and a round's outcomes differ most where it was unsure. Counted on the replay trace of the
    reference pair (`benchmarks/hit_curve.py`, 265 lookups; docs/SPEC_CACHE.md): hit rate at F = 4 /
    8 / 16 with one running rate per position 73.2 / 83.0 / 89.4 %, by confidence 78.9 / 86.4 / 92.1 %
    (prose 54.7 / 70.8 / 81.8 -> 62.0 / 75.9 / 85.4 %). The calibration keeps a drafter that is sure and
    wrong (or unsure and right) from steering the branches by its word alone."""

    def __init__(self, bins: int = 10, weight: float = 10.0) -> None:
        if bins < 1 or weight <= 0:
            raise ValueError(f"Acceptance needs bins >= 1 and weight > 0, got {bins}, {weight}")
        self.bins = bins
        self.tries = np.full(bins, float(weight))
        self.kept = weight * (np.arange(bins) + 0.5) / bins

    def _bin(self, confs) -> np.ndarray:
        return np.clip((np.asarray(confs, np.float64) * self.bins).astype(np.int64), 0, self.bins - 1)

    def update(self, confs, kept: int) -> None:
        """Drafts of confidences `confs` were offered, the first `kept` of them were accepted (those after
        the first rejection were never tried)."""
        b = self._bin(confs)[:kept + 1]
        np.add.at(self.tries, b, 1.0)
        np.add.at(self.kept, b[:kept], 1.0)

    def rates(self, confs) -> np.ndarray:
        """The estimated chance that each draft of confidences `confs` is kept, given those before it were."""
        b = self._bin(confs)
        return self.kept[b] / self.tries[b]


def dense(table: Table | None, keys: list[tuple[int, int, int]], k: int, fanout: int):
    """The table as fixed-shape arrays for a selection without host logic (SpecCache.select_on_device):
    one row per (request_id, generation, base) of `keys`, in the engine's batch order.
    Returns ok bool [B] (the row's entry exists with those keys), prefix int32 [B, F, k+1] (-1 padded),
    prefix_len int32 [B, F] (0: no branch), drafts int32 [B, F, k]."""
    B = len(keys)
    ok = np.zeros(B, bool)
    prefix = np.full((B, fanout, k + 1), -1, np.int32)
    plen = np.zeros((B, fanout), np.int32)
    drafts = np.zeros((B, fanout, k), np.int32)
    for i, (rid, gen, base) in enumerate(keys):
        e = table.entry(rid) if table is not None else None
        if e is None or e.generation != gen or e.base != base:
            continue
        ok[i] = True
        kk = min(k, e.kb)
        for b in range(min(fanout, e.n_branches)):
            p = e.prefix(b)
            if len(p) > k + 1:
                continue
            prefix[i, b, :len(p)] = p
            plen[i, b] = len(p)
            drafts[i, b, :kk] = e.branch_drafts[b, :kk]
    return ok, prefix, plen, drafts
