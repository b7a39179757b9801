#!/usr/bin/env bash
# One call on a one-GPU H200 machine for the fast forward: the fast-forward GPU tests, then the drafter and
# target sections of benchmarks/fast_forward.py (every variant side by side, the plans included), each
# bounded; results under $OUT (default ./out). Run from the repository root with the tree on the path,
# the native helper built:
#   python3 setup.py -q build_ext --inplace && PYTHONPATH=$PWD/src bash benchmarks/fast_forward_h200.sh
# TESTS_S / BENCH_S bound the two parts (seconds); ITERS the benchmark's iterations.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader
echo "== fast-forward GPU tests"
FAST_FORWARD_GPU_JSON="$OUT/fast_forward_gpu_report.json" timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider tests_gpu/test_fast_forward_gpu.py --out "$OUT" \
    2>&1 | tee "$OUT/tests_gpu.log" | grep -v "^\[W" | tail -15
echo "== fast_forward.py drafter,target ($(( $(date +%s) - T0 )) s so far)"
timeout "${BENCH_S:-180}" python3 benchmarks/fast_forward.py --sections drafter,target --iters "${ITERS:-12}" \
    --out "$OUT/fast_forward.json" 2>&1 | tee "$OUT/fast_forward.log" | grep -v "^\[W" | tail -12
echo "done in $(( $(date +%s) - T0 )) s"
