#!/usr/bin/env bash
# One call on a one-GPU H200 machine, each step bounded, everything under $OUT (packed as
# $OUT/checks.tgz; the seed and the serve JSON also loose):
#   1. the kernel plan seed of the replay shapes (benchmarks/plan_seed.py; it also fills this
#      machine's plan cache, so the steps after it start as a restarted server would), when SEED_S > 0
#   2. the GPU tests named in TESTS (default: the engine's and the CUDA hand-off scenarios')
#   3. the serve load test on the replay models (start-up, TTFT, every mode in MODES)
#   WHEELS=DIR OUT=DIR SEED_S=200 TESTS_S=150 SERVE_S=240 MODES=off,sync,async bash benchmarks/h200_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/serve" "$OUT/tests"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src
T0=$(date +%s)
if [ "${SEED_S:-200}" -gt 0 ]; then
    echo "== plan seed"
    timeout "${SEED_S:-200}" python3 benchmarks/plan_seed.py --shapes "${SEED_SHAPES:-qwen2.5-7b,qwen2.5-0.5b}" \
        --out "$OUT/NVIDIA_H200.json" 2>&1 | grep -v "^\[W" | tee "$OUT/tests/plan_seed.log" | tail -3
fi
echo "== GPU tests ($(( $(date +%s) - T0 )) s so far)"
# shellcheck disable=SC2086
timeout "${TESTS_S:-150}" python3 -m pytest -q -rs --durations=8 ${TESTS:-tests_gpu/test_engine_gpu.py tests_gpu/test_handoff_scenarios.py} \
    -k "not emulated" --out "$OUT/tests" 2>&1 | tee "$OUT/tests/tests_gpu.log" | tail -12
echo "== serve load test (${SERVE_S:-240} s budget; $(( $(date +%s) - T0 )) s so far)"
OUT="$OUT/serve" BUDGET=${SERVE_S:-240} bash benchmarks/serve_replay_h200.sh 2>&1 | grep -v "^\[W" | tail -30
echo "done in $(( $(date +%s) - T0 )) s"
cp "$OUT/serve/serve_replay_h200.json" "$OUT/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/checks.tgz" serve tests
