"""The fast forward on a GPU, side by side in one process: drafter STEP (0.5B shape) and target decode /
verify (7B shape), this project's eager, graphs (plain forward), graphs with the fused kernels and
cuBLAS for every product ("graphs_fast_cublas"), graphs with the fused kernels and the products chosen
per shape (skinny GEMM or cuBLAS, kernels.plan: "graphs_fast"; "graphs_fast_nopdl" the same launched
without programmatic dependent launch, "graphs_fast_noprefetch" without the attention's L2 prefetch,
"graphs_fast_norows" planned without the compact-rows dot tiles, "graphs_fast_nocublas" planned over the
Triton candidates only, "graphs_fast_s4" planned without the swapped tiles of 3 stages and over two K ranges,
"graphs_fast_nosiluepi" with SiLU * up computed by the down product or its own launch, not stored by gate|up;
for the drafter also its head read as int8 ("graphs_fast_int8head"), its layers' products read as int8
("graphs_fast_int8layers", worker --quant int8) and both ("graphs_fast_int8all"), its graph replayed alone,
"graphs_fast_replay_only", and the worker's host work of the step with the replay left out,
"graphs_fast_host_only"), plain torch.compile of the same model
(7B decode), and Hugging Face transformers (target decode). The "gemm" section and "plans" list each
product shape's cuBLAS and skinny-GEMM times.

Random bf16 weights of the real shapes; KV filled with random values up to the context (timing does not
depend on values). Variants are timed interleaved (each iteration runs every variant once, in a seeded
random order), p50 with p10/p90. Also: the device copy bandwidth (bytes read + written), achieved
bytes/s of each step (weights read once per forward + the KV each forward reads), and the kernels one
step launches (profiled replay).

    python benchmarks/fast_forward.py [--out benchmarks/results/fast_forward.json] [--contexts 128,32768]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch

from draftrelay import model as M
from draftrelay.capture import gc_paused, kv_bucket
from draftrelay.draft_vocab import DraftVocab
from draftrelay.engine.graphs import DecodeGraphs
from draftrelay.handoff.procinfo import machine_info
from draftrelay.int8_head import Int8Head
from draftrelay.int8_layers import quantize_layers
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R
from draftrelay.kernels import triton_ops
from draftrelay.worker.drafters import SHAPES, Job, LlamaDrafter

TARGET_7B = dict(vocab_size=151936, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                 intermediate_size=18944, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 max_position_embeddings=131072, qkv_bias=True)


def pct(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"p50_ms": round(float(np.median(a)), 4), "p10_ms": round(float(np.percentile(a, 10)), 4),
            "p90_ms": round(float(np.percentile(a, 90)), 4), "n": len(xs)}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(variants: dict, iters: int, seed: int = 0) -> dict:
    """p50 / p10 / p90 of each variant over `iters` iterations, each iteration running every variant once
    in a fresh (seeded) random order: with a fixed order each variant always ran right after the same one
    (the restricted head's STEP after an eager forward of 30-100 ms of small launches, say), and whatever
    that predecessor leaves behind in the host's caches or the card landed on that variant alone."""
    for fn in variants.values():  # warm
        fn()
        fn()
    times = {k: [] for k in variants}
    rng = np.random.default_rng(seed)
    names = list(variants)
    for _ in range(iters):
        for i in rng.permutation(len(names)):
            times[names[i]].append(timed(variants[names[i]]))
    return {k: pct(v) for k, v in times.items()}


def kernel_count(fn) -> dict:
    """Kernels (and their total device time) one call of fn launches, from a profiled run."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n, dev_us, names = 0, 0.0, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            n += 1
            dev_us += e.device_time
            c, t = names.get(e.name[:70], (0, 0.0))
            names[e.name[:70]] = (c + 1, t + e.device_time)
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:14]
    return {"kernels": n, "device_us": round(dev_us, 1),
            "top_by_time": [(k, c, round(t, 1)) for k, (c, t) in top]}  # name, count, us


def copy_bandwidth(dev) -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()  # 2 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = [timed(lambda: y.copy_(x)) for _ in range(20)]
    return 2 * (1 << 30) * 2 / float(np.median(ts))


def gbps(nbytes: int, t: dict) -> dict:
    return {k: round(nbytes / (v["p50_ms"] / 1e3) / 1e9, 1) for k, v in t.items()}


MAIN_PLANNER = triton_ops.PLANNER
PLAN_KEY = P.plan_key
# the plan without the compact-rows dot tiles (its own choice table, no cache file): the "norows" variant
NOROWS_PLANNER = P.Planner(triton_ops._measure)


def _measure_nocublas(key, cands):
    times = triton_ops._measure(key, cands)
    times[None] = float("inf")  # cuBLAS is never chosen where a candidate runs and matches
    return times


# the plan that keeps every product of at most plan.MAX_ROWS rows on the Triton kernels (launched with PDL)
# wherever a candidate runs: the "nocublas" variant, which prices the chain breaks a cuBLAS product costs
NOCUBLAS_PLANNER = P.Planner(_measure_nocublas)


# the plan without the swapped tiles of 3 stages and over two K ranges (plan.candidates, for K > 1,024; its own
# choice table): the "s4" variant
S4_PLANNER = P.Planner(triton_ops._measure)


def _plan_key_without(drop):
    """plan.plan_key with the candidates for which drop(K, cfg) holds left out (a variant's own plan)."""
    def plan_key(*args, **kw):
        planned = PLAN_KEY(*args, **kw)
        if planned is None:
            return None
        key, cands = planned
        return key, [c for c in cands if not drop(key[4], c)]
    return plan_key


# (the ranged swapped tile of a K of 1,025 to 2,048 is split 2 too: it stays)
_plan_key_s4 = _plan_key_without(lambda K, c: c.swap and (c.stages == 3 or c.split == 2 != math.ceil(K / 1024)))
_plan_key_norows = _plan_key_without(lambda K, c: P.rows_dot_tile(c))


def fast_path(model: M.Transformer, fast) -> None:
    """True: the fused kernels with the products chosen per shape (kernels.plan, skinny GEMM or cuBLAS)
    and the fused greedy pick, launched with programmatic dependent launch where the card has it;
    "nopdl": the same launched plainly (triton_ops.PDL off); "noprefetch": the same without the
    attention's L2 prefetch of its first key tile (triton_ops.ATTN_PREFETCH off); "norows": the same
    planned without the compact-rows dot tiles (a plan of its own over the other candidates);
    "nocublas": planned over the Triton candidates only (cuBLAS never chosen where one runs); "s4": planned
    without the swapped tiles of 3 stages and over two K ranges (a plan of its own); "nosiluepi": the gate|up
    product not storing SiLU * up (triton_ops.SILU_EPILOGUE off: act_linear's way);
    "cublas": the same fused kernels with cuBLAS for every product and the separate norm / SiLU / pick
    kernels (plan MODE "off"); False: the plain forward. Graphs keep what was set when they were captured."""
    model.fast = bool(fast)
    P.MODE = "off" if fast == "cublas" else "auto"
    triton_ops.PDL = fast != "nopdl"
    triton_ops.ATTN_PREFETCH = fast != "noprefetch"
    triton_ops.SILU_EPILOGUE = fast != "nosiluepi"
    norows = fast == "norows"
    triton_ops.PLANNER = NOROWS_PLANNER if norows else NOCUBLAS_PLANNER if fast == "nocublas" else \
        S4_PLANNER if fast == "s4" else MAIN_PLANNER
    P.plan_key = _plan_key_norows if norows else _plan_key_s4 if fast == "s4" else PLAN_KEY


def plan_first(model: M.Transformer, forward) -> None:
    """The default plan made before any variant runs, as a worker makes it: with PDL on. The plan is the
    process's, and every variant but "norows" and "nocublas" takes its choices (the first product of a shape
    plans all its row buckets): where a variant's first call planned it, the variant that happened to run
    first set the conditions, and under "nopdl" the Triton tiles were timed launched plainly (each paying
    the launch gap PDL hides; cuBLAS never has PDL), so on an H100 (no shipped seed: measured) the four-row
    products of the 0.5B got tiles that time 1.35-1.65 x the best with PDL, and "graphs_fast" at four requests
    read 0.1-0.5 ms slower than "nocublas" (benchmarks/results/fast_forward_shuffled_*_h100.json: each
    product's "us" under "plans" against "plans_nocublas"). forward(): one eager forward of the model."""
    fast_path(model, True)
    forward()


def plan_rows(planner: P.Planner = MAIN_PLANNER) -> list[dict]:
    """Every product shape the planner measured so far: cuBLAS's and each candidate's time, the choice."""
    rows = []
    for key, times in planner.report.items():
        _, pro, m, n, k, dtype, bias, delta = key
        choice = planner.table[key]
        nbytes = n * k * (1 if dtype == P.INT8 else 2)
        rows.append({"product": P.PRO_NAMES[pro], "M": m, "N": n, "K": k, "dtype": dtype, "bias": bias,
                     "residual": delta,
                     "us": {c: round(t * 1e6, 2) for c, t in times.items() if np.isfinite(t)},
                     "failed": [c for c, t in times.items() if not np.isfinite(t)],
                     "GBps": {c: round(nbytes / t / 1e9, 1) for c, t in times.items() if np.isfinite(t)},
                     "choice": "cublas" if choice is None else choice.label()})
    return rows


def gemm_section(dev, out) -> None:
    """The layer products of both shapes at M = 1 and 5 rows through the planner's measurement: cuBLAS
    against each skinny-GEMM configuration (plain, with the norm prologue for q|k|v and gate|up, with
    SiLU * up for down), achieved GB/s of the weight read over distinct weight copies."""
    shapes = {"0.5b qkv": (P.PRO_NORM, 896, 1152, True), "0.5b o": (P.PRO_NONE, 896, 896, False),
              "0.5b gate_up": (P.PRO_NORM, 896, 9728, False), "0.5b down": (P.PRO_SILU, 4864, 896, False),
              "0.5b head": (P.PRO_NONE, 896, 151936, False), "7b qkv": (P.PRO_NORM, 3584, 4608, True),
              "7b o": (P.PRO_NONE, 3584, 3584, False), "7b gate_up": (P.PRO_NORM, 3584, 37888, False),
              "7b down": (P.PRO_SILU, 18944, 3584, False), "7b head": (P.PRO_NONE, 3584, 151936, False)}
    P.MODE = "auto"
    rows = []
    for name, (pro, k, n, bias) in shapes.items():
        for m in (1, 5):
            key = (dev.index or 0, pro, m, n, k, "bfloat16", bias, pro == P.PRO_NORM)
            cands = P.candidates(pro, m, n, k)
            if not cands:  # no configuration for the shape (the norm prologue past one tile): cuBLAS
                rows.append({"gemm": name, "M": m, "N": n, "K": k, "choice": "cublas", "GBps": {}})
                continue
            triton_ops.PLANNER.choose(key, cands)
            r = next(r for r in plan_rows() if (r["product"], r["M"], r["N"], r["K"]) == (P.PRO_NAMES[pro], m, n, k)
                     and r["bias"] == bias and r["residual"] == (pro == P.PRO_NORM))
            rows.append({"gemm": name, **r})
    out["gemm"] = rows
    print("GEMM GB/s cuBLAS / best skinny (choice): " + ", ".join(
        f"{r['gemm']} M{r['M']} {r['GBps'].get('cublas')}/"
        f"{max((v for c, v in r['GBps'].items() if c != 'cublas'), default=None)} ({r['choice']})" for r in rows),
        flush=True)


def attention_section(dev, out) -> None:
    """decode_attention alone at the drafter's and the target's shapes and short contexts, for each tile
    size of the one-program-per-(row, kv head) case (triton_ops.SINGLE_BLOCK): one graph replays a
    launch per layer over 24 layers' caches (cold in L2, as in a forward), per launch."""
    rows = []
    saved = dict(triton_ops.SINGLE_BLOCK)
    g = torch.Generator(device=dev).manual_seed(0)
    cases = (("0.5b", (14, 2, 64), 1, 1, 128, 256), ("0.5b", (14, 2, 64), 4, 1, 128, 256),
             ("0.5b", (14, 2, 64), 1, 1, 1000, 1024), ("7b", (28, 4, 128), 1, 1, 128, 1024),
             ("7b", (28, 4, 128), 1, 5, 128, 1024))
    for name, (H, HK, D), B, T, ctx, kv in cases:
        L = 24
        ck = torch.randn(L, B + 1, HK, kv + 16, D, device=dev, generator=g).to(torch.bfloat16)
        cv = torch.randn(L, B + 1, HK, kv + 16, D, device=dev, generator=g).to(torch.bfloat16)
        q = torch.randn(B, T, H, D, device=dev, generator=g).to(torch.bfloat16)
        start = torch.full((B,), ctx, device=dev, dtype=torch.long)
        rws = torch.arange(B, device=dev)
        res = {}
        ref = R.decode_attention(q, ck[0], cv[0], rws, start, kv)
        r_pad = max(16, triton_ops.triton.next_power_of_2(H // HK * T))
        for blk in (64, 128, 256):
            triton_ops.SINGLE_BLOCK[D, r_pad] = blk
            try:
                got = triton_ops.decode_attention(q, ck[0], cv[0], rws, start, kv)
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                graph = torch.cuda.CUDAGraph()
                with gc_paused(), torch.cuda.graph(graph):  # capture.gc_paused says why
                    for i in range(L):
                        triton_ops.decode_attention(q, ck[i], cv[i], rws, start, kv)
                graph.replay()
                per = float(np.median([timed(graph.replay) for _ in range(20)])) / L
                res[str(blk)] = {"us": round(per * 1e6, 2), "rel_err": err}
            except Exception as exc:
                res[str(blk)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        triton_ops.SINGLE_BLOCK.clear()
        triton_ops.SINGLE_BLOCK.update(saved)
        rows.append({"shape": name, "B": B, "T": T, "context": ctx, "kv_len": kv, "block": res})
        print(f"attention {name} B={B} T={T} ctx {ctx}: " + ", ".join(
            f"{k}: {v.get('us')} us" for k, v in res.items()), flush=True)
    out["attention"] = rows


def weight_bytes(model: M.Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(cfg: M.ModelConfig, dtype_size: int = 2) -> int:
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * dtype_size


def drafter_section(dev, ctxs, iters, out, draft_vocab: int = 0) -> None:
    cfg = M.ModelConfig(**{**SHAPES["qwen2.5-0.5b"], "max_position_embeddings": 131072}, name="qwen2.5-0.5b")
    model = M.Transformer.random(cfg, seed=0, device=dev, dtype=torch.bfloat16, draw_on="device")
    max_ctx = max(ctxs) + 64
    n_out = 4
    variants = {"eager": ("eager", False), "graphs": ("graph", False), "graphs_fast_cublas": ("graph", "cublas"),
                "graphs_fast_nopdl": ("graph", "nopdl"), "graphs_fast_noprefetch": ("graph", "noprefetch"),
                "graphs_fast_norows": ("graph", "norows"), "graphs_fast_nocublas": ("graph", "nocublas"),
                "graphs_fast_s4": ("graph", "s4"), "graphs_fast_nosiluepi": ("graph", "nosiluepi"),
                "graphs_fast": ("graph", True),
                "eager_fast": ("eager", True)}
    # the head restricted to a draft vocabulary (draft_vocab.py): the same forward, a head of N rows
    vocabs = {}
    if draft_vocab:
        variants[f"graphs_fast_vocab{draft_vocab}"] = ("graph", True)
        vocabs[f"graphs_fast_vocab{draft_vocab}"] = DraftVocab.top(draft_vocab, cfg.vocab_size)
    # the head read as int8 by the greedy picks (int8_head.py, worker --head-int8), the whole head and restricted
    int8 = Int8Head()
    int8s = ["graphs_fast_int8head", *(f"{k}_int8head" for k in list(vocabs))]
    # the layers' products read as int8 (int8_layers.py, worker --quant int8 on a GPU), with the bf16 head and
    # with the int8 head (whole and restricted): "int8all" is every large product of the step in int8
    layers8 = ["graphs_fast_int8layers", "graphs_fast_int8all", *(f"{k}_int8all" for k in list(vocabs))]
    int8s += layers8[1:]
    q8 = quantize_layers(model)
    for k in int8s + layers8:
        variants[k] = ("graph", True)
    for k in list(vocabs):
        vocabs[f"{k}_int8head"] = vocabs[f"{k}_int8all"] = vocabs[k]
    heads = list(dict.fromkeys([*vocabs, *int8s, *layers8]))  # the variants of another head or layers: each once
    drafters = {}
    for k, (m, _) in variants.items():
        model.draft_vocab = vocabs.get(k)  # LlamaDrafter's lean loop and graphs take the head as set now
        if k in int8s:
            int8.of(model.head_weight())  # the int8 copy made now, eagerly
        drafters[k] = LlamaDrafter(model, 5, max_ctx, 8, "d", "", mode=m)
    model.draft_vocab = None
    plan_first(model, lambda: drafters["graphs_fast"].plan_warm())
    for k in dict.fromkeys(int8s + layers8):  # their int8 keys planned eagerly too, as a worker's plan_warm does
        model.draft_vocab = vocabs.get(k)
        model.int8_head = int8 if k in int8s else None
        model.int8_layers = q8 if k in layers8 else None
        drafters[k].plan_warm()
    model.draft_vocab = model.int8_head = model.int8_layers = None
    wb = weight_bytes(model)
    res = out.setdefault("drafter_0p5b", {"weight_bytes": wb, "n_out": n_out, "rows": []})
    for ctx in ctxs:
        base = next(iter(drafters.values()))
        with torch.no_grad():
            base.cache.k[:, :, :, :ctx].normal_(0, 1)
            base.cache.v[:, :, :, :ctx].normal_(0, 1)
        for d in drafters.values():
            if d is not base:
                d.cache.k.copy_(base.cache.k)
                d.cache.v.copy_(base.cache.v)
        for B in (1, 4):
            def step(d, fast, B=B, ctx=ctx, vocab=None, head8=None, lay8=None):
                def go():
                    fast_path(model, fast)
                    model.draft_vocab = vocab  # read when a graph is captured (the first call) and eagerly
                    model.int8_head = head8
                    model.int8_layers = lay8
                    for r in range(B):
                        d.cache.lens[r] = ctx  # the numpy view: a torch scalar write costs 2 us a row here
                    d.run([Job(r, ctx, np.array([17 + r], np.int32)) for r in range(B)], n_out)
                return go
            fns = {k: step(drafters[k], f, vocab=vocabs.get(k), head8=int8 if k in int8s else None,
                           lay8=q8 if k in layers8 else None)
                   for k, (_, f) in variants.items()}

            def step_graph(d, B=B, ctx=ctx):  # the static step this STEP runs (one new token per request)
                return d._static[B, 1, n_out, kv_bucket(ctx + 1 + n_out, d.cache.max_len)]

            def replay_only(d=drafters["graphs_fast"]):
                # the same step's graph replayed alone: the STEP less the worker's host work and copies
                step_graph(d).graph.replay()
            fns["graphs_fast_replay_only"] = replay_only

            class NoReplay:
                def replay(self) -> None:
                    pass

            def host_only(d=drafters["graphs_fast"], go=fns["graphs_fast"]):
                # the worker's host work and copies of the same step, the graph's replay left out
                g = step_graph(d)
                graph, g.graph = g.graph, NoReplay()
                try:
                    go()
                finally:
                    g.graph = graph
            fns["graphs_fast_host_only"] = host_only
            for k in heads:  # the restricted and int8 heads' and int8 layers' step graphs replayed alone too
                fns[f"{k}_replay_only"] = lambda d=drafters[k]: step_graph(d).graph.replay()
            t = interleaved(fns, iters)
            row = {"context": ctx, "requests": B, "step": t}
            kv_read = B * n_out * (ctx + 4) * kv_bytes_per_token(cfg)
            row["bytes_per_step"] = n_out * wb + kv_read
            row["achieved_GBps"] = gbps(row["bytes_per_step"], t)
            row["kernels"] = {k: kernel_count(fns[k]) for k in ("graphs", "graphs_fast_cublas", "graphs_fast",
                                                                 "graphs_fast_nosiluepi", *heads)}
            fast_path(model, True)
            model.draft_vocab = None
            model.int8_head = model.int8_layers = None
            res["rows"].append(row)
            print(f"drafter 0.5B ctx {ctx} B={B}: " + "  ".join(f"{k} {v['p50_ms']:.2f}" for k, v in t.items())
                  + f"  kernels {row['kernels']['graphs']['kernels']} -> {row['kernels']['graphs_fast']['kernels']}"
                  f" (nosiluepi {row['kernels']['graphs_fast_nosiluepi']['kernels']})",
                  flush=True)
    # graph == eager (fast path), drafts of the timed steps: identical by construction of the same kernels
    model.fast = None
    torch.cuda.empty_cache()


def target_section(dev, ctxs, iters, out) -> None:
    cfg = M.ModelConfig(**TARGET_7B, name="qwen2.5-7b")
    model = M.Transformer.random(cfg, seed=0, device=dev, dtype=torch.bfloat16, draw_on="device")
    wb = weight_bytes(model)
    max_len = max(ctxs) + 16
    cache = model.new_cache(2, max_len)
    with torch.no_grad():
        cache.k[:, 0, :, :max(ctxs)].normal_(0, 1)
        cache.v[:, 0, :, :max(ctxs)].normal_(0, 1)
    res = out.setdefault("target_7b", {"weight_bytes": wb, "rows": []})

    def one_token():
        with torch.inference_mode():
            model(torch.zeros((1, 1), dtype=torch.int64), torch.tensor([0]), cache, torch.tensor([1]))
            cache.lengths[1] = 0
    plan_first(model, one_token)
    graphs = {}
    for T in (1, 5):
        for fast in (False, "cublas", "nopdl", "noprefetch", "norows", "nocublas", "s4", "nosiluepi", True):
            fast_path(model, fast)
            t0 = time.perf_counter()
            graphs[T, fast] = DecodeGraphs(model, cache, 2, T, sizes=[1], min_kv=1024)
            res.setdefault("capture_s", {})[f"T{T}_{fast}"] = round(time.perf_counter() - t0, 2)
    fast_path(model, True)
    for ctx in ctxs:
        for T in (1, 5):
            toks_h = torch.randint(0, cfg.vocab_size, (1, T))
            start_h = torch.tensor([ctx])
            rows_h = torch.tensor([0])

            def eager(fast, T=T, ctx=ctx, toks_h=toks_h):
                def go():
                    fast_path(model, fast)
                    cache.lengths[0] = ctx
                    with torch.inference_mode():
                        model(toks_h, torch.tensor([ctx]), cache, torch.tensor([0]))
                return go

            def graph(fast, T=T, toks_h=toks_h, start_h=start_h, rows_h=rows_h):
                def go():
                    with torch.inference_mode():
                        graphs[T, fast].run(toks_h, start_h, rows_h)
                return go

            fns = {"eager": eager(False), "graphs": graph(False), "graphs_fast_cublas": graph("cublas"),
                   "graphs_fast_nopdl": graph("nopdl"), "graphs_fast_noprefetch": graph("noprefetch"),
                   "graphs_fast_norows": graph("norows"), "graphs_fast_nocublas": graph("nocublas"),
                   "graphs_fast_s4": graph("s4"), "graphs_fast_nosiluepi": graph("nosiluepi"),
                   "graphs_fast": graph(True), "eager_fast": eager(True)}
            t = interleaved(fns, iters)
            row = {"context": ctx, "tokens": T, "step": t,
                   "bytes_per_step": wb + (ctx + T) * kv_bytes_per_token(cfg)}
            row["achieved_GBps"] = gbps(row["bytes_per_step"], t)
            row["kernels"] = {k: kernel_count(fns[k])
                              for k in ("graphs", "graphs_fast_cublas", "graphs_fast", "graphs_fast_nosiluepi")}
            fast_path(model, True)
            res["rows"].append(row)
            print(f"target 7B ctx {ctx} T={T}: " + "  ".join(f"{k} {v['p50_ms']:.2f}" for k, v in t.items())
                  + f"  kernels {row['kernels']['graphs']['kernels']} -> {row['kernels']['graphs_fast']['kernels']}"
                  f" (nosiluepi {row['kernels']['graphs_fast_nosiluepi']['kernels']})",
                  flush=True)
    model.fast = None


def compile_section(dev, iters, out, tokens: list[int]) -> None:
    """Plain torch.compile (inductor, mode reduce-overhead) of the 7B forward at context 128 (the plain
    path, as torch.compile sees any torch model), timed interleaved with this project's graphs of the
    fast forward on the same model."""
    cfg = M.ModelConfig(**TARGET_7B, name="qwen2.5-7b")
    model = M.Transformer.random(cfg, seed=0, device=dev, dtype=torch.bfloat16, draw_on="device")
    cache = model.new_cache(2, 2048)
    ctx, kv = 128, 1024
    with torch.no_grad():
        cache.k[:, 0, :, :ctx].normal_(0, 1)
        cache.v[:, 0, :, :ctx].normal_(0, 1)
    res = out.setdefault("torch_compile_7b", {"context": ctx, "kv_len": kv, "rows": []})
    for T in tokens:
        fast_path(model, True)
        graphs = DecodeGraphs(model, cache, 2, T, sizes=[1], min_kv=1024)
        model.fast = False

        def fwd(toks, start, rows, model=model, cache=cache, kv=kv):
            return model(toks, start, cache, rows, kv_len=kv)
        compiled = torch.compile(fwd, mode="reduce-overhead", fullgraph=False, dynamic=False)
        toks_h = torch.randint(0, cfg.vocab_size, (1, T))
        toks_d, st_d, rw_d = toks_h.to(dev), torch.tensor([ctx], device=dev), torch.tensor([0], device=dev)
        t0 = time.perf_counter()
        with torch.no_grad():  # the weights are parameters: outside no_grad autograd would track them
            for _ in range(3):
                compiled(toks_d, st_d, rw_d)
        torch.cuda.synchronize()
        compile_s = round(time.perf_counter() - t0, 1)

        def comp(compiled=compiled, toks_d=toks_d, st_d=st_d, rw_d=rw_d):
            with torch.no_grad():
                compiled(toks_d, st_d, rw_d)

        def ours(graphs=graphs, toks_h=toks_h):
            with torch.inference_mode():
                graphs.run(toks_h, torch.tensor([ctx]), torch.tensor([0]))
        t = interleaved({"torch_compile": comp, "graphs_fast": ours}, iters)
        res["rows"].append({"tokens": T, "compile_s": compile_s, "step": t})
        print(f"torch.compile 7B ctx {ctx} T={T}: compiled {t['torch_compile']['p50_ms']:.2f} ms, "
              f"graphs_fast {t['graphs_fast']['p50_ms']:.2f} ms (compile {compile_s} s)", flush=True)
    model.fast = None


def hf_section(dev, ctxs, out) -> None:
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = TARGET_7B
    hcfg = Qwen2Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["n_layers"],
                       num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
                       intermediate_size=c["intermediate_size"], rope_theta=c["rope_theta"],
                       rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=False,
                       max_position_embeddings=c["max_position_embeddings"])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            hf = Qwen2ForCausalLM(hcfg).eval()
    finally:
        torch.set_default_dtype(prev)
    rows = []
    for ctx in ctxs:
        with torch.inference_mode():
            ids = torch.randint(0, c["vocab_size"], (1, ctx), device=dev)
            o = hf(input_ids=ids, use_cache=True)
            pkv = o.past_key_values
            tok = torch.randint(0, c["vocab_size"], (1, 1), device=dev)
            ts = []
            for _ in range(12):
                ts.append(timed(lambda tok=tok, pkv=pkv: hf(input_ids=tok, past_key_values=pkv, use_cache=True)))
                pkv.crop(ctx)
            rows.append({"context": ctx, "tokens": 1, "eager": pct(ts[2:])})
            print(f"HF transformers {transformers.__version__} eager 7B ctx {ctx}: "
                  f"{rows[-1]['eager']['p50_ms']:.2f} ms", flush=True)
    out["hf_transformers"] = {"version": transformers.__version__, "attn": hcfg._attn_implementation, "rows": rows}
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="128,32768")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compile-tokens", default="1",
                    help="token counts whose 7B forward torch.compile builds (comma list)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="skip the HF and compile sections past this many seconds")
    ap.add_argument("--sections", default="gemm,drafter,target,hf,compile")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="also time the drafter with its head restricted to ids 0..N-1 (a draft vocabulary, "
                         "draft_vocab.py; 0: not)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "fast_forward.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    dev = torch.device("cuda:0")
    ctxs = [int(x) for x in args.contexts.split(",")]
    out: dict = {"benchmark": "fast_forward", "machine": machine_info(), "contexts": ctxs, "iters": args.iters,
                 "weights": "random bf16, real shapes", "argv": sys.argv[1:]}
    out["copy_GBps"] = round(copy_bandwidth(dev) / 1e9, 1)
    print(f"device copy {out['copy_GBps']} GB/s (read + write)", flush=True)

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    for sec in args.sections.split(","):
        try:
            if sec == "drafter":
                drafter_section(dev, ctxs, args.iters, out, args.draft_vocab)
            elif sec == "gemm":
                gemm_section(dev, out)
            elif sec == "attention":
                attention_section(dev, out)
            elif sec == "target":
                target_section(dev, ctxs, args.iters, out)
            elif sec in ("hf", "compile") and time.perf_counter() - t_start > args.budget_s:
                out[f"{sec}_skipped"] = f"past the {args.budget_s} s budget"
            elif sec == "hf" and not args.no_hf:
                hf_section(dev, ctxs, out)
            elif sec == "compile":
                compile_section(dev, args.iters, out, [int(t) for t in args.compile_tokens.split(",") if t])
        except Exception as exc:
            out[f"{sec}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            traceback.print_exc()
        out["plans"] = plan_rows()  # every product shape measured so far, the forwards' own included
        out["plans_norows"] = plan_rows(NOROWS_PLANNER)  # the "norows" variant's plan
        out["plans_nocublas"] = plan_rows(NOCUBLAS_PLANNER)  # the "nocublas" variant's plan
        out["plans_s4"] = plan_rows(S4_PLANNER)  # the "s4" variant's plan
        save()
        torch.cuda.empty_cache()  # the section's models are gone: their blocks back for the next one
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(f"wrote {args.out} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
