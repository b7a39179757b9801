"""A generation request and its sampling parameters: what the caller asked, what came out so far,
what the drafter holds for it, and its per-request figures."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0  # nucleus sampling (1: off)
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field (NaN or inf would silently break sampling and acceptance:
        min(1, nan) keeps every draft)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number within (0, 1], got {self.top_p!r}")


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    row: int = -1
    done: bool = False
    finish_reason: str = ""
    # drafter bookkeeping: what the drafter holds (position of the next block) and its incarnation
    generation: int = 1
    synced: int = 0
    restarts: int = 0  # restarts in a row without a draft
    no_drafts: bool = False  # the drafter returned nothing even after restarts: stop asking
    # metrics
    t_arrive: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    step_s: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # drafts kept, per step that had drafts
    pos_tries: list[int] = field(default_factory=list)
    pos_hits: list[int] = field(default_factory=list)
    rounds: Counter = field(default_factory=Counter)  # ok / failed / watchdog / target_only
    cache: Counter = field(default_factory=Counter)  # speculation-cache lookups / hits of this request
    gen: torch.Generator | None = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, a: int, b: int) -> list[int]:
        """(prompt + output)[a:b] without building the whole sequence (long prompts)."""
        P = len(self.prompt)
        if b <= P:
            return self.prompt[a:b]
        if a >= P:
            return self.output[a - P:b - P]
        return self.prompt[a:] + self.output[:b - P]

    def emit(self, tokens: list[int]) -> None:
        """Append tokens, stopping at a stop token or max_tokens (the rest is dropped)."""
        p = self.params
        for tok in tokens:
            self.output.append(tok)
            if tok in p.stop_token_ids:
                self.done, self.finish_reason = True, "stop"
                return
            if len(self.output) >= p.max_tokens:
                self.done, self.finish_reason = True, "length"
                return

    def metrics(self) -> dict:
        steps = self.step_s
        n_out = len(self.output)
        return {
            "id": self.id, "prompt_tokens": len(self.prompt), "output_tokens": n_out,
            "finish_reason": self.finish_reason,
            "ttft_s": self.t_first - self.t_arrive,
            "step_p50_ms": 1e3 * statistics.median(steps) if steps else 0.0,
            "steps": len(steps),
            "tokens_per_step": (n_out - 1) / len(steps) if steps else 0.0,
            "mean_accepted": float(np.mean(self.kept)) if self.kept else 0.0,
            "accept_rate_by_pos": [h / t if t else 0.0 for h, t in zip(self.pos_hits, self.pos_tries, strict=True)],
            "rounds": {k: self.rounds.get(k, 0) for k in ("ok", "failed", "watchdog", "target_only")},
            "generation": self.generation,
        }
