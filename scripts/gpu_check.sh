#!/usr/bin/env bash
# One call on a lent CUDA machine: the GPU tests (real FA2/FA3/FA4, DeepGEMM, QuACK, DeepEP where
# installed; each skips cleanly where its library is absent) and the attention benchmark's GPU
# path. Runs in the machine's own Python; prints the table last and writes JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/prime-ops-gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m pytest -q -m gpu tests/gpu -rs 2>&1 | tee "$out/gpu_tests.txt" | tail -40
python3 benchmarks/attention.py --json > "$out/attention.json" && python3 benchmarks/attention.py
