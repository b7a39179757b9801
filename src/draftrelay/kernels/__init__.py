"""Fused kernels of the fast forward, each with a plain-torch definition of what it computes.

`backend(device)` is the module whose functions the fast forward calls: `triton_ops` on a CUDA device
where Triton imports, `reference` everywhere else (the CPU runs the fast forward's structure with the
plain-torch definitions: the same function, not faster). Both modules define

    embedding(tokens, weight) -> weight's rows of the token ids (F.embedding)
    add_rms_norm(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta) * weight)
    norm_linear(x, delta, weight, eps, w, b) -> (x + delta, add_rms_norm's output @ w^T + b)
    use_norm_linear(rows, w) -> whether the forward takes norm_linear for that product
    linear(x, w, b) -> x @ w^T + b
    act_linear(gu, w, b) -> silu_mul(gu) @ w^T + b
    norm_mlp(x, delta, weight, eps, wgu, wd, qgu=None, qd=None) -> (x + delta, act_linear(norm_linear(x,
        delta, weight, eps, wgu, None)'s product, wd)): on CUDA a skinny gate|up product stores silu_mul of
        itself; qgu / qd: int8 copies of wgu / wd read in their place (on CUDA where an int8 tile is planned)
    int8_linear(x, q, s, b=None) -> x @ (q * s)^T + b for int8 q with fp32 row scales s (int8_head.py); on
        CUDA None where no int8 tile is planned for the rows (the caller reads its bf16 weight)
    int8_norm_linear(x, delta, weight, eps, q, s, b=None) -> norm_linear's pair with int8_linear's product
        (or None)
    greedy_pick(logits, ids=None) -> (argmax, its softmax probability); ids: columns -> token ids
    greedy_top(logits, m, ids=None) -> greedy_pick's two and the m most likely ids with their probabilities
    silu_mul(gu) -> silu(gate) * up
    rope_kv_write(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows) -> q rotated (k, v into the cache)
    decode_attention(q, ck, cv, rows, start, kv_len) -> causal GQA attention over the cache rows
    rope_attention(qkv, start, inv_freq, n_heads, n_kv, ck, cv, rows, kv_len) -> rope_kv_write then
        decode_attention (one kernel on CUDA for one token per row up to a chunk of keys:
        attention_fuses_rope(kv_len, T))

with the signatures and rounding documented in `reference`. On CUDA the products of decode and verify
rows run cuBLAS or the skinny GEMM (multiply-and-sum, dot or split-K tiles), whichever `kernels.plan`
measured faster for the shape, and every Triton kernel is launched with programmatic dependent launch
where the card has it (`triton_ops.PDL`).
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

import torch

from draftrelay.kernels import reference

__all__ = ["backend", "plan_stats", "triton_available", "reference"]


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    try:
        from draftrelay.kernels import triton_ops
    except ImportError:  # no Triton on this machine (a machine without the gpu or test extras)
        return None
    return triton_ops


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on `device` (a CUDA device with Triton installed)."""
    return torch.device(device).type == "cuda" and _triton_module() is not None


def backend(device: torch.device | str) -> ModuleType:
    """The kernels for tensors on `device`: Triton's on CUDA where available, else the references."""
    return _triton_module() if triton_available(device) else reference


def plan_stats():
    """This process's kernel-planning cost so far (`plan.PlanStats`: shapes measured, configurations
    timed, seconds, shapes taken from the plan cache), or None where the Triton kernels were never
    loaded (a CPU, the plain forward). Start-up logs it: the measurement is the start's largest cost."""
    mod = sys.modules.get(__name__ + ".triton_ops")
    return None if mod is None else mod.PLANNER.stats
