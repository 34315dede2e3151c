#!/usr/bin/env bash
# Build DeepEP V1 at the pinned commit (docs/deepep.md) for this machine's torch, from source.
#
#   bash scripts/build_deepep.sh prepare GIT_DIR   # any machine: .deepep/DeepEP-<commit>.tar.gz from a DeepEP git clone
#   bash scripts/build_deepep.sh                   # GPU machine: build it, write .deepep/env.sh
#   source .deepep/env.sh                          # puts the build on PYTHONPATH
#
# The build needs the GPU machine's torch with CUDA, nvcc of that CUDA (torch's CUDA_HOME), and the
# NVSHMEM pip wheel (nvidia-nvshmem-cu13 / -cu12), which DeepEP's setup.py finds by itself. With CUDA 13
# the host compiler also needs CUDA's include/cccl (DeepEP issue #568: nvshmem.h includes cuda/std/tuple).
# It builds in $DEEPEP_BUILD_DIR (default /tmp/deepep-build, outside the repository) with
# `setup.py build_ext --inplace`, for TORCH_CUDA_ARCH_LIST (default 9.0), and skips the build when that
# directory already holds one for the same commit, torch and arch. About 80-90 s on 16 cores.
# .deepep/build.started and .deepep/build.done mark a build in progress for scripts/gpu_checks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=567632dd59810d77b3cc05553df953cc0f779799  # the last DeepEP V1 commit of main (docs/deepep.md)
TARBALL=".deepep/DeepEP-$COMMIT.tar.gz"
PY="${PYTHON:-python3}"

if [ "${1:-}" = prepare ]; then
    git_dir="${2:?usage: $0 prepare GIT_DIR (a clone of github.com/deepseek-ai/DeepEP holding $COMMIT)}"
    mkdir -p .deepep
    git -C "$git_dir" cat-file -e "$COMMIT^{commit}" 2>/dev/null \
        || { echo "build_deepep: $git_dir does not hold commit $COMMIT; git fetch it there first" >&2; exit 2; }
    # the sources setup.py builds, without figures and tests
    git -C "$git_dir" archive --format=tar.gz --prefix="DeepEP-$COMMIT/" -o "$PWD/$TARBALL" "$COMMIT" \
        csrc deep_ep setup.py LICENSE README.md pyproject.toml install.sh
    echo "build_deepep: wrote $TARBALL ($(du -h "$TARBALL" | cut -f1)); take .deepep along to the GPU machine"
    exit 0
fi

die() { echo "build_deepep: $*" >&2; exit 2; }
[ -f "$TARBALL" ] || die "$TARBALL is missing; run 'bash $0 prepare GIT_DIR' where a DeepEP clone is, and bring .deepep here"
mkdir -p .deepep
rm -f .deepep/build.done
touch .deepep/build.started
trap 'rm -f .deepep/build.started; touch .deepep/build.done' EXIT

read -r TORCH_VERSION TORCH_CUDA CUDA_HOME_T NINJA < <("$PY" - <<'PY'
import torch
from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available
print(torch.__version__, torch.version.cuda or "none", CUDA_HOME or "none", is_ninja_available())
PY
)
[ "$NINJA" = True ] || echo "build_deepep: ninja is not installed: the sources compile one after another (pip install ninja)" >&2
[ "$TORCH_CUDA" != none ] || die "torch $TORCH_VERSION is a CPU build; DeepEP needs torch with CUDA"
[ "$CUDA_HOME_T" != none ] || die "torch finds no CUDA toolkit (nvcc); set CUDA_HOME to the CUDA $TORCH_CUDA toolkit"
export CUDA_HOME="$CUDA_HOME_T"
"$PY" -c "import nvidia.nvshmem" 2>/dev/null || [ -n "${NVSHMEM_DIR:-}" ] \
    || die "no NVSHMEM: pip install nvidia-nvshmem-cu${TORCH_CUDA%%.*}, or set NVSHMEM_DIR"
for d in "$CUDA_HOME/include/cccl" "$CUDA_HOME/targets/x86_64-linux/include/cccl"; do
    if [ -d "$d" ]; then export CPATH="$d${CPATH:+:$CPATH}"; break; fi
done
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"

BUILD_DIR="${DEEPEP_BUILD_DIR:-/tmp/deepep-build}"
SRC="$BUILD_DIR/DeepEP-$COMMIT"
STAMP="$SRC/.epmoe-built"
WANT="$COMMIT torch=$TORCH_VERSION arch=$TORCH_CUDA_ARCH_LIST"
t0=$(date +%s)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "build_deepep: already built in $SRC ($WANT)"
else
    rm -rf "$SRC"
    mkdir -p "$BUILD_DIR"
    tar -xzf "$TARBALL" -C "$BUILD_DIR"
    echo "build_deepep: building DeepEP ${COMMIT:0:12} for torch $TORCH_VERSION (CUDA $TORCH_CUDA at $CUDA_HOME)," \
         "arch $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs; log $BUILD_DIR/build.log"
    if ! (cd "$SRC" && "$PY" setup.py build_ext --inplace) > "$BUILD_DIR/build.log" 2>&1; then
        grep -E "error|Error" "$BUILD_DIR/build.log" | head -20 >&2
        die "the build failed after $(( $(date +%s) - t0 ))s; the full log is $BUILD_DIR/build.log"
    fi
    echo "$WANT" > "$STAMP"
    echo "build_deepep: built in $(( $(date +%s) - t0 ))s"
fi
echo "export PYTHONPATH=\"$SRC\${PYTHONPATH:+:\$PYTHONPATH}\"" > .deepep/env.sh
PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    "import deep_ep, torch; print('build_deepep: import deep_ep ok:', deep_ep.__file__, '| topk_idx_t', deep_ep.topk_idx_t, '| torch', torch.__version__)" \
    || die "the build finished but 'import deep_ep' fails (above)"
echo "build_deepep: now 'source .deepep/env.sh' (PYTHONPATH gets $SRC)"
