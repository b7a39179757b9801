#!/usr/bin/env bash
# One call on a one-GPU H200 machine: the replayed-acceptance headline with the speculation cache (short
# contexts and 32K, one request), then the fast-forward GPU tests, each bounded, results under $OUT (or
# ./out). Run from the repository root with the tree on the path:
#   PYTHONPATH=$PWD/src bash benchmarks/h200_run.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TRACE=${TRACE:-benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json}
T0=$(date +%s)
echo "== replay headline with the speculation cache"
timeout "${HEADLINE_S:-270}" python3 benchmarks/replay_headline.py --trace "$TRACE" --repeats 2 \
    --workloads "${WORKLOADS:-short:1,short:1@1,short:4,32k:1}" --placements emulated,same \
    --modes off,sync,async,cache --fanout 4,8 --wait-rules rows,all --hit-curve 1,2,4,8,16 \
    --out "$OUT/replay_headline_cache.json" 2>&1 | tee "$OUT/replay_headline.log" | grep -v "^\[W" | tail -12
echo "== fast-forward GPU tests ($(( $(date +%s) - T0 )) s so far)"
timeout "${TESTS_S:-100}" python3 -m pytest -q tests_gpu/test_fast_forward_gpu.py --out "$OUT" 2>&1 \
    | tee "$OUT/tests_gpu.log" | tail -8
echo "done in $(( $(date +%s) - T0 )) s"
