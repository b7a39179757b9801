"""How much kernel planning a server start triggers: skinny-GEMM measurements and Triton compiles.

Counted on a CPU, deterministically: the forwards a start-up runs are run on the meta device (shapes
only, no arithmetic) with the fast forward's structure, and every product call the fused-kernel
backend receives (`linear`, `norm_linear`, `act_linear`, `norm_mlp` with 1..16 rows: the planned ones) goes
through `kernels.plan`'s key, candidate and choice logic with a fake timer (seconds drawn from a hash
of the shape and configuration: which configuration wins changes only the few compiles of a bucket's
other row counts). A compile is a distinct `plan.launch_key` (the kernel's constexprs and integer
specialisations: what Triton compiles for), over every candidate measured and every product run (a
gate|up product that stores SiLU * up, norm_mlp's, is a compile of its own beside the one timed); the
separate norm / SiLU / pick kernels are not counted (a handful each).

The start-up forwards, as the code runs them:
  worker  `draftrelay worker --warm-graphs K --warm-batch B --warm-max-kv KV` (as serve starts its
          local worker and benchmarks/serve_replay.py on the H200): the drafter's static step for every
          steady_state_keys key (extension of B x T tokens with the picked position's head, then
          K - 1 one-token forwards), warmed before its capture.
  engine  the target's decode graphs (every verify width 1..K+1 with the depth policy, padded batch
          sizes 1, 2, 4, .., max batch) and the serve warm-up's prefill sweep (one request prefilled at
          each sweep length, last position's head).

Two rules side by side: "exact" (a key per exact row count, each candidate compiled with its rows as
a constant: the rule before the row buckets) and "bucket" (the present rule: a key per row bucket,
measured at its top, one kernel per bucket). Then a restart against the plan cache file the first
start wrote (present rule): what it measures.

    python benchmarks/plan_count.py     # prints the table, writes benchmarks/results/plan_count.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import types

import torch

from draftrelay import kernels
from draftrelay.capture import kv_buckets
from draftrelay.engine.graphs import _pow2_sizes
from draftrelay.kernels import plan as P
from draftrelay.kernels import reference as R
from draftrelay.model import ModelConfig, Transformer
from draftrelay.serve.scheduler import sweep_lengths
from draftrelay.worker.drafters import PAD_LIMIT, SHAPES, steady_state_keys
from machine import write_json  # benchmarks/machine.py (the script's own folder)

HERE = os.path.dirname(os.path.abspath(__file__))


MLP_DOWN = -1  # a call's pro: norm_mlp's down product, PRO_NONE or PRO_SILU as its gate|up's choice decides
MLP_GATE = -2  # a call's pro: norm_mlp's gate|up, a PRO_NORM product that stores SiLU * up where its tile can


class Recorder:
    """A kernels backend: the reference functions, each planned product call recorded as
    (pro, rows, N, K, dtype, has bias, has residual)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        mod = types.ModuleType("recording_backend")
        mod.__dict__.update({k: v for k, v in vars(R).items() if not k.startswith("__")})
        mod.linear, mod.norm_linear, mod.act_linear = self.linear, self.norm_linear, self.act_linear
        mod.norm_mlp = self.norm_mlp
        mod.int8_linear, mod.int8_norm_linear = self.int8_linear, self.int8_norm_linear
        self.module = mod

    def _rec(self, pro: int, rows: int, w: torch.Tensor, b, delta) -> None:
        if 1 <= rows <= P.MAX_ROWS:
            self.calls.append((pro, rows, w.shape[0], w.shape[1], str(w.dtype).replace("torch.", ""),
                               b is not None, delta is not None))

    def linear(self, x, w, b=None):
        self._rec(P.PRO_NONE, x.numel() // w.shape[1], w, b, None)
        return R.linear(x, w, b)

    def act_linear(self, gu, w, b=None):
        self._rec(P.PRO_SILU, gu.numel() // (2 * w.shape[1]), w, b, None)
        return R.act_linear(gu, w, b)

    def norm_linear(self, x, delta, norm_w, eps, w, b):
        self._rec(P.PRO_NORM, x.numel() // w.shape[1], w, b, delta)
        return R.norm_linear(x, delta, norm_w, eps, w, b)

    def int8_linear(self, x, q, s, b=None):  # the int8 head's pick, an int8 o_proj or down: an INT8 key
        self._rec(P.PRO_NONE, x.numel() // q.shape[1], q, b, None)
        return R.int8_linear(x, q, s, b)

    def int8_norm_linear(self, x, delta, norm_w, eps, q, s, b=None):
        self._rec(P.PRO_NORM, x.numel() // q.shape[1], q, b, delta)
        return R.int8_norm_linear(x, delta, norm_w, eps, q, s, b)

    def norm_mlp(self, x, delta, norm_w, eps, wgu, wd, qgu=None, qd=None):  # q*: int8 copies (int8_layers.py)
        self._rec(MLP_GATE, x.numel() // wgu.shape[1], wgu if qgu is None else qgu[0], None, delta)
        self._rec(MLP_DOWN, x.numel() // wgu.shape[1], wd if qd is None else qd[0], None, None)
        return R.norm_mlp(x, delta, norm_w, eps, wgu, wd, qgu, qd)


def meta_model(shape: str, n_layers: int) -> Transformer:
    """The shape's model on the meta device in bf16 (as on the GPU), n_layers layers (the products of
    layer 1 on stand for every later layer's: the same keys)."""
    cfg = ModelConfig(**{**SHAPES[shape], "n_layers": n_layers})
    with torch.device("meta"):
        m = Transformer(cfg)
    m = m.to(torch.bfloat16)
    m.fast = True
    return m


def z(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long, device="meta")


def worker_forwards(m: Transformer, k: int, max_batch: int, max_ctx: int, warm_max_kv: int) -> int:
    """The drafter's static steps of `draftrelay worker --warm-graphs k`: their forwards, shapes only."""
    cache = m.new_cache(max_batch + 1, max_ctx + max(PAD_LIMIT, 8) + 1)
    n = 0
    for B, T, steps, kv in steady_state_keys([k], max_batch, cache.max_len, warm_max_kv):
        m(z(B, T), z(B), cache, z(B), kv_len=kv, logits_at=z(B), greedy=True)
        for _ in range(steps - 1):
            m(z(B, 1), z(B), cache, z(B), kv_len=kv, greedy=True)
        n += steps
    return n


def engine_forwards(m: Transformer, k: int, max_batch: int, max_len: int, prefill_chunk: int) -> int:
    """The target's decode graphs (warmed before capture) and the serve warm-up's prefill sweep."""
    cache = m.new_cache(max_batch, max_len)
    n = 0
    for T in range(1, k + 2):
        for B in _pow2_sizes(max_batch):
            for kv in kv_buckets(max_len):
                m(z(B, T), z(B), cache, z(B), kv_len=kv)
                n += 1
    for length in sweep_lengths(prefill_chunk, max_len):
        for c0 in range(0, length, prefill_chunk):
            c = min(prefill_chunk, length - c0)
            m(z(1, c), z(1), cache, z(1), kv_len=c0 + c, last_only=True)
            n += 1
    return n


def fake_times(key: tuple, cands: list[P.SkinnyConfig]) -> dict:
    def t(label: str) -> float:
        return (1 + int(hashlib.sha256(f"{key[1:]}{label}".encode()).hexdigest()[:6], 16) / 0xFFFFFF) * 1e-5
    return {None: t("cublas"), **{c: t(c.label()) for c in cands}}


def simulate(calls: list[tuple], rule: str, cache: P.PlanCache | None = None) -> dict:
    """Plan every call as triton_ops._plan does under `rule`; count keys measured, candidates timed,
    compiles (distinct launch keys over the measurements and the runs)."""
    compiled: set = set()

    def measure(key, cands):
        _, pro, M, N, K, dt, bias, delta = key
        for c in cands:
            tiles = None if rule == "bucket" else (16 if c.dot else P.next_pow2(M), M)
            compiled.add(P.launch_key(pro, c, M, N, K, dt, bias, delta, tiles))
        return fake_times(key, cands)

    pl = P.Planner(measure, (lambda dev: cache) if cache is not None else None)
    fused = False  # the last norm_mlp gate|up stored SiLU * up
    for pro, M, N, K, dt, bias, delta in calls:
        silu_out = pro == MLP_GATE  # norm_mlp's gate|up, as triton_ops's
        if silu_out:
            pro = P.PRO_NORM
        elif pro == MLP_DOWN:  # reads the activations its gate|up stored, or computes them (act_linear)
            pro = P.PRO_NONE if fused else P.PRO_SILU
        if rule == "bucket":  # as triton_ops._plan
            key, cands = P.plan_key(0, pro, M, N, K, dt, bias, delta)
        else:
            key, cands = (0, pro, M, N, K, dt, bias, delta), P.candidates(pro, M, N, K)
        cfg = pl.choose(key, cands)
        fused = silu_out and cfg is not None and P.holds_silu_pairs(cfg)
        if cfg is not None:
            tiles = None if rule == "bucket" else (16 if cfg.dot else P.next_pow2(M), M)
            compiled.add(P.launch_key(pro, cfg, M, N, K, dt, bias, delta, tiles, fused))
    return {"keys_measured": pl.stats.measured, "candidates_timed": pl.stats.candidates,
            "from_cache": pl.stats.from_cache, "compiles": len(compiled),
            "keys_skinny": sum(c is not None for c in pl.table.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--target", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--warm-max-kv", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=32768 + 32 + 5, help="the engine's row length")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2, help="layers of each meta model (1 = first layer, 2+: later)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_count.json"))
    args = ap.parse_args()
    rec = Recorder()
    kernels.backend = lambda device: rec.module  # the forward looks it up at each step
    out: dict = {"args": vars(args), "sides": {}}
    lines = ["side | rule | forwards | planned calls | keys measured | candidates timed | compiles | skinny keys"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        meta = {"device": "simulated", "kernels": "plan_count"}
        for side in ("worker", "engine"):
            rec.calls.clear()
            if side == "worker":
                n = worker_forwards(meta_model(args.drafter, args.layers), args.k, args.max_batch,
                                    args.max_len + 64, args.warm_max_kv)
            else:
                n = engine_forwards(meta_model(args.target, args.layers), args.k, args.max_batch, args.max_len,
                                    args.prefill_chunk)
            row = {"forwards": n, "planned_calls": len(rec.calls),
                   "rows_seen": sorted({c[1] for c in rec.calls}),
                   "exact": simulate(rec.calls, "exact"),
                   "bucket": simulate(rec.calls, "bucket", P.PlanCache(path, meta)),
                   "restart": simulate(rec.calls, "bucket", P.PlanCache(path, meta))}
            out["sides"][side] = row
            for rule in ("exact", "bucket", "restart"):
                r = row[rule]
                lines.append(f"{side} | {rule} | {n} | {len(rec.calls)} | {r['keys_measured']} | "
                             f"{r['candidates_timed']} | {r['compiles']} | {r['keys_skinny']}")
    out["table"] = lines
    print("\n".join(lines))
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
