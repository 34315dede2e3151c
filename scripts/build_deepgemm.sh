#!/usr/bin/env bash
# Build DeepGEMM (https://github.com/deepseek-ai/DeepGEMM) on a GPU machine without network access,
# from a source tarball that holds the repository with its third-party/cutlass and third-party/fmt
# headers (what `git clone --recursive` gives):
#   bash scripts/build_deepgemm.sh [.deepgemm/DeepGEMM.tar.xz]     # then: export PYTHONPATH=/tmp/deepgemm/DeepGEMM:$PYTHONPATH
# Builds the C++ extension in place (one translation unit; its kernels compile at run time with the
# machine's nvcc) under /tmp/deepgemm, and prints the version. Its three std::regex uses are replaced by
# plain string scans first (scripts/deepgemm_no_regex.py says why). With network access, DeepGEMM's own
# `./install.sh` in a recursive clone does the same.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
src="$(realpath "${1:-.deepgemm/DeepGEMM.tar.xz}")"
dst=/tmp/deepgemm
rm -rf "$dst" && mkdir -p "$dst"
tar xJf "$src" -C "$dst"
cd "$dst/DeepGEMM"
python3 "$repo/scripts/deepgemm_no_regex.py" .   # std::regex crashed inside _C.so on the H200 image
ln -sfn "$PWD/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
ln -sfn "$PWD/third-party/cutlass/include/cute" deep_gemm/include/cute
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
t0=$(date +%s)
python3 setup.py build_ext --inplace > build.log 2>&1 || { tail -30 build.log; exit 1; }
echo "DeepGEMM built in $(( $(date +%s) - t0 )) s"
PYTHONPATH="$PWD" python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__, deep_gemm.__file__)"
