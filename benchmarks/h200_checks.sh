#!/usr/bin/env bash
# One call on a one-GPU H200 machine: the serve load test on the replay models (start-up and every mode),
# then the GPU tests other than the fast-forward file (fork, engine, CUDA probe, hand-off scenarios on
# the CUDA backends), each bounded; everything under $OUT, packed as $OUT/checks.tgz plus the two JSON.
#   WHEELS=DIR OUT=DIR SERVE_S=240 TESTS_S=250 bash benchmarks/h200_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/serve" "$OUT/tests"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
echo "== serve load test (${SERVE_S:-240} s budget)"
OUT="$OUT/serve" BUDGET=${SERVE_S:-240} bash benchmarks/serve_replay_h200.sh 2>&1 | grep -v "^\[W" | tail -30
echo "== GPU tests ($(( $(date +%s) - T0 )) s so far)"
export PYTHONPATH=$PWD/src
timeout "${TESTS_S:-250}" python3 -m pytest -q -rs --durations=12 tests_gpu/test_fork_gpu.py tests_gpu/test_engine_gpu.py \
    tests_gpu/test_cuda_probe.py tests_gpu/test_probes.py tests_gpu/test_handoff_scenarios.py -k "not emulated" \
    --out "$OUT/tests" 2>&1 | tee "$OUT/tests/tests_gpu.log" | tail -25
echo "done in $(( $(date +%s) - T0 )) s"
cp "$OUT/serve/serve_replay_h200.json" "$OUT/tests/tests_gpu.json" "$OUT/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/checks.tgz" serve tests
