#!/usr/bin/env bash
# One call on a one-GPU machine for the weight prefetch (docs/FAST_FORWARD.md, "The layer's weights
# prefetched into L2"): its GPU test and the skinny kernels' (the sum tile's mask changed), then the 0.5B
# STEP with every prefetch way side by side (fast_forward.py's graphs_fast, _wpf = lines, _wpfbulk = bulk),
# then the branch work's graphs with each way (branch_work.py, one process per way). Results under $OUT:
#   python3 setup.py -q build_ext --inplace && PYTHONPATH=$PWD/src bash benchmarks/weight_prefetch_h200.sh
# TESTS_S / BENCH_S / BRANCH_S bound the parts (seconds).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DRAFTRELAY_PLAN_CACHE=off
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
echo "== GPU tests: weight prefetch, skinny kernels"
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests_gpu/test_fast_forward_gpu.py \
    -k "weight_prefetch or skinny" --out "$OUT" 2>&1 | grep -v "^\[W" | tail -4
echo "== fast_forward.py drafter ($(( $(date +%s) - T0 )) s so far)"
timeout "${BENCH_S:-150}" python3 benchmarks/fast_forward.py --sections drafter --contexts 128 --iters 16 \
    --out "$OUT/fast_forward_wpf.json" 2>&1 | grep -v "^\[W" | tee "$OUT/fast_forward_wpf.log" | grep "^drafter"
for way in off lines bulk; do
    echo "== branch_work.py, prefetch $way ($(( $(date +%s) - T0 )) s so far)"
    DRAFTRELAY_WEIGHT_PREFETCH=$way timeout "${BRANCH_S:-80}" python3 benchmarks/branch_work.py --fanout 8 \
        --requests 1,4 --iters 24 --out "$OUT/branch_work_wpf_$way.json" 2>&1 | grep -v "^\[W" | grep "^ctx"
done
echo "done in $(( $(date +%s) - T0 )) s"
