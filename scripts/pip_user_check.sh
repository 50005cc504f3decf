#!/usr/bin/env bash
# What a pip user is told to do, done with the installed wheel (scripts/release_check.sh runs it):
#
#   bash scripts/pip_user_check.sh PYTHON
#
# PYTHON is the interpreter of a fresh venv holding torch and the built wheel, nothing else.
# 1. Every command of the README's "Quick start with pip" block, as written, from a directory
#    outside the checkout: `pip install torch==...` and `pip install prime-ops` are checked to be
#    satisfied by what the venv holds (the wheel stands in for the package index); every
#    `python ...` command runs with PYTHON and must exit 0 without a warning on stderr.
# 2. Every python block of README.md and docs/*.md, each alone (or with the block it says it
#    continues) in a fresh PYTHON process: tests/test_docs.py with PRIME_OPS_DOCS_PYTHON=PYTHON,
#    run by the checkout's test venv (pytest lives there, not in the user's venv). The blocks on
#    Hugging Face models need transformers and diffusers, as a reader of those pages has them:
#    the wheel's own `conformance` requirements are installed first (torch pinned).
set -euo pipefail
python=${1:?usage: bash scripts/pip_user_check.sh PYTHON}
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

commands=$("$python" - "$root/README.md" <<'PY'
import re, sys
section = open(sys.argv[1]).read().split("## Quick start with pip", 1)[1]
block = re.search(r"^```bash\n(.*?)^```", section, re.M | re.S).group(1)
for line in block.splitlines():
    command = line.split("#", 1)[0].strip()
    if command:
        print(command)
PY
)
[[ -n $commands ]] || { echo "README.md: no commands in the Quick start block" >&2; exit 1; }
while IFS= read -r command; do
    echo "--- pip user: $command" >&2
    read -ra argv <<<"$command"
    case ${argv[0]} in
    pip)
        # Already done by the caller; check that the venv satisfies it as written.
        [[ ${argv[1]} == install ]] || { echo "unexpected pip command: $command" >&2; exit 1; }
        for requirement in "${argv[@]:2}"; do
            "$python" - "$requirement" <<'PY'
import importlib.metadata as m, re, sys
name, _, version = re.sub(r"\[.*\]", "", sys.argv[1]).partition("==")
have = m.version(name)
assert not version or have.split("+")[0] == version, f"{name} {have} installed, {version} asked"
print(f"satisfied: {sys.argv[1]} ({name} {have})", file=sys.stderr)
PY
        done
        ;;
    python)
        (cd "$work" && OMP_NUM_THREADS=1 "$python" "${argv[@]:1}" >"$work/out" 2>"$work/err") ||
            { cat "$work/err" >&2; echo "failed: $command" >&2; exit 1; }
        if grep -i warn "$work/err"; then
            echo "$command warned (above)" >&2
            exit 1
        fi
        tail -n 3 "$work/out" >&2
        ;;
    *)
        echo "README.md Quick start: $command is neither pip nor python; check it here" >&2
        exit 1
        ;;
    esac
done <<<"$commands"

echo "--- pip user: every python block of the docs, alone, with the installed package" >&2
mapfile -t conformance < <("$python" - <<'PY'
import importlib.metadata as m
for requirement in m.requires("prime-ops") or []:
    if 'extra == "conformance"' in requirement:
        print(requirement.split(";")[0].strip())
PY
)
torch_version=$("$python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
echo "torch==$torch_version" >"$work/pin.txt"
"$python" -m pip install -q -c "$work/pin.txt" "${conformance[@]}"
# shellcheck disable=SC1091
. scripts/_venv.sh
prime_ops_venv "${PRIME_OPS_VENV:-.venv-test}" 2.13.0 test
PRIME_OPS_DOCS_PYTHON=$python python -m pytest -p no:cacheprovider -n auto -q \
    tests/test_docs.py -k run_as_pasted
