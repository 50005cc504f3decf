#!/usr/bin/env bash
# One call on a lent CUDA machine (the device tool's H200: python3 with a CUDA torch, nvcc, no
# network; the project's pins do not apply there). Builds the native ops for CUDA, runs
# tests/gpu/test_ac_cuda.py and the rest of tests/gpu/, the GPU benchmarks (native ops,
# prime_ac, attention) and the eager-overhead benchmark; writes logs and JSON under $OUT and
# prints one short table last. Every step runs under `timeout` within one overall budget, and
# the steps after a failure still run. Without CUDA the GPU steps skip (the script checks itself
# on a CPU machine that way). tests/gpu runs the FA4 and QuACK calls of tests/libraries/cases.py
# with real kernels: the calls tests/libraries compiles on CPU for SM90 and SM100.
# The gpu_tests step also runs tests/gpu/test_ac_pipeline_offload.py: prime-rl's pipeline stage
# offload (side streams, pinned pool, fp8 target) and saved views moved through their storage.
# The ac_compile step also runs tests/gpu/test_ac_compiled.py: compiled blocks whose plan
# offloads (torch's compile-side offload), aot_eager and inductor.
#
#   scripts/gpu_check.sh --prepare     # here, with network: fetch the kernel-library wheels into
#                                      # build/gpu_wheels when they fit the device tool's limit
#   scripts/gpu_check.sh               # there (carry build/gpu_wheels): every step
#   scripts/gpu_check.sh --steps native,ac_tests    # a rerun of some steps, of: env wheels
#       native ac_tests gpu_tests bench_native bench_ac ac_compile bench_attention bench_eager
#
# GPU_CHECK_BUDGET  seconds for all steps (default 450: the issue allows 8 minutes for the call)
# OUT               where logs and JSON go (default /tmp/prime-ops-gpu); at most 7 files land there
set -uo pipefail
cd "$(dirname "$0")/.."

WHEEL_DIR=build/gpu_wheels # ignored by .gitignore (build/); name it in the device call's carry
# flash-attn-4 and quack-kernels, and the packages they need that the device image lacks
WHEELS=(
    flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
)
CARRY_LIMIT=$((64 * 1024 * 1024)) # the device tool's limit on the working tree plus carried paths

prepare() {
    # The device image is Python 3.12 on x86-64; the platform tags are the device tool's own list.
    local tags=() n
    for n in 17 24 27 28 31 34 35; do tags+=(--platform "manylinux_2_${n}_x86_64"); done
    rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR/download"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${tags[@]}" --platform manylinux2014_x86_64 --platform any \
        -d "$WHEEL_DIR/download" "${WHEELS[@]}" || { echo "pip download failed" >&2; return 1; }
    local wheels tree room
    wheels=$(du -cb "$WHEEL_DIR"/download/*.whl | tail -1 | cut -f1)
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null |
        tail -1 | cut -f1)
    room=$((CARRY_LIMIT - tree - 1024 * 1024)) # 1 MiB for files that appear before the call
    (cd "$WHEEL_DIR/download" && ls -l --block-size=K -- *.whl | awk '{print $5, $9}')
    if ((wheels <= room)); then
        mv "$WHEEL_DIR"/download/*.whl "$WHEEL_DIR"/ && rmdir "$WHEEL_DIR/download"
        echo "carry $WHEEL_DIR: $((wheels >> 20)) MiB of wheels fit ($((room >> 20)) MiB free)"
        return 0
    fi
    # nvidia-cutlass-dsl-libs-cu13 (4.8.1: a 92 MB wheel, 63.5 MB even as tar.xz -9e) is the
    # CUTLASS DSL compiler that both libraries need, so no subset of the wheels helps
    local big big_mib
    big=$(cd "$WHEEL_DIR/download" && ls -S -- *.whl | head -1)
    big_mib=$(($(stat -c %s "$WHEEL_DIR/download/$big") >> 20))
    echo "flash-attn-4, quack-kernels not carried: their wheels take $((wheels >> 20)) MiB" \
        "($big_mib MiB in ${big%%-[0-9]*}," \
        "which both need); the device tool carries $((CARRY_LIMIT >> 20)) MiB" >"$WHEEL_DIR/SKIPPED"
    rm -rf "$WHEEL_DIR/download"
    cat "$WHEEL_DIR/SKIPPED"
}

only=""
budget=${GPU_CHECK_BUDGET:-450}
while [[ $# -gt 0 ]]; do
    case $1 in
    --prepare) prepare; exit ;;
    --steps) only=",${2:?--steps needs a list, e.g. --steps native,ac_tests},"; shift 2 ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    -h | --help) sed -n '2,/^[^#]/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

out=${OUT:-/tmp/prime-ops-gpu}
scratch=$(mktemp -d /tmp/gpu_check.XXXXXX) # junit files and step logs, folded into summary.json
mkdir -p "$out"
log=$out/check.log
: >"$log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the native build outside the scratch folder, so a rerun on a warm machine reuses it
export PRIME_OPS_CSRC=$PWD/csrc PRIME_OPS_NATIVE_DIR=${PRIME_OPS_NATIVE_DIR:-/tmp/prime_ops_native}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS for test_ac_cuda's bitwise checks
has_cuda=$(python3 -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
pytest_timeout=()
python3 -c 'import pytest_timeout' 2>/dev/null && pytest_timeout=(--timeout=150)
start=$SECONDS

# step NAME CAP COMMAND: run COMMAND (a bash string) under timeout; its output goes to the log,
# its last lines to stdout; one line per step in steps.tsv for the summary.
step() {
    local name=$1 cap=$2 command=$3 left t0 rc status
    [[ -z $only || $only == *",$name,"* ]] || return 0
    left=$((budget - (SECONDS - start) - 15)) # 15 s kept for the summary
    if ((left < 20)); then
        skip "$name" "budget spent (${budget} s)"
        return 0
    fi
    ((cap > left)) && cap=$left
    printf '\n=== %s (at most %d s)\n' "$name" "$cap" | tee -a "$log"
    t0=$SECONDS
    timeout -k 10 "$cap" bash -c "$command" >"$scratch/$name.log" 2>&1
    rc=$?
    cat "$scratch/$name.log" >>"$log"
    tail -n 6 "$scratch/$name.log"
    case $rc in
    0) status=pass ;;
    124 | 137) status=timeout ;;
    *) status=fail ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" \
        "${note:-}" >>"$scratch/steps.tsv"
    note=""
}

skip() {
    [[ -z $only || $only == *",$1,"* ]] || return 0
    printf '\n=== %s skipped: %s\n' "$1" "$2" | tee -a "$log"
    printf '%s\tskip\t-\t0\t%s\n' "$1" "$2" >>"$scratch/steps.tsv"
}

note=""
step env 30 "nvidia-smi -L; nvcc --version | tail -2; python3 - <<'EOF' >'$scratch/env.json'
import json, platform, torch
info = {'python': platform.python_version(), 'torch': torch.__version__,
        'cuda': torch.version.cuda, 'gpu': None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability='%d.%d' % (p.major, p.minor), sms=p.multi_processor_count,
                memory_GiB=round(p.total_memory / 2**30, 1))
print(json.dumps(info))
EOF
cat '$scratch/env.json'"

if compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    step wheels 60 "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/gpu_site $WHEEL_DIR/*.whl && PYTHONPATH=/tmp/gpu_site:\$PYTHONPATH \
        python3 -c 'import flash_attn.cute, quack; print(\"flash_attn.cute and quack import\")'"
    grep -q "^wheels"$'\t'"pass" "$scratch/steps.tsv" 2>/dev/null &&
        export PYTHONPATH=/tmp/gpu_site:$PYTHONPATH
elif [[ -f $WHEEL_DIR/SKIPPED ]]; then
    skip wheels "$(cat "$WHEEL_DIR/SKIPPED")"
else
    skip wheels "no wheels carried: run scripts/gpu_check.sh --prepare here, carry $WHEEL_DIR"
fi

if [[ $has_cuda == 1 ]]; then
    step native 240 "python3 -m prime_ops.native --cuda"  # errors carry nvcc's output
else
    note="no CUDA: CPU kernels only"
    step native 240 "python3 -m prime_ops.native --no-cuda"
fi
pytest_args="-v -rs -p no:cacheprovider -o junit_family=xunit1 ${pytest_timeout[*]}"
# pytest writes its junit file at the end: of a step killed at its limit the summary reads the
# verbose log instead; the torch.compile tests (slow: inductor compiles cold) have their own step
step ac_tests 150 "python3 -m pytest $pytest_args --junitxml='$scratch/ac_tests.xml' \
    -m 'not slow' tests/gpu/test_ac_cuda.py"
step gpu_tests 150 "python3 -m pytest $pytest_args --junitxml='$scratch/gpu_tests.xml' -m gpu \
    tests/gpu --ignore=tests/gpu/test_ac_cuda.py --ignore=tests/gpu/test_ac_compiled.py"

if [[ $has_cuda == 1 ]]; then
    step bench_native 90 "python3 benchmarks/cuda_native_ops.py --json >'$out/cuda_native_ops.json'"
    step bench_ac 120 "python3 benchmarks/cuda_ac.py --json >'$out/cuda_ac.json'"
else
    skip bench_native "no CUDA device"
    skip bench_ac "no CUDA device"
fi
step ac_compile 150 "python3 -m pytest $pytest_args --junitxml='$scratch/ac_compile.xml' \
    -m slow tests/gpu/test_ac_cuda.py tests/gpu/test_ac_compiled.py"
# attention.py times every installed flash backend on the GPU (and the op's CPU overhead);
# cuda_attention.py the sdpa backend on CUDA, which the image always has
step bench_attention 90 "python3 benchmarks/attention.py --json --iters 20 >'$out/attention.json' \
    && { [[ $has_cuda == 0 ]] || python3 benchmarks/cuda_attention.py --json \
    >'$out/cuda_attention.json'; }"

# eager_overhead.py is being rewritten: ask it what it takes, and record what it did not do
eager_help=$(timeout 60 python3 benchmarks/eager_overhead.py --help 2>&1)
if [[ $? -ne 0 ]]; then
    skip bench_eager "eager_overhead.py --help failed: $(tail -1 <<<"$eager_help")"
else
    eager_args="" eager_file=$out/eager_overhead.txt
    [[ $eager_help == *--quick* ]] && eager_args+=" --quick"
    [[ $eager_help == *--json* ]] && eager_args+=" --json" eager_file=$out/eager_overhead.json
    if [[ $eager_help == *--device* && $has_cuda == 1 ]]; then
        eager_args+=" --device cuda"
    else
        note="on the host CPU: eager_overhead.py takes no --device or there is no CUDA"
    fi
    step bench_eager 90 "python3 benchmarks/eager_overhead.py $eager_args >'$eager_file'"
fi

python3 - "$scratch" "$out" "$budget" "$((SECONDS - start))" <<'EOF'
"""The summary: summary.json under $OUT, and the table printed last."""
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

scratch, out, budget, spent = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def tests(name):
    """Per test: status, first line of its message, recorded properties (from the junit file;
    from the verbose log where pytest was killed before writing it)."""
    xml, log = scratch / f"{name}.xml", scratch / f"{name}.log"
    if not xml.exists():
        found = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", _read(log), re.M)
        return [{"test": t.split("/")[-1], "status": s.lower(), "message": "(from the log)",
                 "props": {}} for t, s in found]
    cases = []
    for case in ET.parse(xml).iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status, message = tag, (node.get("message") or "").splitlines()[0:1]
                message = message[0] if message else ""
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        test = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "")
        cases.append({"test": test, "status": status, "message": message[:160], "props": props})
    return cases


def _read(path):
    return path.read_text(errors="replace") if path.exists() else ""


steps = []
ledger = scratch / "steps.tsv"
for line in ledger.read_text().splitlines() if ledger.exists() else []:
    name, status, rc, seconds, note = (line.split("\t") + [""] * 5)[:5]
    steps.append({"step": name, "status": status, "rc": rc, "s": int(seconds), "note": note})
summary = {
    "env": load(scratch / "env.json"),
    "steps": steps,
    "tests": {
        name: tests(name) for name in ("ac_tests", "ac_compile", "gpu_tests")
    },
    "native_ops": load(out / "cuda_native_ops.json"),
    "ac": load(out / "cuda_ac.json"),
    "attention": load(out / "attention.json"),
    "attention_cuda": load(out / "cuda_attention.json"),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))

env = summary["env"] or {}
print(f"\n##### GPU check: {env.get('gpu')} (sm {env.get('capability')}), torch "
      f"{env.get('torch')}, CUDA {env.get('cuda')}; {spent} s of {budget} s")
for name, cases in summary["tests"].items():
    counts = Counter(c["status"] for c in cases)
    counted = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"{name}: {counted or 'no junit results (not run, or killed: see check.log)'}")
    for c in cases:
        if c["status"] in ("failure", "error", "failed"):
            print(f"  {c['status'].upper():7} {c['test']}: {c['message']}")
        elif name.startswith("ac_") and c["props"]:
            props = "; ".join(f"{k} {v}" for k, v in c["props"].items())
            print(f"  {c['status']:7} {c['test']}: {props}"[:200])
    reasons = Counter(c["message"] for c in cases if c["status"] == "skipped")
    for reason, n in reasons.most_common():
        print(f"  skipped x{n}: {reason}")
native = summary["native_ops"]
if native:
    print("native op (CUDA)                  chain/native  native ms  vs CPU kernel")
    for name, row in native["speed"].items():
        agree = native["vs_cpu"].get(name)
        agree = "" if agree is None else (
            "bitwise" if agree["bitwise"] else f"max err {agree['max_abs_err']:.2g}")
        print(f"  {name:32} {row['ratio']:>10.2f} {row['native_ms']:>10.3f}  {agree}")
for source in (summary["attention"] or {}).get("gpu", {}).get("fwd_bwd", {}).items(), (
    summary["attention_cuda"] or {}
).get("rows", {}).items():
    for name, row in source:
        print(f"attention {name}: op {row['op_ms']:.3f} ms, direct {row['own_ms']:.3f} ms, "
              f"ratio {row['op_over_own']:.3f}")
for row in (summary["ac"] or {}).get("rows", []):
    cells = " ".join(
        f"{v} {row['ms'][v]:.1f}ms/{row['peak_MiB'][v]:.0f}MiB" for v in row["ms"])
    print(f"prime_ac {row['model']} {row['size']}: {cells}")
print(f"{'step':16} {'status':8} {'s':>4}  note")
for s in steps:
    print(f"{s['step']:16} {s['status']:8} {s['s']:>4}  {s['note']}"[:200])
EOF
