#!/bin/bash
# The H200 run of benchmarks/serve_replay.py, from a copy of the tree on a GPU machine without network:
#   WHEELS=DIR  a folder of the server's wheels the machine lacks (fastapi, starlette, uvicorn, pydantic,
#               pydantic-core cp312, annotated-types, annotated-doc, typing-inspection, typing-extensions,
#               opentelemetry-api and importlib-metadata, which fastapi imports), installed into /tmp/site;
#               unset: the machine has them
#   OUT=DIR     where the JSON and the logs go, written as the run goes (default /tmp/serve-replay;
#               the JSON belongs in benchmarks/results/serve_replay_h200_all_modes.json)
#   BUDGET=S    seconds after which no further mode is started (default 270: set-up ~50 s, each mode 60-80 s)
#   MODES=M     the modes (default off,sync,async; cache: async + the speculation cache, FANOUT=F branches)
#   PLACEMENT=P same (default: the worker on this GPU) or emulated (a drafter on an emulated second device)
set -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/serve-replay}
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; exit 3; }
    export PYTHONPATH=/tmp/site
fi
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "build_ext failed"; tail -5 "$OUT/build.log"; exit 4; }
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import fastapi, uvicorn, draftrelay.serve.app, torch; print('imports ok', torch.cuda.get_device_name())" || exit 5
timeout -k 5 $(( ${BUDGET:-270} + 20 )) python3 benchmarks/serve_replay.py \
    --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --budget-s "${BUDGET:-270}" \
    --modes "${MODES:-off,sync,async}" --placement "${PLACEMENT:-same}" --fanout "${FANOUT:-8}" \
    --out "$OUT/serve_replay_h200.json" 2>&1 | tee "$OUT/serve_replay.log"
