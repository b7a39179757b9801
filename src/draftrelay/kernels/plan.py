"""Which kernel computes each skinny product (at most MAX_ROWS rows: decode, verify, a few branches):
cuBLAS, or one configuration of the skinny GEMM (`triton_ops.skinny_linear`), chosen per shape by
measurement the first time the shape runs outside a graph capture.

Why measured: at these row counts cuBLAS's choice swings between 0.3 and 4 TB/s with the shape (the
0.5B drafter's small weights are latency-bound, the 7B's large ones near the copy bandwidth), and a
Triton kernel's speed depends on the card; the measurement times every candidate on the card the
forward runs on, inside a CUDA graph (launch gaps as in a replay), over enough distinct weight copies
that the L2 cache does not serve the repeats, and checks each candidate's output against cuBLAS's
first. The choice is per (product kind, row bucket, weight shape, dtype, bias, residual) and fixed for
the process once made (graphs captured later bake it in; a rank of a tensor-parallel pair may choose
differently from its peer, which changes no replicated value: each rank's products are its own).

Row buckets (1, 2, 3-4, 5-8, 9-16 rows): a product is measured once per bucket, at the bucket's top
row count, and every row count of the bucket runs the same compiled kernel (`row_tiles`: the
multiply-and-sum tile loops over the bucket's rows with those past M masked; the dot tiles pad to 16
anyway). A server's start-up runs every row count from 1 to 16 (graph captures per batch size and
verify width, the prefill sweep), so planning per exact row count measured and compiled each
candidate sixteen times per shape; per bucket it is five, and a row count inside a bucket costs what
the measured top costs at most.

`PlanCache`: the choices on disk, one JSON file per (device name, torch and Triton versions, the
kernels' source), so a restart on the same card measures nothing. An unreadable, malformed or
mismatched file, or an entry naming a configuration the present candidates do not have, is ignored
with a warning and measured afresh.

`PlanSeed`: choices shipped with the package (`kernels/plans/<device name>.json`, a plan cache file
measured on that card), so a card's first start need not time every candidate: a seeded choice that
is one of the present candidates is checked for correctness on this card (one build, one call against
cuBLAS: no timing) and taken; a failed check measures as if there were no seed. Environment
DRAFTRELAY_PLAN_SEED: "off" (measure), a path (that file), unset (the shipped file of the card, if any).

Whole shapes: the first time a product shape (kind, weight, dtype, bias, residual) runs, every row
bucket of it is planned at once. A decode forward then plans everything a verify, a batch or a branch
step of the same model can meet, so no round or step later pays for a measurement on its path (a
worker's round that measured a new bucket inside it overran its budget and tripped the breaker).

Pure Python (no torch, no Triton): the CPU tests check the candidate lists, the choice and bucket
rules and the cache file.

`MODE` (environment DRAFTRELAY_SKINNY): "auto" measures; "off" keeps cuBLAS for every product and the
separate norm / SiLU / pick kernels (the forward as it is without the skinny kernels).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from draftrelay import env_choice

MAX_ROWS = 16  # products with more rows (prefill chunks, large batches) stay on cuBLAS
SUM_MAX_ROWS = 8  # the multiply-and-sum tile's rows (each row one more pass over the loaded weight tile)
PRO_NONE, PRO_NORM, PRO_SILU = 0, 1, 2  # what the kernel computes on its input rows before the product
PRO_NAMES = {PRO_NONE: "linear", PRO_NORM: "norm_linear", PRO_SILU: "act_linear"}
MARGIN = 0.03  # a Triton configuration replaces cuBLAS only when it is at least this much faster ...
# ... than cuBLAS's own time plus what a cuBLAS launch costs its neighbours in a forward. The Triton kernels
# are launched with programmatic dependent launch (each issues its weight tiles while the kernel before it
# finishes); cuBLAS launches plainly, so it breaks that chain on both sides, a cost the measurement (each
# choice timed back to back with itself) does not see. Measured on the H200 (benchmarks/fast_forward.py,
# variant "nocublas", three runs): the 0.5B drafter's four-request STEP was 0.11-0.33 ms faster with its
# 96 four-row gate|up products on the Triton tile than on cuBLAS, the two within 3 % of each other alone,
# i.e. 1-3.4 us per cuBLAS launch; timing each choice paired with a Triton neighbour launch in the graph
# did not show it (docs/FAST_FORWARD.md).
CHAIN_S = 2e-6
MODES = ("auto", "off")
MODE = env_choice("DRAFTRELAY_SKINNY", "auto", MODES)
NORM_MAX_K = 4096  # the norm prologue holds the whole row in one tile (its RMS needs all of it)
ROW_BUCKETS = (1, 2, 4, 8, 16)  # a product is planned and compiled once per bucket, at its top row count

log = logging.getLogger("draftrelay.kernels")


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
    pre: bool = False  # a compact-rows dot tile's norm as its own launch first (add_rms_norm)
    swap: bool = False  # a looped dot tile with the weight tile as the dot's first operand (warp-group dots)

    def label(self) -> str:
        return (f"{'dot' if self.dot else 'sum'}{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"
                + ("u" if self.unroll else "") + (f"k{self.split}" if self.split > 1 else "")
                + ("p" if self.pre else "") + ("sw" if self.swap else ""))


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


ROWS_DOT_PROGRAMS = 264  # the compact-rows dot tile's grid: at least this many programs (two per SM of an H200)
SMALL_WEIGHT = 4096 * 1024  # weights of at most this many elements: the multiply-and-sum tiles still win at a few rows
ROWS_DOT_MAX = 8 << 20  # weights of at most this many elements: the compact-rows dot tiles (they lost on larger ones)
WHOLE_ROW_DOT_K = 1024  # rows of at most this many elements: the whole-row dot tiles of a norm's product


def rows_dot(N: int, K: int, block_n: int, pre: bool = False) -> SkinnyConfig:
    """The compact-rows dot tile of block_n columns for an [N, K] weight: one K slice a program (256
    elements, or 128 where that leaves fewer than ROWS_DOT_PROGRAMS programs), K split into as many
    ranges, so that every program issues its whole weight tile before it waits for the previous
    kernel and nothing in it waits on a loop. pre: the norm as its own launch first (for long rows,
    whose RMS every program would otherwise read whole)."""
    bk = 256 if math.ceil(N / block_n) * math.ceil(K / 256) >= ROWS_DOT_PROGRAMS else 128
    return SkinnyConfig(block_n, bk, True, 4, 1, True, math.ceil(K / bk), pre)


def candidates(pro: int, M: int, N: int, K: int) -> list[SkinnyConfig]:
    """The configurations measured against cuBLAS for one product of M rows by an [N, K] weight.

    One row: the multiply-and-sum tiles (each weight tile read once, fp32 multiply-and-sum): K up to
    1,024 two of them, 4,096 elements with 4 warps (many programs for the small weights) and 16,384
    with 8 warps (fewer, larger reads for the big ones); with the norm prologue (whole rows up to
    NORM_MAX_K) those and 8,192 elements with 4 warps. Longer K (down_proj, the 7B's o_proj and head):
    three split-K tiles (K ranges of 1,024 / 2,048 elements in tiles of 1,024, and of 4,096 in one
    tile) and the whole K in tiles of 1,024 over two weight rows, unrolled: every load of a program in
    flight at once, and programs enough to fill the card.

    Two to sixteen rows: for weights of at most ROWS_DOT_MAX elements the compact-rows dot tiles
    (`rows_dot`, 32 and 64 columns a program, one K slice each; the SiLU or, for rows up to 1,024, the
    norm prologue on the real rows inside the kernel, tensor-core dots over the rows padded to 16),
    the pipelined dot tile of 64 columns (a norm or SiLU prologue then its own launch first) and for K
    beyond 1,024 two split-K dot tiles (ranges of ~1,024 / ~2,048); for a norm's product on rows of at
    most WHOLE_ROW_DOT_K elements (the 0.5B's) the whole-row dot tiles of 16 and 32 columns (the norm in
    the kernel, as the one-row tiles hold it, where the pipelined tile runs add_rms_norm first: gate|up,
    beyond ROWS_DOT_MAX, and the head had only that and cuBLAS, each with the norm's own launch). Up to
    SUM_MAX_ROWS rows the
    multiply-and-sum tile of 4,096 elements stays for the small weights (at most SMALL_WEIGHT
    elements, latency-bound: each row one more pass over the loaded tile). Measured on the H200: at
    four or more rows the fp32 multiply-and-sum is bound by its instruction issue on the large weights
    and lost to cuBLAS by up to 3 x; the compact-rows dot tiles won on the 0.5B's q|k|v and down at
    four rows and lost on the larger weights (gate|up, the head, every 7B product) and at one row.

    Beside the pipelined tile of 64 columns, the same swapped (`swap`: the weight tile the dot's first
    operand, 64 rows a warp group, the rows transposed as the second: Hopper's warp-group dots from shared
    memory, where the rows-first tile runs `mma.sync` on rows padded to 16), on the whole K and, for
    weights of few column blocks, over K ranges of ~1,024 (a norm or SiLU prologue its own launch first,
    as for the tile it swaps). On an H100 the plan chose it for the 0.5B's gate|up at 2-16 rows and the
    7B's eight-row q|k|v, o_proj and head. For K beyond 1,024 (the 7B's rows) also the swapped tile at 3
    stages (60 KiB of shared memory: three programs an SM, where 4 stages fit two) and, without a norm, over
    two K ranges: on an H100 the 7B verify took them for its gate|up, down and o_proj and ran 0.09-0.10 ms
    shorter; at the 0.5B's rows of 896 the 3-stage tile timed faster alone on the four-row gate|up and head,
    yet the four-request STEP ran 0.04-0.05 ms slower with it. The rows-first tile of 32 columns, and the
    rows-first tiles over K ranges, were measured there too and lost (docs/FAST_FORWARD.md)."""
    if not 1 <= M <= MAX_ROWS or N < 1 or K < 1:
        return []
    out: list[SkinnyConfig] = []
    small = N * K <= SMALL_WEIGHT
    if M == 1:
        if pro == PRO_NORM:
            bk = next_pow2(K)
            if bk <= NORM_MAX_K:
                out += [SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 1),
                        SkinnyConfig(max(1, 8192 // bk), bk, False, 4, 1),
                        SkinnyConfig(max(2, 16384 // bk), bk, False, 8, 1)]
        elif K <= 1024:
            bk = next_pow2(K)
            out += [SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 2),
                    SkinnyConfig(max(2, 16384 // bk), bk, False, 8, 2)]
        else:  # the run-time loop's tiles wait on each other; split and unrolled, they are all in flight
            out += [SkinnyConfig(bn, bk, False, w, 1, True, math.ceil(K / ks))
                    for bn, bk, w, ks in ((4, 1024, 4, 1024), (8, 1024, 4, 2048), (4, 4096, 8, 4096), (2, 1024, 4, K))]
        return out
    if M <= SUM_MAX_ROWS and small:
        bk = next_pow2(K)
        if pro == PRO_NORM and bk <= NORM_MAX_K:
            out.append(SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 1))
        elif pro != PRO_NORM and K <= 1024:
            out.append(SkinnyConfig(max(1, 4096 // bk), bk, False, 4, 2))
    if N * K <= ROWS_DOT_MAX:
        pre = pro == PRO_NORM and K > 1024  # every program reads its rows whole for the RMS: long rows normed first
        out += [rows_dot(N, K, 32, pre), rows_dot(N, K, 64, pre)]
    if pro == PRO_NORM and next_pow2(K) <= WHOLE_ROW_DOT_K:  # the whole row a tile: the norm inside, no loop
        out += [SkinnyConfig(bn, next_pow2(K), True, 8, 1) for bn in (16, 32)]
    out.append(SkinnyConfig(64, 128, True, 4, 4))
    if K > 128:  # swapped (a prologue runs first: the tile loops over K)
        out.append(SkinnyConfig(64, 128, True, 4, 4, swap=True))
        if K > 1024:  # long rows: also at 3 stages (60 KiB a program, three an SM where 4 stages fit two)
            out.append(SkinnyConfig(64, 128, True, 4, 3, swap=True))
        if K > 1024 and math.ceil(N / 64) < ROWS_DOT_PROGRAMS:  # few column blocks: over K ranges of ~1,024 too
            out.append(SkinnyConfig(64, 128, True, 4, 4, False, math.ceil(K / 1024), swap=True))
        two = SkinnyConfig(64, 128, True, 4, 4, False, 2, swap=True)
        if pro != PRO_NORM and K > 1024 and two not in out:  # long K (down, the 7B's o_proj): two K ranges
            out.append(two)
    if pro != PRO_NORM and K > 1024:
        out += [SkinnyConfig(bn, 128, True, 4, 3, False, math.ceil(K / ks)) for bn, ks in ((16, 1024), (32, 2048))]
    return out


def holds_silu_pairs(cfg: SkinnyConfig) -> bool:
    """Whether cfg's tile can store SiLU(gate) * up of a gate|up product itself (launch's silu_out): its
    block_n columns split into gate and up halves, so it needs two or more."""
    return cfg.block_n >= 2


def rows_dot_tile(cfg: SkinnyConfig) -> bool:
    """Whether cfg is a compact-rows dot tile (the prologue inside, K slices unrolled)."""
    return cfg.dot and cfg.unroll


def k_ranges(pro: int, K: int, cfg: SkinnyConfig) -> tuple[int, int]:
    """(elements of K per range, ranges) of cfg's launch: split_range, except the norm's multiply-and-sum
    and whole-row dot tiles, which hold the whole row (one range of K). (A swapped tile runs the norm
    first, then the plain product over its ranges.)"""
    if pro == PRO_NORM and not rows_dot_tile(cfg) and not cfg.pre and not cfg.swap:
        return K, 1
    return split_range(K, cfg)


def split_range(K: int, cfg: SkinnyConfig) -> tuple[int, int]:
    """(elements of K per range, number of ranges) of a split configuration: ranges whole tiles of
    block_k, the last one shorter; a split of 1 is the whole K."""
    ks = math.ceil(math.ceil(K / max(1, cfg.split)) / cfg.block_k) * cfg.block_k
    return ks, math.ceil(K / ks)


def row_bucket(M: int) -> int:
    """The row count a product of M rows (1..MAX_ROWS) is planned and compiled at: the smallest of
    ROW_BUCKETS that holds M."""
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"row_bucket: {M} rows, expected 1 to {MAX_ROWS}")
    return next(b for b in ROW_BUCKETS if b >= M)


def bucket_rows(M: int) -> range:
    """Every row count that shares M's bucket."""
    top = row_bucket(M)
    i = ROW_BUCKETS.index(top)
    return range(ROW_BUCKETS[i - 1] + 1 if i else 1, top + 1)


def supports(cfg: SkinnyConfig, M: int) -> bool:
    """Whether skinny_linear can run cfg on M rows (the multiply-and-sum tile takes up to SUM_MAX_ROWS)."""
    return 1 <= M <= MAX_ROWS and (cfg.dot or M <= SUM_MAX_ROWS)


INT8 = "int8"  # a key's dtype for int8 weights with one fp32 scale per row (bf16 rows: kernels.int8_head)


def bucket_candidates(pro: int, M: int, N: int, K: int, dtype: str = "") -> list[SkinnyConfig]:
    """The candidates measured for M rows: those of the bucket's top row count that run every row
    count of the bucket (a bucket's choice serves all of them). dtype INT8 (int8 weights, a scale per
    row): the same tiles (a dot tile converts each int8 tile to bf16 before its dot), none of another
    prologue than the norm's or none."""
    if not 1 <= M <= MAX_ROWS or (dtype == INT8 and pro == PRO_SILU):
        return []
    rows = bucket_rows(M)
    return [c for c in candidates(pro, rows[-1], N, K) if all(supports(c, m) for m in rows)]


def row_tiles(cfg: SkinnyConfig, M: int) -> tuple[int, int]:
    """(M_PAD, M_ROWS), the row constexprs of skinny_linear's launch for M rows. The multiply-and-sum
    tile runs its static row loop over the bucket's top row count, rows from M on masked (no loads,
    zeros summed): every row count of a bucket runs the one kernel measured at the top. The dot tiles
    pad the rows to 16; the looped ones never read M_ROWS (1: one kernel for every row count), the
    compact-rows ones run their prologue over the bucket's top (rows from M on masked)."""
    if cfg.dot:
        return (16, row_bucket(M)) if rows_dot_tile(cfg) else (16, 1)
    top = row_bucket(M)
    return top, top


def kernel_pro(pro: int, cfg: SkinnyConfig, K: int) -> int:
    """The prologue cfg's kernel computes itself: pro, or PRO_NONE where skinny_linear runs it as its own
    launch first (`pre`; a looped rows-first or swapped dot tile's SiLU, and its norm over a row longer
    than one tile: inside the pipelined K loop they cost more than the launch)."""
    looped = cfg.dot and not rows_dot_tile(cfg) and (pro == PRO_SILU or pro == PRO_NORM and K > cfg.block_k)
    return PRO_NONE if looped or cfg.pre else pro


def launch(pro: int, cfg: SkinnyConfig, M: int, K: int, has_delta: bool, has_bias: bool,
           tiles: tuple[int, int] | None = None, silu_out: bool = False,
           w_scale: bool = False) -> tuple[int, int, dict]:
    """(K elements per range, ranges, the kernel's constexprs) of skinny_linear's launch of cfg for M rows
    of a weight of K columns, pro the prologue the kernel computes (kernel_pro) and has_delta whether it
    adds a residual: the one place those constexprs are made (the launch, launch_key, the offline compile
    of benchmarks/kernel_registers.py). The launch adds what depends on the run (IEEE, FIXED_TRIPS, PDL).
    tiles: (M_PAD, M_ROWS) in place of row_tiles' (to count another row rule). silu_out: the output is
    silu(gate) * up of a gate | up product (triton_ops._store_y). w_scale: int8 weights, each output
    column times its row's scale before it is stored (an INT8 key)."""
    m_pad, m_rows = tiles or row_tiles(cfg, M)
    ks, n_split = k_ranges(pro, K, cfg)
    return ks, n_split, dict(M_PAD=m_pad, M_ROWS=m_rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRO=pro,
                             HAS_DELTA=has_delta, HAS_BIAS=has_bias, DOT=cfg.dot, K_UNROLL=k_unroll(pro, cfg, ks),
                             SPLIT=n_split, K_TRIPS=norm_trips(pro, K, cfg), SWAP=cfg.swap, SILU_OUT=silu_out,
                             W_SCALE=w_scale)


def launch_key(pro: int, cfg: SkinnyConfig, M: int, N: int, K: int, dtype: str, has_bias: bool,
               has_delta: bool, tiles: tuple[int, int] | None = None, silu_out: bool = False) -> tuple:
    """What Triton compiles skinny_linear's kernel for (its constexprs and the specialisations of its
    integer arguments: == 1 and divisible by 16): equal keys share one compiled kernel. Counts compiles
    on a CPU (benchmarks/plan_count.py); a prologue run as its own launch first (kernel_pro) is not in
    the key. tiles: (M_PAD, M_ROWS) in place of row_tiles' (to count another row rule); silu_out: as
    launch's."""
    kpro = kernel_pro(pro, cfg, K)
    ks, _, constexprs = launch(kpro, cfg, M, K, has_delta and kpro == pro, has_bias, tiles, silu_out,
                               dtype == INT8)

    def spec(v: int) -> tuple[bool, bool]:
        return v == 1, v % 16 == 0

    return (*sorted(constexprs.items()), cfg.warps, cfg.stages, dtype, spec(M), spec(N), spec(K), spec(ks))


def k_unroll(pro: int, cfg: SkinnyConfig, ks: int) -> int:
    """The K_UNROLL constexpr of cfg's launch over ranges of ks elements: the tiles of a range as
    straight-line code (an unrolled configuration), 1 for a multiply-and-sum tile whose range is one tile
    (the same code as its one-trip loop, but its weight tile is then loaded before the PDL wait, while the
    kernel before it runs, where the loop waits first), 0 for a loop. (A norm's multiply-and-sum tile
    holds the whole row and loads it before the wait anyway; a dot tile with K_UNROLL is the compact-rows
    tile.)"""
    if cfg.unroll:
        return ks // cfg.block_k
    return 1 if not cfg.dot and pro != PRO_NORM and ks <= cfg.block_k else 0


def norm_trips(pro: int, K: int, cfg: SkinnyConfig) -> int:
    """The tiles of the compact-rows dot tile's RMS pass over the whole row, block_k elements each (the
    slice's own tile shape, so that the slice and the pass share one register layout): a constexpr of
    its launch; 0 where there is none."""
    return math.ceil(K / cfg.block_k) if pro == PRO_NORM and rows_dot_tile(cfg) and not cfg.pre else 0


Key = tuple  # (device index, pro, row bucket, N, K, dtype name, has bias, has residual)


def plan_key(dev: int, pro: int, M: int, N: int, K: int, dtype: str, has_bias: bool,
             has_delta: bool) -> tuple[Key, list[SkinnyConfig]] | None:
    """(the Planner's key, the candidates it measures) of a product of M rows; None beyond MAX_ROWS
    (cuBLAS, nothing measured). The key holds M's row bucket: one measurement, at the bucket's top,
    serves every row count of the bucket."""
    if not 1 <= M <= MAX_ROWS:
        return None
    return (dev, pro, row_bucket(M), N, K, dtype, has_bias, has_delta), bucket_candidates(pro, M, N, K, dtype)


MISSING = object()  # PlanCache.get: no usable entry


class PlanCache:
    """The plan's choices on disk for one card and one build (`meta`: device name, torch and Triton
    versions, a digest of the kernels' source): {"format", "meta", "plans": {key: {"choice", "us"}}}.
    A file that cannot be read, does not parse, has another format or another meta is ignored with a
    warning (its plans are measured afresh and the file rewritten); an entry whose choice is not one
    of the present candidates for its key is ignored likewise. Writes merge with what the file holds
    (two processes on one card plan different models), under a lock, through a rename."""

    FORMAT = 1

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta = path, dict(meta)
        self.entries: dict[str, dict] = self._read(warn=True)

    @staticmethod
    def entry_key(key: tuple) -> str:
        return "|".join(str(v) for v in key)

    def _read(self, warn: bool) -> dict[str, dict]:
        why = None
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            why = f"unreadable ({exc})"
        else:
            plans = data.get("plans") if isinstance(data, dict) else None
            if not isinstance(plans, dict) or data.get("format") != self.FORMAT:
                why = f"not a format-{self.FORMAT} plan file"
            elif data.get("meta") != self.meta:
                got = data.get("meta") if isinstance(data.get("meta"), dict) else {}
                diff = ", ".join(f"{k} {got.get(k)!r} != {v!r}" for k, v in self.meta.items() if got.get(k) != v)
                why = f"made for another card or build ({diff or 'meta differs'})"
            else:
                return {k: v for k, v in plans.items() if isinstance(v, dict)}
        if warn:
            log.warning("kernel plan cache %s: %s; ignored, the plans are measured", self.path, why)
        return {}

    def get(self, key: tuple, cands: list[SkinnyConfig]) -> SkinnyConfig | None | object:
        """The stored choice for key among cands (None: cuBLAS), or MISSING."""
        e = self.entries.get(self.entry_key(key))
        if e is None:
            return MISSING
        choice = e.get("choice")
        if choice == "cublas":
            return None
        match = [c for c in cands if c.label() == choice]
        if not match:
            log.warning("kernel plan cache %s: %s chose %r, not a present candidate; measured afresh",
                        self.path, self.entry_key(key), choice)
            return MISSING
        return match[0]

    def report(self, key: tuple) -> dict[str, float]:
        """The stored times of key's measurement (seconds per call by label; inf: failed)."""
        return recorded_seconds(self.entries.get(self.entry_key(key), {}).get("us"))

    def put(self, key: tuple, choice: SkinnyConfig | None, report: dict[str, float]) -> None:
        self.entries[self.entry_key(key)] = {
            "choice": "cublas" if choice is None else choice.label(),
            "us": {k: (round(v * 1e6, 3) if math.isfinite(v) else None) for k, v in report.items()}}
        try:
            self._write()
        except OSError as exc:
            log.warning("kernel plan cache %s: not written (%s)", self.path, exc)

    def _write(self) -> None:
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            with contextlib.suppress(ImportError):
                import fcntl
                fcntl.flock(lock, fcntl.LOCK_EX)
            merged = {**self._read(warn=False), **self.entries}
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".kernel-plan-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": self.FORMAT, "meta": self.meta, "plans": merged}, f, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self.entries = merged


def cache_path(meta: dict, setting: str | None = None) -> str | None:
    """Where the plan cache of `meta` lives: environment DRAFTRELAY_PLAN_CACHE (or `setting`) "off":
    nowhere; a path: that file; unset: a file named by meta's digest under $XDG_CACHE_HOME/draftrelay
    (~/.cache/draftrelay)."""
    setting = os.environ.get("DRAFTRELAY_PLAN_CACHE", "") if setting is None else setting
    if setting == "off":
        return None
    if setting:
        return setting
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(base, "draftrelay", f"kernel-plan-{digest}.json")


SEED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plans")


def seed_path(device_name: str, setting: str | None = None) -> str | None:
    """The shipped seed of a card: environment DRAFTRELAY_PLAN_SEED (or `setting`) "off": none; a path:
    that file; unset: kernels/plans/<device name, non-alphanumerics as _>.json where it exists."""
    setting = os.environ.get("DRAFTRELAY_PLAN_SEED", "") if setting is None else setting
    if setting == "off":
        return None
    if setting:
        return setting
    path = os.path.join(SEED_DIR, re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")
    return path if os.path.exists(path) else None


class PlanSeed:
    """Shipped choices for one card: a PlanCache file of that card (its "meta" device must be this
    card's name; its other meta may differ: each choice is checked on this card before use, never
    trusted for its speed). Unreadable or another card's: empty, with a warning."""

    def __init__(self, path: str, device_name: str) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        try:
            with open(path) as f:
                data = json.load(f)
            plans, meta = data.get("plans"), data.get("meta")
            if data.get("format") != PlanCache.FORMAT or not isinstance(plans, dict) or not isinstance(meta, dict):
                raise ValueError(f"not a format-{PlanCache.FORMAT} plan file")
            if meta.get("device") != device_name:
                raise ValueError(f"made on {meta.get('device')!r}, this card is {device_name!r}")
            self.entries = {k: v for k, v in plans.items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("kernel plan seed %s: %s; not used", path, exc)

    def get(self, key: tuple, cands: list[SkinnyConfig]) -> SkinnyConfig | None | object:
        """The seeded choice for key among cands (None: cuBLAS), or MISSING (none, not a candidate, or
        a seed that recorded its times and never timed one of cands: a candidate added since it was
        made could beat its choice, so the key is measured)."""
        e = self.entries.get(PlanCache.entry_key(key))
        choice = None if e is None else e.get("choice")
        timed = None if e is None else e.get("us")
        if isinstance(timed, dict) and any(c.label() not in timed for c in cands):
            return MISSING
        if choice == "cublas":
            return None
        match = [c for c in cands if c.label() == choice]
        return match[0] if match else MISSING

    def report(self, key: tuple) -> dict[str, float]:
        return recorded_seconds(self.entries.get(PlanCache.entry_key(key), {}).get("us"))


@dataclass
class PlanStats:
    """What planning cost this process: keys measured, candidate configurations timed (cuBLAS not
    counted), seconds inside the measurements and seed checks, keys taken from the cache, keys taken
    from the shipped seed (checked, not timed)."""
    measured: int = 0
    candidates: int = 0
    seconds: float = 0.0
    from_cache: int = 0
    caches: set = field(default_factory=set)
    from_seed: int = 0

    def summary(self) -> dict:
        return {"measured": self.measured, "candidates": self.candidates, "seconds": round(self.seconds, 2),
                "from_cache": self.from_cache, "from_seed": self.from_seed, "cache": sorted(self.caches)}

    def line(self) -> str:
        return (f"kernel plan: {self.measured} shapes measured ({self.candidates} configurations) in "
                f"{self.seconds:.1f} s, {self.from_cache} from the cache, {self.from_seed} from the seed")


class Planner:
    """The choice table: key -> the chosen config (None: cuBLAS), made once per key by `measure`
    (candidates -> seconds per call for None and each config; inf for one that failed its check), or
    taken from the device's PlanCache (`cache_for(device index)`, None: no cache) when it has the key,
    else from the device's PlanSeed (`seed_for`) when `check(key, config)` passes on this card.
    whole_shape: a key's first choice plans every row bucket of its shape (the module docstring)."""

    def __init__(self, measure: Callable[[Key, list[SkinnyConfig]], dict],
                 cache_for: Callable[[int], PlanCache | None] | None = None,
                 seed_for: Callable[[int], PlanSeed | None] | None = None,
                 check: Callable[[Key, SkinnyConfig], bool] | None = None, whole_shape: bool = False) -> None:
        self.measure = measure
        self.cache_for = cache_for
        self.seed_for, self.check = seed_for, check
        self.whole_shape = whole_shape
        self.table: dict[Key, SkinnyConfig | None] = {}
        self.report: dict[Key, dict[str, float]] = {}
        self.stats = PlanStats()
        self._caches: dict[int, PlanCache | None] = {}
        self._seeds: dict[int, PlanSeed | None] = {}

    def _seed(self, dev: int) -> PlanSeed | None:
        if self.seed_for is None or self.check is None:
            return None
        if dev not in self._seeds:
            try:
                self._seeds[dev] = self.seed_for(dev)
            except Exception as exc:  # no seed is a slower first start, never a failed one
                log.warning("kernel plan seed for device %s unavailable (%s): plans are measured", dev, exc)
                self._seeds[dev] = None
        return self._seeds[dev]

    def _cache(self, dev: int) -> PlanCache | None:
        if self.cache_for is None:
            return None
        if dev not in self._caches:
            try:
                self._caches[dev] = self.cache_for(dev)
            except Exception as exc:  # no cache is a slower start, never a failed one
                log.warning("kernel plan cache for device %s unavailable (%s): plans are measured", dev, exc)
                self._caches[dev] = None
            if self._caches[dev] is not None:
                self.stats.caches.add(self._caches[dev].path)
        return self._caches[dev]

    def choose(self, key: Key, cands: list[SkinnyConfig]) -> SkinnyConfig | None:
        if key in self.table:
            return self.table[key]
        got = self._resolve(key, cands)
        if self.whole_shape:
            dev, pro, _, N, K = key[:5]
            for b in ROW_BUCKETS:  # the shape's other buckets now, off every later step's path
                sib = (dev, pro, b, *key[3:])
                if sib not in self.table:
                    self._resolve(sib, bucket_candidates(pro, b, N, K, key[5]))
        return got

    def _resolve(self, key: Key, cands: list[SkinnyConfig]) -> SkinnyConfig | None:
        if not cands:
            self.table[key] = None
            return None
        cache = self._cache(key[0])
        if cache is not None:
            hit = cache.get(key[1:], cands)
            if hit is not MISSING:
                self.stats.from_cache += 1
                self.table[key] = hit
                self.report[key] = cache.report(key[1:])  # the times of the measurement that made the entry
                return hit
        seed = self._seed(key[0])
        if seed is not None:
            hit = seed.get(key[1:], cands)
            if hit is not MISSING:
                t0 = time.perf_counter()
                ok = hit is None or self._checked(key, hit)
                self.stats.seconds += time.perf_counter() - t0
                if ok:
                    self.stats.from_seed += 1
                    self.table[key] = hit
                    self.report[key] = seed.report(key[1:])
                    if cache is not None:
                        cache.put(key[1:], hit, self.report[key])
                    return hit
        t0 = time.perf_counter()
        times = self.measure(key, cands)
        self.stats.measured += 1
        self.stats.candidates += len(cands)
        self.stats.seconds += time.perf_counter() - t0
        self.table[key] = pick(times)
        self.report[key] = {("cublas" if c is None else c.label()): t for c, t in times.items()}
        if cache is not None and any(math.isfinite(t) for c, t in times.items() if c is not None):
            cache.put(key[1:], self.table[key], self.report[key])  # (every candidate failed: not stored)
        return self.table[key]


    def _checked(self, key: Key, cfg: SkinnyConfig) -> bool:
        try:
            ok = bool(self.check(key, cfg))
        except Exception as exc:  # a seeded choice that cannot run here: measured instead
            log.warning("kernel plan seed: %s for %s failed its check (%s); measured", cfg.label(), key, exc)
            return False
        if not ok:
            log.warning("kernel plan seed: %s for %s differs from cuBLAS here; measured", cfg.label(), key)
        return ok


def recorded_seconds(us) -> dict[str, float]:
    """A plan file entry's recorded times ("us": microseconds per call by label, null for a candidate
    that failed) as seconds by label, inf for a failed one; {} where the entry has none."""
    if not isinstance(us, dict):
        return {}
    return {k: (v / 1e6 if isinstance(v, (int, float)) else math.inf) for k, v in us.items()}


def pick_recorded(us) -> str | None:
    """The label `pick` chooses from a plan file entry's recorded times ("cublas" for cuBLAS), or None
    where no cuBLAS time was recorded (nothing to compare against)."""
    times = recorded_seconds(us)
    if "cublas" not in times:
        return None
    got = pick({None if label == "cublas" else label: t for label, t in times.items()})
    return "cublas" if got is None else got


def int8_yardstick(cublas_s: float, bf16_tiles_s: float) -> float:
    """The time an INT8 key's choice must beat, stored as its cuBLAS entry (key None): the bf16 product the
    forward runs without the int8 copy, the faster of cuBLAS on bf16 weights (charged CHAIN_S by pick) and
    the bf16 key's fastest tile (in the PDL chain: no charge, so CHAIN_S is taken off it here). With cuBLAS
    alone as the yardstick an int8 tile slower than the bf16 tile the forward would run was chosen: the
    0.5B's four-row products on an H100 (docs/FAST_FORWARD.md, "The drafter's layers in int8")."""
    return min(cublas_s, bf16_tiles_s - CHAIN_S)


def pick(times: dict) -> SkinnyConfig | None:
    """The fastest configuration if it beats cuBLAS (key None) charged CHAIN_S by MARGIN, else None
    (cuBLAS). The keys may be configurations or their labels (plan_seed.py re-picks a file's times)."""
    base = times.get(None, math.inf)
    best, best_t = None, math.inf
    for c, t in times.items():
        if c is not None and t < best_t:
            best, best_t = c, t
    if best is not None and best_t < (base + CHAIN_S) * (1 - MARGIN):
        return best
    return None
