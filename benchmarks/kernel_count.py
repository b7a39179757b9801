"""Kernels per forward: how many device kernels one decode / verify forward issues, per layer.

The drafter's STEP and the TP2 step on the H200 are bound by kernel count, not bytes (~2.6 µs per small
kernel in a graph replay; docs/TP2.md, README): this counts them, deterministically and on a CPU.
An op counts as one kernel when it writes memory: an in-place op, or an op whose output does not share
storage with an input (views, no-op casts and reshapes of contiguous tensors launch nothing). Two
paths: "cpu" as a CPU runs it, "gpu" with F.rms_norm as one fused kernel (torch's _fused_rms_norm on
CUDA; a CPU decomposes it), and "fused": the fast forward (Transformer.fast), each of its fused kernels
(draftrelay.kernels) counted once, as its Triton kernel launches (RoPE, the K/V write and the attention
are one launch for one token per row up to 1,024 keys, else two; beyond 1,024 keys the attention's
combine is one more, not counted: the contexts here are short). The products count as
the skinny GEMM launches them, one each with the norm or SiLU inside; where kernels.plan measures cuBLAS
faster for a shape, the norm / SiLU is a launch of its own there.
Launch-level behaviour of a real GPU (cuBLAS splitK kernels, ...) is not
modelled: the GPU profile is tests_gpu/worker_graph_probe.py.

    python benchmarks/kernel_count.py            # prints the table, writes benchmarks/results/kernel_count.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from draftrelay import model as M
from draftrelay.worker.drafters import SHAPES


class KernelCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name.endswith("_") or any(t.numel() and t.untyped_storage().data_ptr() not in ins for t in outs):
            self.ops[name] += 1
        return out


class FusedRmsNorm(TorchFunctionMode):
    """F.rms_norm as one kernel, as on a GPU (torch's _fused_rms_norm); a CPU decomposes it."""

    def __init__(self, counter: KernelCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.rms_norm:
            return func(*args, **(kwargs or {}))
        self.counter.paused = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.paused = False
            self.counter.ops["rms_norm (fused)"] += 1


@contextlib.contextmanager
def fused_kernels(counter: KernelCounter):
    """Each function of kernels.reference counted as one kernel (its Triton launch), its torch ops not."""
    from draftrelay.kernels import reference

    names = ("add_rms_norm", "silu_mul", "rope_kv_write", "decode_attention", "rope_attention", "norm_linear",
             "linear", "act_linear")
    saved = {n: getattr(reference, n) for n in names}

    def wrap(n, fn):
        def one(*a, **k):
            if counter.paused:  # inside another fused kernel's definition (norm_linear's norm): part of it
                return fn(*a, **k)
            counter.paused = True
            try:
                return fn(*a, **k)
            finally:
                counter.paused = False
                # RoPE + attention: one launch for one token per row (up to 1,024 keys), two for more tokens
                counter.ops[f"{n} (fused)"] += 1 if n != "rope_attention" or a[0].shape[1] == 1 else 2
        return one

    for n, fn in saved.items():
        setattr(reference, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(reference, n, fn)


def count(shape: str, n_layers: int, B: int, T: int, kv_len: int, path: str) -> collections.Counter:
    cfg = M.ModelConfig(**{**SHAPES[shape], "n_layers": n_layers, "vocab_size": 1024}, name=shape)
    model = M.Transformer.random(cfg, seed=0, device="cpu", dtype=torch.bfloat16)
    model.fast = path == "fused"
    cache = model.new_cache(B + 1, kv_len + T)
    tokens = torch.zeros(B, T, dtype=torch.long)
    start = torch.full((B,), kv_len - T, dtype=torch.long)
    rows = torch.arange(B, 0, -1)  # scattered rows: the graph path (a gather per layer)
    with torch.no_grad(), KernelCounter() as k:  # no_grad, not inference_mode: composite ops decompose
        ctx = {"gpu": FusedRmsNorm, "fused": fused_kernels}.get(path)
        with ctx(k) if ctx else contextlib.nullcontext():
            model(tokens, start, cache, rows, kv_len=kv_len)
    return k.ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernel_count.json")
    args = ap.parse_args()
    rows = []
    for where in ("cpu", "gpu", "fused"):
        for shape in SHAPES:
            for B, T in ((1, 1), (4, 5)):
                one, two = (count(shape, n, B, T, 256, where) for n in (1, 2))
                per_layer = sum(two.values()) - sum(one.values())
                fixed = sum(one.values()) - per_layer
                layer_ops = dict(sorted((two - one).items(), key=lambda kv: -kv[1]))
                rows.append({"path": where, "shape": shape, "requests": B, "tokens": T,
                             "kernels_per_layer": per_layer, "kernels_outside_layers": fixed,
                             "kernels_per_forward": fixed + per_layer * SHAPES[shape]["n_layers"],
                             "per_layer_ops": layer_ops})
                print(f"{where} {shape:14} B={B} T={T}: {per_layer} kernels per layer, {fixed} outside, "
                      f"{rows[-1]['kernels_per_forward']} per forward  {layer_ops}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "kernel_count", "commit": commit, "torch": torch.__version__, "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
