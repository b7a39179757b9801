"""Checkpoint load time and memory: each (checkpoint, dtype) loads in a fresh process, `--repeats` times.

Prints and writes (JSON) per run: seconds to read the metadata and to load the tensors, the model's
bytes in memory, the process's peak resident set (ru_maxrss, everything the process ever held at
once, interpreter and torch included) and the load's own peak above the resident set it started from
(VmHWM after resetting it). Ratios are to the loaded model's bytes.

    python3 benchmarks/checkpoint_load.py /work/refpair/*.gguf --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

PROBE = r"""
import json, os, resource, sys, time
import torch
from draftrelay.checkpoint import gguf, hf

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current resident set
base = status("VmRSS")
t0 = time.perf_counter()
if path.endswith(".gguf"):
    ck = gguf.read_gguf(path)
    t1 = time.perf_counter()
    model = gguf.load_gguf(path, dtype=dtype, checkpoint=ck)
else:
    t1 = time.perf_counter()
    model = hf.load_hf_dir(path, dtype=dtype)
t2 = time.perf_counter()
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"read_s": t1 - t0, "load_s": t2 - t1, "model_bytes": nbytes,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "load_peak_above_start_bytes": status("VmHWM") - base}))
"""


def file_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="GGUF files or HF model directories")
    ap.add_argument("--dtypes", default="float32", help="comma list: float32, bfloat16, float16")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="", help="JSON path (default: benchmarks/results/checkpoint_load.json)")
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_load.json")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results = []
    for path in args.checkpoints:
        for dtype in args.dtypes.split(","):
            runs = []
            for _ in range(args.repeats):
                p = subprocess.run([sys.executable, "-c", PROBE, path, dtype], capture_output=True, text=True,
                                   env=env)
                if p.returncode != 0:
                    print(f"{path} {dtype}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                    return 1
                runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
            nb = runs[0]["model_bytes"]
            row = {"checkpoint": os.path.basename(path.rstrip("/")), "file_bytes": file_bytes(path), "dtype": dtype,
                   "model_bytes": nb, "runs": runs,
                   "load_s_median": statistics.median(r["read_s"] + r["load_s"] for r in runs),
                   "peak_rss_over_model": max(r["peak_rss_bytes"] for r in runs) / nb,
                   "load_peak_over_model": max(r["load_peak_above_start_bytes"] for r in runs) / nb}
            results.append(row)
            spread = [round(r["read_s"] + r["load_s"], 1) for r in runs]
            print(f"{row['checkpoint']:48s} {dtype:9s} model {nb / 1e9:6.3f} GB  load {row['load_s_median']:6.1f} s "
                  f"{spread}  peak RSS / model {row['peak_rss_over_model']:.3f}  "
                  f"load peak / model {row['load_peak_over_model']:.3f}", flush=True)
    info = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": info, "results": results}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
