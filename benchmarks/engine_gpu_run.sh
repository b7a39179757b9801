#!/usr/bin/env bash
# One GPU session for the engine: install, GPU probes, the drafter's own STEP time, the workload table
# on one GPU, and (when a second GPU is there) the table again with the worker on GPU 1.
# Everything it produces lands in $OUT (default ./gpu-out): logs and benchmark JSON.
#   bash benchmarks/engine_gpu_run.sh [seconds the whole script may take, default 540]
# WORKLOADS / WORKLOADS_2GPU override the workload lists (see benchmarks/engine_workloads.py); SKIP_PROBES=1
# leaves out the GPU tests and the worker probe (when an earlier call in the same session ran them).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
TOTAL=${1:-540}
WORKLOADS=${WORKLOADS:-128k:graphs,32k:graphs,short:graphs,short:ring,32k-conc3:graphs,128k}
WORKLOADS_2GPU=${WORKLOADS_2GPU:-short:graphs,32k:graphs}
STEPS=${STEPS:-24}
t0=$(date +%s)
stamp() { echo "[engine_gpu_run +$(( $(date +%s) - t0 ))s] $*"; }
left() { echo $(( TOTAL - ($(date +%s) - t0) - 5 )); }

stamp "install"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import cuda.bindings as b; print('cuda-bindings', b.__version__)" 2>&1 | tail -1
} | tee "$OUT/env.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")

if [ "${SKIP_PROBES:-0}" = 1 ]; then
  stamp "GPU probes and worker probe skipped (SKIP_PROBES=1)"
else
  stamp "GPU probes"
  if python3 -c "import pytest" 2>/dev/null; then
    timeout 90 python3 -m pytest -q -x -s tests_gpu/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  else
    timeout 90 python3 tests_gpu/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  fi
  stamp "worker drafter: graph == eager, run() time per mode, on each GPU"
  timeout 120 python3 tests_gpu/worker_graph_probe.py --rounds 40 --out "$OUT" 2>&1 | tee "$OUT/worker_probe.log" | tail -6
fi

if [ "$NGPU" -ge 2 ]; then
  L=$(( $(left) / 3 ))
  stamp "workload table, target GPU 0, worker GPU 1 (${L}s)"
  timeout "$L" python3 benchmarks/engine_workloads.py --time-budget-s $(( L / 2 )) --prefill-chunk 2048 \
    --warmup 3 --steps "$STEPS" --workloads "$WORKLOADS_2GPU" --worker-device cuda:1 \
    --out "$OUT/engine_workloads_2gpu.json" 2>&1 | tee "$OUT/bench_2gpu.log" | grep -v "^\s*$" | tail -12
fi

L=$(left)
stamp "workload table, one GPU (${L}s left; no new workload after $(( L * 6 / 10 ))s)"
timeout "$L" python3 benchmarks/engine_workloads.py --time-budget-s $(( L * 6 / 10 )) --prefill-chunk 2048 \
  --warmup 3 --steps "$STEPS" --workloads "$WORKLOADS" \
  --out "$OUT/engine_workloads.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -25
stamp "done"
