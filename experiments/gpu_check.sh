#!/usr/bin/env bash
# One prepared check of the vLLM engine on a GPU machine (one GPU), in under 8 minutes:
#   1. installs the GPU build of vLLM when `import vllm` fails;
#   2. makes sure trained heads for the default model exist (trains a short run when they do not);
#   3. runs the torch engine and vLLM (plain and with our heads as drafter) on SmolLM2-135M float32,
#      batch 1 and 8, in both draft modes, and prints tokens/s, ratios and per-position acceptance.
# Usage (from anywhere):  bash experiments/gpu_check.sh [--max-new-tokens 128]  (extra args go to the bench)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export MTP_ROLLOUT_CACHE="${MTP_ROLLOUT_CACHE:-$HOME/.cache/mtp-rollout}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.gpu_check/vllm_cache}"
mkdir -p .gpu_check
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! python -c "import vllm" 2>/dev/null; then
    echo "== installing vllm (GPU build)"
    pip install -q "vllm>=0.32"
fi
python - <<'EOF'
import torch, vllm
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} | vllm {vllm.__version__}")
assert torch.cuda.is_available(), "no CUDA device visible: this script is for a GPU machine"
EOF

heads="$MTP_ROLLOUT_CACHE/heads/smollm2-135m-D3-tv.safetensors"
if [ ! -f "$heads" ]; then
    echo "== no trained heads at $heads: short pre-training run (self-distillation, TV loss)"
    timeout 240 python -m experiments.pretrain_heads --steps 60 --eval-prompts 0 || {
        echo "pre-training failed or timed out: continuing with init heads"; heads=init; }
fi
[ -f "$heads" ] || heads=init

for mode in rejection greedy; do
    echo "== draft mode $mode (temperature 1, k = 3)"
    timeout 200 python -m experiments.bench_vllm --heads "$heads" --draft-mode "$mode" --k 3 \
        --temperature 1.0 --max-new-tokens 128 --repeats 3 --batch 1 8 --device cuda --gpu-mem-util 0.3 \
        --json ".gpu_check/bench_$mode.json" "$@" \
        2>&1 | grep -v -E "^\(|^INFO|^WARNING|Loading safetensors|^$" || echo "bench ($mode) failed or timed out"
done
echo "== done in $(( $(date +%s) - start )) s; results in .gpu_check/bench_*.json"
