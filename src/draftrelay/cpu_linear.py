"""Which library runs a CPU fp32 weight product: MKL (`F.linear`) or oneDNN, chosen by timing both here.

torch sends an fp32 `F.linear` on the CPU to MKL. How well MKL reads a large weight depends on the CPU:
on the Intel development VM a one-row product streamed the weight near the read bandwidth, while on the
2-core AMD EPYC VM it reached about 19 GB/s of 46, and 2..16 rows cost 2-3x one row (a
verify of 4 positions of the 1.5B reference target cost twice its decode step, so speculation lost). The
same products through oneDNN (`torch.ops.mkldnn._linear_pointwise` on the plain weight: no packed copy,
no extra memory) read at 32 GB/s there and 2..16 rows cost 1.3-1.8x one (`benchmarks/cpu_linear.py`).

So the choice is measured, not assumed: the engine and the worker call `prepare(model)` when they are
built (else the first fp32 product over a weight of PROBE_MIN_BYTES or more does it), which, for a model
with such a weight, times both libraries on a weight of PROBE_BYTES (larger than a last-level cache, so
it measures reads from memory, as a decode's products do) at 1 and 4 rows, checks oneDNN's values
against MKL's, and keeps oneDNN only where it is at least PROBE_MARGIN faster and right.
`DRAFTRELAY_CPU_LINEAR=mkl|onednn|auto` (or `choose()`) fixes it. Weights under ONEDNN_MIN_BYTES always
stay on MKL: oneDNN's call costs ~12 us more, which a small weight does not repay (a 256 x 256 product:
5 us on MKL, 17 on oneDNN). bf16 and other dtypes are not touched: torch already sends bf16 products to oneDNN.

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

LIBRARIES = ("auto", "mkl", "onednn")
ENV = "DRAFTRELAY_CPU_LINEAR"
ONEDNN_MIN_BYTES = 2 << 20  # smaller weights stay on MKL (call overhead, above)
PROBE_MIN_BYTES = 4 << 20  # the first product over a weight this large decides (small models never probe)
PROBE_BYTES = 64 << 20  # the probe's weight: 4096 x 4096 fp32, above the 32 MB L3 of the AMD VM
PROBE_MARGIN = 0.9  # oneDNN is kept where its time is at most this fraction of MKL's
PROBE_TOL = 1e-4  # relative error of oneDNN's probe product against MKL's above which it is not used

_chosen: str | None = None  # "mkl" or "onednn" once decided
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


def choose(library: str) -> str:
    """Fix the library for this process ("mkl", "onednn", or "auto": probe at the next large product).
    Returns the library now in force ("auto" until the probe has run). Refuses "onednn" where it cannot
    run, naming why. A fixed choice keeps the timings of a probe that ran (they still describe this
    machine: a benchmark that forces one library for a while reports them); "auto" clears them."""
    global _chosen
    if library not in LIBRARIES:
        raise ValueError(f"CPU linear library {library!r}: one of {', '.join(LIBRARIES)}")
    if library == "onednn" and (why := onednn_unavailable()):
        raise RuntimeError(f"CPU linear library 'onednn': {why}")
    _chosen = None if library == "auto" else library
    if library == "auto":
        _probe.clear()
    return _chosen or "auto"


def chosen() -> str:
    """The library in force: "mkl", "onednn", or "auto" before the probe has run."""
    return _chosen or "auto"


def probe_times() -> dict[str, float]:
    """The latest probe's timings in ms (empty when none has run since "auto" was chosen): mkl_1,
    onednn_1, mkl_4, onednn_4."""
    return dict(_probe)


def _time_ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def probe() -> str:
    """Time MKL and oneDNN on a PROBE_BYTES weight at 1 and 4 rows (interleaved, best of 3 after one warm
    call each) and keep the faster by PROBE_MARGIN if its values agree with MKL's. Returns the choice."""
    global _chosen
    if why := onednn_unavailable():
        log.info("CPU fp32 products on MKL: %s", why)
        _chosen = "mkl"
        return _chosen
    gen = torch.Generator().manual_seed(0)
    side = int((PROBE_BYTES // 4) ** 0.5)
    w = torch.rand(side, side, generator=gen) - 0.5
    times = {}
    for rows in (1, 4):
        x = torch.rand(rows, side, generator=gen) - 0.5
        ref, got = F.linear(x, w), _onednn(x, w, None)  # also the warm calls
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= PROBE_TOL:
            log.warning("CPU fp32 products on MKL: oneDNN's probe product is off by %.2g (relative)", err)
            _chosen = "mkl"
            return _chosen
        m, d = [], []
        for _ in range(3):  # interleaved, so a burst of load hits both
            m.append(_time_ms(lambda x=x: F.linear(x, w)))
            d.append(_time_ms(lambda x=x: _onednn(x, w, None)))
        times[f"mkl_{rows}"], times[f"onednn_{rows}"] = min(m), min(d)
    _probe.update(times)
    fast = times["onednn_1"] + times["onednn_4"] <= PROBE_MARGIN * (times["mkl_1"] + times["mkl_4"])
    _chosen = "onednn" if fast else "mkl"
    log.info("CPU fp32 products on %s (%d threads; a %d MB weight at 1 / 4 rows: MKL %.1f / %.1f ms, "
             "oneDNN %.1f / %.1f ms)", _chosen, torch.get_num_threads(), PROBE_BYTES >> 20,
             times["mkl_1"], times["mkl_4"], times["onednn_1"], times["onednn_4"])
    return _chosen


def _from_env() -> None:
    library = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if library not in LIBRARIES:
        raise SettingError(f"{ENV}={library!r}: one of {', '.join(LIBRARIES)}")
    if library != "auto":
        choose(library)


def _fp32_cpu_bytes(w: torch.Tensor) -> int:
    """w's bytes if it is an fp32 CPU tensor (what this module chooses for), else 0."""
    return w.numel() * 4 if w.dtype == torch.float32 and w.device.type == "cpu" else 0


def use_onednn(w: torch.Tensor) -> bool:
    """Whether an fp32 CPU product over w runs on oneDNN (probing first if this is the first large one)."""
    size = _fp32_cpu_bytes(w) if w.is_contiguous() else 0
    if size < ONEDNN_MIN_BYTES:
        return False
    if _chosen is None and size >= PROBE_MIN_BYTES:
        probe()
    return _chosen == "onednn"


def prepare(model: torch.nn.Module) -> str:
    """Decide now, before anything is timed (the engine and the worker call it on their models): probes if
    undecided and the model has an fp32 CPU weight of PROBE_MIN_BYTES or more. Returns the choice."""
    if _chosen is None and any(_fp32_cpu_bytes(p) >= PROBE_MIN_BYTES for p in model.parameters()):
        probe()
    return chosen()


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b through oneDNN on w's plain layout (what model.linear runs when use_onednn(w))."""
    if x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        raise TypeError(f"oneDNN linear: dtypes x {x.dtype}, w {w.dtype}, b {None if b is None else b.dtype}")
    return _onednn(x, w, b)


_from_env()
