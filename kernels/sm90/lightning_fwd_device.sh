#!/usr/bin/env bash
# One device call for the Lightning prefill kernel: check, GPU tests, bench vs FLA, sanitizers.
# Run on the GPU machine from the repo root after `source .device/env.sh`:
#   bash kernels/sm90/lightning_fwd_device.sh [full|tests|bench|sanitize] ...
# Writes logs and JSON under $OUT. Each step has its own timeout so a hang costs one step only.
set -u
OUT=${OUT:-/tmp/lightning_out}
mkdir -p "$OUT"
mode=${1:-full}
chk="python3 -m cula.kernels.sm90.lightning_fwd_check"
step() { local t=$1; shift; echo "== $* (timeout ${t}s)"; local s=$SECONDS; timeout "$t" "$@"; echo "== rc=$? in $((SECONDS - s))s"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [[ $mode == full || $mode == tests ]]; then
  step 120 $chk --check
  step 240 python3 -m pytest -m gpu tests/test_kernel_lightning_fwd.py -q -p no:cacheprovider -rf
fi
if [[ $mode == full || $mode == bench ]]; then
  step 200 $chk --bench --reps "${REPS:-20}" --json "$OUT/bench.json"
  step 60 $chk --bench --reps "${REPS:-20}" --only "B1 T16384 H64" --v-tiles 32 --json "$OUT/bench_vt32.json"
fi
if [[ $mode == full || $mode == sanitize ]]; then
  if command -v compute-sanitizer >/dev/null; then
    step 150 compute-sanitizer --tool memcheck --print-limit 5 $chk --sanitize-case
    step 150 compute-sanitizer --tool racecheck --print-limit 5 $chk --sanitize-case
  else
    echo "compute-sanitizer: not available on this machine"
  fi
fi
