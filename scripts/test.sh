#!/usr/bin/env bash
# The README's test command: the whole test suite on CPU, in a virtual environment made on the
# first run and reused afterwards (tests/gpu/ skips without CUDA).
#
#   bash scripts/test.sh [--torch VERSION] [--fresh] [PYTEST ARGS...]
#
# --torch VERSION  test against another torch release (default 2.13.0, the CPU build); its venv is
#                  .venv-torch-VERSION, made once (other versions are CUDA builds, ~3.5 GB)
# --fresh          delete and re-create the venv
# PRIME_OPS_VENV   use this venv path instead (.venv-test for torch 2.13.0)
# PYTEST ARGS      passed on to pytest after --durations=15. With no test path among them the
#                  whole suite runs on one worker per core (-n auto); with explicit test paths
#                  (tests/test_ac_policy.py, tests/x.py::test_y) they run in this process,
#                  unless the arguments ask for workers themselves (-n N, --numprocesses).
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=2.13.0
fresh=""
while [[ $# -gt 0 ]]; do
    case $1 in
    --torch)
        [[ $# -ge 2 ]] || { echo "scripts/test.sh: --torch needs a version, e.g. --torch 2.9.1" >&2; exit 2; }
        torch_version=$2
        shift 2
        ;;
    --fresh) fresh=1; shift ;;
    *) break ;;
    esac
done
if [[ $torch_version == 2.13.0 ]]; then default_venv=.venv-test; else default_venv=.venv-torch-$torch_version; fi
. scripts/_venv.sh
prime_ops_venv "${PRIME_OPS_VENV:-$default_venv}" "$torch_version" test $fresh
workers=(-n auto)
browser_test=1 # tests/test_ac_report_html.py runs: with no test path, or when named
for arg in "$@"; do
    case $arg in
    tests* | */tests/* | *.py | *::*) [[ $browser_test == 1 ]] && browser_test=0 ;;&
    *test_ac_report_html* | tests | tests/) browser_test=2 ;;&
    -n | -n* | --numprocesses*) workers=() ; break ;;
    tests* | */tests/* | *.py | *::*) workers=() ;;
    esac
done
# That test renders a page in headless Chromium: Debian's is installed once where it is missing
# and apt-get can (as root); where it cannot, the test skips and says why.
if ((browser_test)) && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 &&
    [[ $(id -u) == 0 ]]; then
    echo "scripts/test.sh: installing chromium for tests/test_ac_report_html.py" >&2
    { apt-get install -y -qq --no-install-recommends chromium ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; }; } \
        >/dev/null 2>&1 || echo "scripts/test.sh: chromium could not be installed" >&2
fi
echo "torch $torch_version: python -m pytest ${workers[*]} --durations=15 $*" >&2
python -m pytest "${workers[@]}" --durations=15 "$@"
