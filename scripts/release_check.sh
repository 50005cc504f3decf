#!/usr/bin/env bash
# What a release must pass (CI runs it after the suite):
#
# 1. python -m build (sdist and wheel) and twine check --strict, with the tools in .venv-release;
# 2. the wheel installed into a fresh venv (torch==2.13.0 first, then the wheel with torch
#    pinned), imported from outside the checkout with both __version__ equal to the project's
#    version and no warning, and the README's "prime_ac in one page" example run there; then
#    what a pip user is told to run (scripts/pip_user_check.sh): the README's Quick start
#    commands from outside the checkout, and every python block of the docs alone, there;
# 3. pip resolves the `all` and `conformance` extras, and `all-cu12`, on this CPU machine
#    (--dry-run --report: the kernel wheels are fetched to read their metadata, about 0.6 GB,
#    never installed), and each set holds packages of one CUDA major only (13, resp. 12);
# 4. the sdist's own test suite, run in the unpacked sdist with .venv-test's packages (the sdist's
#    prime_ac and prime_ops shadow the editable install of the checkout).
#
#   bash scripts/release_check.sh [PYTEST ARGS...]   (passed to step 4, e.g. -m "not slow")
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==2.13.0" >"$work/pin.txt"
step() { echo "--- release check: $*" >&2; }

step "1. build and twine check"
if ! .venv-release/bin/python -c "import build, twine" 2>/dev/null; then
    rm -rf .venv-release
    python3 -m venv .venv-release
    .venv-release/bin/pip install -qq build twine
fi
.venv-release/bin/python -m build -o "$work/dist" . >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
.venv-release/bin/twine check --strict "$work"/dist/*
wheel=$(echo "$work"/dist/*.whl)
sdist=$(echo "$work"/dist/*.tar.gz)

step "2. the wheel in a fresh venv, imported from $work"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -qq torch==2.13.0
"$work/venv/bin/pip" install -qq -c "$work/pin.txt" "$wheel"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
cd "$work"
"$work/venv/bin/python" - "$root" "$version" 2>"$work/import.err" <<'PY'
import sys
import prime_ac, prime_ops

root, version = sys.argv[1:]
for package in (prime_ac, prime_ops):
    assert not package.__file__.startswith(root), f"{package.__name__} imported from {root}"
    assert package.__version__ == version, (package.__name__, package.__version__, version)
print(f"prime_ac and prime_ops {version} import from {prime_ac.__file__.rsplit('/', 2)[0]}")
PY
# The README's one-page example, as pasted.
"$work/venv/bin/python" - "$root/README.md" >"$work/example.py" <<'PY'
import re, sys
section = open(sys.argv[1]).read().split("## prime_ac in one page", 1)[1]
print(re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1))
PY
"$work/venv/bin/python" "$work/example.py" 2>>"$work/import.err"
if grep -i warn "$work/import.err"; then
    echo "the installed package warns (above)" >&2
    exit 1
fi
bash "$root/scripts/pip_user_check.sh" "$work/venv/bin/python"

step "3. the extras resolve on this machine, each to one CUDA major"
# A package belongs to a CUDA major by a -cuNN suffix, or, for CUDA's own components (which drop
# the suffix from CUDA 13 on), by its version. The torch here is the CPU wheel; PyPI's torch
# 2.13.0 is CUDA 13 itself (cuda-bindings 13, nvidia-nvshmem-cu13).
cuda_majors() {
    "$work/venv/bin/python" - "$@" <<'PY'
import json, re, sys

report, want = sys.argv[1], int(sys.argv[2])
versioned = re.compile(
    r"cuda-(bindings|toolkit|python)|nvidia-(cuda-[a-z0-9-]+|cublas|cudnn|cufft|cufile|curand"
    r"|cusolver|cusparse|cusparselt|nccl|nvjitlink|nvshmem|nvtx|nvvm|nvfatbin)"
)
majors = {}
for item in json.load(open(report))["install"]:
    name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
    suffix = re.search(r"-cu(\d+)$", name)
    if suffix or versioned.fullmatch(name):
        majors[name] = int(suffix.group(1) if suffix else version.split(".")[0])
# nvidia-cutlass-dsl installs its cu12 libraries in every variant; next to its cu13 ones, its
# loader takes those on any driver that runs CUDA 13 (the drivers torch's CUDA 13 needs).
if want == 13 and "nvidia-cutlass-dsl-libs-cu13" in majors:
    majors.pop("nvidia-cutlass-dsl-libs-cu12", None)
others = {name: major for name, major in majors.items() if major != want}
assert majors and not others, f"CUDA {want} wanted; these are not: {others} (all: {majors})"
print(f"CUDA {want} only: {', '.join(sorted(majors))}")
PY
}
for pair in "all,conformance 13" "all-cu12 12"; do
    read -r extras major <<<"$pair"
    "$work/venv/bin/pip" install -qq --dry-run --report "$work/$extras.json" -c "$work/pin.txt" \
        "$wheel[$extras]"
    cuda_majors "$work/$extras.json" "$major"
done

step "4. the sdist's test suite"
mkdir "$work/sdist"
tar -xzf "$sdist" -C "$work/sdist" --strip-components=1
cd "$root"
# shellcheck disable=SC1091
. scripts/_venv.sh
prime_ops_venv .venv-test 2.13.0 test
cd "$work/sdist"
python -c "import os, prime_ac; assert prime_ac.__file__.startswith(os.getcwd()), prime_ac.__file__"
python -m pytest -p no:cacheprovider -n auto --durations=5 "$@"
