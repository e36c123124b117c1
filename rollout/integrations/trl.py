"""TRL's GRPOTrainer rolling out through a RolloutAccelerator.

    rollout = TRLRollout(accel, num_draft_tokens=3)
    trainer = GRPOTrainer(model=hf_dir, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                          rollout_func=rollout, callbacks=[rollout])
    trainer.train()
    accel.shutdown()

One object fills the two seams TRL offers, each where TRL already does that job:

- `rollout_func(prompts, trainer)`: TRL calls it where it would generate, with the prompts it
  would have tokenized itself (chat messages or text, each prompt already repeated
  num_generations times). We tokenize them exactly as TRL does, generate speculatively, and
  return prompt ids, completion ids and log-probs, plus our per-completion fields (FIELDS),
  which TRL hands to every reward function as keyword arguments. Rollout metrics also go to
  TRL's logs (`rollout/acceptance_rate`, ...).
- `TrainerCallback.on_step_end`: fires exactly once per optimizer step, after optimizer.step()
  and before the next generation. There the trained parameters go to the workers and the
  co-trainer (`sync_policy`, version = TRL's global_step) and the step's monitor record is
  written (`end_step`). Checking `trainer.state.global_step` inside rollout_func instead (what
  TRL's own vLLM path does) would also sync in time, but the last step would never reach the
  monitor, and with steps_per_generation > 1 the steps between generations would go unseen.

Log-probs: `Completion.logprobs` are log p of the policy at temperature 1 (raw logits). TRL
compares its rollout log-probs (`sampling_per_token_logps`; only the off-policy mask uses them
when vLLM is off) with its own `log_softmax(logits / args.temperature)`: equal quantities when
args.temperature == 1, TRL's default. Another temperature is refused together with
off_policy_mask_threshold and warned about otherwise.

Evaluation rollouts (trainer.evaluate) take the same path and count in the next step's record.
Single process only (one TRL process owns the accelerator); weights are the HF model's own
parameter names, which are this project's names for llama / qwen2 / qwen3 (policy_tensors).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import TrainerCallback

from rollout.accelerator import RolloutAccelerator
from rollout.monitor.step_stats import max_prob_stats
from rollout.types import Completion, RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from trl import GRPOTrainer

logger = logging.getLogger(__name__)

# per-completion fields returned next to the ids; TRL passes them to reward functions as kwargs
FIELDS = ("policy_version", "head_version", "acceptance_rate", "acceptance_length", "num_draft_tokens",
          "mean_entropy", "entropies", "mean_max_prob", "max_probs", "finish_reason")

# prefixes that wrappers put before the model's own parameter names (DDP/accelerate, torch.compile)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# ------------------------------------------------------------------------------ weights


def policy_tensors(model: torch.nn.Module, *, only_trainable: bool = True,
                   rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """The HF model's parameters under the policy's names: what sync_policy must receive.

    only_trainable: just the parameters that require grad (a partial update when some layers
    are frozen; the frozen ones never change, so the workers already hold them).
    Names: transformers' Llama / Qwen2 / Qwen3 parameter names are this project's canonical
    names (rollout.models.hf_loader), so the mapping only strips wrapper prefixes; `rename`
    maps any other naming (return None to drop a tensor). A tied lm_head is not a separate
    parameter and is not sent.
    """
    out = {}
    for name, p in model.named_parameters():
        if only_trainable and not p.requires_grad:
            continue
        for prefix in WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if "lora_" in name or ".base_layer." in name:
            raise ValueError(f"{name!r} is a PEFT adapter tensor: rollout workers hold the plain model; "
                             "merge the adapters into a copy (peft's merge_and_unload) and sync that, or pass rename=")
        out[name] = p.detach()
    if not out:
        raise ValueError("the model has no trainable parameters to sync (every requires_grad is False)")
    return out


# ------------------------------------------------------------------------------ sampling


def sampling_from_args(args, eos_token_ids, **overrides) -> SamplingParams:
    """SamplingParams matching a GRPOConfig (length, temperature, top-k/p, TRL's EOS ids); `overrides`
    replace any field (num_draft_tokens, draft_mode, temperature, seed, ...)."""
    unsupported = {"min_p": args.min_p not in (None, 0.0), "repetition_penalty": args.repetition_penalty != 1.0,
                   "generation_kwargs": bool(args.generation_kwargs)}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"GRPOConfig sets {bad}, which the accelerator's engines do not implement; "
                         "unset them (speculative decoding stays lossless only for temperature / top-k / top-p)")
    base = dict(max_new_tokens=int(args.max_completion_length), temperature=float(args.temperature),
                top_k=int(args.top_k or 0), top_p=float(args.top_p if args.top_p is not None else 1.0),
                stop_token_ids=tuple(int(t) for t in eos_token_ids))
    sp = SamplingParams(**{**base, **overrides})
    sp.validate()
    return sp


def _tokenize(prompts: list, trainer: "GRPOTrainer") -> list[list[int]]:
    """Prompt ids exactly as GRPOTrainer._tokenize_prompts makes them (chat template with the
    generation prompt for conversations, plain tokenization for text)."""
    from trl.data_utils import is_conversational

    proc = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        out = proc.apply_chat_template(conversation=prompts, tools=trainer.tools or None,
                                       chat_template=trainer.chat_template, add_generation_prompt=True,
                                       tokenize=True, return_dict=True, **trainer.chat_template_kwargs)
        ids = out["input_ids"]
    else:
        ids = proc(text=prompts)["input_ids"]
    return [[int(t) for t in row] for row in ids]


def completion_fields(c: Completion) -> dict[str, Any]:
    """Our per-completion fields (FIELDS), plain Python values."""
    stats = c.spec_stats()
    return {"policy_version": c.policy_version, "head_version": c.head_version,
            "acceptance_rate": stats.acceptance_rate, "acceptance_length": stats.acceptance_length,
            "num_draft_tokens": c.num_draft_tokens,
            "mean_entropy": float(np.mean(c.entropies)) if c.entropies else float("nan"),
            "entropies": list(c.entropies),
            "mean_max_prob": float(np.mean(c.max_probs)) if c.max_probs else float("nan"),
            "max_probs": list(c.max_probs), "finish_reason": c.finish_reason}


# ------------------------------------------------------------------------------ the adapter


class TRLRollout(TrainerCallback):
    """TRL's rollout_func and the TrainerCallback that keeps the accelerator in step (module docstring).

    sampling: a full SamplingParams, or None to derive it from the trainer's GRPOConfig on the
    first call (sampling_from_args) with `overrides` (num_draft_tokens, draft_mode, temperature...).
    seed: rollouts of call n use seed + n (reproducible, and no two steps repeat each other).
    """

    def __init__(self, accel: RolloutAccelerator, *, sampling: SamplingParams | None = None, seed: int = 0,
                 rename: Callable[[str], str | None] | None = None, **overrides):
        self.accel = accel
        self.sampling = sampling
        self.overrides = overrides
        self.seed = seed
        self.rename = rename
        self.trainer: "GRPOTrainer | None" = None
        self.batches: list[RolloutBatch] = []     # this step's batches (cleared at end_step)
        self.last_batch: RolloutBatch | None = None
        self.records: list[dict] = []              # the monitor records end_step returned
        self._calls = 0
        self._checked = False

    # -- rollout_func ----------------------------------------------------------------------------

    def __call__(self, prompts: list, trainer: "GRPOTrainer") -> dict[str, list]:
        """TRL's RolloutFunc: one completion per prompt entry, in order."""
        if not prompts:
            raise ValueError("TRL passed no prompts to the rollout function")
        self._bind(trainer)
        prompt_ids = _tokenize(prompts, trainer)
        sp = self._sampling(trainer)
        if sp.seed is not None:
            sp = dataclasses.replace(sp, seed=sp.seed + self._calls)
        self._calls += 1
        batch = self.accel.generate(prompt_ids, sp)
        self.batches.append(batch)
        self.last_batch = batch
        comps = batch.completions
        out: dict[str, list] = {"prompt_ids": prompt_ids, "completion_ids": [list(c.tokens) for c in comps],
                                "logprobs": [list(c.logprobs) for c in comps]}
        fields = [completion_fields(c) for c in comps]
        out.update({k: [f[k] for f in fields] for k in FIELDS})
        self._log_metrics(trainer, batch)
        return out

    def _bind(self, trainer: "GRPOTrainer") -> None:
        if self.trainer is trainer and self._checked:
            return
        if trainer.accelerator.num_processes > 1:
            raise ValueError("TRLRollout drives one accelerator from one process; run TRL on a single process "
                             f"(got {trainer.accelerator.num_processes}) and scale with workers.num_workers")
        args = trainer.args
        if args.use_vllm:
            raise ValueError("use_vllm=True and a rollout function both generate; set use_vllm=False "
                             "(the accelerator's workers are the rollout engine, vLLM included: workers.engine=vllm)")
        if args.temperature != 1.0:
            msg = (f"GRPOConfig.temperature={args.temperature}: TRL scores tokens at that temperature, while the "
                   "accelerator returns log-probs at temperature 1")
            if args.off_policy_mask_threshold is not None:
                raise ValueError(msg + "; the off-policy mask would compare the two. Use temperature=1.0.")
            warnings.warn(msg + "; TRL only stores them (sampling_per_token_logps) in this setup.", stacklevel=3)
        self.trainer, self._checked = trainer, True

    def _sampling(self, trainer: "GRPOTrainer") -> SamplingParams:
        if self.sampling is None:
            self.sampling = sampling_from_args(trainer.args, trainer.eos_token_ids,
                                               **{"seed": self.seed, **self.overrides})
        return self.sampling

    @staticmethod
    def _log_metrics(trainer: "GRPOTrainer", batch: RolloutBatch) -> None:
        """Rollout speed and acceptance into TRL's logged metrics. `_log_metric` is the private
        sink behind reward functions' `log_metric` kwarg (averaged, then logged with the step);
        without it (another TRL version) the metrics only reach our monitor."""
        log = getattr(trainer, "_log_metric", None)
        if log is None:
            return
        stats, comps = batch.spec_stats(), batch.completions
        ent = [h for c in comps for h in c.entropies]
        values = {"rollout/acceptance_rate": stats.acceptance_rate, "rollout/acceptance_length": stats.acceptance_length,
                  "rollout/entropy": float(np.mean(ent)) if ent else float("nan"),
                  **{f"rollout/{k}": v for k, v in max_prob_stats(comps).items()},
                  "rollout/tokens_per_s": batch.tokens_per_s, "rollout/wall_time_s": batch.wall_time_s,
                  "rollout/policy_version": float(max(c.policy_version for c in comps)),
                  "rollout/head_version": float(max(c.head_version for c in comps))}
        for name, v in values.items():
            if not math.isnan(v):
                log(name, float(v))

    # -- TrainerCallback ---------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Resuming from a TRL checkpoint: the workers still hold the initial policy, so send all of it."""
        if state.global_step > 0 and model is not None:
            self.accel.sync_policy(policy_tensors(model, only_trainable=False, rename=self.rename),
                                   version=state.global_step)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After each optimizer step: the step's monitor record, then the new weights (version = global_step)."""
        step = state.global_step - 1                  # 0-based RL step whose rollouts just trained
        if self.batches:
            self.records.append(self.accel.end_step(step, self._step_metrics()))
            self.batches = []
        if model is None:
            raise ValueError("TRL called on_step_end without the model; cannot sync the trained weights")
        self.accel.sync_policy(policy_tensors(model, rename=self.rename), version=state.global_step)
        return control

    def _step_metrics(self) -> dict:
        """The step's reward means as TRL computed them (its metric buffer is only flushed at logging
        time, after on_step_end), for the monitor record's `extra`."""
        metrics = getattr(self.trainer, "_metrics", {}).get("train", {})
        out = {"trl_global_step": None if self.trainer is None else self.trainer.state.global_step}
        for name, values in metrics.items():
            if values and (name in ("reward", "reward_std") or (name.startswith("rewards/") and name.endswith("/mean"))):
                out[name] = float(values[-1])
        return out
