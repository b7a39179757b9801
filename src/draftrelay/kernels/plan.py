"""Which kernel computes each skinny product (at most MAX_ROWS rows: decode, verify, a few branches):
cuBLAS, or one configuration of the skinny GEMM (`triton_ops.skinny_linear`), chosen per shape by
measurement the first time the shape runs outside a graph capture.

Why measured: at these row counts cuBLAS's choice swings between 0.3 and 4 TB/s with the shape (the
0.5B drafter's small weights are latency-bound, the 7B's large ones near the copy bandwidth), and a
Triton kernel's speed depends on the card; the measurement times every candidate on the card the
forward runs on, inside a CUDA graph (launch gaps as in a replay), over enough distinct weight copies
that the L2 cache does not serve the repeats, and checks each candidate's output against cuBLAS's
first. The choice is per (product kind, rows, weight shape, dtype, bias, residual) and fixed for the
process once made (graphs captured later bake it in; a rank of a tensor-parallel pair may choose
differently from its peer, which changes no replicated value: each rank's products are its own).

Pure Python (no torch, no Triton): the CPU tests check the candidate lists and the choice rule.

`MODE` (environment DRAFTRELAY_SKINNY): "auto" measures; "off" keeps cuBLAS for every product and the
separate norm / SiLU / pick kernels (the forward as it is without the skinny kernels).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

MAX_ROWS = 16  # products with more rows (prefill chunks, large batches) stay on cuBLAS
SUM_MAX_ROWS = 8  # the multiply-and-sum tile's rows (each row one more pass over the loaded weight tile)
PRO_NONE, PRO_NORM, PRO_SILU = 0, 1, 2  # what the kernel computes on its input rows before the product
PRO_NAMES = {PRO_NONE: "linear", PRO_NORM: "norm_linear", PRO_SILU: "act_linear"}
MARGIN = 0.03  # a Triton configuration replaces cuBLAS only when it is at least this much faster
MODES = ("auto", "off")
MODE = os.environ.get("DRAFTRELAY_SKINNY", "auto")
if MODE not in MODES:
    raise ValueError(f"DRAFTRELAY_SKINNY={MODE!r}: expected one of {', '.join(MODES)}")
NORM_MAX_K = 4096  # the norm prologue holds the whole row in one tile (its RMS needs all of it)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of the skinny GEMM: each program computes block_n output columns for
    all rows, reading its block_n weight rows once, block_k elements of K per step. dot: tensor-core
    dots over rows padded to 16 (any row count); otherwise fp32 multiply-and-sum (up to SUM_MAX_ROWS).
    unroll: the K loop as straight-line code (a compiled kernel per K), for K beyond one tile.
    split: K cut into this many ranges, one program per (block_n columns, range); each writes fp32
    partials and the last program of a column block (an atomic count) sums them in range order and
    writes the output: one launch, the same bits whichever program finishes last."""
    block_n: int
    block_k: int
    dot: bool
    warps: int
    stages: int
    unroll: bool = False  # K's tiles unrolled (compiled per K): loads issued ahead instead of a loop
    split: int = 1

    def label(self) -> str:
        return (f"{'dot' if self.dot else 'sum'}{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"
                + ("u" if self.unroll else "") + (f"k{self.split}" if self.split > 1 else ""))


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def candidates(pro: int, M: int, N: int, K: int) -> list[SkinnyConfig]:
    """The configurations measured against cuBLAS for one product of M rows by an [N, K] weight.

    Up to SUM_MAX_ROWS rows, the multiply-and-sum tiles (each weight tile read once, multiplied by
    each row in turn): K up to 1,024 two of them, 4,096 elements with 4 warps (many programs for the
    small weights) and 16,384 with 8 warps (fewer, larger reads for the big ones); with the norm
    prologue (whole rows up to NORM_MAX_K) those and 8,192 elements with 4 warps. Longer K (down_proj,
    the 7B's o_proj and head): the looped tile, three split-K tiles (K ranges of 1,024 / 2,048
    elements in tiles of 1,024, and of 4,096 in one tile) and the whole K in tiles of 1,024 over two
    weight rows, unrolled: every load of a program in flight at once, and programs enough to fill the
    card. Tensor-core dot tiles at any row count: one
    whole-row tile with the norm (K up to 1,024); for more than one row two looped tiles (16 and 64
    columns a program; a norm or SiLU prologue then runs as its own launch first), and for K beyond
    1,024 two split-K dot tiles (ranges of ~1,024 / ~2,048)."""
    if not 1 <= M <= MAX_ROWS or N < 1 or K < 1:
        return []
    out: list[SkinnyConfig] = []
    summed = M <= SUM_MAX_ROWS
    if pro == PRO_NORM:
        bk = next_pow2(K)
        if summed and bk <= NORM_MAX_K:
            out += [SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 1),
                    SkinnyConfig(max(1, 8192 // bk), bk, False, 4, 1),
                    SkinnyConfig(max(2, 16384 // bk), bk, False, 8, 1)]
        if bk <= 1024:
            out.append(SkinnyConfig(16, bk, True, 4, 1))
        if M > 1:  # looped dot tiles after a separate add_rms_norm (pipelined K loop, no prologue in it)
            out += [SkinnyConfig(16, 128, True, 4, 4), SkinnyConfig(64, 128, True, 4, 4)]
        return out
    if summed and K <= 1024:
        bk = next_pow2(K)
        out += [SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 2), SkinnyConfig(max(2, 16384 // bk), bk, False, 8, 2)]
    elif summed:  # the run-time loop's tiles wait on each other; split and unrolled, they are all in flight
        out += [SkinnyConfig(8, 512, False, 4, 2)]
        out += [SkinnyConfig(bn, bk, False, w, 1, True, math.ceil(K / ks))
                for bn, bk, w, ks in ((4, 1024, 4, 1024), (8, 1024, 4, 2048), (4, 4096, 8, 4096), (2, 1024, 4, K))]
    if M == 1 and K <= 1024:
        out.append(SkinnyConfig(16, 128, True, 4, 4))
    elif M > 1:
        out += [SkinnyConfig(16, 128, True, 4, 4), SkinnyConfig(64, 128, True, 4, 4)]
        if K > 1024:
            out += [SkinnyConfig(bn, 128, True, 4, 3, False, math.ceil(K / ks)) for bn, ks in ((16, 1024), (32, 2048))]
    return out


def split_range(K: int, cfg: SkinnyConfig) -> tuple[int, int]:
    """(elements of K per range, number of ranges) of a split configuration: ranges whole tiles of
    block_k, the last one shorter; a split of 1 is the whole K."""
    ks = math.ceil(math.ceil(K / max(1, cfg.split)) / cfg.block_k) * cfg.block_k
    return ks, math.ceil(K / ks)


Key = tuple  # (device, pro, M, N, K, dtype name, has bias, has residual)


class Planner:
    """The choice table: key -> the chosen config (None: cuBLAS), made once per key by `measure`
    (candidates -> seconds per call for None and each config; inf for one that failed its check)."""

    def __init__(self, measure: Callable[[Key, list[SkinnyConfig]], dict]) -> None:
        self.measure = measure
        self.table: dict[Key, SkinnyConfig | None] = {}
        self.report: dict[Key, dict[str, float]] = {}

    def choose(self, key: Key, cands: list[SkinnyConfig]) -> SkinnyConfig | None:
        if key in self.table:
            return self.table[key]
        if not cands:
            self.table[key] = None
            return None
        times = self.measure(key, cands)
        self.table[key] = pick(times)
        self.report[key] = {("cublas" if c is None else c.label()): t for c, t in times.items()}
        return self.table[key]


def pick(times: dict) -> SkinnyConfig | None:
    """The fastest configuration if it beats cuBLAS (key None) by MARGIN, else None (cuBLAS)."""
    base = times.get(None, math.inf)
    best, best_t = None, math.inf
    for c, t in times.items():
        if c is not None and t < best_t:
            best, best_t = c, t
    if best is not None and best_t < base * (1 - MARGIN):
        return best
    return None
