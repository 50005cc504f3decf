#!/usr/bin/env bash
# The README's demo command: one training step per checkpoint mode on the built-in models
# (Llama-sized blocks by default, --tiny for the tiny ones), in a virtual environment made on the
# first run (torch 2.13.0, CPU) and reused afterwards.
#
#   bash scripts/demo.sh [--fresh] [DEMO ARGS...]     (python -m prime_ac demo --help)
#
# PRIME_OPS_VENV overrides the venv path (default .venv-demo); --fresh re-creates it.
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=""
if [[ ${1:-} == --fresh ]]; then fresh=1; shift; fi
. scripts/_venv.sh
prime_ops_venv "${PRIME_OPS_VENV:-.venv-demo}" 2.13.0 "" $fresh
python -m prime_ac demo "$@"
