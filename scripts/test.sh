#!/usr/bin/env bash
# The README's test command: builds a fresh venv, installs torch (CPU) and the package, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PRIME_OPS_VENV:-.venv-test}
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install --quiet torch==2.13.0
pip install --quiet -e '.[test]'
python -m pytest -q "$@"
