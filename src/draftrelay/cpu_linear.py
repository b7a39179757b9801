"""How a CPU weight product runs: MKL (`F.linear`, in row blocks for a few rows) or oneDNN, chosen by timing.

torch sends an fp32 `F.linear` on the CPU to MKL. How well MKL reads a large weight depends on the CPU:
on the Intel development VM a one-row product streamed the weight near the read bandwidth, while on the
2-core AMD EPYC VM it reached about 19 GB/s of 46, and 2..16 rows cost 2-3x one row (a
verify of 4 positions of the 1.5B reference target cost twice its decode step, so speculation lost). The
same products through oneDNN (`torch.ops.mkldnn._linear_pointwise` on the plain weight: no packed copy,
no extra memory) read at 32 GB/s there and 2..16 rows cost 1.3-1.8x one (`benchmarks/cpu_linear.py`).

MKL's few-row products run in row blocks (`mkl_linear`): MKL's small-M GEMM re-streams a large weight
for every few rows, so a single-threaded product of CPU_BLOCK_ROWS rows (a verify of 4..16 positions)
runs over row blocks of the weight that fit in the core's L2; a 7-wide verify of the 1.5B reference
target cost 2.7x a 1-wide one on one thread, 1.5-1.8x in blocks. Each block's GEMM computes whole
output columns (the same dot products). With n threads a block holds n x CPU_BLOCK_BYTES (one share
per thread), and only weights of CPU_BLOCK_MIN_THREADED or more are blocked: each block is a parallel
region that waits for every thread (on two threads of the 2-core machine the 7-wide verify took 534 ms
in blocks against 709 ms as one GEMM per weight, benchmarks/cpu_step.py). bf16 products take the
blocks too; which library runs them is torch's (it sends them to oneDNN).

So the library is measured, not assumed, and separately for narrow products (fewer than WIDE_ROWS
rows: a decode, a short verify) and wide ones (a verify of 4 or more positions): the engine and the
worker call `prepare(model)` when they are built (else the first fp32 product over a weight of
PROBE_MIN_BYTES or more does it), which, for a model with such weights, times MKL (as `mkl_linear`
runs it) and oneDNN over the model's own large weights, up to PROBE_MODEL_BYTES (the first product
without a model: one synthetic PROBE_BYTES weight), more than a last-level cache holds, so it measures
reads from memory as a forward's products do, at 1 and WIDE_ROWS rows; it checks oneDNN's values against
MKL's, and for each width keeps oneDNN only where it is at least PROBE_MARGIN faster and right. On one core
of the Intel Xeon VM MKL wins at one row and oneDNN at four (a 5-wide verify of the 1.5B target: 0.85-0.94
s in MKL's blocks, 0.61-0.64 s on oneDNN, against 0.39 s for a decode): the choice is then "mkl+onednn".
`DRAFTRELAY_CPU_LINEAR=mkl|onednn|mkl+onednn|onednn+mkl|auto` (or `choose()`) fixes it (NARROW+WIDE).
Weights under ONEDNN_MIN_BYTES always stay on MKL: oneDNN's call costs ~12 us more, which a small weight
does not repay (a 256 x 256 product: 5 us on MKL, 17 on oneDNN).

The two libraries sum in different orders: their fp32 results differ in the last bits (~1e-6 relative),
as MKL's do between widths and thread counts; neither is bitwise width-invariant.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from draftrelay import SettingError

log = logging.getLogger("draftrelay.cpu_linear")

LIBRARIES = ("auto", "mkl", "onednn", "mkl+onednn", "onednn+mkl")  # NARROW+WIDE; one name: both
ENV = "DRAFTRELAY_CPU_LINEAR"
WIDE_ROWS = 4  # products of this many rows or more are "wide" (decided apart from narrower ones)
CPU_BLOCK_ROWS = (4, 16)  # MKL products of this many rows run in row blocks (mkl_linear)
CPU_BLOCK_BYTES = 1 << 20  # weight bytes per block and thread
CPU_BLOCK_MIN = 4 << 20  # smaller weights run as one GEMM (a block costs ~10 us of Python)
CPU_BLOCK_MIN_THREADED = 8 << 20  # the same with several threads
ONEDNN_MIN_BYTES = 2 << 20  # smaller weights stay on MKL (call overhead, above)
PROBE_MIN_BYTES = 4 << 20  # the first product over a weight this large decides (small models never probe)
PROBE_BYTES = 64 << 20  # the probe's weight: 4096 x 4096 fp32, above the 32 MB L3 of the AMD VM
PROBE_MODEL_BYTES = 768 << 20  # a model's own weights probed: above the 480 MB L3 the Intel VM reports
PROBE_MARGIN = 0.9  # oneDNN is kept where its time is at most this fraction of MKL's
PROBE_TOL = 1e-4  # relative error of oneDNN's probe product against MKL's above which it is not used

_chosen: tuple[str, str] | None = None  # (narrow, wide): "mkl" or "onednn" each, once decided
_probe: dict[str, float] = {}  # the probe's timings (ms), for logs and benchmarks


def onednn_unavailable() -> str:
    """Why oneDNN products cannot run in this torch ("" when they can)."""
    if not torch.backends.mkldnn.is_available():
        return f"this torch ({torch.__version__}) is built without oneDNN (mkldnn)"
    if getattr(torch.ops.mkldnn, "_linear_pointwise", None) is None:
        return f"this torch ({torch.__version__}) has no mkldnn._linear_pointwise"
    return ""


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")


def _name(pair: tuple[str, str]) -> str:
    return pair[0] if pair[0] == pair[1] else f"{pair[0]}+{pair[1]}"


def choose(library: str) -> str:
    """Fix the library for this process ("mkl", "onednn", NARROW+WIDE such as "mkl+onednn": MKL below
    WIDE_ROWS rows, oneDNN from there, or "auto": probe at the next large product). Returns the choice now
    in force ("auto" until the probe has run). Refuses oneDNN where it cannot run, naming why. A fixed
    choice keeps the timings of a probe that ran (they still describe this machine: a benchmark that
    forces one library for a while reports them); "auto" clears them."""
    global _chosen
    if library not in LIBRARIES:
        raise ValueError(f"CPU linear library {library!r}: one of {', '.join(LIBRARIES)}")
    if "onednn" in library and (why := onednn_unavailable()):
        raise RuntimeError(f"CPU linear library {library!r}: {why}")
    narrow, _, wide = library.partition("+")
    _chosen = None if library == "auto" else (narrow, wide or narrow)
    if library == "auto":
        _probe.clear()
    return chosen()


def chosen() -> str:
    """The choice in force: "mkl", "onednn", NARROW+WIDE where they differ, or "auto" before the probe."""
    return _name(_chosen) if _chosen else "auto"


def probe_times() -> dict[str, float]:
    """The latest probe's timings in ms (empty when none has run since "auto" was chosen): mkl_1,
    onednn_1, mkl_4, onednn_4."""
    return dict(_probe)


def _time_ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def probe(weights: list[torch.Tensor] | None = None) -> str:
    """Time MKL (as mkl_linear runs it) and oneDNN at 1 and WIDE_ROWS rows (interleaved, best of 3 after
    one warm call each) and keep, for narrow and for wide products apart, the faster by PROBE_MARGIN if
    oneDNN's values agree with MKL's. Returns the choice.

    weights: a model's own fp32 weights (prepare() passes them), each product of the probe one pass over
    them, since how MKL's few-row kernel fares depends on the shapes: on one core of the Intel VM a 4-row
    product over a 4096 x 4096 weight cost MKL 0.9x its 1-row one, over the 1.5B target's 1536-wide
    weights about 2x. Without: one synthetic PROBE_BYTES weight."""
    global _chosen
    if why := onednn_unavailable():
        log.info("CPU fp32 products on MKL: %s", why)
        _chosen = ("mkl", "mkl")
        return chosen()
    gen = torch.Generator().manual_seed(0)
    if not weights:
        side = int((PROBE_BYTES // 4) ** 0.5)
        weights = [torch.rand(side, side, generator=gen) - 0.5]
    times = {}
    for rows in (1, WIDE_ROWS):
        xs = [torch.rand(rows, w.shape[1], generator=gen) - 0.5 for w in weights]
        ref, got = mkl_linear(xs[0], weights[0]), _onednn(xs[0], weights[0], None)  # also the warm calls
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= PROBE_TOL:
            log.warning("CPU fp32 products on MKL: oneDNN's probe product is off by %.2g (relative)", err)
            _chosen = ("mkl", "mkl")
            return chosen()
        m, d = [], []
        for _ in range(3):  # interleaved, so a burst of load hits both
            m.append(_time_ms(lambda xs=xs: [mkl_linear(x, w) for x, w in zip(xs, weights, strict=True)]))
            d.append(_time_ms(lambda xs=xs: [_onednn(x, w, None) for x, w in zip(xs, weights, strict=True)]))
        times[f"mkl_{rows}"], times[f"onednn_{rows}"] = min(m), min(d)
    _probe.update(times)
    _chosen = tuple("onednn" if times[f"onednn_{r}"] <= PROBE_MARGIN * times[f"mkl_{r}"] else "mkl"
                    for r in (1, WIDE_ROWS))
    log.info("CPU fp32 products on %s (%d threads; %d MB of weights at 1 / %d rows: MKL %.1f / %.1f ms, "
             "oneDNN %.1f / %.1f ms)", chosen(), torch.get_num_threads(),
             sum(w.numel() * 4 for w in weights) >> 20, WIDE_ROWS,
             times["mkl_1"], times[f"mkl_{WIDE_ROWS}"], times["onednn_1"], times[f"onednn_{WIDE_ROWS}"])
    return chosen()


def _from_env() -> None:
    library = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if library not in LIBRARIES:
        raise SettingError(f"{ENV}={library!r}: one of {', '.join(LIBRARIES)}")
    if library != "auto":
        choose(library)


def _fp32_cpu_bytes(w: torch.Tensor) -> int:
    """w's bytes if it is an fp32 CPU tensor (what this module chooses for), else 0."""
    return w.numel() * 4 if w.dtype == torch.float32 and w.device.type == "cpu" else 0


def use_onednn(w: torch.Tensor, rows: int = 1) -> bool:
    """Whether an fp32 CPU product of `rows` rows over w runs on oneDNN (probing first if this is the first
    large one)."""
    size = _fp32_cpu_bytes(w) if w.is_contiguous() else 0
    if size < ONEDNN_MIN_BYTES:
        return False
    if _chosen is None and size >= PROBE_MIN_BYTES:
        probe()
    return _chosen is not None and _chosen[rows >= WIDE_ROWS] == "onednn"


def mkl_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (MKL for fp32), in row blocks of w for products of CPU_BLOCK_ROWS rows (the docstring above
    says why and where)."""
    if CPU_BLOCK_ROWS[0] <= x.numel() // x.shape[-1] <= CPU_BLOCK_ROWS[1]:
        per_row = w.shape[1] * w.element_size()
        size = w.shape[0] * per_row
        n = torch.get_num_threads() if size >= CPU_BLOCK_MIN else 0  # small weights: no call at all
        if n == 1 or n > 1 and size >= CPU_BLOCK_MIN_THREADED:
            rows = max(16, n * CPU_BLOCK_BYTES // per_row)
            return torch.cat([F.linear(x, w[i:i + rows], None if b is None else b[i:i + rows])
                              for i in range(0, w.shape[0], rows)], dim=-1)
    return F.linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU product x [..., K] @ w [N, K].T (+ b): on oneDNN where the choice for its width says so, else
    mkl_linear."""
    if use_onednn(w, x.numel() // x.shape[-1]) and x.dtype == w.dtype:
        return onednn_linear(x, w, b)
    return mkl_linear(x, w, b)


def prepare(model: torch.nn.Module) -> str:
    """Decide now, before anything is timed (the engine and the worker call it on their models): probes if
    undecided and the model has an fp32 CPU weight of PROBE_MIN_BYTES or more, on its own weights of that
    size (the first ones, up to PROBE_MODEL_BYTES: larger than a last-level cache, so it reads memory as a
    forward does). Returns the choice."""
    if _chosen is None:
        ring: list[torch.Tensor] = []
        total = 0
        for p in model.parameters():
            if total >= PROBE_MODEL_BYTES:
                break
            if p.dim() == 2 and p.is_contiguous() and _fp32_cpu_bytes(p) >= PROBE_MIN_BYTES:
                ring.append(p.detach())
                total += _fp32_cpu_bytes(p)
        if ring:
            probe(ring)
    return chosen()


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b through oneDNN on w's plain layout (what model.linear runs when use_onednn(w))."""
    if x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        raise TypeError(f"oneDNN linear: dtypes x {x.dtype}, w {w.dtype}, b {None if b is None else b.dtype}")
    return _onednn(x, w, b)


_from_env()
