#!/usr/bin/env bash
# The GPU runbook, for a session lent a GPU machine (/work/.library/device). There, from the
# repository root, after the vLLM kit is installed (../shared/gpu/build_kit.sh):
#   bash scripts/gpu_runbook.sh [SECONDS]
# Runs in this order, each in what is left of SECONDS (default 540; a step that would not fit is
# said and skipped): gpu_smc's vLLM rows on the V2 runner beside the released 0.3.1, on the V1
# runner, the tries' device path, a step's draws on the device (random rows of SmolLM2's width;
# host reads counted), the tests on CUDA (those that need SmolLM2's weights left out:
# the weights do not travel; the tiny models are built there first), then gpu_smc's
# transformers rows beside 0.3.1. On 2026-11-27 (H100) the first two took 285 and 123 s.
# Expects, in .gpuassets/, the assets folder (SmolLM2's tokenizer files, the qwen2 and gpt-2
# tokenizers) and released-0.3.1/ (`pip install --no-deps --target`). Figures go to $OUT/*.json
# (here: `python -m benchmarks page --merge FILES --measured GPU-NAME`), output to
# $OUT/bench.log and $OUT/tests.log.
set -u
deadline=$((SECONDS + ${1:-540}))
out=${OUT:-/tmp/gpu-runbook}
mkdir -p "$out"
export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export GENLM_BACKEND_ASSETS=${GENLM_BACKEND_ASSETS:-$PWD/.gpuassets/assets}
python=${PYTHON:-/opt/torch/.venv/bin/python3}
released=${RELEASED:-$PWD/.gpuassets/released-0.3.1}

run_step() {  # name, seconds it needs at least, log, command...
  local name=$1 need=$2 log=$3 left=$((deadline - SECONDS)) began=$SECONDS
  shift 3
  if ((left < need)); then
    echo "== $name: not run ($left s left, needs $need)"
    return
  fi
  echo "== $name ($left s left): $*" | tee -a "$log"
  timeout "$left" "$@" >> "$log" 2>&1
  echo "== $name: exit $? after $((SECONDS - began)) s" | tee -a "$log"
}

nvidia-smi -L
"$python" -c "import torch, transformers, vllm; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
bench=("$python" -m benchmarks gpu_smc --device cuda)
run_step v2 240 "$out/bench.log" "${bench[@]}" --skip-hf --released "$released" \
  --json "$out/v2.json"
run_step v1 120 "$out/bench.log" "${bench[@]}" --skip-hf --skip-released --runner v1 \
  --json "$out/v1.json"
run_step trie 60 "$out/bench.log" "$python" -m benchmarks trie --device cuda --json "$out/trie.json"
run_step draws 30 "$out/bench.log" "$python" -m benchmarks draws --device cuda --rows random \
  --json "$out/draws.json"
grep -E "^(transformers|vLLM|trie|0\.3\.1|engine start|Traceback|[A-Za-z]*Error)|ms  " \
  "$out/bench.log" | grep -v "INFO\|WARNING"
"$python" -c "from genlm.backend import assets
for arch in ('llama', 'gpt2'):
    assets.tiny_model(arch)"
# -v: each test's outcome is in the log as it ends, should the budget cut the run.
run_step tests 60 "$out/tests.log" "$python" -m pytest -v -p no:cacheprovider \
  -p scripts.gpu_test_plugin --timeout 300 -rfE tests/llm/vllm tests/test_output_cache.py \
  tests/trie tests/llm/hf/test_hf.py
grep -E "FAILED|ERROR|passed|failed" "$out/tests.log" | tail -25
run_step hf 150 "$out/bench.log" "${bench[@]}" --skip-vllm --released "$released" \
  --json "$out/hf.json"
grep -E "^transformers|0\.3\.1 did not" "$out/bench.log"
