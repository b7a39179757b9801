"""The one-card drafter on a GPU: graph mode must draft exactly what eager mode drafts, on the GPU
it was asked for, and a draft step's time must be what its shape implies.

    python tests_gpu/worker_graph_probe.py [--out DIR]

For each model (tiny fp32; the 0.5B shape at random weights, bf16) and each device (cuda:0 and, when
there is one, cuda:1, driven from a thread whose current device is cuda:0, as the server's are):
the same job sequence (a prompt, then rounds that keep part of the drafts) through an eager and a
graph drafter; drafts compared position by position; then `run()` p50 per mode and the top kernels
of a few graph steps (torch profiler). Exit 1 on any draft mismatch of the fp32 model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

from draftrelay.worker.drafters import Job, load_drafter


def job_sequence(vocab: int, rounds: int, seed: int = 0) -> list[tuple[int, np.ndarray, int]]:
    """(keep, new tokens, accepted) per round for one row: prompt first, then accepted+1 tokens."""
    rng = np.random.default_rng(seed)
    return [(-1, rng.integers(0, vocab, 40).astype(np.int32), 0)] + \
           [(-1, rng.integers(0, vocab, 1).astype(np.int32), int(rng.integers(0, 4))) for _ in range(rounds)]


def drive(drafter, seq, n_out: int) -> tuple[list[np.ndarray], list[float]]:
    keep, drafts, times = 0, [], []
    prev = None
    for i, (_, toks, acc) in enumerate(seq):
        if prev is not None:  # the client accepted `acc` of the previous drafts + sends one token
            toks = np.concatenate([prev[:acc], toks]).astype(np.int32)
        t0 = time.perf_counter()
        d, _ = drafter.run([Job(0, keep, toks)], n_out)
        times.append(time.perf_counter() - t0)
        keep += len(toks)
        prev = d[0]
        drafts.append(d[0].copy())
        if i == 0:
            times.pop()
    return drafts, times


def probe(spec: str, dtype: str, device: str, n_out: int, rounds: int) -> dict:
    out: dict = {"model": spec, "dtype": dtype, "device": device}
    res = {}
    for mode in ("eager", "graph"):
        d = load_drafter(spec, device=device, dtype=dtype, n_rows=4, max_ctx=4096, n_out_max=8, seed=0, mode=mode)
        seq = job_sequence(d.vocab_size, rounds)
        holder: dict = {}
        # the server's threads start with GPU 0 current: drive from a fresh thread like they do
        th = threading.Thread(target=lambda h=holder, dr=d, sq=seq: h.update(r=drive(dr, sq, n_out)))
        th.start()
        th.join()
        res[mode] = holder["r"]
        out[f"{mode}_info"] = d.info
        out[f"{mode}_run_p50_ms"] = 1e3 * statistics.median(holder["r"][1][5:])
        if mode == "graph":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                drive(d, job_sequence(d.vocab_size, 5, seed=1), n_out)
            ev = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:8]
            out["graph_top_kernels_us"] = [(e.key[:90], round(getattr(e, "device_time_total", 0) / 6, 1))
                                           for e in ev]
        del d
        torch.cuda.empty_cache()
    e, g = res["eager"][0], res["graph"][0]
    same = [bool(np.array_equal(a, b)) for a, b in zip(e, g, strict=True)]
    out["rounds_identical"] = f"{sum(same)}/{len(same)}"
    out["first_diff_round"] = same.index(False) if False in same else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    devices = [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    results, bad = [], 0
    for dev in devices:
        for spec, dtype in (("tiny", "float32"), ("random:qwen2.5-0.5b", "bfloat16")):
            r = probe(spec, dtype, dev, 4, args.rounds)
            results.append(r)
            print(json.dumps(r), flush=True)
            if dtype == "float32" and r["first_diff_round"] is not None:
                bad += 1
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "worker_graph_probe.json"), "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": results}, f,
                      indent=1)
    print("FAIL" if bad else "PASS", f"({bad} fp32 mismatches)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
