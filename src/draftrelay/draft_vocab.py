"""A drafter's head restricted to the most frequent tokens (a *draft vocabulary*).

A small drafter's head is a large share of what each drafted token reads: the Qwen2.5-0.5B's tied head is
151,936 x 896 (272 MB in bf16) beside 715 MB for all 24 layers, and on an H200 it is the one
bandwidth-bound product of the forward (about 62 us of the 0.5B's ~0.5 ms). A draft only has to be
likely; the target verifies every one, so the drafter may leave out tokens it would rarely propose.
FR-Spec (frequency-ranked speculative sampling) and EAGLE-3's 32K draft vocabulary do exactly this: the
head keeps the rows of the N most frequent tokens, the pick runs over those N, and the chosen row is
mapped back to its token id. What it costs is acceptance: a target token outside the subset can never be
drafted (benchmarks/data's trace: 96.6 % of the target's tokens lie within the first 32,768 ids).

Nothing downstream changes: greedy picks return token ids (the row mapped back: `token`), and a forward
asked for logits gets the full vocabulary's width with -inf outside the subset (`widen`), so a softmax,
top-k or argmax over it is the subset's. Greedy output and sampling stay exact whatever the subset: the
drafts are point masses that the target accepts or corrects.

Which ids: by default the first N. A byte-level BPE vocabulary (Qwen2's, Llama-3's) numbers its tokens
in merge order, and a merge is made where a pair is most frequent in the tokenizer's own training corpus,
so low ids are the frequent tokens of a far larger corpus than any machine here holds. On the Qwen2.5-Coder
trace (benchmarks/data) the first 32,768 ids hold 96.6 % of the target's tokens (code 97.2 %, prose
95.6 %); a ranking counted over this machine's Python library and /usr/share/doc (scripts/
build_draft_vocab.py) held 92.7 % (code 98.0 %, prose 83.9 %: that corpus has little prose). A ranking
file (ids, most frequent first, .npy) made from a workload's own text can be given instead.
"""

from __future__ import annotations

import os

import numpy as np
import torch


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be used; the message names the value."""


def split_spec(spec: str | int | None) -> tuple[str, int | None] | None:
    """A --draft-vocab value: None for the whole head ('', 'off', 'full', 'none'), ('', N) for N, (path, N or
    None) for FILE.npy[:N]."""
    s = "" if spec is None else str(spec).strip()
    if s.lower() in ("", "off", "full", "none"):
        return None
    if s.isdigit():
        return "", int(s)
    head, _, tail = s.rpartition(":")
    return (head, int(tail)) if head and tail.isdigit() else (s, None)


def spec_problem(spec: str | int | None) -> str:
    """What is wrong with a --draft-vocab value before a vocabulary is known ('' when nothing is; the reason
    alone, its caller names the value)."""
    parts = split_spec(spec)
    if parts is None:
        return ""
    path, n = parts
    if n is not None and n < 1:
        return "must be at least 1 id"
    if path and not os.path.exists(path):
        return f"expected N, FILE.npy or FILE.npy:N; {path!r} does not exist"
    return ""


class DraftVocab:
    """The ids a drafter's head keeps (sorted, unique, within [0, vocab_size))."""

    def __init__(self, ids, vocab_size: int, source: str = "") -> None:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size == 0:
            raise DraftVocabError("draft vocabulary: no ids")
        if a.min() < 0 or a.max() >= vocab_size:
            raise DraftVocabError(f"draft vocabulary: ids must lie in [0, {vocab_size}), got {a.min()}..{a.max()}")
        u = np.unique(a)
        if u.size != a.size:
            raise DraftVocabError(f"draft vocabulary: {a.size - u.size} repeated ids")
        self.ids = torch.from_numpy(u)
        self.vocab_size = vocab_size
        self.source = source
        self._dev: dict[torch.device, torch.Tensor] = {}
        self._heads: dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return int(self.ids.numel())

    def __repr__(self) -> str:
        return f"DraftVocab({len(self)} of {self.vocab_size}{', ' + self.source if self.source else ''})"

    @classmethod
    def top(cls, n: int, vocab_size: int, ranking: np.ndarray | None = None) -> DraftVocab:
        """The first n ids of `ranking` (default: id order, the BPE merge order)."""
        size = vocab_size if ranking is None else len(ranking)
        if not 0 < n <= size:
            raise DraftVocabError(f"draft vocabulary {n}: must be between 1 and the ranking's {size} ids")
        if ranking is None:
            return cls(np.arange(n), vocab_size, f"ids 0..{n - 1}")
        return cls(ranking[:n], vocab_size, f"the first {n} of a ranking")

    @classmethod
    def parse(cls, spec: str | int | None, vocab_size: int) -> DraftVocab | None:
        """A command line's value (split_spec): none -> None (the whole head); N -> ids 0..N-1 (N at least
        the vocabulary: the whole head); FILE.npy or FILE.npy:N -> a ranking file's (first N) ids."""
        problem = spec_problem(spec)
        if problem:
            raise DraftVocabError(f"draft vocabulary {spec}: {problem}")
        parts = split_spec(spec)
        if parts is None:
            return None
        path, n = parts
        if not path:
            return None if n >= vocab_size else cls.top(n, vocab_size)
        try:
            ranking = np.load(path)
        except (OSError, ValueError) as exc:
            raise DraftVocabError(f"draft vocabulary {spec!r}: cannot read {path!r}: {exc}") from None
        return cls.top(len(ranking) if n is None else n, vocab_size, ranking)

    # -- the forward's side ------------------------------------------------------------------------------------

    def ids_on(self, device: torch.device) -> torch.Tensor:
        t = self._dev.get(device)
        if t is None:
            t = self._dev[device] = self.ids.to(device)
        return t

    def head(self, w: torch.Tensor) -> torch.Tensor:
        """The head's rows of the kept ids, made once per head tensor (a copy: row-contiguous for the
        product; for the 0.5B at 32,768 ids 59 MB in bf16). Set the vocabulary once the weights are loaded:
        a head written in place afterwards keeps its old copy here."""
        key = (w.data_ptr(), w.device, w.dtype, tuple(w.shape))
        h = self._heads.get(key)
        if h is None:
            if w.shape[0] != self.vocab_size:
                raise DraftVocabError(f"draft vocabulary of {self.vocab_size} ids for a head of {w.shape[0]} rows")
            h = self._heads[key] = w.detach().index_select(0, self.ids_on(w.device)).contiguous()
        return h

    def token(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows of the restricted head -> token ids (same shape, int64)."""
        return self.ids_on(idx.device)[idx.long()]

    def widen(self, out: torch.Tensor) -> torch.Tensor:
        """The restricted head's output [..., n] -> the vocabulary's width [..., V], -inf outside."""
        full = out.new_full((*out.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(out.dim() - 1, self.ids_on(out.device), out)
