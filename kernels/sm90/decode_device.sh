#!/bin/bash
# One device call for the decode kernels: GPU tests, then the benchmark against FLA.
#   run(command="source .device/env.sh && bash kernels/sm90/decode_device.sh", carry=[".device"])
# Logs and the benchmark JSON land in $OUT; the tables print last.
set -o pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
start=$(date +%s)
timeout "${TEST_TIMEOUT:-130}" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=25 \
    --durations=8 tests/test_kernel_kda_decode.py tests/test_kernel_lightning_decode.py \
    > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? after $(( $(date +%s) - start )) s"; tail -n 45 "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-80}" python3 -m cula.kernels.sm90.decode_bench --out "$OUT" ${BENCH_ARGS} \
    > "$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - start )) s"; grep -v '^{' "$OUT/bench.log" | tail -n 40
