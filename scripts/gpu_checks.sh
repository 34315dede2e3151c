#!/usr/bin/env bash
# GPU checks and benchmarks in few, bounded steps (on a GPU machine). From the repo root:
#   bash scripts/gpu_checks.sh tests    # every tests/gpu file, each under its own time limit
#   bash scripts/gpu_checks.sh bench    # expert stage, full layer vs baseline, dispatchers
#   bash scripts/gpu_checks.sh deepep|deepep-launch|deepep-faults   # DeepEP with ranks sharing the GPU
#   bash scripts/gpu_checks.sh deepep-all     # deepep (its tests within 330 s of the start), then deepep-launch
#   bash scripts/gpu_checks.sh deepep-rest    # deepgemm fp8 layer checks, killed ranks, bench_dispatch with deepep
#   bash scripts/gpu_checks.sh deepep-fp8-layers  # FP8 + EPLB layer checks of both modes, launcher LL FP8 ep 4
#   bash scripts/gpu_checks.sh deepep-bench   # bench_dispatch: deepep, deepep_ll, flashinfer, torch at ep 2 and 4
#   bash scripts/gpu_checks.sh deepgemm-experts                   # the deepgemm experts: tests, bench, profile
#   bash scripts/gpu_checks.sh training                           # GPU training tests, bench_training
#   bash scripts/gpu_checks.sh nightly-baseline                   # 3 nightly runs (4 ranks on the GPU) -> baseline.json
#       a run takes 4.5-7 min on one H100 (2026-12-07; the first on a fresh machine the longest): NIGHTLY_RUNS=1 per 10-minute call, NIGHTLY_PREV="run1/nightly.json ..."
#       names the runs of earlier calls to include in baseline.json
# Logs go to $OUT (default ./bench_results): tests.log / bench.log plus JSON and a PNG plot; a short
# summary is printed last. FLASHINFER_DISABLE_JIT=1 makes any FlashInfer module that is not prebuilt
# fail at once instead of compiling for minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench_results}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASHINFER_DISABLE_JIT="${FLASHINFER_DISABLE_JIT:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 ))s"; }

run_tests() {
    local log="$OUT/tests.log"
    "$PY" -c "import torch, triton; p = torch.cuda.get_device_properties(0); print(f'{p.name} sm{p.major}{p.minor} | torch {torch.__version__} | triton {triton.__version__} | nccl {torch.cuda.nccl.version()}')" | tee "$log"
    for spec in "test_layer_gpu.py:60" "test_hopper_experts.py:200" "test_flashinfer_quant.py:60" \
                "test_flashinfer_a2a.py:100" "test_flashinfer_cutlass.py:40" "test_deepep.py:540" \
                "test_embed_gpu.py:90" "test_triton_codec.py:60" "test_deepgemm.py:300"; do
        local f="${spec%%:*}" limit="${spec##*:}"
        if [ "$f" = test_deepep.py ] && [ -e .deepep/build.started ]; then  # a DeepEP build runs beside us
            for _ in $(seq 1 240); do [ -e .deepep/build.done ] && break; sleep 1; done
            echo "== DeepEP build finished: $([ -e .deepep/build.done ] && echo yes || echo no) at $(el)" | tee -a "$log"
        fi
        echo "== $f (limit ${limit}s, at $(el))" | tee -a "$log"
        timeout "$limit" "$PY" -m pytest "tests/gpu/$f" -q -s -rs -p no:cacheprovider >> "$log" 2>&1
        echo "== $f rc=$? at $(el)" | tee -a "$log"
        tail -n 3 "$log" | grep -E "passed|failed|error|skipped" || true
    done
}

run_bench() {
    local log="$OUT/bench.log"
    echo "== bench_experts at $(el)" | tee "$log"
    timeout 240 "$PY" benchmarks/bench_experts.py --json "$OUT/bench_experts.json" >> "$log" 2>&1
    echo "== bench_experts rc=$? at $(el)" | tee -a "$log"
    echo "== bench_layer at $(el)" | tee -a "$log"
    timeout 200 "$PY" benchmarks/bench_layer.py --json "$OUT/bench_layer.json" --plot "$OUT/layer.png" >> "$log" 2>&1
    echo "== bench_layer rc=$? at $(el)" | tee -a "$log"
    echo "== bench_dispatch at $(el)" | tee -a "$log"
    timeout 90 "$PY" benchmarks/bench_dispatch.py --dispatchers flashinfer,torch --iters 20 --json "$OUT/bench_dispatch.json" >> "$log" 2>&1
    echo "== bench_dispatch rc=$? at $(el)" | tee -a "$log"
    if "$PY" -c "import deep_ep" 2>/dev/null; then
        timeout 70 "$PY" benchmarks/bench_deepep.py --json "$OUT/bench_deepep.json" >> "$log" 2>&1
        echo "== bench_deepep rc=$? at $(el)" | tee -a "$log"
    fi
    grep -E "^\[bench|TFLOP|best|us|GB/s|rc=" "$log" | grep -v -i warn | tail -60
}

# FlashInfer's CUTLASS fused MoE, one SM90 mode per process first (a launcher missing from the module
# ends the process with "symbol lookup error"), then the 4-rank and checkpoint tests of the modes that
# passed, then the quick benchmark of each passing mode (own process, own JSON).
run_cutlass() {
    local log="$OUT/cutlass.log" ok=()
    : > "$log"
    for mode in bf16 fp8_block mxfp4_w4a16 mxfp4_w4a8; do
        timeout 100 "$PY" -m pytest tests/gpu/test_flashinfer_cutlass.py -q -s -rs -p no:cacheprovider \
            -k "$mode and not four_ranks" >> "$log" 2>&1
        local rc=$?
        echo "== cutlass $mode: rc=$rc at $(el)" | tee -a "$log"
        [ $rc = 0 ] && ok+=("$mode")
    done
    echo "== cutlass modes passing alone: ${ok[*]:-none}" | tee -a "$log"
    [ ${#ok[@]} = 4 ] && { timeout 200 "$PY" -m pytest tests/gpu/test_flashinfer_cutlass.py -q -s -rs \
        -p no:cacheprovider -k four_ranks >> "$log" 2>&1; echo "== cutlass four ranks: rc=$? at $(el)" | tee -a "$log"; }
    timeout 100 "$PY" -m pytest tests/gpu/test_checkpoint_formats_gpu.py -q -s -rs -p no:cacheprovider \
        -k flashinfer_cutlass >> "$log" 2>&1
    echo "== cutlass checkpoints: rc=$? at $(el)" | tee -a "$log"
    for mode in "${ok[@]}"; do  # the launcher's own check, 1 rank and 4 ranks sharing the GPU
        timeout 60 torchrun --nproc-per-node 1 -m epmoe.launch --preset tiny --device cuda \
            --experts flashinfer_cutlass --quant "$mode" --steps 3 --check >> "$log" 2>&1
        echo "== cutlass launch $mode ep=1: rc=$? at $(el)" | tee -a "$log"
        timeout 90 torchrun --nproc-per-node 4 -m epmoe.launch --preset tiny --device cuda --ranks-per-gpu 4 \
            --dispatcher flashinfer --experts flashinfer_cutlass --quant "$mode" --steps 3 --check >> "$log" 2>&1
        echo "== cutlass launch $mode ep=4 sharing the GPU: rc=$? at $(el)" | tee -a "$log"
    done
    "$PY" -m epmoe.launch --preset dsv3 --device cuda --experts flashinfer_cutlass --quant fp8_block --ep 8 --plan \
        >> "$log" 2>&1
    [ "${CUTLASS_BENCH:-1}" = 1 ] && for mode in "${ok[@]}"; do
        timeout 90 "$PY" benchmarks/bench_experts.py --backends flashinfer_cutlass --modes "$mode" --no-peers \
            ${CUTLASS_BENCH_ARGS:---quick} --json "$OUT/bench_cutlass_$mode.json" >> "$log" 2>&1
        echo "== cutlass bench $mode: rc=$? at $(el)" | tee -a "$log"
    done
    grep -E "^\[flashinfer-cutlass\]|^==|passed|failed|Error|error:" "$log" | grep -v -i warn | tail -60
}

# DeepGEMM (a peer of the expert stage): build it from .deepgemm/ (scripts/build_deepgemm.sh), the
# smallest call of each kernel, then its figures on the benchmark shape in a child process.
run_deepgemm() {
    local log="$OUT/deepgemm.log"
    bash scripts/build_deepgemm.sh > "$log" 2>&1 || { tail -20 "$log"; return 1; }
    export PYTHONPATH="/tmp/deepgemm/DeepGEMM:$PYTHONPATH"
    timeout 120 "$PY" -X faulthandler benchmarks/deepgemm_peer.py --smoke >> "$log" 2>&1
    echo "== deepgemm smoke: rc=$? at $(el)" | tee -a "$log"
    timeout 200 "$PY" -X faulthandler benchmarks/deepgemm_peer.py --json "$OUT/deepgemm_peer.json" >> "$log" 2>&1
    echo "== deepgemm peer: rc=$? at $(el)" | tee -a "$log"
    grep -E "^==|smoke|peer |deepgemm|Error|error|Fatal|line [0-9]+ in" "$log" | tail -40
}

# DeepEP on one GPU with ranks sharing it (docs/deepep.md, docs/shared-gpu.md). Builds DeepEP V1 from
# .deepep/ (scripts/build_deepep.sh; cached in /tmp while the machine stays up) and, when .whl/ holds
# the sgl-deep-gemm wheel, installs it to /tmp/site (the deepgemm experts). Three parts, each within
# one 10-minute device call:
#   deepep          the dispatcher and layer checks of tests/gpu/test_deepep.py (ep = 1, 2, 4)
#   deepep-launch   the launcher with --check: normal and low latency, bf16 and an FP8 checkpoint,
#                   ep = 2 and 4, real experts behind them, EPLB under skewed routing; training through
#                   deepep (tests/gpu/test_training_gpu.py -k deepep); bench_deepep
#   deepep-faults   a rank killed inside DeepEP's dispatch (the watchdog's DeepEP path)
install_deepgemm_wheel() {  # sgl-deep-gemm from .whl/ into /tmp/site, put on PYTHONPATH; 1 when absent
    compgen -G ".whl/sgl_deep_gemm-*.whl" > /dev/null || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sgl_deep_gemm-*.whl || return 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH" DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/dgcache}"
}

deepep_setup() {  # once per call (the parts of deepep-all / deepep-rest share it)
    [ -n "${DEEPEP_READY:-}" ] && return 0
    bash scripts/build_deepep.sh > "$OUT/deepep_build.log" 2>&1 || { tail -20 "$OUT/deepep_build.log"; return 1; }
    tail -2 "$OUT/deepep_build.log"
    # shellcheck disable=SC1091
    source .deepep/env.sh
    install_deepgemm_wheel || echo "no sgl-deep-gemm wheel in .whl/: the deepgemm checks will be skipped"
    "$PY" -c "import deep_ep, torch; print('deep_ep', deep_ep.__file__, '| torch', torch.__version__)"
    "$PY" -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
    DEEPEP_READY=1
}

run_deepep() {
    local log="$OUT/deepep.log"
    deepep_setup || return 1
    timeout 120 "$PY" -m epmoe.launch --doctor --device cuda --dispatcher deepep_ll --experts deepgemm --quant fp8_block \
        > "$OUT/doctor.log" 2>&1
    echo "== doctor rc=$? (exit 3: the configuration cannot run here)" | tee -a "$OUT/doctor.log"
    grep -i -E "deep_?ep|deep_?gemm|verdict" "$OUT/doctor.log" | head -12
    # DEEPEP_K picks a subset (pytest -k), e.g. "ll_one_rank or ep2" and then "ep4" in two calls
    # the tests get what is left of one 10-minute call after the build (DEEPEP_BUDGET_S in all)
    local left=$(( ${DEEPEP_BUDGET_S:-590} - $(date +%s) + T0 ))
    echo "== test_deepep -k '${DEEPEP_K:-not rank_killed}' within ${left}s at $(el)"
    timeout "$left" "$PY" -m pytest tests/gpu/test_deepep.py -q -s -rs -p no:cacheprovider -k "${DEEPEP_K:-not rank_killed}" \
        > "$log" 2>&1
    echo "== test_deepep rc=$? at $(el)" | tee -a "$log"
    grep -E "^\[deepep|^SKIPPED|passed|failed|Error" "$log" | grep -v " ok " | tail -40
    grep -cE " ok " "$log" | sed 's/^/checks passed (all ranks): /'
}

run_deepep_launch() {
    local log="$OUT/deepep_launch.log" base=(--preset qwen3-moe --scale 0.125 --layers 2 --device cuda --steps 3
                                            --tokens 64 --tokens-jitter 1.0 --check)
    : > "$log"
    deepep_setup || return 1
    # training through DeepEP's normal kernels (dispatch backward = combine, combine backward = cached dispatch)
    timeout 200 "$PY" -m pytest tests/gpu/test_training_gpu.py -q -s -rs -p no:cacheprovider -k deepep \
        > "$OUT/deepep_training.log" 2>&1
    echo "== training through deepep rc=$? at $(el)" | tee -a "$OUT/deepep_training.log"
    grep -E "deepep/|passed|failed|Error" "$OUT/deepep_training.log" | tail -12
    launch() {  # name, nproc, flags...
        local name="$1" n="$2"; shift 2
        echo "== launch $name: $*" >> "$log"
        timeout 200 torchrun --nproc-per-node "$n" -m epmoe.launch "${base[@]}" --ranks-per-gpu "$n" "$@" >> "$log" 2>&1
        echo "== launch $name: rc=$? at $(el)" | tee -a "$log"
    }
    launch "normal bf16 triton ep=4" 4 --dispatcher deepep --experts triton
    launch "normal fp8 deepgemm ep=4" 4 --dispatcher deepep --experts deepgemm --checkpoint-format fp8
    launch "normal fp8 triton ep=2" 2 --dispatcher deepep --experts triton --checkpoint-format fp8
    launch "ll bf16 deepgemm ep=4" 4 --dispatcher deepep_ll --experts deepgemm
    launch "ll fp8 deepgemm ep=4" 4 --dispatcher deepep_ll --experts deepgemm --checkpoint-format fp8
    launch "ll fp8 deepgemm ep=2" 2 --dispatcher deepep_ll --experts deepgemm --checkpoint-format fp8
    launch "normal eplb skewed ep=4" 4 --dispatcher deepep --experts triton --redundant-experts 4 \
        --rebalance-every 2 --routing skewed --steps 6
    grep -E "^== |check \||rank load|eplb:|quant plan|Error|error:" "$log" | tail -60
    timeout 150 "$PY" benchmarks/bench_deepep.py --ranks 4 --json "$OUT/bench_deepep_ep4.json" > "$OUT/bench_deepep.log" 2>&1
    echo "== bench_deepep ep=4 (sharing the GPU) rc=$? at $(el)" | tee -a "$OUT/bench_deepep.log"
    timeout 120 "$PY" benchmarks/bench_deepep.py --ranks 2 --json "$OUT/bench_deepep_ep2.json" >> "$OUT/bench_deepep.log" 2>&1
    echo "== bench_deepep ep=2 (sharing the GPU) rc=$? at $(el)" | tee -a "$OUT/bench_deepep.log"
    # DeepEP beside the flashinfer and torch dispatchers in the same run (bf16; low latency at decode only)
    timeout 120 torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --ranks-per-gpu 4 --formats bf16 --tokens 128 \
        --dispatchers deepep,deepep_ll,flashinfer,torch --json "$OUT/bench_dispatch_ep4_t128.json" >> "$OUT/bench_deepep.log" 2>&1
    echo "== bench_dispatch ep=4 T=128 (sharing the GPU) rc=$? at $(el)" | tee -a "$OUT/bench_deepep.log"
    timeout 120 torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --ranks-per-gpu 4 --formats bf16 --tokens 4096 \
        --dispatchers deepep,flashinfer,torch --json "$OUT/bench_dispatch_ep4_t4096.json" >> "$OUT/bench_deepep.log" 2>&1
    echo "== bench_dispatch ep=4 T=4096 (sharing the GPU) rc=$? at $(el)" | tee -a "$OUT/bench_deepep.log"
    grep -E "deepep|rc=" "$OUT/bench_deepep.log" | tail -12
}

run_deepep_faults() {
    local log="$OUT/deepep_faults.log"
    deepep_setup || return 1
    timeout "${DEEPEP_FAULTS_S:-500}" "$PY" -m pytest tests/gpu/test_deepep.py -q -s -rs -p no:cacheprovider -k rank_killed \
        > "$log" 2>&1
    echo "== rank_killed rc=$? at $(el)" | tee -a "$log"
    # a hung rank's stacks (dumped before the harness kills it) show as File "..." lines
    grep -E "shared-gpu fault|deepep fault|rank [0-9]:|passed|failed|Error|File \"|Thread|watchdog|fault report" "$log" | head -40
    grep -E "^\[native stacks|^Thread |^#[0-9]+ |^  [0-9]+ '" "$log" | cut -c1-150 | head -60
}

# What is left of the DeepEP work, in one call, most important first, each step within what is left of
# DEEPEP_BUDGET_S: a rank killed inside each DeepEP dispatch (the watchdog thread or its backstop must
# end the survivor with one report), the FP8 deepgemm layer checks, the deepgemm fp8 stage diagnostic,
# then DeepEP beside the flashinfer and torch dispatchers in one run.
run_deepep_rest() {
    local log="$OUT/deepep_rest.log"
    left() { echo $(( ${DEEPEP_BUDGET_S:-570} - $(date +%s) + T0 )); }
    : > "$log"
    deepep_setup || return 1
    DEEPEP_FAULTS_S=200 run_deepep_faults
    timeout "$(( $(left) > 260 ? 240 : $(left) - 20 ))" "$PY" -m pytest tests/gpu/test_deepep.py -q -s -rs \
        -p no:cacheprovider -k "fp8_deepgemm" >> "$log" 2>&1
    echo "== layer_fp8_deepgemm rc=$? at $(el)" | tee -a "$log"
    grep -E "layer_fp8_deepgemm: (ok|FAILED)|passed|failed" "$log" | sed 's/\[[0-9.]*s\]$//' | sort | uniq | tail -12
    [ "$(left)" -gt 60 ] || return 0
    timeout "$(( $(left) - 10 ))" "$PY" tests/gpu/deepgemm_fp8_diag.py > "$OUT/deepgemm_fp8_diag.log" 2>&1
    echo "== deepgemm_fp8_diag rc=$? at $(el)" | tee -a "$OUT/deepgemm_fp8_diag.log"
    grep -vi warn "$OUT/deepgemm_fp8_diag.log" | tail -40
    [ "$(left)" -gt 80 ] || return 0
    timeout "$(( $(left) - 5 ))" torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --ranks-per-gpu 4 --formats bf16 \
        --tokens 128,4096 --dispatchers deepep,flashinfer,torch --json "$OUT/bench_dispatch_ep4.json" > "$OUT/bench_dispatch.log" 2>&1
    echo "== bench_dispatch ep=4 (sharing the GPU) rc=$? at $(el)" | tee -a "$OUT/bench_dispatch.log"
    grep -E "^\[bench|deepep|flashinfer|torch" "$OUT/bench_dispatch.log" | tail -12
}

# The deepgemm masked layout (M = 128 and an unaligned M = 100), the fp8 experts' accuracy stage by
# stage (flat and masked layouts), then the low-latency layer checks (deepgemm fp8 behind DeepEP's
# masked layout) at ep 2 and 4.
run_deepep_ll_fp8() {
    local log="$OUT/deepep_ll_fp8.log"
    deepep_setup || return 1
    timeout 200 "$PY" -m pytest tests/gpu/test_deepgemm.py -q -s -rs -p no:cacheprovider -k masked \
        > "$OUT/test_deepgemm_masked.log" 2>&1
    echo "== test_deepgemm -k masked rc=$? at $(el)" | tee -a "$OUT/test_deepgemm_masked.log"
    grep -E "masked M=|passed|failed" "$OUT/test_deepgemm_masked.log" | cut -c1-160
    timeout 150 "$PY" tests/gpu/deepgemm_fp8_diag.py > "$OUT/deepgemm_fp8_diag.log" 2>&1
    echo "== deepgemm_fp8_diag rc=$? at $(el)" | tee -a "$OUT/deepgemm_fp8_diag.log"
    grep -vi warn "$OUT/deepgemm_fp8_diag.log" | tail -60
    timeout 300 "$PY" -m pytest tests/gpu/test_deepep.py -q -s -rs -p no:cacheprovider \
        -k "low_latency and (layer_fp8_deepgemm or layer_eplb or layer_fp8)" > "$log" 2>&1
    echo "== low-latency fp8 layers rc=$? at $(el)" | tee -a "$log"
    grep -E "layer_(fp8|eplb)[a-z_]*: (ok|FAILED)|passed|failed" "$log" | sed 's/\[[0-9.]*s\]$//' | tail -24
}

# The FP8 and EPLB layer checks of both modes at ep 2 and 4 (every experts backend), then the launcher's
# low-latency FP8 check at ep 4 (deepgemm masked experts, an FP8 checkpoint).
run_deepep_fp8_layers() {
    local log="$OUT/deepep_fp8_layers.log"
    deepep_setup || return 1
    timeout 300 "$PY" -m pytest tests/gpu/test_deepep.py -q -s -rs -p no:cacheprovider \
        -k "layer_fp8 or layer_eplb" > "$log" 2>&1
    echo "== fp8 / eplb layers rc=$? at $(el)" | tee -a "$log"
    grep -E "layer_(fp8|eplb)[a-z_]*: (ok|FAILED)|passed|failed" "$log" | sed 's/\[[0-9.]*s\]$//' | tail -40
    timeout 200 torchrun --nproc-per-node 4 -m epmoe.launch --preset qwen3-moe --scale 0.125 --layers 2 \
        --device cuda --steps 3 --tokens 64 --tokens-jitter 1.0 --check --ranks-per-gpu 4 \
        --dispatcher deepep_ll --experts deepgemm --checkpoint-format fp8 > "$OUT/deepep_ll_launch.log" 2>&1
    echo "== launch ll fp8 deepgemm ep=4 rc=$? at $(el)" | tee -a "$OUT/deepep_ll_launch.log"
    grep -E "check \||quant plan|Error|error:" "$OUT/deepep_ll_launch.log" | tail -8
}

# DeepEP's two modes beside the flashinfer and torch dispatchers in one run, ep 2 then ep 4, ranks sharing
# the GPU (bf16; low latency at T = 128 only: its buffer at T = 4096 is 61 GB per rank). Each step writes
# its JSON as it ends, so a call cut short still returns what ran.
run_deepep_bench() {
    local log="$OUT/bench_dispatch_deepep.log"
    : > "$log"
    deepep_setup || return 1
    for ep in 2 4; do
        timeout 120 torchrun --nproc-per-node "$ep" benchmarks/bench_dispatch.py --ranks-per-gpu "$ep" --formats bf16 \
            --tokens 128 --dispatchers deepep,deepep_ll,flashinfer,torch --json "$OUT/bench_dispatch_ep${ep}_t128.json" >> "$log" 2>&1
        echo "== bench_dispatch ep=$ep T=128 rc=$? at $(el)" | tee -a "$log"
        timeout 120 torchrun --nproc-per-node "$ep" benchmarks/bench_dispatch.py --ranks-per-gpu "$ep" --formats bf16 \
            --tokens 4096 --dispatchers deepep,flashinfer,torch --json "$OUT/bench_dispatch_ep${ep}_t4096.json" >> "$log" 2>&1
        echo "== bench_dispatch ep=$ep T=4096 rc=$? at $(el)" | tee -a "$log"
    done
    grep -E "^\[bench\] (deepep|flashinfer|torch)|rc=" "$log" | tail -24
}

# The nightly baseline of this GPU with 4 ranks sharing it (docs/nightly.md): NIGHTLY_RUNS runs (default
# 3) of the suite with DeepGEMM installed (its bench/experts rows), each under its own limit, then
# `--baseline-from` over the passing runs plus any earlier ones named in NIGHTLY_PREV (nightly.json
# paths), written to $OUT/baseline.json (copy it to benchmarks/baselines/<machine kind>.json).
run_nightly_baseline() {
    install_deepgemm_wheel || echo "no sgl-deep-gemm wheel in .whl/: the deepgemm steps will be skipped"
    local runs=() i rc
    read -r -a runs <<< "${NIGHTLY_PREV:-}"
    for i in $(seq 1 "${NIGHTLY_RUNS:-3}"); do
        timeout "${NIGHTLY_RUN_S:-540}" "$PY" -m epmoe.nightly --gpus 1 --ranks-per-gpu 4 --jobs 4 --max-minutes "${NIGHTLY_MAX_MINUTES:-8.5}" \
            --modes bf16,fp8_block,nvfp4_w4a16,mxfp4_w4a16,bf16+nvfp4 --out "$OUT/nightly_$i" > "$OUT/nightly_$i.log" 2>&1
        rc=$?
        echo "== nightly run $i rc=$rc at $(el)"
        grep -E "NIGHTLY|gate:|FAIL" "$OUT/nightly_$i.log" | tail -4
        [ "$rc" = 0 ] && runs+=("$OUT/nightly_$i/nightly.json")
    done
    [ "${#runs[@]}" -gt 0 ] || { echo "no passing run: no baseline written"; return 1; }
    "$PY" -m epmoe.nightly --baseline-from "${runs[@]}" --baseline "$OUT/baseline.json" 2>&1 | tail -5
}

# The deepgemm experts after a change (sgl-deep-gemm from .whl/): their GPU tests, then the expert stage
# beside triton, torch's grouped GEMMs, FlashInfer's CUTLASS (when its module is prebuilt) and DeepGEMM's
# bare GEMMs in one run, then one profiled prefill forward, then the row count's read before the gather
# against overlapping it, at 1024 and 4096 tokens.
run_deepgemm_experts() {
    local log="$OUT/deepgemm_experts.log"
    install_deepgemm_wheel || { echo "no .whl/sgl_deep_gemm-*.whl: pip download it first (docs/deepgemm.md)"; return 1; }
    timeout 300 "$PY" -m pytest tests/gpu/test_deepgemm.py -q -s -rs -p no:cacheprovider > "$log" 2>&1
    echo "== test_deepgemm rc=$? at $(el)" | tee -a "$log"
    tail -n 3 "$log" | grep -E "passed|failed|error" || true
    if [ "${DEEPGEMM_BENCH:-1}" = 1 ]; then  # DEEPGEMM_BENCH=0: tests and profiles only
        timeout 270 "$PY" benchmarks/bench_experts.py --quick --backends deepgemm,triton,grouped_mm,flashinfer_cutlass \
            --modes fp8_block,bf16 --expected-m 16,32 --json "$OUT/bench_experts.json" > "$OUT/bench_experts.log" 2>&1
        echo "== bench_experts rc=$? at $(el)" | tee -a "$OUT/bench_experts.log"
        grep -E "deepgemm|triton|cutlass|peer|<=|rc=" "$OUT/bench_experts.log" | tail -40
    fi
    timeout 100 "$PY" benchmarks/profile_experts.py --backend deepgemm --mode fp8_block > "$OUT/profile.log" 2>&1
    echo "== profile rc=$? at $(el)" | tee -a "$OUT/profile.log"
    grep -E "kernels per forward|GPU idle|^  +[0-9]|^forward|^host time" "$OUT/profile.log" | head -n 40
    local T f
    for T in 1024 4096; do  # the row count's read before the gather or overlapping it (the backend picks by size)
        for f in sync overlap; do
            timeout 45 "$PY" benchmarks/profile_experts.py --tokens "$T" --rows-read "$f" > "$OUT/profile_T${T}_$f.log" 2>&1
            echo "== profile T=$T --rows-read $f rc=$? at $(el)"
            grep -E "^forward do_bench|GPU idle" "$OUT/profile_T${T}_$f.log"
        done
    done
}

# Training: the GPU training tests (bf16 against float64, the fused grouped_mm stage) and the experts
# stage's forward + backward at the DeepSeek-V3 shape beside torch's grouped GEMMs (bench_training.py).
run_training() {
    local log="$OUT/training.log"
    timeout 300 "$PY" -m pytest tests/gpu/test_training_gpu.py -q -s -rs -p no:cacheprovider -k "not deepep" > "$log" 2>&1
    echo "== test_training_gpu rc=$? at $(el)" | tee -a "$log"
    grep -E "passed|failed|Error" "$log" | tail -5
    timeout 200 "$PY" benchmarks/bench_training.py --json "$OUT/bench_training.json" > "$OUT/bench_training.log" 2>&1
    echo "== bench_training rc=$? at $(el)" | tee -a "$OUT/bench_training.log"
    grep -E "forward|ratio|rc=" "$OUT/bench_training.log" | grep -v '"' | tail -8
}

case "${1:-tests}" in
    tests) run_tests ;;
    bench) run_bench ;;
    cutlass) run_cutlass ;;
    deepgemm) run_deepgemm ;;
    deepep) run_deepep ;;
    deepep-launch) run_deepep_launch ;;
    deepep-all) DEEPEP_BUDGET_S="${DEEPEP_BUDGET_S:-330}" run_deepep; run_deepep_launch ;;  # one call, in this order
    deepep-faults) run_deepep_faults ;;
    deepep-rest) run_deepep_rest ;;
    deepep-ll-fp8) run_deepep_ll_fp8 ;;
    deepep-fp8-layers) run_deepep_fp8_layers ;;
    deepep-bench) run_deepep_bench ;;
    nightly-baseline) run_nightly_baseline ;;
    deepgemm-experts) run_deepgemm_experts ;;
    training) run_training ;;
    all) run_tests; run_bench ;;
    *) echo "usage: $0 tests|bench|cutlass|deepgemm|deepep|deepep-launch|deepep-faults|deepep-rest|deepep-ll-fp8|deepep-fp8-layers|deepep-bench|nightly-baseline|deepgemm-experts|training|all" >&2; exit 2 ;;
esac
echo "done at $(el); logs in $OUT"
