#!/usr/bin/env bash
# tests/integrations against the real trainers, in a virtual environment of their own made on the
# first run (about a minute from the local package index) and reused afterwards:
#
#   bash scripts/test_trainers.sh [--fresh] [PYTEST ARGS...]
#
# .venv-trainers holds torch 2.13.0 (CPU), this project with its test extra (transformers,
# diffusers, accelerate), and torchtitan 0.3.0, peft 0.21.2, TRL 1.16.0 and torch-remat 0.2.2
# (torchtitan main's checkpointing engine; it requires torch only). Those and spmd_types go in
# with --no-deps: torchtitan's own requirements (torchdata, torch_checkpointing,
# wandb, ...) would pull another torch, and none of them is needed to build its models. The
# light dependencies they import are installed with torch pinned, so nothing can move it.
# FastVideo is not installed: it pins torch 2.12 and imports torchvision, whose PyPI build needs
# CUDA libraries (its Wan DiT is tested as diffusers' WanTransformer3DModel instead).
#
# --fresh              delete and re-create the venv
# PRIME_OPS_TRAINERS_VENV  use this venv path instead of .venv-trainers
# PYTEST ARGS          passed on, after the defaults (-n 2 --dist loadfile tests/integrations)
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=""
if [[ ${1:-} == --fresh ]]; then
    fresh=1
    shift
fi
venv=${PRIME_OPS_TRAINERS_VENV:-.venv-trainers}

no_deps=(torchtitan==0.3.0 peft==0.21.2 trl==1.16.0 spmd_types==0.2.3 torch-remat==0.2.2)
light=(tyro==1.0.17 einops==0.8.2 datasets==4.7.0)

. scripts/_venv.sh
prime_ops_venv "$venv" 2.13.0 test $fresh
if ! python - "${no_deps[@]}" "${light[@]}" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if m.version(name) != version:  # raises when not installed
        sys.exit(1)
PY
then
    echo "installing ${no_deps[*]} (--no-deps) and ${light[*]} into $venv" >&2
    pin=$(mktemp)
    echo "torch==2.13.0" >"$pin"
    pip install -qq -c "$pin" --no-deps "${no_deps[@]}"
    pip install -qq -c "$pin" "${light[@]}"
    rm -f "$pin"
fi
echo "trainers: python -m pytest -n 2 --dist loadfile tests/integrations $*" >&2
python -m pytest -n 2 --dist loadfile tests/integrations "$@"
