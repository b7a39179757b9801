"""Trace replay: a real pair's acceptance at any model shape, for benchmarks only.

Real weights cannot travel to every machine that measures (the GPU machine's working tree is capped),
and random weights accept nothing. A *trace* records what a real pair did on a set of prompts:

  prompt      the prompt's token ids
  target      the target's greedy continuation (token ids)
  draft_top   for each i, the drafter's top-F tokens predicting target[i] given prompt + target[:i]
  draft_prob  (optional) their probabilities

Greedy speculative decoding depends on nothing else: the drafter's j-th draft is its top-1 after the
(j-1) earlier drafts, which is on the true sequence exactly while every earlier draft was accepted; once
a draft is rejected nothing after it is used. So two replay models reproduce the pair's acceptance
exactly while every cost stays that of the shapes they run:

  ReplayTarget (install_replay_target)  the real forward of a chosen shape, then its logits are replaced
        by a point mass on the trace's next token at every position of a row that follows a trace;
  ReplayDrafter                          the real drafter forward (or, for "a drafter on an emulated
        second device", wall time taken from a table measured beforehand, no GPU work at all), then the
        trace's drafter tokens while the row's context is on the trace, an off-trace token otherwise.

Engine, proxy, wire and worker run unmodified between them. These are benchmark tools: nothing loads
them unless asked for by name (`replay:` drafter specs), and every figure they produce says
"replayed acceptance of <pair>".
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("draftrelay.replay")

TRACE_FORMAT = "draftrelay-trace-1"


class TraceError(ValueError):
    """A trace file is unusable; the message says what and where."""


@dataclass
class TraceEntry:
    prompt: list[int]
    target: list[int]
    draft_top: list[list[int]]
    draft_prob: list[list[float]] = field(default_factory=list)
    name: str = ""

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.target


@dataclass
class Trace:
    pair: str  # e.g. "Qwen2.5-Coder 0.5B -> 1.5B (Q4_K_M GGUF), greedy"
    top_f: int
    entries: list[TraceEntry]
    vocab_size: int = 0
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> Trace:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise TraceError(f"{path}: cannot read a trace: {exc}") from None
        if not isinstance(d, dict) or d.get("format") != TRACE_FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else None
            raise TraceError(f"{path}: not a {TRACE_FORMAT} file (format={fmt!r})")
        tr = cls(pair=str(d.get("pair", "")), top_f=int(d.get("top_f", 0)), vocab_size=int(d.get("vocab_size", 0)),
                 entries=[TraceEntry(prompt=list(e["prompt"]), target=list(e["target"]), draft_top=list(e["draft_top"]),
                                     draft_prob=list(e.get("draft_prob", [])), name=str(e.get("name", "")))
                          for e in d.get("entries", [])],
                 meta=dict(d.get("meta", {})))
        tr.validate(path)
        return tr

    def validate(self, where: str = "trace") -> None:
        if not self.pair:
            raise TraceError(f"{where}: 'pair' (which real pair was recorded) is missing")
        if self.top_f < 1:
            raise TraceError(f"{where}: top_f must be >= 1, got {self.top_f}")
        if not self.entries:
            raise TraceError(f"{where}: no entries")
        for n, e in enumerate(self.entries):
            if not e.prompt or not e.target:
                raise TraceError(f"{where}: entry {n} has an empty prompt or target")
            if len(e.draft_top) != len(e.target):
                raise TraceError(f"{where}: entry {n}: {len(e.draft_top)} draft_top rows for "
                                 f"{len(e.target)} target tokens")
            if any(len(row) < 1 for row in e.draft_top):
                raise TraceError(f"{where}: entry {n}: an empty draft_top row")
            if e.draft_prob and len(e.draft_prob) != len(e.target):
                raise TraceError(f"{where}: entry {n}: draft_prob has {len(e.draft_prob)} rows, target {len(e.target)}")
            ids = [*e.prompt, *e.target, *(t for row in e.draft_top for t in row)]
            if min(ids) < 0 or (self.vocab_size and max(ids) >= self.vocab_size):
                raise TraceError(f"{where}: entry {n}: a token id outside [0, {self.vocab_size})")

    def save(self, path: str) -> None:
        d = {"format": TRACE_FORMAT, "pair": self.pair, "top_f": self.top_f, "vocab_size": self.vocab_size,
             "meta": self.meta,
             "entries": [{"name": e.name, "prompt": e.prompt, "target": e.target, "draft_top": e.draft_top,
                          **({"draft_prob": e.draft_prob} if e.draft_prob else {})} for e in self.entries]}
        with open(path, "w") as f:
            json.dump(d, f, separators=(",", ":"))

    def restricted(self, ids) -> Trace:
        """The trace a drafter with a draft vocabulary (draft_vocab.py) would have recorded: each position's
        top tokens filtered to `ids`, in their recorded order (the restricted head's ranking is the full
        head's ranking of the ids it keeps, so its top-1 is the first recorded token it keeps). Where none
        of the recorded top-F is kept, the restricted drafter's choice is unknown; it is taken to be a
        kept id other than the target's token (probability 0), so the position is never accepted: a
        lower bound on the restricted drafter's acceptance. Probabilities stay as recorded (the full
        softmax's, not renormalised over the kept ids)."""
        keep = np.zeros(max(self.vocab_size, int(np.max(ids)) + 1, self.max_token() + 1), bool)
        keep[np.asarray(ids, np.int64)] = True
        spare = [int(t) for t in np.flatnonzero(keep)[:2]]
        entries = []
        for e in self.entries:
            tops, probs = [], []
            for j, row in enumerate(e.draft_top):
                kept = [r for r, t in enumerate(row) if keep[t]]
                if kept:
                    tops.append([row[r] for r in kept])
                    probs.append([e.draft_prob[j][r] for r in kept] if e.draft_prob else [])
                else:  # (a vocabulary of the target's token alone drafts it: then that is right)
                    tops.append([next((t for t in spare if t != e.target[j]), spare[0])])
                    probs.append([0.0])
            entries.append(TraceEntry(e.prompt, e.target, tops, probs if e.draft_prob else [], e.name))
        return Trace(f"{self.pair}, drafts restricted to {int(keep.sum())} ids", self.top_f, entries,
                     self.vocab_size, {**self.meta, "draft_vocab": int(keep.sum())})

    def max_token(self) -> int:
        return max(max(*e.prompt, *e.target, *(t for r in e.draft_top for t in r)) for e in self.entries)


def count_accepted(entry: TraceEntry, k: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """The greedy sequential schedule on one entry, counted directly from the trace: [(offered, kept)]
    per verify step, with the engine's rules (the prefill emits target[0]; a step offers
    min(k, max_tokens - emitted - 1) drafts and emits kept + 1 tokens)."""
    T = len(entry.target) if max_tokens is None else min(max_tokens, len(entry.target))
    n, out = 1, []
    while n < T:
        offered = max(0, min(k, T - n - 1))
        kept = 0
        while kept < offered and entry.draft_top[n + kept][0] == entry.target[n + kept]:
            kept += 1
        out.append((offered, kept))
        n += kept + 1
    return out


# -------------------------------------------------------------------------------------------------
# scripts: the full token sequences (prompt + target) rows may follow


class Scripts:
    """Which trace a row follows, found from the first tokens it is given (a prefill at position 0)."""

    def __init__(self, sequences: list[list[int]], min_match: int = 1) -> None:
        if not sequences:
            raise TraceError("replay: no sequences to follow")
        self.seqs = [np.asarray(s, np.int64) for s in sequences]
        self.min_match = min_match

    def match(self, first: np.ndarray) -> int:
        """Index of the one sequence starting with `first`, or -1 (ambiguity is an error: a replay
        that guessed between two traces would not be replaying either)."""
        hits = [i for i, s in enumerate(self.seqs) if len(s) >= len(first) and np.array_equal(s[:len(first)], first)]
        if len(hits) > 1 and len({tuple(self.seqs[i]) for i in hits}) > 1:
            raise TraceError(f"replay: a prompt's first {len(first)} tokens match {len(hits)} different sequences; "
                             "give each request a distinct prompt start")
        return hits[0] if hits else -1


def with_fillers(trace: Trace, fillers: list[list[int]]) -> Trace:
    """The trace with entry i's prompt behind fillers[i] (long-context runs: the drafter's recorded
    tokens stay those of the original context; only the cost of the longer one changes)."""
    entries = [TraceEntry(list(f) + e.prompt, e.target, e.draft_top, e.draft_prob, e.name)
               for f, e in zip(fillers, trace.entries, strict=True)]
    meta = {**trace.meta, "fillers": [len(f) for f in fillers]}
    return Trace(trace.pair, trace.top_f, entries, trace.vocab_size, meta)


def synthetic_trace(vocab: int, n: int = 3, length: int = 48, hit: float = 0.7, *, seed: int = 0,
                    second: bool = False, prompt_len: tuple[int, int] = (5, 3), pair: str = "synthetic pair",
                    prefix: str = "e") -> Trace:
    """Random target sequences (tests, CPU smoke runs): entry i has a prompt of prompt_len[0] +
    prompt_len[1] * i random tokens; the drafter's top-1 is the target's token with probability `hit`
    (second: where it is not, the target's token is the drafter's second choice, so branches over the
    corrections hit), its other guesses distinct random tokens."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        prompt = [int(x) for x in rng.integers(0, vocab, prompt_len[0] + prompt_len[1] * i)]
        target = [int(x) for x in rng.integers(0, vocab, length)]
        top = []
        for t in target:
            first = t if rng.random() < hit else int((t + 1 + rng.integers(0, vocab - 1)) % vocab)
            rest = [int(x) for x in rng.choice([v for v in range(vocab) if v not in (first, t)], 3, replace=False)]
            if second and first != t:
                rest[0] = t
            top.append([first, *rest])
        entries.append(TraceEntry(prompt, target, top, name=f"{prefix}{i}"))
    return Trace(pair=pair, top_f=4, entries=entries, vocab_size=vocab)


# -------------------------------------------------------------------------------------------------
# the target side


class ReplayTargetHook:
    """Forward hook on a draftrelay.model.Transformer: after the real forward, the logits of every
    position p of a row that follows a script become a point mass on script[p + 1].

    The per-row table of next tokens lives on the model's device, so the override is device work only
    (it is captured into CUDA graphs like the rest of the forward). Rows get their script when the
    engine prefills them from position 0 (an eager forward with host-side inputs); a row that matches
    no script keeps its real logits (counted in `unmatched`)."""

    def __init__(self, model, sequences: list[list[int]], n_rows: int, max_len: int) -> None:
        import torch

        self.torch = torch
        self.scripts = Scripts(sequences)
        self.vocab = model.cfg.vocab_size
        mx = max(int(s.max()) for s in self.scripts.seqs)
        if mx >= self.vocab:
            raise TraceError(f"replay target: a trace token id {mx} is outside the model's vocabulary {self.vocab}")
        self.max_len = max_len
        # -1: this row follows no script (its real logits stay)
        self.next = torch.full((n_rows, max_len), -1, dtype=torch.long, device=model.device)
        self.follow = [-1] * n_rows
        self.unmatched = 0
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def remove(self) -> None:
        self.handle.remove()

    def _assign(self, tokens, start, rows) -> None:
        torch = self.torch
        if tokens.device.type != "cpu" or start.device.type != "cpu" or rows.device.type != "cpu":
            return  # a capture or a device-fed forward: the rows were assigned at their prefill
        for b in range(tokens.shape[0]):
            if int(start[b]) != 0:
                continue
            r = int(rows[b])
            i = self.scripts.match(tokens[b].numpy())
            self.follow[r] = i
            self.next[r].fill_(-1)
            if i < 0:
                self.unmatched += 1
                continue
            seq = torch.from_numpy(self.scripts.seqs[i][1:])
            n = min(len(seq), self.max_len)
            self.next[r, :n].copy_(seq[:n])

    def __call__(self, module, args, kwargs, out):
        torch = self.torch
        tokens, start, _cache, rows = (list(args) + [None] * 4)[:4]
        tokens = kwargs.get("tokens", tokens)
        start = kwargs.get("start_pos", start)
        rows = kwargs.get("rows", rows)
        self._assign(tokens, start, rows)
        dev = out.device
        B, T = tokens.shape
        s = start.to(dev, non_blocking=True).long()
        if kwargs.get("last_only"):
            pos = (s + T - 1)[:, None]
        elif kwargs.get("logits_at") is not None:
            pos = (s + kwargs["logits_at"].to(dev, non_blocking=True).long())[:, None]
        else:
            pos = s[:, None] + torch.arange(T, device=dev)[None]
        pos = pos.clamp(0, self.max_len - 1)
        r = rows.to(dev, non_blocking=True).long()[:, None].expand_as(pos)
        nxt = self.next[r, pos]  # [B, Tout]
        if kwargs.get("argmax_only"):  # a greedy verify asked for the argmax: the trace's token is it
            return torch.where(nxt >= 0, nxt, out)
        forced = torch.full_like(out, -1e4)
        forced.scatter_(-1, nxt.clamp(min=0)[..., None], 0.0)
        return torch.where((nxt >= 0)[..., None], forced, out)


def install_replay_target(model, trace: Trace, n_rows: int, max_len: int) -> ReplayTargetHook:
    """Make `model` a replay target for `trace` (benchmarks only). Remove with hook.remove()."""
    log.warning("REPLAY target: logits are forced to the trace of %s", trace.pair)
    return ReplayTargetHook(model, [e.sequence for e in trace.entries], n_rows, max_len)


# -------------------------------------------------------------------------------------------------
# the drafter side (a worker backend)


@dataclass
class CostTable:
    """Measured seconds of the real drafter's work, which the emulated second device spends as wall time.

    seconds[(jobs, n_steps, kv)]: one STEP (jobs requests, n_steps drafts, kv bucket of the context);
    prefetch[(requests, fanout, k, kv)]: the speculation cache's branch work after a STEP of `requests`
        requests with k drafts each (worker.prefetch.Prefetcher: the forward over the k + 1 stopping
        places and one batched run over requests x fanout branches); prefetch_stops[same key]: the part
        of it that is the forward over the stopping places, which the work after a STEP answered from
        branches does not run; prefetch_bonus[same key]: the part that is the bonus place's forward (a
        forward feeding each branch's last draft). bonus_mode says when the measured worker ran it
        (worker.prefetch.BONUS): "queued", over every branch right after the table is out; "lazy", over
        one branch a request (the one that answered the STEP) when the next table reads it.
    Lookup takes the nearest measured key (jobs or requests first, then n_steps or fanout and k, then
    context), never extrapolating silently beyond the table (it takes the largest entry). In the file,
    a prefetch entry is {"kind": "prefetch", "jobs", "fanout", "k", "kv", "s"} (and "stops_s", "bonus_s");
    other entries are STEPs."""

    seconds: dict[tuple[int, int, int], float]
    source: str = ""
    prefetch: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    prefetch_stops: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    prefetch_bonus: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    bonus_mode: str = "queued"

    @classmethod
    def load(cls, path: str) -> CostTable:
        try:
            with open(path) as f:
                d = json.load(f)
            sec, pre, stops, bonus = {}, {}, {}, {}
            for e in d["entries"]:
                if e.get("kind", "step") == "prefetch":
                    key = (int(e["jobs"]), int(e["fanout"]), int(e["k"]), int(e["kv"]))
                    pre[key] = float(e["s"])
                    stops[key] = float(e.get("stops_s", 0.0))
                    bonus[key] = float(e.get("bonus_s", 0.0))
                else:
                    sec[(int(e["jobs"]), int(e["n_steps"]), int(e["kv"]))] = float(e["s"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TraceError(f"{path}: not a replay cost table: {exc}") from None
        if not sec:
            raise TraceError(f"{path}: the cost table has no STEP entries")
        mode = d.get("bonus_mode", "queued")  # files written before the lazy bonus measured the queued one
        if mode not in ("queued", "lazy"):
            raise TraceError(f"{path}: bonus_mode {mode!r}: expected queued or lazy")
        return cls(sec, str(d.get("source", "")), pre, stops, bonus, mode)

    def save(self, path: str) -> None:
        steps = [{"jobs": j, "n_steps": n, "kv": kv, "s": s} for (j, n, kv), s in sorted(self.seconds.items())]
        pre = [{"kind": "prefetch", "jobs": j, "fanout": f, "k": k, "kv": kv, "s": s,
                "stops_s": self.prefetch_stops.get((j, f, k, kv), 0.0),
                "bonus_s": self.prefetch_bonus.get((j, f, k, kv), 0.0)}
               for (j, f, k, kv), s in sorted(self.prefetch.items())]
        with open(path, "w") as f:
            json.dump({"source": self.source, "bonus_mode": self.bonus_mode, "entries": steps + pre}, f)

    @staticmethod
    def _nearest(table: dict, want: tuple, ctx: int):
        def dist(key):
            return (*(abs(a - b) for a, b in zip(key[:-1], want, strict=True)),
                    abs(np.log2(max(key[-1], 1)) - np.log2(max(ctx, 1))))

        return table[min(table, key=dist)]

    def lookup(self, jobs: int, n_steps: int, ctx: int) -> float:
        return self._nearest(self.seconds, (jobs, n_steps), ctx)

    def lookup_prefetch(self, requests: int, fanout: int, k: int, ctx: int) -> float:
        if not self.prefetch:
            raise TraceError("replay cost table: no prefetch entries (the branch work was not measured)")
        return self._nearest(self.prefetch, (requests, fanout, k), ctx)

    def lookup_prefetch_stops(self, requests: int, fanout: int, k: int, ctx: int) -> float:
        """The stopping places' forward within lookup_prefetch's entry (0 where it was not measured)."""
        table = {key: self.prefetch_stops.get(key, 0.0) for key in self.prefetch}
        return self._nearest(table, (requests, fanout, k), ctx) if table else 0.0

    def lookup_prefetch_bonus(self, requests: int, fanout: int, k: int, ctx: int) -> float:
        """The bonus place's forward within lookup_prefetch's entry (0 where it was not measured)."""
        table = {key: self.prefetch_bonus.get(key, 0.0) for key in self.prefetch}
        return self._nearest(table, (requests, fanout, k), ctx) if table else 0.0


def spend(seconds: float) -> None:
    """Wall time without the GPU: sleep most of it, spin the last stretch (sleep overshoots)."""
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.0015)
    while time.perf_counter() < end:
        pass


class ReplayDrafter:
    """A worker drafter whose drafts come from a trace. Cost: the wrapped real drafter's own run (same
    jobs, its tokens discarded), or `cost` (a CostTable) spent as wall time for a drafter on an
    emulated second device. Same interface as worker.drafters.Drafter."""

    def __init__(self, trace: Trace, inner=None, cost: CostTable | None = None, n_rows: int = 16,
                 max_ctx: int = 4096, n_out_max: int = 8, vocab_size: int = 0, model_id: str = "") -> None:
        if (inner is None) == (cost is None):
            raise ValueError("ReplayDrafter: give exactly one of inner (real cost) or cost (emulated device)")
        self.trace, self.inner, self.cost = trace, inner, cost
        self.scripts = Scripts([e.sequence for e in trace.entries])
        self.vocab_size = vocab_size or (inner.vocab_size if inner is not None else trace.vocab_size)
        if not self.vocab_size:
            raise TraceError("ReplayDrafter: the vocabulary size is unknown (no inner drafter, trace has none)")
        self.n_rows = inner.n_rows if inner is not None else n_rows
        self.max_ctx = inner.max_ctx if inner is not None else max_ctx
        self.n_out_max = inner.n_out_max if inner is not None else n_out_max
        self.model_id = model_id or (inner.model_id if inner is not None else "replay-emulated")
        self.tokenizer_hash = inner.tokenizer_hash if inner is not None else ""
        where = "emulated second device" if inner is None else (inner.info or "real drafter")
        self.info = f"REPLAY of {trace.pair} (cost: {where})"
        self.hist = np.zeros((self.n_rows + 1, self.max_ctx + self.n_out_max + 32), np.int64)
        self.lengths = np.zeros(self.n_rows + 1, np.int64)
        self.follow = np.full(self.n_rows + 1, -1, np.int64)
        self.on_trace = np.zeros(self.n_rows + 1, np.int64)  # longest prefix of the row on its script
        log.warning("REPLAY drafter: drafts come from the trace of %s", trace.pair)

    @property
    def fixed_rounds(self) -> bool:
        """The wrapped drafter's (its run is the cost); an emulated device spends every asked draft's cost."""
        return bool(getattr(self.inner, "fixed_rounds", False)) if self.inner is not None else True

    @property
    def last_run(self) -> str:
        """What the wrapped drafter's latest run did (the worker's slow-STEP report)."""
        return getattr(self.inner, "last_run", "") if self.inner is not None else "emulated cost spent"

    def warm(self, n_steps_list: list[int], max_batch: int, max_kv: int = 0, progress=None, min_kv: int = 0) -> int:
        fn = getattr(self.inner, "warm", None)
        return fn(n_steps_list, max_batch, max_kv, progress, min_kv) if fn is not None else 0

    def _entry_pos(self, row: int, n: int) -> tuple[TraceEntry, int] | None:
        """(entry, index into entry.target) of the token after an on-script context of length n."""
        i = int(self.follow[row])
        if i < 0:
            return None
        e = self.trace.entries[i]
        j = n - len(e.prompt)
        return (e, j) if 0 <= j < len(e.target) else None

    def _advance(self, row: int, a: int, b: int) -> None:
        """The row's tokens [a, b) were just written: extend its on-script prefix."""
        i = int(self.follow[row])
        if i < 0:
            self.on_trace[row] = 0
            return
        seq = self.scripts.seqs[i]
        on = min(int(self.on_trace[row]), a)
        if on == a:  # the new tokens continue an on-script prefix: count how many still agree
            seg, ref = self.hist[row, a:b], seq[a:min(b, len(seq))]
            k = min(len(seg), len(ref))
            neq = np.nonzero(seg[:k] != ref[:k])[0]
            on = a + (int(neq[0]) if len(neq) else k)
        self.on_trace[row] = on

    def run(self, jobs, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        if self.inner is not None:
            self.inner.run(jobs, n_steps)  # the real cost; its tokens are not used
        elif jobs:
            ctx = max(j.keep + len(j.tokens) for j in jobs)
            spend(self.cost.lookup(len(jobs), n_steps, ctx))
        return self.book(jobs, n_steps)

    def book(self, jobs, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens and the bookkeeping (hist, lengths, on_trace) of `run`, without its cost: a STEP
        answered from a pre-drafted branch (worker.prefetch.ReplayHitDrafter) leaves the same state."""
        drafts = np.zeros((len(jobs), n_steps), np.int32)
        confs = np.zeros((len(jobs), n_steps), np.float32)
        for b, j in enumerate(jobs):
            r = j.row
            if not 0 <= j.keep <= self.lengths[r]:
                raise ValueError(f"row {r}: keep {j.keep} beyond its length {self.lengths[r]}")
            n = j.keep + len(j.tokens)
            if n + n_steps > self.hist.shape[1]:
                raise ValueError(f"row {r}: context {n} + {n_steps} drafts beyond the replay's {self.hist.shape[1]}")
            self.hist[r, j.keep:n] = j.tokens
            if j.keep == 0:
                self.follow[r] = self.scripts.match(self.hist[r, :n])
                self.on_trace[r] = 0
            self._advance(r, j.keep, n)
            for s in range(n_steps):
                tok, conf = self._draft(r, n)
                drafts[b, s], confs[b, s] = tok, conf
                if s < n_steps - 1:
                    self.hist[r, n] = tok
                    self._advance(r, n, n + 1)
                    n += 1
            self.lengths[r] = n
        return drafts, confs

    def _draft(self, row: int, n: int) -> tuple[int, float]:
        return self._draft_at(int(self.follow[row]), int(self.on_trace[row]) == n, n)

    def _draft_at(self, script: int, on: bool, n: int) -> tuple[int, float]:
        """The draft after a context of length n of script `script` (-1: none), on the script or not."""
        seq = self.scripts.seqs[script] if script >= 0 else None
        j = n - len(self.trace.entries[script].prompt) if script >= 0 else -1
        if not on or not 0 <= j < len(self.trace.entries[script].target):
            # off the script: a token the target will not accept there (any id but the script's)
            bad = int(seq[n]) + 1 if seq is not None and n < len(seq) else 0
            return bad % self.vocab_size, 0.0
        e = self.trace.entries[script]
        p = e.draft_prob[j][0] if e.draft_prob else 0.5
        return int(e.draft_top[j][0]), float(p)

    def top_f(self, row: int, n: int, f: int) -> list[tuple[int, float]]:
        """The drafter's recorded top-f (token, prob) after the row's first n tokens, if on the script
        (branch guesses for a speculation cache); [] off the script."""
        at = self._entry_pos(row, n) if self.on_trace[row] >= n else None
        if at is None:
            return []
        e, j = at
        probs = e.draft_prob[j] if e.draft_prob else [0.0] * len(e.draft_top[j])
        return list(zip(e.draft_top[j][:f], probs[:f], strict=False))

    # -- the speculation cache's branches (worker.prefetch.ReplayPrefetcher) ------------------------------
    def _on_after(self, row: int, base: int, tokens) -> tuple[int, int]:
        """(script, on-script length) of the row's first `base` tokens followed by `tokens`."""
        i = int(self.follow[row])
        if i < 0:
            return -1, 0
        seq = self.scripts.seqs[i]
        on = min(int(self.on_trace[row]), base)
        if on == base and len(tokens):
            ref = seq[base:base + len(tokens)]
            m = min(len(ref), len(tokens))
            neq = np.nonzero(np.asarray(tokens[:m]) != ref[:m])[0]
            on = base + (int(neq[0]) if len(neq) else m)
        return i, on

    def stops(self, row: int, base: int, drafts: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafter's top-m candidates (tokens, probs [k+1, m]) at the k + 1 places where a verify of
        `drafts` after the row's first `base` tokens can stop (position a: after f1..fa).

        Where the row is on its script there (the first a drafts all true), they are the trace's recorded
        top-m. Elsewhere the verify cannot stop (the engine appends only true tokens), but a real drafter
        does not know that and spends branches there too: those places get the probabilities recorded
        at the same position of the script (the nearest thing to the drafter's confidence there) on
        placeholder tokens (script token + 1 + rank), which can never match; past the trace's end, zeros."""
        k = len(drafts)
        tok = np.zeros((k + 1, m), np.int64)
        prob = np.zeros((k + 1, m), np.float64)
        i, on = self._on_after(row, base, drafts)
        e = self.trace.entries[i] if i >= 0 else None
        seq = self.scripts.seqs[i] if i >= 0 else None
        for a in range(k + 1):
            n = base + a
            j = n - len(e.prompt) if e is not None else -1
            if e is None or not 0 <= j < len(e.target):
                tok[a] = (np.arange(m) + 1 + (int(seq[n]) if seq is not None and n < len(seq) else 0)) % self.vocab_size
                continue
            row_t = list(e.draft_top[j][:m])
            row_p = list(e.draft_prob[j][:m]) if e.draft_prob else [0.5 ** (r + 1) for r in range(len(row_t))]
            row_t += [row_t[-1]] * (m - len(row_t))  # a trace with fewer than m: repeats at probability 0
            row_p += [0.0] * (m - len(row_p))
            prob[a] = row_p
            if on >= n:
                tok[a] = row_t
            else:
                tok[a] = (int(seq[n]) + 1 + np.arange(m)) % self.vocab_size
        return tok, prob

    def branch_drafts(self, row: int, base: int, prefix: np.ndarray, n_steps: int) -> np.ndarray:
        """What `run` would draft (n_steps tokens) for this row after its first `base` tokens and then
        `prefix`, without touching the row: a branch's drafts."""
        i, on = self._on_after(row, base, prefix)
        n = base + len(prefix)
        out = np.zeros(n_steps, np.int32)
        for s in range(n_steps):
            tok, _ = self._draft_at(i, on == n, n)
            out[s] = tok
            if on == n and i >= 0 and n < len(self.scripts.seqs[i]) and int(self.scripts.seqs[i][n]) == tok:
                on += 1
            n += 1
        return out


def load_replay_drafter(spec: str, load_inner, *, n_rows: int, max_ctx: int, n_out_max: int,
                        model_id: str = "", draft_vocab: str = "") -> ReplayDrafter:
    """`replay:TRACE.json:INNER` (INNER: any drafter spec, whose forward gives the cost) or
    `replay:TRACE.json:emulated=COST.json` (a drafter on an emulated second device: measured wall
    time, no GPU work). `load_inner(spec)` loads INNER. draft_vocab (draft_vocab.DraftVocab.parse):
    the trace's drafts restricted to those ids (Trace.restricted); the cost is then the restricted
    drafter's (INNER loaded with it, or a cost table measured with it)."""
    body = spec[len("replay:"):]
    path, sep, inner = body.partition(":")
    if not sep or not path or not inner:
        raise TraceError(f"--model {spec!r}: expected replay:TRACE.json:INNER or replay:TRACE.json:emulated=COST.json")
    trace = Trace.load(path)
    if draft_vocab:
        from draftrelay.draft_vocab import DraftVocab

        vocab = DraftVocab.parse(draft_vocab, trace.vocab_size or trace.max_token() + 1)
        if vocab is not None:
            trace = trace.restricted(vocab.ids.numpy())
    if inner.startswith("emulated="):
        cost = CostTable.load(inner[len("emulated="):])
        return ReplayDrafter(trace, cost=cost, n_rows=n_rows, max_ctx=max_ctx, n_out_max=n_out_max,
                             vocab_size=trace.vocab_size, model_id=model_id or "replay-emulated")
    base = load_inner(inner)
    if trace.vocab_size and base.vocab_size != trace.vocab_size:
        raise TraceError(f"--model {spec!r}: the trace's vocabulary is {trace.vocab_size}, "
                         f"the drafter {inner!r} has {base.vocab_size}")
    if trace.max_token() >= base.vocab_size:
        raise TraceError(f"--model {spec!r}: trace token {trace.max_token()} outside the drafter's vocabulary "
                         f"{base.vocab_size}")
    return ReplayDrafter(trace, inner=base, model_id=model_id)
