#!/usr/bin/env bash
# One prepared check of the vLLM engine on a GPU machine (one GPU), in under 10 minutes: the same
# side-by-side benchmark as on CPU (`mtp-rollout bench-decode --against vllm`): our torch engine
# (plain, speculative) and vLLM (plain, and speculative with our heads as its drafter), interleaved,
# same prompts and seeds, medians of repeats; vLLM compiled (CUDA graphs), bf16 and float32.
#   1. installs the GPU build of vLLM when `import vllm` fails;
#   2. checks that our drafter plugin and the in-vLLM entropy hook work on the GPU (a tiny model);
#   3. runs the benchmark on SmolLM2-135M with the default heads (`heads=auto`: the shipped heads when
#      the package has them), k = 3, rejection drafting, T = 1, batch 1 and 8, 128 new tokens.
# Usage (from anywhere):  bash experiments/gpu_check.sh [key=value ...]   (extra keys go to the bench)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MTP_ROLLOUT_CACHE="${MTP_ROLLOUT_CACHE:-$HOME/.cache/mtp-rollout}"
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

echo "== tiny-model check: vLLM entropies = torch teacher-forced entropies, identical greedy drafts (GPU)"
timeout 240 python - <<'EOF' 2>&1 | grep -E "^(ok|FAIL)" || echo "tiny-model check failed or timed out"
import torch
from mtp_heads.heads import init_heads
from rollout.models.config import ModelConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from rollout.verify import entropy, process_logits

if __name__ == "__main__":
    from rollout.vllm import VLLMEngine, VLLMEngineConfig
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, eos_token_ids=(1,), rope_theta=10000.0)
    policy = random_model(cfg, seed=0).cuda()
    heads = init_heads(policy, 1, seed=0)
    prompts = [[5, 9, 17, 33], [7, 8, 100, 3, 44, 21]]
    eng = VLLMEngine(policy, heads, config=VLLMEngineConfig(max_model_len=512, gpu_memory_utilization=0.2))
    sp0 = SamplingParams(max_new_tokens=24, temperature=0.0, num_draft_tokens=3, ignore_eos=True)
    same = [c.round_accepted for c in eng.generate(prompts, sp0).completions] == \
           [c.round_accepted for c in TorchEngine(policy, heads).generate(prompts, sp0).completions]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, num_draft_tokens=3, ignore_eos=True, seed=0)
    err = 0.0
    for c in eng.generate(prompts, sp).completions:
        with torch.inference_mode():
            h = policy.hidden_states(torch.tensor([c.prompt + c.tokens[:-1]], device="cuda"))[0, len(c.prompt) - 1:]
            ref = entropy(process_logits(policy.compute_logits(h).float(), 1.0)).cpu()
        err = max(err, float((ref - torch.tensor(c.entropies)).abs().max()))
    eng.close()
    print(f"{'ok' if same and err < 1e-3 else 'FAIL'}: identical per-round acceptance at T=0: {same}; "
          f"max |entropy(vLLM) - entropy(torch)| = {err:.2e}")
EOF

echo "== SmolLM2-135M: ours vs vLLM plain vs vLLM with our heads (k = 3, rejection, T = 1)"
timeout 420 python -m experiments.bench_vllm configs/bench_vllm.yaml device=cuda vllm_compile=true \
    dtypes='[bfloat16,float32]' batch_sizes='[1,8]' max_new_tokens=128 repeats=3 gpu_memory_utilization=0.25 \
    json=.gpu_check/against_vllm.json "$@" \
    2>&1 | grep -v -E "^\(|^INFO|^WARNING|Loading safetensors|^$" || echo "bench failed or timed out"
echo "== done in $(( $(date +%s) - start )) s; results in .gpu_check/against_vllm.json"
