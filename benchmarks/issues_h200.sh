#!/usr/bin/env bash
# One bounded call on a one-GPU H200 for the open fast-forward and speculation-cache figures (docs/FAST_FORWARD.md,
# docs/SPEC_CACHE.md), each part under its own timeout so a slow part costs only itself; results under $OUT:
#   1. the skinny kernels' GPU tests (tests_gpu/test_fast_forward_gpu.py)
#   2. fast_forward.py drafter,target at 128 and 32K (every variant side by side; CONTEXTS and SECTIONS
#      narrow it)
#   3. step_host.py: where the worker's host time of the STEP goes on this host
#   4. replay_headline.py: off / sync / cache F = 8 (guard off) at replayed acceptance, code, prose, four requests
#   5. replay_headline.py at four requests with each wait rule (all, rows, early), F = 8, guard off (RULES and
#      FANOUTS change them)
#   6. depth_rounds.py: a local worker's STEP at each depth, warmed for the deepest alone and for every depth
#   7. where the 32K F = 8 branch work's time goes (docs/SPEC_CACHE.md, "The present build on an H200"):
#      branch_work.py at 128 and 32K keys, F = 4 and 8, one request, with PDL and without (DRAFTRELAY_PDL=off);
#      where BASE_TREE names an older build's tree (its src/ and benchmarks/, unpacked into an ignored folder
#      that the call carries, e.g. `git archive 16125a1 src benchmarks ':(exclude)benchmarks/results'
#      ':(exclude)benchmarks/data' ':(exclude)src/draftrelay/demo_pair' | tar -x -C .base`), each tree's
#      replay_headline.py at 32k:1, F = 8, every step a cache step: the branch pieces measured in its run
#   8. the forked rows' shared prefix and the combine over query rows (docs/SPEC_CACHE.md, docs/FAST_FORWARD.md):
#      tests_gpu/test_fork_gpu.py and test_fast_forward_gpu.py, then branch_work.py at 128 and 32K keys, F = 4
#      and 8, with the shared reads (DRAFTRELAY_FORK_SHARE=on) and without, and, given BASE_TREE (the build
#      before, as in part 7), that build's branch_work.py on the same card
#   9. fast_forward.py drafter,target at 32K on this build and, given BASE_TREE, on the build before; then
#      replay_headline.py 32k:1 at F = 4, 8 (guard off), each build its own
#  10. attention_tiles.py: the split attention's (keys per tile, warps) candidates and the forked rows' shared
#      launch's warps at 32K, one and four rows, side by side (each checked against its definition)
#  11. fast_forward.py drafter,target at context 128 on this build and, given BASE_TREE, on the build before,
#      alternated ROUNDS times (default 2), each process planning every product itself (the plan seed off
#      unless SEED=on: a seed names only the choices of the build that made it)
#  12. plan_seed.py: the plan seed of this card made again (every product of the 7B and 0.5B shapes at every
#      row bucket, the 0.5B's head restricted to 32,768 ids too, timed), written to $OUT/plan_seed.json for
#      kernels/plans/<device name>.json as it stands: a shipped seed
#      that never timed a present candidate has those keys measured at every start (plan.PlanSeed.get)
#  13. fast_forward.py drafter,target at context 128 planned from the seed part 12 wrote (else the shipped one), as
#      a worker started from that seed plans: bf16 beside the int8 layers and head (and DRAFT_VOCAB's restriction)
#   python3 setup.py -q build_ext --inplace && PYTHONPATH=$PWD/src bash benchmarks/issues_h200.sh
# PARTS picks the parts (default "1 2 3 4": their bounds sum to 560 s), e.g. the STEP alone:
#   PARTS="2" SECTIONS=drafter CONTEXTS=128 bash benchmarks/issues_h200.sh
# TILES narrows part 10's candidates (attention_tiles.py --tiles, e.g. 64x4,32x4).
# DRAFT_VOCAB=32768 adds part 2's restricted-head variants (fast_forward.py --draft-vocab).
# TESTS_S / FF_S / HOST_S / REPLAY_S / RULES_S / DEPTH_S bound the parts (seconds).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DRAFTRELAY_PLAN_CACHE=off
PARTS=" ${PARTS:-1 2 3 4} "
T0=$(date +%s)
part() { [[ "$PARTS" == *" $1 "* ]] && echo "== $1. $2 ($(( $(date +%s) - T0 )) s so far)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
if part 1 "GPU tests: skinny kernels"; then
    timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider tests_gpu/test_fast_forward_gpu.py \
        -k "skinny" --out "$OUT" 2>&1 | grep -v "^\[W" | tail -4
fi
if part 2 "fast_forward.py"; then
    timeout "${FF_S:-200}" python3 benchmarks/fast_forward.py --sections "${SECTIONS:-drafter,target}" \
        --contexts "${CONTEXTS:-128,32768}" --iters 12 ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} \
        --out "$OUT/fast_forward.json" 2>&1 | grep -v "^\[W" \
        | tee "$OUT/fast_forward.log" | grep "^drafter\|^target"
fi
if part 3 "step_host.py"; then
    timeout "${HOST_S:-40}" python3 benchmarks/step_host.py --requests 1,4 --out "$OUT/step_host.json" 2>&1 \
        | grep -v "^\[W" | tail -6
fi
if part 4 "replay_headline.py"; then
    timeout "${REPLAY_S:-220}" python3 benchmarks/replay_headline.py \
        --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --repeats 2 --workloads short:1,short:1@1,short:4 \
        --placements emulated --modes off,sync,cache --fanout 8 --guard off --out "$OUT/replay_headline.json" \
        --plot "$OUT/replay_headline.png" 2>&1 | grep -v "^\[W" | tail -20
fi
if part 5 "replay_headline.py, wait rules at four requests"; then
    timeout "${RULES_S:-200}" python3 benchmarks/replay_headline.py \
        --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --repeats 2 --workloads short:4 \
        --placements emulated --modes off,sync,cache --fanout "${FANOUTS:-8}" --wait-rules "${RULES:-all,rows,early}" \
        --guard off --out "$OUT/replay_headline_rules.json" --plot "$OUT/replay_headline_rules.png" 2>&1 | grep -v "^\[W" | tail -3
fi
if part 6 "depth_rounds.py"; then
    timeout "${DEPTH_S:-150}" python3 benchmarks/depth_rounds.py --out "$OUT/depth_rounds.json" 2>&1 \
        | grep -v "^\[W" | tail -3
fi
if part 7 "the 32K F = 8 branch work"; then
    for pdl in on off; do
        DRAFTRELAY_PDL=$pdl timeout "${BRANCH_S:-120}" python3 benchmarks/branch_work.py --contexts 128,32768 \
            --fanout 4,8 --requests 1 --out "$OUT/branch_work_pdl_$pdl.json" 2>&1 | grep -v "^\[W" | tail -6
    done
    if [[ -n "${BASE_TREE:-}" ]]; then  # the older tree's own script (it predates --guard: every step a cache step)
        cp src/draftrelay/handoff/*.so "$BASE_TREE/src/draftrelay/handoff/" 2>/dev/null  # the host atomics, built here
        for label in base present; do
            tree=$PWD extra=(--guard off)
            [[ $label == base ]] && tree=$BASE_TREE extra=()
            PYTHONPATH=$tree/src timeout "${REPLAY_S:-220}" python3 "$tree/benchmarks/replay_headline.py" \
                --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --repeats 1 --workloads 32k:1 \
                --placements emulated --modes off,cache --fanout 8 "${extra[@]}" \
                --out "$OUT/replay_32k_$label.json" 2>&1 | grep -v "^\[W" | grep "branch work\|32k:1" | tail -3
        done
    fi
fi
base_on() {  # the build before's extension built here, then its script of that name with its src/ first
    cp src/draftrelay/handoff/*.so "$BASE_TREE/src/draftrelay/handoff/" 2>/dev/null
    PYTHONPATH=$BASE_TREE/src "$@"
}
if part 8 "the forked rows' shared prefix"; then
    timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests_gpu/test_fork_gpu.py \
        tests_gpu/test_fast_forward_gpu.py --out "$OUT" 2>&1 | grep -v "^\[W" | tail -4
    for share in on off; do
        DRAFTRELAY_FORK_SHARE=$share timeout "${BRANCH_S:-100}" python3 benchmarks/branch_work.py \
            --contexts 128,32768 --fanout 4,8 --requests 1 --out "$OUT/branch_work_share_$share.json" 2>&1 \
            | grep "^ctx"
    done
    if [[ -n "${BASE_TREE:-}" ]]; then
        base_on timeout "${BRANCH_S:-100}" python3 "$BASE_TREE/benchmarks/branch_work.py" --contexts 128,32768 \
            --fanout 4,8 --requests 1 --out "$OUT/branch_work_base.json" 2>&1 | grep "^ctx"
    fi
fi
if part 9 "32K: the fast forward and the cache"; then
    timeout "${FF_S:-200}" python3 benchmarks/fast_forward.py --sections drafter,target --contexts 32768 \
        --iters 12 --out "$OUT/fast_forward_32k.json" 2>&1 | grep "^drafter\|^target"
    if [[ -n "${BASE_TREE:-}" ]]; then
        base_on timeout "${FF_S:-200}" python3 "$BASE_TREE/benchmarks/fast_forward.py" --sections drafter,target \
            --contexts 32768 --iters 12 --out "$OUT/fast_forward_32k_base.json" 2>&1 | grep "^drafter\|^target"
    fi
    timeout "${REPLAY_S:-220}" python3 benchmarks/replay_headline.py \
        --trace benchmarks/data/trace_qwen2.5-coder-0.5b-1.5b.json --repeats 1 --workloads 32k:1 \
        --placements emulated --modes off,sync,cache --fanout 4,8 --guard off --out "$OUT/replay_32k.json" 2>&1 \
        | grep "branch work\|32k:1" | tail -4
fi
if part 10 "the split attention's tiles"; then
    timeout "${TILES_S:-200}" python3 benchmarks/attention_tiles.py ${TILES:+--tiles "$TILES"} \
        --out "$OUT/attention_tiles.json" 2>&1 \
        | grep "^ctx\|bound"
fi
if part 11 "the fast forward at 128, this build and the build before alternated"; then
    for round in $(seq "${ROUNDS:-2}"); do
        for label in present base; do
            [[ $label == base && -z "${BASE_TREE:-}" ]] && continue
            run=(timeout "${FF_S:-200}" python3)
            [[ $label == base ]] && run=(base_on "${run[@]}" "$BASE_TREE/benchmarks/fast_forward.py") \
                || run+=(benchmarks/fast_forward.py)
            DRAFTRELAY_PLAN_SEED=${SEED:-off} "${run[@]}" --sections drafter,target --contexts 128 --iters 12 \
                ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} --out "$OUT/fast_forward_${label}_$round.json" 2>&1 \
                | grep "^drafter\|^target" | sed "s/^/$label $round: /"
        done
    done
fi
if part 12 "the plan seed made again"; then
    DRAFTRELAY_PLAN_SEED=off timeout "${SEED_S:-200}" python3 benchmarks/plan_seed.py \
        --shapes qwen2.5-7b,qwen2.5-0.5b@32768+int8 \
        --out "$OUT/plan_seed.json" 2>&1 | grep -v "^\[W" | tail -3
fi
if part 13 "fast_forward.py at 128 from part 12's plan seed (else the shipped one)"; then
    seed=""
    [[ -f "$OUT/plan_seed.json" ]] && seed=$OUT/plan_seed.json
    DRAFTRELAY_PLAN_SEED=$seed timeout "${FF_S:-280}" python3 benchmarks/fast_forward.py --sections drafter,target \
        --contexts 128 --iters 12 --no-hf ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} \
        --out "$OUT/fast_forward_seeded.json" 2>&1 | grep -v "^\[W" | tee "$OUT/fast_forward_seeded.log" \
        | grep "^drafter\|^target"
fi
echo "done in $(( $(date +%s) - T0 )) s"
