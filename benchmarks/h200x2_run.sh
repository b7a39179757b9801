#!/usr/bin/env bash
# The two-GPU runs, one group per call on a two-GPU H200 machine (results under $OUT, or ./out):
#   PYTHONPATH=$PWD/src bash benchmarks/h200x2_run.sh 1   # end to end: target on GPU 0, worker on GPU 1
#   PYTHONPATH=$PWD/src bash benchmarks/h200x2_run.sh 2   # TP2 where the drafter is bandwidth-bound
#   PYTHONPATH=$PWD/src bash benchmarks/h200x2_run.sh 3   # P2P collectives and the TP2 probe
# Group 1 runs the replayed-acceptance headline (replay_headline.py) with the worker on the second GPU
# ("gpu1") beside the emulated second device, so the two can be compared in one run. Group 2 times the
# one-card drafter against the TP2 pair at the 7B shape (tp2_step.py), and at 0.5B/1.5B for reference.
# Group 3 checks the collectives (p2p_probe.py, tp2_probe.py) and times them (p2p_allreduce.py).
# Each group stays inside one call's 10 minutes (GROUP_S, default 540 s); a group refuses on one GPU.
set -uo pipefail
GROUP=${1:?"usage: h200x2_run.sh 1|2|3 (see the header)"}
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TRACE=${TRACE:-benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json}
TOTAL=${GROUP_S:-540}
T0=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - T0) - 10 )); }
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then
  echo "h200x2_run.sh: $NGPU GPU(s) here; every group needs two" >&2
  exit 2
fi
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
case "$GROUP" in
  1)
    echo "== replayed headline, worker on GPU 1 and on an emulated second device ($(left) s)"
    timeout "$(left)" python3 benchmarks/replay_headline.py --trace "$TRACE" --repeats 2 \
        --workloads "${WORKLOADS:-short:1,short:1@1,short:4,32k:1}" --placements gpu1,emulated \
        --modes off,sync,async,cache --fanout "${FANOUT:-4,8}" \
        --out "$OUT/replay_headline_2gpu.json" 2>&1 | tee "$OUT/replay_headline_2gpu.log" | grep -v "^\[W" | tail -14
    ;;
  2)
    L=$(( $(left) * 2 / 3 ))
    echo "== TP2 vs one card, 7B-shaped drafter (${L} s)"
    timeout "$L" python3 benchmarks/tp2_step.py --shapes qwen2.5-7b --requests 1,4 --n-out 4,5 --iters 60 \
        --rtt-rounds 40 --budget-s $(( L - 60 )) --out "$OUT" 2>&1 | tee "$OUT/tp2_step_7b.log" | tail -12
    echo "== TP2 vs one card, 0.5B / 1.5B shapes ($(left) s)"
    timeout "$(left)" python3 benchmarks/tp2_step.py --shapes qwen2.5-1.5b,qwen2.5-0.5b --iters 60 --rtt-rounds 40 \
        --budget-s $(( $(left) - 30 )) --out "$OUT" 2>&1 | tee "$OUT/tp2_step_small.log" | tail -12
    ;;
  3)
    echo "== P2P pair probe ($(left) s)"
    timeout 150 python3 tests_gpu/p2p_probe.py --out "$OUT" 2>&1 | tee "$OUT/p2p_probe.log" | tail -12
    echo "== TP2 probe ($(left) s)"
    timeout 150 python3 tests_gpu/tp2_probe.py --out "$OUT" 2>&1 | tee "$OUT/tp2_probe.log" | tail -12
    echo "== all-reduce timings, ours against NCCL and symmetric memory ($(left) s)"
    timeout "$(left)" python3 benchmarks/p2p_allreduce.py --out "$OUT" 2>&1 | tee "$OUT/p2p_allreduce.log" | tail -16
    ;;
  *)
    echo "h200x2_run.sh: group must be 1, 2 or 3, got $GROUP" >&2
    exit 2
    ;;
esac
echo "group $GROUP done in $(( $(date +%s) - T0 )) s"
