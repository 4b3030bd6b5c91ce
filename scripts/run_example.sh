#!/usr/bin/env bash
# The main job from a fresh clone: set-up, then the SMC example on SmolLM2-135M.
# Extra arguments go to the example (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error .venv/bin/python examples/smc.py "$@"
