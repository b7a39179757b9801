#!/usr/bin/env bash
# One call on a one-GPU H200 machine: the replayed-acceptance headline, the fast-forward GPU tests and the
# two structure checks, each bounded, results under $OUT (or ./out). Run from the repository root:
#   bash benchmarks/h200_run.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
TRACE=${TRACE:-benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json}
T0=$(date +%s)
echo "== replay headline, with the speculation cache (short contexts)"
timeout "${HEADLINE_S:-200}" python3 benchmarks/replay_headline.py --trace "$TRACE" --repeats 2 \
    --workloads short:1,short:1@1,short:4 --modes off,sync,async,cache --fanout 4,8 --hit-curve 1,2,4,8,16 \
    --out "$OUT/replay_headline_cache.json" 2>&1 | tee "$OUT/replay_headline.log" | grep -v "^\[W" | tail -8
echo "== replay headline, 32K ($(( $(date +%s) - T0 )) s so far)"
timeout "${HEADLINE_32K_S:-250}" python3 benchmarks/replay_headline.py --trace "$TRACE" --repeats 2 \
    --workloads 32k:1,32k:4 --modes off,sync,async,cache --fanout 4,8 \
    --out "$OUT/replay_headline_cache_32k.json" 2>&1 | tee "$OUT/replay_headline_32k.log" | grep -v "^\[W" | tail -6
echo "== fast-forward GPU tests ($(( $(date +%s) - T0 )) s so far)"
timeout 120 python3 -m pytest -q tests_gpu/test_fast_forward_gpu.py --out "$OUT" 2>&1 | tail -6
echo "== engine workloads, short ($(( $(date +%s) - T0 )) s so far)"
timeout 120 python3 benchmarks/engine_workloads.py --workloads short:graphs,short --steps 24 \
    --out "$OUT/engine_workloads_short.json" 2>&1 | tail -6
echo "== wire step ($(( $(date +%s) - T0 )) s so far)"
timeout 60 python3 benchmarks/wire_step.py --model random:qwen2.5-0.5b --device cuda --modes graph \
    --out "$OUT/wire_step_gpu.json" 2>&1 | tail -4
echo "done in $(( $(date +%s) - T0 )) s"
