#!/usr/bin/env bash
# One device call that re-checks everything landed without a GPU since the last device session, in
# the priority order of docs/DEVICE.md. Each step has its own timeout (a hang costs one step), writes
# $OUT/<step>.log and prints its tail; the summary lines start with "==".
#   run(command="source .device/env.sh && bash kernels/sm90/device_round.sh [steps...]", carry=[".device"])
# Steps: see the case labels below; docs/DEVICE.md names the next session's ("next")
# Others: decode_suite (set CULA_GIT_SHA to the committed sha first), gpu_tests, blocked, v2, fast
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device_round}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >"$OUT/install.log" 2>&1 \
    || { echo "== install failed"; tail -5 "$OUT/install.log"; }
steps=${*:-decode bench_gpu kda_check packed}
expand() {  # expand ALIAS STEPS [H200_STEPS]: the alias in $steps becomes STEPS, or H200_STEPS where an H200 came
    local alias=$1 with=$2 gpu=""
    [[ " $steps " == *" $alias "* ]] || return 0
    if [ $# -gt 2 ]; then
        gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
        [[ "$gpu" == *H200* ]] && with=$3
    fi
    steps=$(echo " $steps " | sed "s/ $alias / $with /" | xargs)
    echo "== $alias${gpu:+ ($gpu)}: $steps"
}
# "next" / "next2": the next session's first and second calls (docs/DEVICE.md): the three suites to publish
# (CULA_GIT_SHA set; session 25 published kda and kda_layer on an H100 only), then fused_premise and block32 (16-
# against 32-row blocks), on whichever card came (session 25 ran fused_premise once, on an H100)
expand next "kda_suite train_suite kda_layer_suite"
expand next2 "fused_premise block32"
# "first": the next session's first call on whichever card comes (docs/DEVICE.md): on an H200 the three suites to
# publish (its rows predate session 21), the sanitizers and the AOT GPU test (fixed in session 36); on an H100 the
# AOT GPU test alone
expand first "aot_gpu" "kda_suite train_suite kda_layer_suite sanitize aot_gpu"
# "s41first": session 41's first call (run in session 42; lockstep since removed): the L2 premise, on an H200 then
# two suites to publish (its rows predate session 21); then s41 (the host-side checks of session 40) and train_suite
expand s41first "s41_l2 train s41 train_suite" "s41_l2 kda_suite kda_layer_suite train s41 train_suite"
# "s42": session 42's last call: on an H100 stage 2 under ncu; on an H200 first the premise there and both suites
expand s42 "ncu_recur" "s41_l2 kda_suite kda_layer_suite ncu_recur"
# "s38": session 38's queue in one call (~260 s warm): the clock's GPU tests, then s38_raw and s38_clock
expand s38 "s38_clock_test s38_raw s38_clock"
# "s43": session 43's queue (no device call ran then): the pair GPU tests and --split pair A/B/A (pairs stay opt-in,
# CULA_KDA_RECUR_PAIR=0, until they pass and win), then s42_mask (the steps after s43_pair run only if its tests pass)
expand s43 "s43_pair s42_mask"
# "s44": the call after the rows mask became the default (session 44): the pair GPU tests (pair's word mask against
# the split launch's rows), then the suites to publish; on an H200 with the pair split too (does the chain-bound H200
# take pairs?). The training forward does not pack, so the rows mask leaves it as it was
expand s44 "s44_pair_tests kda_suite kda_layer_suite" "s44_pair_tests s44_pair_split kda_suite kda_layer_suite"
start=$SECONDS
step() {  # step NAME TIMEOUT CMD...
    local name=$1 t=$2; shift 2
    local s=$SECONDS
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - s)) s (total $((SECONDS - start)) s)"
    grep -E "passed|failed|error|PASS|FAIL|EXCEPTION|split|correctness|config|eager|graph|\[scale\]|\[clock\]|\[l2_premise\]" \
        "$OUT/$name.log" | tail -n 25
    return $rc
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
# Kernels compiled ahead of time on the CPU (python3 -m cula.kernels.common.aot build .device/aot, after the last
# commit): each launch whose module is there skips its ~40 s compile; a module that does not load is compiled.
if [ -d .device/aot ] && [ -z "${CULA_AOT_DIR:-}" ]; then
    export CULA_AOT_DIR=$PWD/.device/aot
    echo "== aot: $(ls .device/aot | wc -l) modules in $CULA_AOT_DIR"
fi
pair_tests() {  # stage 2 as pairs bitwise the split launch (the GPU tests of s43_pair, s44_pair_tests)
    step pair_tests 240 python3 -u -m pytest -x -v -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
        -k "pair_equals_split"
}
pair_splits() {  # --split pair with pairs off / on / off (s43_pair, s44_pair_split)
    local p
    for p in 0 1 0; do
        step split_pair$p 100 env CULA_KDA_RECUR_PAIR=$p python3 -u -m cula.kernels.sm90.kda_fwd --check --split pair
    done
}
s21_check() {
    local cases=tc-T1,tc-T65-gva-vfirst,tc-T1000-negeig,tc-varlen-zero,tc-lb11-strong,tc-softplus-varlen-zero
    step s21_check 200 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $cases
}
# the tensor-core checks of a phase-1 change: every gate form (sigmoid, softplus, fp32 gate, log-space)
phase1_cases=tc-T1,tc-T65-gva-vfirst,tc-T1000-negeig,tc-varlen-zero,tc-varlen-33,tc-lb5-strong,\
tc-softplus-varlen-zero,tc-fp32-gate-plainbeta,tc-loggate-safe-varlen
mode_splits() {  # mode_splits PREFIX MODE...: `--split worst` once per stage-1 mode, in the order given
    # default = halves + right; pre21 = direct + left (the pre-session-21 stage 1); direct = direct + right;
    # left = halves + left; one_cta = the default at one CTA per SM (timing diagnostic: same code and values);
    # block32 = 32-row reference-factor blocks where the bound allows (the split rows' lb -5 does); block32_direct
    # = the same with 2^Γ by exp2 (timing: its checks have not run); pre26 = session 25's phase 1 (butterfly l2 sums)
    local prefix=$1 m envs
    shift
    for m in "$@"; do
        envs=""
        case $m in
        pre21) envs="CULA_KDA_TC_GATE_FACTORS=direct CULA_KDA_TC_SUBST=left" ;;
        direct) envs="CULA_KDA_TC_GATE_FACTORS=direct" ;;
        left) envs="CULA_KDA_TC_SUBST=left" ;;
        one_cta) envs="CULA_KDA_TC_DIAG=one_cta" ;;
        clock) envs="CULA_KDA_TC_DIAG=clock" ;;
        block32) envs="CULA_KDA_TC_FACTOR_BLOCK=32" ;;
        block32_direct) envs="CULA_KDA_TC_FACTOR_BLOCK=32 CULA_KDA_TC_GATE_FACTORS=direct" ;;
        block16) envs="CULA_KDA_TC_FACTOR_BLOCK=16" ;;
        no_stores) envs="CULA_KDA_TC_DIAG=no_qg_kgt,no_wu_store,no_aqk_store" ;;
        one_cta_no_stores) envs="CULA_KDA_TC_DIAG=one_cta,no_qg_kgt,no_wu_store,no_aqk_store" ;;
        no_qkx) envs="CULA_KDA_TC_DIAG=no_qg_kgt,no_wu_store" ;;
        raw) envs="CULA_KDA_RAW_TILES=1" ;;
        cvt) envs="CULA_KDA_TC_WIDEN=cvt" ;;
        s36) envs="CULA_KDA_TC_WIDEN=cvt CULA_KDA_TC_KGT=kh" ;;
        square) envs="CULA_KDA_TC_GATE_FACTORS=square" ;;
        pre26) envs="CULA_KDA_TC_PHASE1=pre26" ;;
        lean) envs="CULA_KDA_TC_PHASE1=lean" ;;
        tma_qk) envs="CULA_KDA_TC_PHASE1=tma_qk" ;;
        tma_qkg_pf66) envs="CULA_KDA_TC_PHASE1=tma_qkg CULA_KDA_TC_PREFETCH=66" ;;
        pf0 | pf33 | pf132) envs="CULA_KDA_TC_PREFETCH=${m#pf}" ;;
        pack_bytes) envs="CULA_KDA_TC_DIAG=no_tp_store CULA_KDA_RECUR_DIAG=half_at" ;;
        pack) envs="CULA_KDA_PACK=1" ;;
        unpacked) envs="CULA_KDA_PACK=0" ;;
        chunk) envs="CULA_KDA_TC_ORDER=chunk" ;;
        w_in) envs="CULA_KDA_W_IN_RECUR=1" ;;
        ctas2) envs="CULA_KDA_TC_CTAS=2" ;;
        no_w_in) envs="CULA_KDA_W_IN_RECUR=0" ;;
        esac
        step ${prefix}_$m 50 env $envs python3 -u -m cula.kernels.sm90.kda_fwd --check --split ${SPLIT_SET:-worst}
    done
}
s21_splits() {  # the default against the pre-session-21 stage 1 and each change alone, twice in turn
    mode_splits s21_split default pre21 direct left default pre21
}
for s in $steps; do
    case $s in
    decode)  # the decode host fast path (session 4, CPU-only so far): GPU tests, then decode_bench
        step decode_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --maxfail=20 \
            tests/test_kernel_kda_decode.py tests/test_kernel_lightning_decode.py tests/test_decode_fast_path.py
        step decode_bench 80 python3 -m cula.kernels.sm90.decode_bench --out "$OUT" ;;
    bench_gpu)  # the timer after failed captures: memory, RNG and stream
        step bench_gpu 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_bench_gpu.py ;;
    kda_check)  # stage 1 at 7acbd92 ran only tc-T65-gva-vfirst and the suite's rows
        step kda_check 120 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-varlen-33,tc-T1000-negeig,tc-T1 ;;
    round5)  # session 5: timer memory fix, decode host profile, dummy-chunk exit checks and splits
        step bench_gpu 45 python3 -m pytest -q -m gpu -p no:cacheprovider -rf -x tests/test_bench_gpu.py -k "not tiny"
        step decode_profile 45 python3 -m cula.kernels.sm90.decode_bench --profile
        step kda_check 130 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-varlen-33,tc-varlen-zero,varlen-zero
        step kda_split 60 python3 -m cula.kernels.sm90.kda_fwd --check --split all ;;
    next)  # session 15's stage 1 (off-diagonal blocks on shared-memory operands, the default) and session 16's
        # log-space gate (docs/DEVICE.md): stage 1's occupancy (2 CTAs per SM: its shared memory fills the SM
        # exactly), then the tensor-core GPU cases through pytest (with FLA); the suites follow in their own
        # call (kda_suite kda_layer_suite, CULA_GIT_SHA set)
        step tc_occupancy 120 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf tests/test_kda_tc_numerics.py
        step tc_gpu 420 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "test_gpu_kernel_matches_reference and tc-" ;;
    loggate)  # session 16's log-space gate on the tensor-core stage 1 (opt-in until LOG_GATE_VALIDATED): its two
        # check cases through pytest, against the fp64 reference and FLA (AOT modules; <= 120 s)
        step loggate 120 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "test_gpu_kernel_matches_reference and tc-loggate" ;;
    train)  # chunk_kda with gradients (session 16, CPU-built): our forward under FLA's backward, opt-in until
        # this passes (cula.kda._train.SWITCH). FLA's backward autotunes on first use (save_triton_cache after)
        # -v: a step killed at its limit prints no summary, so the log names each test as it ends
        step kda_train ${TRAIN_LIMIT:-420} python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf -s --durations=0 \
            tests/test_kda_train.py ;;
    train_suite)  # the training step (forward + backward) against FLA's (CULA_GIT_SHA set)
        step kda_train_suite 420 env CULA_GIT_DIRTY=0 python3 -m cula.cli bench \
            --suite kda_train --mode both --impl fla,cula --plain --out-dir "$OUT" --max-time 0.2 ;;
    ncu)  # stage 1's stall reasons by instruction (session 6): full set on one B1 T4096 launch
        step ncu 200 ncu --clock-control none -k regex:intra_tc --launch-count 1 --set full \
            --import-source no -o "$OUT/intra_tc" python3 -m cula.kernels.sm90.kda_fwd_profile --stage intra
        ncu -i "$OUT/intra_tc.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
        ncu -i "$OUT/intra_tc.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
        ncu -i "$OUT/intra_tc.ncu-rep" --page source --csv --print-source ptx > "$OUT/ncu_ptx.csv" 2>&1
        grep -iE "warp cycles|eligible|issued|throughput|registers|occupancy" "$OUT/ncu_details.txt" | head -30
        python3 -m cula.kernels.common.ncu_phases "$OUT/ncu_sass.csv" --warps $((4096 * 4)) ;;
    s42_mask)  # session 42: the packed tile masked in two passes (mask_packed_rows, the default since session 44):
        # packed bitwise the unpacked path and the w-in-stage-2 references (GPU tests), then the packed split rows
        # against the word mask (CULA_KDA_PACK_MASK=words, the default before), A/B/A in one call (AOT words_split)
        step s42_mask_tests 200 python3 -u -m pytest -x -v -m gpu -p no:cacheprovider \
            -rf tests/test_kernel_kda_fwd.py -k "pack_equals_unpacked or w_in_recur" || continue
        step s42_split_words 90 env CULA_KDA_PACK_MASK=words python3 -u -m cula.kernels.sm90.kda_fwd --check \
            --split packed
        step s42_split_rows 90 python3 -u -m cula.kernels.sm90.kda_fwd --check --split packed
        step s42_split_words 90 env CULA_KDA_PACK_MASK=words python3 -u -m cula.kernels.sm90.kda_fwd --check \
            --split packed ;;
    s43_pair)  # session 43: stage 2 as pairs (CULA_KDA_RECUR_PAIR=1: both V halves of an item in one CTA, one math
        # warpgroup each, the stage's tiles shared): bitwise the split launch (GPU tests), then the pair split rows
        # A/B/A (AOT nossm_* / pair_*); the steps after it run only if its tests pass
        pair_tests || { echo "== pair GPU tests failed: the later steps are skipped"; break; }
        pair_splits ;;
    s44_pair_tests)  # session 44: s43_pair's GPU tests alone (the later steps run either way)
        pair_tests ;;
    s44_pair_split)  # session 44: s43_pair's split rows alone, pairs off / on / off (the split launch: the rows mask)
        pair_splits ;;
    s43_lean)  # session 43, with little device time left: four cases of the pair GPU tests, then --split pair_lean (B2
        # T16384, skewed n10 T16384) with pairs off and on
        step s43_lean_tests 150 python3 -u -m pytest -x -v -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "pair_equals_split and (T1000 or big-varlen or varlen-zero or short-zero)" || break
        for p in 0 1; do
            step s43_lean_$p 70 env CULA_KDA_RECUR_PAIR=$p python3 -u -m cula.kernels.sm90.kda_fwd --check \
                --split pair_lean
        done ;;
    ncu_recur)  # session 42: stage 2 (v2) at B2 T16384 under ncu (one launch, full set): is its ~2 us chunk step its chain
        # (one math warpgroup: tensor pipe mostly idle, warps waiting on wgmma / barriers) or memory?
        step ncu_recur 240 ncu --clock-control none -k regex:recur --launch-count 1 --set full \
            --import-source no -o "$OUT/recur" python3 -m cula.kernels.sm90.kda_fwd_profile --B 2 --T 16384 --H 64 \
            --stage recur
        ncu -i "$OUT/recur.ncu-rep" --page details > "$OUT/ncu_recur_details.txt" 2>&1
        ncu -i "$OUT/recur.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_recur_sass.csv" 2>&1
        grep -iE "warp cycles|eligible|issued|throughput|registers|occupancy|pipe|duration" \
            "$OUT/ncu_recur_details.txt" | head -40
        python3 -m cula.kernels.common.ncu_phases "$OUT/ncu_recur_sass.csv" --warps $((132 * 5)) | head -40 ;;
    s6)  # session 6: leaner gate / exponent arguments in stage 1: checks, split, then the gradient API tests
        step kda_check 110 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-T65-gva-vfirst,tc-lb11-strong
        step kda_split 70 python3 -m cula.kernels.sm90.kda_fwd --check --split all ;;
    persist)  # stage 2 (v2) as a persistent kernel: one CTA per SM walking (V tile, head, sequence) items
        step recur_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "gpu_recur_v2"
        step kda_check_persist 150 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-varlen-zero,tc-varlen-33,tc-T65-gva-vfirst,tc-T1000-negeig
        step kda_split_persist 60 python3 -m cula.kernels.sm90.kda_fwd --check --split all ;;
    invwg)  # stage 1's inverse step 3 on wgmma (CULA_KDA_TC_INV_WGMMA=1, CPU-compiled only): checks, A/B/A splits
        step kda_check_invwg 200 env CULA_KDA_TC_INV_WGMMA=1 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T1,tc-T65-gva-vfirst,tc-varlen-zero,tc-lb11-strong,tc-T1000-negeig,tc-fp32-gate-plainbeta
        for a in 0 1 0; do
            step kda_split_inv$a 60 env CULA_KDA_TC_INV_WGMMA=$a python3 -m cula.kernels.sm90.kda_fwd --check --split all
        done ;;
    kda_gpu)  # every kda_fwd check case through pytest (stage 1 either kernel, the persistent stage 2)
        step kda_gpu 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "kernel_matches_reference" ;;
    tc_gpu)  # the tensor-core stage-1 cases of kda_gpu only (the SIMT kernel has not changed since they passed)
        ids=""
        for c in tc-T1 tc-T65-gva-vfirst tc-T1000-negeig tc-varlen-zero tc-varlen-33 tc-lb11-strong \
                tc-fp32-gate-plainbeta; do
            ids="$ids tests/test_kernel_kda_fwd.py::test_gpu_kernel_matches_reference[$c]"
        done
        step tc_gpu ${TC_GPU_T:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rf $ids ;;
    sanitize)  # memcheck of both KDA kernels (tensor-core stage 1, persistent stage 2) on two small cases
        step kda_memcheck 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --report-api-errors no \
            --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --no-fla \
            --cases tc-varlen-zero,tc-T65-gva-vfirst
        grep -E "ERROR SUMMARY|Invalid" "$OUT/kda_memcheck.log" | head -5
        # shared-memory hazards (session 15's B' pass writes B'_3 in place between two barriers)
        step kda_racecheck 200 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --report-api-errors no \
            --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --no-fla --cases tc-T1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/kda_racecheck.log" | head -5 ;;
    sanitize_pack)  # session 31: the sanitizers on session 30's stage 2 order (Sᵀ(-w)ᵀ first; the packed tile's
        # masks between two wgmma groups in flight, behind a named barrier), packed (forced) and unpacked, on a
        # 2-chunk case (the racecheck of `sanitize` runs one chunk only; AOT pack_checks)
        step kda_memcheck_pack 150 env CULA_KDA_PACK=1 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
            --report-api-errors no --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --no-fla \
            --cases tc-varlen-zero,tc-T65-gva-vfirst
        grep -E "ERROR SUMMARY|Invalid" "$OUT/kda_memcheck_pack.log" | head -5
        for p in 0 1; do
            step kda_racecheck_pack$p 200 env CULA_KDA_PACK=$p /usr/local/cuda/bin/compute-sanitizer --tool racecheck \
                --report-api-errors no --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
                --no-fla --cases tc-T65-gva-vfirst
            grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/kda_racecheck_pack$p.log" | head -5
        done ;;
    split_worst)  # the time split (stage 1 / stage 2 / host) of the three lowest-ratio suite rows and B2 T16384
        step kda_split_worst 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst ;;
    dbench)  # decode_bench alone: graph / eager times, kernel-entry host time and the public op's (public_op_us)
        step decode_bench 90 python3 -m cula.kernels.sm90.decode_bench --out "$OUT" ;;
    probe)  # the bare cuLaunchKernel probe: equal results, host us per launch against the DSL's launch
        step launch_probe 60 python3 -m cula.kernels.sm90.decode_launch_probe ;;
    h0pf)  # stage 2's per-thread L2 prefetch of the next item's state tile: GPU checks, then A/B/A splits
        step recur_tests_pf 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "gpu_recur_v2"
        step kda_check_pf 110 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-varlen-33,tc-T65-gva-vfirst
        for a in 0 1 0; do
            step kda_split_pf$a 50 env CULA_KDA_RECUR_H0_PREFETCH=$a python3 -m cula.kernels.sm90.kda_fwd --check \
                --split worst
        done ;;
    pdl)  # stage 2 launched programmatically behind stage 1 (CULA_KDA_PDL): GPU checks, then A/B/A splits
        step pdl_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "chained_calls or two_kernels"
        step kda_check_pdl 150 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-varlen-33,tc-T65-gva-vfirst,tc-varlen-zero,tc-T1
        for a in 0 1 0; do
            step kda_split_pdl$a 60 env CULA_KDA_PDL=$a python3 -m cula.kernels.sm90.kda_fwd --check --split small
        done
        step kda_split_worst_pdl 60 python3 -m cula.kernels.sm90.kda_fwd --check --split worst ;;
    pdl_ab)  # stage 2's programmatic launch on / off / on / off over short and long rows (split "pdl")
        for a in 1 0 1 0; do
            step kda_split_pdl$a 75 env CULA_KDA_PDL=$a python3 -m cula.kernels.sm90.kda_fwd --check --split pdl
        done ;;
    pfsweep)  # stage 1's L2 prefetch distance (CTAs ahead; 66 is the default since session 9): splits per distance
        for n in 66 33 99 16 66; do
            step kda_split_pf$n 60 env CULA_KDA_TC_PREFETCH=$n python3 -m cula.kernels.sm90.kda_fwd --check --split all
        done ;;
    pdl_long)  # why stage 2's programmatic launch slows long rows: trigger at start / end / none, all rows on
        step pdl_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            tests/test_kernel_lightning_fwd.py tests/test_api_gpu.py -k "chained_calls or two_kernels or warm_call \
            or launch_only"
        for t in start end none; do
            step kda_split_pdl_$t 75 env CULA_KDA_PDL_MAX_CTAS=1000000000 CULA_KDA_PDL_TRIGGER=$t \
                python3 -m cula.kernels.sm90.kda_fwd --check --split pdl
        done
        step kda_split_pdl_off 75 env CULA_KDA_PDL=0 python3 -m cula.kernels.sm90.kda_fwd --check --split pdl ;;
    eager_probe)  # host timestamps + profiler trace of the timer's eager loop (small-B decode rows)
        step eager_probe_l 60 python3 -m cula.bench.eager_probe --variant lightning --B 1 --H 8
        step eager_probe_k 60 python3 -m cula.bench.eager_probe --variant kda --B 1 --H 8 ;;
    flush32)  # the flush-eviction GPU test at 32 MiB (the write flush; the read flush was removed)
        step flush_test 40 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_bench_gpu.py -k evicts ;;
    prof11)  # session 11: decode B64 H32 KDA serving / bare / Lightning (graph A/B/A), ncu of both decodes,
        # of stage 2 on uniform n20 T4096 and of stage 1 (B1 T4096)
        for f in serving bare serving; do
            step dprof_kda_$f 60 python3 -m cula.kernels.sm90.decode_profile --time --variant kda --flags $f
            tail -1 "$OUT/dprof_kda_$f.log"
        done
        step dprof_lightning 60 python3 -m cula.kernels.sm90.decode_profile --time --variant lightning
        tail -1 "$OUT/dprof_lightning.log"
        for v in kda lightning; do
            step ncu_dec_$v 120 ncu --clock-control none -k regex:Decode --launch-count 1 --set full \
                --import-source no -o "$OUT/dec_$v" python3 -m cula.kernels.sm90.decode_profile --variant $v
            ncu -i "$OUT/dec_$v.ncu-rep" --page details > "$OUT/ncu_dec_${v}_details.txt" 2>&1
            ncu -i "$OUT/dec_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_dec_${v}_sass.csv" 2>&1
            grep -iE "duration|dram throughput|warp cycles|eligible|issued ipc|achieved occupancy|registers" \
                "$OUT/ncu_dec_${v}_details.txt" | head -12
        done
        step ncu_recur 150 ncu --clock-control none -k regex:Recur --launch-count 1 --set full \
            --import-source no -o "$OUT/recur" python3 -m cula.kernels.sm90.kda_fwd_profile --stage recur \
            --dist uniform --n 20 --T 4096
        ncu -i "$OUT/recur.ncu-rep" --page details > "$OUT/ncu_recur_details.txt" 2>&1
        ncu -i "$OUT/recur.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_recur_sass.csv" 2>&1
        grep -iE "duration|dram throughput|warp cycles|eligible|issued ipc|achieved occupancy" \
            "$OUT/ncu_recur_details.txt" | head -12
        bash "$0" ncu ;;
    s2probe)  # session 12: what stage 2's state traffic and its third stage cost on the worst rows (splits)
        step s2_base 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst
        step s2_nostate 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst --no-h0 --no-ht
        step s2_stages2 90 env CULA_KDA_RECUR_STAGES=2 python3 -m cula.kernels.sm90.kda_fwd --check --split worst
        step s2_base2 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst ;;
    s2state)  # session 12: stage 2's state traffic on the worst rows, by side (initial load / final store)
        step s2_base 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst
        step s2_noh0 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst --no-h0
        step s2_noht 90 python3 -m cula.kernels.sm90.kda_fwd --check --split worst --no-ht
        step s2_nopf 90 env CULA_KDA_RECUR_H0_PREFETCH=0 python3 -m cula.kernels.sm90.kda_fwd --check --split worst ;;
    ssm)  # session 12: stage 2's state through shared memory (short sequences): GPU tests, checks, A/B/A/B splits
        step ssm_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --maxfail=10 \
            tests/test_kernel_kda_fwd.py -k gpu_recur_v2
        step ssm_check 200 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases varlen-33,varlen-zero,tc-varlen-33,tc-varlen-zero,tc-T65-gva-vfirst,T1
        for a in 0 1 0 1; do
            step ssm_split$a 60 env CULA_KDA_RECUR_STATE_SMEM=$a python3 -m cula.kernels.sm90.kda_fwd --check \
                --split worst
        done ;;
    ssm_items)  # session 12: stage 2's state buffer on longer varlen items (7-26 chunks a sequence), A/B/A/B
        for a in 0 1 0 1; do
            step ssm_items$a 60 env CULA_KDA_RECUR_STATE_SMEM=$a python3 -m cula.kernels.sm90.kda_fwd --check \
                --split items
        done ;;
    diag_split)  # session 15: what part of stage 1's time is memory (CULA_KDA_TC_DIAG: outputs wrong, timing only):
        # one split per diagnostic against none, none again at the end, on the default (u in stage 2's stage 1;
        # each diagnostic is a module of .device/aot: scenarios diag_*, one per kda_fwd_intra_tc.SAME_VALUE_DIAGS).
        # Since session 38 the skipped stores run at the default's three CTAs; l2_loads, no_inverse, one_cta and
        # no_tp_store at two (kda_fwd warns): read those against `mode_splits ... ctas2`, not against none
        diags=$(python3 -c "from cula.kernels.sm90.kda_fwd_intra_tc import SAME_VALUE_DIAGS as d; print(*d)")
        for d in none $diags none; do
            dv=$d; [ "$d" = none ] && dv=""
            step diag_split_$d 100 env CULA_KDA_TC_DIAG=$dv python3 -u -m cula.kernels.sm90.kda_fwd --check \
                --split worst
        done ;;
    s21_defaults)  # session 21's defaults together (halves factors + right-looking substitution; each was checked
        # and timed alone on an H100, the pair only on the CPU): the six tensor-core check cases with FLA, then
        # splits of the default against the pre-session-21 stage 1 (direct, left) and each change alone (<= 420 s;
        # AOT scenarios gate_direct_*, subst_left_*, pre21_split)
        s21_check; s21_splits ;;
    s22_direct)  # session 22 (H100): with the right-looking substitution the halved factors cost +1.1% of stage 1
        # at B2 T16384 and save 1.3% on two n20 rows. direct + right on the three checks it has not passed (session
        # 21 ran the other three), then default / direct splits twice (<= 300 s; AOT gate_direct_checks / _split)
        step s22_direct_check 200 env CULA_KDA_TC_GATE_FACTORS=direct python3 -u -m cula.kernels.sm90.kda_fwd \
            --check --no-bench --cases tc-varlen-zero,tc-lb11-strong,tc-softplus-varlen-zero
        mode_splits s22_split default direct default direct ;;
    loggate32)  # sessions 24-25: the log-space-gate checks with 32-row blocks (passed on an H100 in session 25, the
        # default since), then the split rows with 16-row blocks against the default
        step loggate32_check 150 python3 -u -m cula.kernels.sm90.kda_fwd --check \
            --no-bench --cases tc-loggate-safe-varlen,tc-loggate-safe-floor
        mode_splits block16_split default block16 ;;
    clock)  # session 24: stage 1's phases by the SM's cycle counter (kda_fwd_clock) at B2 T16384, two CTAs per SM
        # and one; the clock build against the default (what the stamps cost); uniform n20 T4096; without the qg /
        # kgᵀ stores (which phases their 10.6% comes out of) (~180 s with AOT)
        step clock_2cta 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384
        step clock_1cta 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384 --one-cta
        mode_splits clock_split default clock
        step clock_n20 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --T 4096 --dist uniform --n 20
        step clock_no_qg_kgt 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384 --diag no_qg_kgt ;;
    s38_clock)  # session 38: the clock at the three-CTA default (32-bit stamps fit there): which phases bound a
        # chunk at B2 T16384 (packed) and n20 T4096 (unpacked), then the clock build against the default twice in
        # turn (what the stamps cost) (~150 s; AOT diag_clock)
        step clock3_b2 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384
        step clock3_n20 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --T 4096 --dist uniform --n 20
        mode_splits clock3_split default clock default clock ;;
    s38_clock_test)  # session 38: the clock build at three CTAs bitwise the default, its stamps in order (GPU tests)
        step s38_clock_test 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_fwd_clock.py ;;
    s39_raw)  # session 39: stage 2 with the raw tiles alone (KdaFwdRecurRaw, q, k, g in; on the default's scratch): its
        # GPU tests (o and the final state against the default's, packed and unpacked, the next sequence's rows
        # ignored), then stage 2 alone against the default's, interleaved, at B2 T16384 and B1 T8192 (~200 s: each
        # raw build compiles on the device, ~40-60 s)
        step s39_raw_test 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_raw_tiles.py
        step s39_raw_bench 120 python3 -u -m cula.kernels.sm90.kda_fwd_recur --raw-bench ;;
    raw_tiles)  # session 39: the raw tiles end to end (CULA_KDA_RAW_TILES=1: stage 1 hands over the norms, stage 2 forms
        # qg, -X, kg): the GPU tests of tests/test_kda_raw_tiles.py, then the split rows against the default twice in
        # turn (~250 s warm: the GPU tests compile their raw kernels; AOT raw_split)
        step raw_tiles_test 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_raw_tiles.py
        mode_splits rawt_split default raw default raw ;;
    raw_suite)  # session 39: the kda suite with the raw tiles into $OUT/raw: an A/B against kda_suite on the same card,
        # not for publishing until the raw tiles are the default (AOT raw_suites)
        mkdir -p "$OUT/raw"
        step kda_suite_raw 150 env CULA_GIT_DIRTY=0 CULA_KDA_RAW_TILES=1 python3 -m cula.cli bench --suite kda \
            --mode both --impl fla,cula --plain --out-dir "$OUT/raw" --max-time 0.2 ;;
    s38_raw)  # session 38: stage 1 at the three-CTA default without its qg / kgT and -X stores (no_qkx), and without
        # every scratch store (no_stores), against the default, twice in turn. Session 36's raw_premise ran these at
        # two CTAs (any diagnostic took the two-CTA build then) against the default at three (~110 s; AOT diag_no_qkx,
        # diag_no_stores)
        mode_splits raw3_split default no_qkx no_stores default no_qkx no_stores ;;
    fused_premise)  # session 25: stage 1 without its scratch stores (qg / kgT, w, Aqk | T'), at two CTAs per SM
        # (three since session 38: the default's) and at one, against the default and one_cta, twice in turn (<= 200 s;
        # AOT diag_one_cta, diag_no_stores, diag_one_cta_no_stores): one CTA per SM without stores is a fused
        # kernel's stage 1 beside its recurrence
        mode_splits fused_split default one_cta no_stores one_cta_no_stores \
            default one_cta no_stores one_cta_no_stores ;;
    phase1)  # session 26: the lean phase 1 (the default: l2 sums by recursive halving, the gate's exponent as one
        # FFMA, 16-byte group totals) through the tensor-core checks (each gate form: sigmoid, softplus, fp32 gate,
        # log-space), then against session 25's phase 1 (pre26), twice in turn (<= 340 s; AOT checks, pre26_split)
        step phase1_check 260 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        mode_splits phase1_split default pre26 default pre26 ;;
    tma_qk)  # session 27: q and k by TMA into the Qa / Ka tiles (the default since its first run; g too since session
        # 28) through the checks, the GPU tests (bitwise the lean phase 1's outputs; Inf in later sequences' q, k
        # reaches no earlier one),
        # then against session 26's phase 1 (CULA_KDA_TC_PHASE1=lean), twice in turn (<= 360 s; AOT lean_checks,
        # lean_split)
        step tma_qk_check 220 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        step tma_qk_test 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "tma_qk"
        mode_splits tma_qk_split default lean default lean ;;
    tma_qkg)  # session 28: g by TMA as well (phase 1 "tma_qkg", the default from its first run until tma_g_first
        # later that session; the init / arrive split for racecheck was new): one case first (a hang costs 45 s), the
        # checks, the GPU tests (bitwise the tma_qk / lean phase 1's outputs; NaN or Inf in later sequences' inputs
        # reaches no earlier one), then the default against session 27's phase 1 (CULA_KDA_TC_PHASE1=tma_qk) once
        # (<= 250 s; AOT tma_qk_checks, lean_checks, tma_qk_split)
        step tma_qkg_sanity 45 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-T1 || continue
        step tma_qkg_check 220 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        step tma_qkg_test 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "tma_qk"
        mode_splits tma_qkg_split default tma_qk ;;
    clock_tma)  # session 28: the clock with its TMA-wait stamp (q, k, g landed) at B2 T16384, two CTAs per SM and
        # one, and uniform n20 T4096 (~25 s with AOT)
        step clock_tma_2cta 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384
        step clock_tma_1cta 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384 --one-cta
        step clock_tma_n20 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --T 4096 --dist uniform --n 20 ;;
    pf_tma)  # session 28: stage 1's L2 prefetch distance now that q, k, g arrive by TMA: the default (66 CTAs ahead
        # then, none since 2e1b3cc) against none, 33 and 132, then the default again (~110 s; AOT pf*_split)
        mode_splits pf_tma default pf0 pf33 pf132 default ;;
    pack)  # session 29: Aqk and T' packed into one 64 x 64 tile a chunk (CULA_KDA_PACK=1; 8 KB a chunk and value
        # head fewer written by stage 1 and read by stage 2; by default for sequences of more than 7 chunks on
        # average): one case first (a hang costs 45 s), the nine checks (the scratch taken apart against the
        # emulation), the GPU test (bitwise the unpacked path), then unpacked / packed splits twice (<= 260 s; AOT
        # pack_checks, unpacked_split, pack_split)
        step pack_sanity 45 env CULA_KDA_PACK=1 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T1 || continue
        step pack_check 220 env CULA_KDA_PACK=1 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases $phase1_cases
        step pack_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k pack_equals
        mode_splits pack_split unpacked pack unpacked pack ;;
    s30)  # session 30: stage 2 issues Sᵀ(-w)ᵀ before vᵀ T'ᵀ (the sums' order changed) and masks the packed tile's
        # copies while it runs; the tile by default above 7 chunks a sequence: one case first, the nine checks, the
        # u-in-stage-2 and pack GPU tests (<= 300 s; AOT checks, pack_checks); the suites follow (next)
        step s30_sanity 45 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-T1 || continue
        step s30_check 220 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        step s30_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "u_in_recur or pack_equals" ;;
    s31)  # session 31: stage 1 launched heads fastest, chunks last to first (ORDER "head_rev", the default): one case
        # first, the nine checks, the order GPU test (bitwise "chunk") with the u-in-stage-2 and pack ones, then the
        # `l2` split rows, "chunk" then the default (<= 420 s; AOT checks, pack_checks, order_chunk_checks/_split;
        # session 31's `l2_order` step, with the evict-first loads since removed, is at d71cb43)
        step s31_sanity 45 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-T1 || continue
        step s31_check 220 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        step s31_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "order_equals or u_in_recur or pack_equals"
        SPLIT_SET=l2 mode_splits s31_l2 chunk default ;;
    s32)  # session 32: w in stage 2 (CULA_KDA_W_IN_RECUR=1, the default since: stage 1 stores -X, stage 2 forms
        # v_new = T'(v - X S)): one case first, the nine checks unpacked and packed, its GPU tests, then it off / on
        # in the splits, twice (<= 560 s; AOT w_in_checks, w_in_pack_checks, no_w_in_checks, no_w_in_pack_checks,
        # split, no_w_in_split)
        step s32_sanity 45 env CULA_KDA_W_IN_RECUR=1 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T1 || continue
        step s32_check 150 env CULA_KDA_W_IN_RECUR=1 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases $phase1_cases
        step s32_check_pack 150 env CULA_KDA_W_IN_RECUR=1 CULA_KDA_PACK=1 python3 -u -m cula.kernels.sm90.kda_fwd \
            --check --no-bench --cases $phase1_cases
        step s32_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "w_in_recur"
        mode_splits s32_split no_w_in default no_w_in default ;;
    s33)  # session 33: stage 1 at three CTAs per SM (the default for the packed tile: no X, v or 48-row B' tile, -X
        # stored from registers, g landing in K̃'s tile; 70 KB and 168 registers a CTA): one case of a packed tile
        # first, the nine checks packed (forced), its GPU tests (bitwise two CTAs, a later sequence's Inf / NaN
        # ignored), then two CTAs / the default in the splits, twice (<= 500 s; AOT pack_checks, ctas2_pack_checks,
        # split, ctas2_split)
        step s33_sanity 45 env CULA_KDA_PACK=1 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T65-gva-vfirst || continue
        step s33_check_pack 150 env CULA_KDA_PACK=1 python3 -u -m cula.kernels.sm90.kda_fwd \
            --check --no-bench --cases $phase1_cases
        step s33_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py -k "ctas3"
        mode_splits s33_split ctas2 default ctas2 default ;;
    s34)  # session 34: the driver's CTAs per SM for each stage 1 built (two unpacked, three packed) and the pack /
        # three-CTA bitwise tests since their shared case builder (5946698) (~60 s; AOT checks, pack_checks)
        step s34_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_tc_numerics.py \
            tests/test_kernel_kda_fwd.py -k "ctas or pack_equals_unpacked" ;;
    aot_gpu)  # modules built in a child process, loaded, bitwise against the compiled path (u in stage 1 and 2)
        step aot_gpu 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_aot.py ;;
    raw_premise)  # session 36: stage 1 at the default (three CTAs) without its qg / kgT and -X stores, Aqk | T' kept:
        # what stage 1 would cost if stage 2 formed qg, kgT and X from q, k, g itself (the same bytes read in stage 2,
        # 48 KB a chunk fewer written by stage 1; kda_fwd.md "Where the time goes"), twice in turn (<= 200 s; AOT
        # split, diag_no_qkx)
        mode_splits raw_split default no_qkx default no_qkx ;;
    s37)  # session 37: stage 1 widening bf16 inputs by word shifts and masks (bf16_widen) and forming kgT with two FMUL an
        # element (KGT "ref"): 152 SASS instructions a thread fewer at three CTAs, packed. The GPU tests (the widening
        # bitwise the cvt.f32.bf16 one; kgT within a bf16 step of "kh", everything else bitwise), then the default
        # against session 36's stage 1 twice in turn (<= 420 s; AOT checks, widen_cvt_checks, kgt_kh_checks, split,
        # s36_split; cvt alone with "ref" spills 4 bytes, so it is not timed)
        step s37_test 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "widen or kgt" || continue
        mode_splits s37_split default s36 default s36 ;;
    s37b)  # session 37: X and qg through 2^C = h h formed once a column (GATE_FACTORS square, 121 SASS instructions a
        # thread fewer): the nine phase-1 checks with it, then the default against it twice in turn (<= 330 s; AOT
        # gate_square_checks, split, gate_square_split)
        step square_check 200 env CULA_KDA_TC_GATE_FACTORS=square python3 -u -m cula.kernels.sm90.kda_fwd --check \
            --no-bench --cases $phase1_cases || continue
        mode_splits square_split default square default square ;;
    s35)  # session 35: the occupancy GPU test with a function handle of its own (stage 1 compiled with --keep-cubin,
        # loaded by us: neither a compiled nor an AOT-loaded DSL function hands one to Python), the AOT GPU test on
        # the fingerprint of kernel sources only (88e7d2d), then two CTAs / the default on the short fixed rows
        # (B1 T512: 512 CTAs are 1.3 waves of 396 at three, 1.9 of 264 at two), twice (<= 450 s; AOT split, ctas2_split)
        step s35_occupancy 200 python3 -u -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_tc_numerics.py \
            -k ctas
        step s35_aot 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_aot.py
        SPLIT_SET=small mode_splits s35_small ctas2 default ctas2 default ;;
    s34u)  # session 34: stage 1 at three CTAs for the unpacked tile too (short sequences: -X's store moved up beside
        # K̃'s, no spill): one unpacked case first, the nine checks unpacked (forced), the GPU tests at both packings
        # (bitwise two CTAs; a later sequence's Inf / NaN ignored), then two CTAs / the default in the splits, twice
        # (<= 500 s; AOT unpacked_checks, ctas2_unpacked_checks, ctas2_pack_checks, split, ctas2_split)
        step s34u_sanity 45 env CULA_KDA_PACK=0 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T65-gva-vfirst || continue
        step s34u_check 150 env CULA_KDA_PACK=0 python3 -u -m cula.kernels.sm90.kda_fwd \
            --check --no-bench --cases $phase1_cases
        step s34u_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            tests/test_kda_tc_numerics.py -k "ctas"
        mode_splits s34u_split ctas2 default ctas2 default ;;
    sanitize_ctas3)  # session 33: memcheck and racecheck of the three-CTA stage 1 (packed: g lands in K̃'s tile, which
        # phase 2 then overwrites; AOT ctas3_pack_checks)
        step kda_memcheck_ctas3 150 env CULA_KDA_TC_CTAS=3 CULA_KDA_PACK=1 /usr/local/cuda/bin/compute-sanitizer \
            --tool memcheck --report-api-errors no --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check \
            --no-bench --no-fla --cases tc-varlen-zero,tc-T65-gva-vfirst
        grep -E "ERROR SUMMARY|Invalid" "$OUT/kda_memcheck_ctas3.log" | head -5
        step kda_racecheck_ctas3 200 env CULA_KDA_TC_CTAS=3 CULA_KDA_PACK=1 /usr/local/cuda/bin/compute-sanitizer \
            --tool racecheck --report-api-errors no --print-limit 5 python3 -m cula.kernels.sm90.kda_fwd --check \
            --no-bench --no-fla --cases tc-T65-gva-vfirst
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/kda_racecheck_ctas3.log" | head -5 ;;
    ctas2_suite)  # session 33: the kda suite with stage 1 at two CTAs per SM into $OUT/ctas2: an A/B against
        # kda_suite on the same card, not for publishing (AOT suites_ctas2)
        mkdir -p "$OUT/ctas2"
        step kda_suite_ctas2 150 env CULA_GIT_DIRTY=0 CULA_KDA_TC_CTAS=2 python3 -m cula.cli bench --suite kda \
            --mode both --impl fla,cula --plain --out-dir "$OUT/ctas2" --max-time 0.2 ;;
    pack_premise)  # session 29: what packing Aqk and T' into one 64 x 64 tile (8 KB a chunk instead of 16) would
        # save at most, timing only (outputs wrong): stage 1 without T''s store (CULA_KDA_TC_DIAG=no_tp_store) and
        # stage 2 reading ~8 KB of distinct [Aqk | T'] memory a chunk (CULA_KDA_RECUR_DIAG=half_at), against the
        # default twice in turn (<= 100 s; AOT pack_premise_split)
        mode_splits pack_premise default pack_bytes default pack_bytes ;;
    g_first)  # session 28: g on its own mbarrier, issued first, q and k waited for after the gate work, the L2
        # prefetch off (the default since its first runs): one case first (a hang costs 45 s), the checks, the GPU
        # tests (bitwise tma_qkg's / tma_qk's / lean's outputs; Inf / NaN in later sequences reaches no earlier
        # one), then against session 28's first default (tma_qkg, prefetch 66 ahead) twice in turn, and the clock
        # (<= 260 s; AOT checks, tma_qkg_checks, tma_qk_checks, lean_checks, tma_qkg_pf66_split)
        step g_first_sanity 45 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases tc-T1 || continue
        step g_first_check 220 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --cases $phase1_cases
        step g_first_test 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "g_first or tma_qk"
        mode_splits g_first_split default tma_qkg_pf66 default tma_qkg_pf66
        step g_first_clock 80 python3 -u -m cula.kernels.sm90.kda_fwd_clock --B 2 --T 16384 ;;
    one_cta)  # session 23: stage 1 at one CTA per SM against two (the fused kernel's premise: kda_fwd.md, "Where
        # the time goes and what is next"), twice in turn (<= 120 s; AOT scenario diag_one_cta)
        mode_splits one_cta_split default one_cta default one_cta ;;
    block32)  # sessions 23-24: 32-row reference-factor blocks (the default since session 24 where the bound takes
        # them, >= -5.366; lb11 and the softplus floor keep 16-row blocks): the tensor-core checks, gates saturated
        # at -5 and -5.36 among them, then block16 / default / block32_direct splits twice (<= 350 s; AOT scenarios
        # checks, block16_split, block32_direct_split)
        step block32_check 200 python3 -u -m cula.kernels.sm90.kda_fwd --check \
            --no-bench --cases tc-T1,tc-T65-gva-vfirst,tc-T1000-negeig,tc-varlen-zero,tc-varlen-33,tc-lb5-strong,\
tc-lb536-strong,tc-fp32-gate-plainbeta,tc-loggate-safe-varlen
        mode_splits block32_split block16 default block32_direct block16 default block32_direct ;;
    s21_check)  # the first half of s21_defaults alone (an H200 call: the checks, then the suites)
        s21_check ;;
    s21_splits)  # the second half
        s21_splits ;;
    u_in_recur)  # session 17: u formed in stage 2 from T' and v (CULA_KDA_U_IN_RECUR, CPU-compiled only): the
        # tensor-core check cases (varlen partial chunks, zero-length segments, GVA, V-first, both gate forms,
        # initial and final state), then the GPU tests without a state and the partial chunk before an Inf
        # (~40 s of compile per new flag set; <= 540 s in all). Then "u_split".
        step u_check 240 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --u-in-recur \
            --cases tc-T1,tc-T65-gva-vfirst,tc-T1000-negeig,tc-varlen-zero,tc-varlen-33,tc-softplus-varlen-zero
        step u_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kernel_kda_fwd.py \
            -k "u_in_recur and (none or partial)" ;;
    u_split)  # session 17: u in stage 2 off / on / off / on on the worst rows and B2 T16384 (<= 300 s)
        for a in 0 1 0 1; do
            step u_split$a 70 env CULA_KDA_U_IN_RECUR=$a python3 -m cula.kernels.sm90.kda_fwd --check --split worst
        done ;;
    s17_checks)  # session 17's u in stage 2 (<= 600 s cold, far less with .device/aot): the ahead-of-time loader's
        # own check, then four check cases (with state: partial chunks, zero-length segments, GVA, V-first)
        step aot_test 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_aot.py
        step u_check 230 python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench --u-in-recur \
            --cases tc-T65-gva-vfirst,tc-T1000-negeig,tc-varlen-zero,tc-varlen-33 ;;
    cp_gpu)  # session 13's CPU-only CP pieces (one GPU is enough): KDA in pieces bitwise, the CP emulation tests
        step kda_pieces 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_kda_fwd_pieces.py
        step cp_gpu 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_cp_gpu.py ;;
    cp_scaling)  # 2+ GPUs (set CULA_GIT_SHA first): checks and strong scaling up to 1M (W=1 at 1M runs in pieces)
        step cp_scaling 330 python3 -m cula.cp.multigpu --scaling-T 131072,262144,524288,1048576 --reps 10 \
            --store "$OUT/results" --md "$OUT/cp_cula.md" ;;
    cp_fla)  # 2+ GPUs: FLA's own CP on the same inputs (FLA tunes its CP kernels in every rank: alone, 300 s)
        step cp_fla 300 python3 -m cula.cp.multigpu --variants kda --impl fla-native \
            --scaling-T 131072,262144,524288 --reps 10 --store "$OUT/results" --md "$OUT/cp_fla.md" ;;
    s41)  # session 41: what session 40 changed on the host, run on a GPU for the first time (with `train`, the training
        # tests after cc403a6): a KDA launch compiled on the device (no AOT: fast_launch.compile_launcher through
        # dsl_compile; the step's time is mostly the two compiles), Lightning's first-call compile (dsl_compile)
        # through its GPU tests
        step s41_compile_check 200 env -u CULA_AOT_DIR python3 -u -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --cases tc-T1,tc-varlen-zero
        step s41_lightning 200 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf tests/test_kernel_lightning_fwd.py
        ;;
    s41_l2)  # session 41: what a stage-2 chunk costs one CTA with its inputs in L2 (the premise of stage 2 running beside
        # stage 1 chunk by chunk, the hand-off never leaving L2): kda_fwd_profile --l2-premise, cold / warm
        step s41_l2 200 python3 -u -m cula.kernels.sm90.kda_fwd_profile --l2-premise ;;
    kda_suite)  # the kda prefill suite against FLA (set CULA_GIT_SHA to the committed sha first)
        step kda_suite 150 env CULA_GIT_DIRTY=0 python3 -m cula.cli bench --suite kda --mode both \
            --impl fla,cula --plain --out-dir "$OUT" --max-time 0.2 ;;
    no_w_in_suite)  # session 32: the kda suite with w in stage 2 off (CULA_KDA_W_IN_RECUR=0) into $OUT/no_w_in: an A/B
        # against kda_suite on the same card, not for publishing (AOT suites_no_w_in)
        mkdir -p "$OUT/no_w_in"
        step kda_suite_no_w_in 150 env CULA_GIT_DIRTY=0 CULA_KDA_W_IN_RECUR=0 python3 -m cula.cli bench --suite kda \
            --mode both --impl fla,cula --plain --out-dir "$OUT/no_w_in" --max-time 0.2 ;;
    softplus)  # the tensor-core stage 1 on FLA's layer call (softplus gate, no bound; clamped at -11): checks
        step softplus_check 300 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --cases \
            T15-l2-gate,T65-gva-vfirst,T1000-all,varlen-33,tc-softplus-strong,tc-softplus-varlen-zero,tc-T65-gva-vfirst
        ;;
    kda_layer_suite)  # FLA's layer call (set CULA_GIT_SHA to the committed sha first)
        step kda_layer_suite 200 env CULA_GIT_DIRTY=0 python3 -m cula.cli bench --suite kda_layer --mode both \
            --impl fla,cula --plain --out-dir "$OUT" --max-time 0.2 ;;
    kda_exact_suite)  # log-space gate given: the SIMT stage 1 (opted in: dispatch hands these to FLA) vs FLA
        step kda_exact_suite 200 env CULA_GIT_DIRTY=0 CULA_KERNELS=kda_fwd_simt python3 -m cula.cli bench \
            --suite kda_exact --mode both \
            --impl fla,cula --plain --out-dir "$OUT" --max-time 0.2 ;;
    simt_pf)  # the SIMT stage 1's L2 prefetch of a later CTA's inputs (off by default): checks, then A/B/A splits
        step simt_pf_check 150 env CULA_KDA_SIMT_PREFETCH=66 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench \
            --no-tc --cases T65-gva-vfirst,varlen-33
        for n in 0 66 0 132; do
            step kda_split_simt_pf$n 90 env CULA_KDA_SIMT_PREFETCH=$n python3 -m cula.kernels.sm90.kda_fwd --check \
                --no-tc --split all
        done ;;
    decode_suite)  # the public decode ops against FLA (the eager rows move with the host fast path)
        step decode_suite 110 env CULA_GIT_DIRTY=0 python3 -m cula.cli bench --suite decode --mode both \
            --impl fla,cula --plain --out-dir "$OUT" --max-time 0.15 ;;
    gpu_tests)  # the public ops (call plans landed CPU-only) and the validated kernels
        step gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --maxfail=20 \
            tests/test_api_gpu.py tests/test_kernel_lightning_fwd.py tests/test_kernel_kda_decode.py \
            tests/test_kernel_lightning_decode.py ;;
    blocked)  # stage 1's blocked inverse: correctness on three cases, then the time split
        step kda_blocked 200 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --inverse blocked \
            --cases T15-l2-gate,T65-gva-vfirst,varlen-33
        step kda_split 100 python3 -m cula.kernels.sm90.kda_fwd --check --split --inverse blocked ;;
    v2)  # stage 1's register-blocked, 2-CTA/SM variant (with the blocked inverse), then its time split
        step kda_v2 200 python3 -m cula.kernels.sm90.kda_fwd --check --no-bench --variant v2 --inverse blocked \
            --cases T15-l2-gate,T65-gva-vfirst,varlen-33
        step kda_v2_split 100 python3 -m cula.kernels.sm90.kda_fwd --check --split --variant v2 --inverse blocked ;;
    fast)  # Lightning's opt-in fast launcher: equality tests, then eager small shapes with and without
        step lightning_fast_tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
            tests/test_kernel_lightning_fwd.py -k fast_launch
        step lightning_fast_bench 90 python3 -m cula.kernels.sm90.lightning_fwd_check --bench --fast-launch \
            --only "B1 T512 H64" --only "B4 T2048 H64"
        step lightning_dsl_bench 90 python3 -m cula.kernels.sm90.lightning_fwd_check --bench --dsl-launch \
            --only "B1 T512 H64" --only "B4 T2048 H64" ;;
    *) echo "== unknown step $s" ;;
    esac
done
