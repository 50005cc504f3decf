# Sourced by scripts/test.sh and scripts/demo.sh: make or reuse a virtual environment.
#
#   prime_ops_venv DIR TORCH_VERSION EXTRAS [--fresh]
#
# A venv at DIR is reused when it runs and holds torch==TORCH_VERSION; then torch is never touched,
# this project is re-installed (pip install --no-deps -e ., 5-15 s) only when pyproject.toml
# changed or the editable install points elsewhere, and any requirement of the project or of
# EXTRAS that the venv lacks is installed. Otherwise DIR is created (or re-created) and torch is
# installed first: the CPU build for 2.13.0, a CUDA build of several GB for other versions on
# this package index. EXTRAS (e.g. "test", or "" for none) are installed with torch pinned, so
# no dependency can upgrade or downgrade it. Leaves DIR activated.
#
# Every set-up step says what it does before it starts and how long it took when it ends, with
# pip's own output (what it collects, downloads and installs) on stderr as it goes, and a copy in
# a log; a step that fails names itself and that log.

# prime_ops_step LOG WHAT COMMAND...: run one set-up step as described above.
prime_ops_step() {
    local log=$1 what=$2 start=$SECONDS rc=0
    shift 2
    echo "setup: $what ..." >&2
    "$@" 2>&1 | tee -a "$log" >&2 || rc=$?
    if ((rc != 0)); then
        echo "setup: FAILED after $((SECONDS - start)) s: $what (exit $rc); its output is in $log" >&2
        return "$rc"
    fi
    echo "setup: done in $((SECONDS - start)) s: $what" >&2
}

prime_ops_venv() {
    local venv=$1 torch_version=$2 extras=$3 fresh=${4:-}
    local py="$venv/bin/python" have=""
    if [[ -z "$fresh" && -x "$py" ]]; then
        # Read the installed version from metadata: importing torch costs seconds.
        have=$("$py" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' \
            2>/dev/null || true)
    fi
    local pin log
    pin=$(mktemp)
    log=$(mktemp "${TMPDIR:-/tmp}/prime-ops-setup.XXXXXX.log")
    echo "torch==$torch_version" >"$pin"
    if [[ "$have" == "$torch_version" ]]; then
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
        local stamp="$venv/.prime-ops-installed" want
        want="$PWD $(sha1sum pyproject.toml | cut -c1-40)"
        if [[ "$(cat "$stamp" 2>/dev/null)" == "$want" ]] && python - "$PWD" <<'PY'
import importlib.util, sys
spec = importlib.util.find_spec("prime_ops")  # finds the package without importing torch
sys.exit(spec is None or not spec.origin.startswith(sys.argv[1] + "/"))
PY
        then
            echo "reusing $venv (torch $have, project installed from here)" >&2
        else
            echo "reusing $venv (torch $have); re-installing the project only" >&2
            prime_ops_step "$log" "pip install --no-deps -e . (this project, 5-15 s)" \
                pip install --no-deps -e .
        fi
        # A dependency added since the venv was made (--no-deps above installs none): install
        # what is missing of the project's own requirements and those of EXTRAS.
        if ! python - "$extras" 2>/dev/null <<'PY'
import importlib.metadata as m, re, sys
marker = f'extra == "{sys.argv[1]}"'
for req in m.requires("prime-ops") or []:
    if ";" not in req or marker in req:
        m.version(re.match(r"[A-Za-z0-9._-]+", req).group())  # raises when not installed
PY
        then
            prime_ops_step "$log" "installing the requirements $venv lacks" \
                pip install -c "$pin" -e ".${extras:+[$extras]}"
        fi
        echo "$want" >"$stamp"
    else
        local start=$SECONDS
        echo "creating $venv with torch==$torch_version: 3 steps, minutes on a first run" >&2
        rm -rf "$venv"
        prime_ops_step "$log" "1/3 python3 -m venv $venv" python3 -m venv "$venv"
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
        prime_ops_step "$log" "2/3 pip install torch==$torch_version (the largest download)" \
            pip install "torch==$torch_version"
        prime_ops_step "$log" "3/3 pip install -e .${extras:+[$extras]} (this project, torch pinned)" \
            pip install -c "$pin" -e ".${extras:+[$extras]}"
        echo "$PWD $(sha1sum pyproject.toml | cut -c1-40)" >"$venv/.prime-ops-installed"
        echo "created $venv in $((SECONDS - start)) s" >&2
    fi
    rm -f "$pin" "$log"
}
