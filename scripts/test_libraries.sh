#!/usr/bin/env bash
# tests/libraries against the real kernel libraries' Python packages, on CPU: the `all` extra
# (flash-attn-4, quack-kernels, CUTLASS DSL, torchao, triton, NVSHMEM) installed beside torch
# 2.13.0 (CPU build) in .venv-libs, made on the first run and reused afterwards. The tests drive
# prime_ops' CUDA call sites into the libraries' host code with CUDA fake tensors (no launch).
#
#   bash scripts/test_libraries.sh [--fresh] [PYTEST ARGS...]
#
# --fresh                delete and re-create the venv
# PRIME_OPS_LIBS_VENV    use this venv path instead of .venv-libs
# PYTEST ARGS            passed on, after the defaults (-n 2 --dist loadfile tests/libraries)
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=""
if [[ ${1:-} == --fresh ]]; then
    fresh=1
    shift
fi
. scripts/_venv.sh
prime_ops_venv "${PRIME_OPS_LIBS_VENV:-.venv-libs}" 2.13.0 "all,test" $fresh
echo "libraries: python -m pytest -n 2 --dist loadfile tests/libraries $*" >&2
python -m pytest -n 2 --dist loadfile tests/libraries "$@"
