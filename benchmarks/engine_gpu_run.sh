#!/usr/bin/env bash
# One GPU session for the engine: install, GPU probes, the demo, the workload table.
# Everything it produces lands in $OUT (default ./gpu-out): logs and benchmark JSON.
#   bash benchmarks/engine_gpu_run.sh [seconds the whole script may take, default 330]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
TOTAL=${1:-330}
t0=$(date +%s)
stamp() { echo "[engine_gpu_run +$(( $(date +%s) - t0 ))s] $*"; }

stamp "install"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import cuda.bindings as b; print('cuda-bindings', b.__version__)" 2>&1 | tail -1
} | tee "$OUT/env.txt"

stamp "GPU probes"
if python3 -c "import pytest" 2>/dev/null; then
  timeout 90 python3 -m pytest -q -x -s tests_gpu/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
else
  timeout 90 python3 tests_gpu/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi

stamp "demo"
timeout 45 python3 -m draftrelay.cli demo --json "$OUT/engine_demo_gpu.json" 2>&1 | tee "$OUT/demo.log" | tail -22

LEFT=$(( TOTAL - ($(date +%s) - t0) - 5 ))
stamp "workload table (${LEFT}s left; no new workload after $(( LEFT - 100 ))s)"
timeout "$LEFT" python3 benchmarks/engine_workloads.py --time-budget-s $(( LEFT - 100 )) --prefill-chunk 2048 \
  --warmup 3 --steps 24 --workloads short,short:graphs,32k-conc3,32k,128k,32k-conc3:graphs,short:ring \
  --out "$OUT/engine_workloads.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -25
stamp "done"
