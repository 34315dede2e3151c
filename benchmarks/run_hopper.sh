#!/usr/bin/env bash
# One device call for the Hopper experts backends (triton, grouped_mm), from the repo root:
#   source .gpu/setup.sh && bash benchmarks/run_hopper.sh
# 1. self-check (GPU, torch, triton)  2. GPU tests  3. expert-stage benchmark.
# Logs and JSON go to $OUT (or ./bench_results). Budget: well under 5 minutes, Triton compiles included.
# Knobs: TEST_TIMEOUT (s, default 270), BENCH_TIMEOUT (s, default 300), BENCH_ARGS (e.g. "--quick
# --backends triton,grouped_mm": the default configurations, the torch peers, the ratios; ~1-2 min).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench_results}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
T0=$(date +%s)

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/selfcheck.log"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"GPU {p.name} sm{p.major}{p.minor} {p.multi_processor_count} SMs {p.total_memory / 2**30:.0f} GiB | "
      f"torch {torch.__version__} (cuda {torch.version.cuda}) | triton {triton.__version__} | "
      f"_grouped_mm {hasattr(torch, '_grouped_mm')}")
PYEOF

echo "== GPU tests ($(( $(date +%s) - T0 )) s)"
timeout "${TEST_TIMEOUT:-270}" "$PY" -m pytest tests/gpu/test_hopper_experts.py -q -s -p no:cacheprovider \
    --junitxml="$OUT/hopper_tests.xml" > "$OUT/hopper_tests.log" 2>&1
TEST_RC=$?
grep -E "rel err|PASS|FAIL|Error|error|passed|failed|skipped" "$OUT/hopper_tests.log" | tail -60
echo "tests rc=$TEST_RC"

echo "== benchmark ($(( $(date +%s) - T0 )) s)"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" "$PY" benchmarks/bench_experts.py ${BENCH_ARGS:-} --json "$OUT/bench_experts.json" > "$OUT/bench.log" 2>&1
BENCH_RC=$?
grep -v -i "warn" "$OUT/bench.log" | tail -60
echo "bench rc=$BENCH_RC; total $(( $(date +%s) - T0 )) s; logs in $OUT"
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
