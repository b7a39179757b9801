#!/usr/bin/env bash
# One bounded GPU call for the forked rows' attention with one shared program per (block, kv head, chunk)
# (docs/SPEC_CACHE.md): its GPU tests, the branch pieces at 32K for one and four requests on this build and,
# given BASE_TREE (the build before, unpacked as issues_h200.sh's part 7 says), on that one, then the tiles.
#   python3 setup.py -q build_ext --inplace && PYTHONPATH=$PWD/src BASE_TREE=.base bash benchmarks/fork_grid_h100.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DRAFTRELAY_PLAN_CACHE=off
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
echo "== GPU tests: forked rows"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider tests_gpu/test_fork_gpu.py --out "$OUT" 2>&1 \
    | grep -v "^\[W" | tail -4
for label in present base; do
    tree=$PWD
    if [[ $label == base ]]; then
        [[ -n "${BASE_TREE:-}" ]] || continue
        tree=$BASE_TREE
        cp src/draftrelay/handoff/*.so "$BASE_TREE/src/draftrelay/handoff/" 2>/dev/null
    fi
    echo "== branch pieces at 32K, $label ($(( $(date +%s) - T0 )) s so far)"
    PYTHONPATH=$tree/src timeout "${BRANCH_S:-110}" python3 "$tree/benchmarks/branch_work.py" --contexts 32768 \
        --fanout 4,8 --requests 1,4 --out "$OUT/branch_work_$label.json" 2>&1 | grep "^ctx"
done
echo "== tiles ($(( $(date +%s) - T0 )) s so far)"
timeout "${TILES_S:-120}" python3 benchmarks/attention_tiles.py --tiles "${TILES:-64x4,32x4}" \
    --out "$OUT/attention_tiles.json" 2>&1 | grep "^ctx\|bound"
echo "done in $(( $(date +%s) - T0 )) s"
