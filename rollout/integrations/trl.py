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

Resume: TRL's own checkpoints carry the trained side (weights, optimizer, RNG, data position).
`on_save` adds the rollout side to each checkpoint-<step> folder (ROLLOUT_STATE: the heads the
workers run, their version and DrafterSpec, the co-trainer's state, the monitor log's length, the rollout seed
counter); with `trainer.train(resume_from_checkpoint=...)`, `on_train_begin` sends the workers the
restored policy and gives the co-trainer its state back. Build the accelerator of a resumed run
after `restore_run_files` (monitor files cut back to the checkpoint) with the saved heads.

Evaluation rollouts (trainer.evaluate) take the same path and count in the next step's record.
Single process only (one TRL process owns the accelerator); weights are the HF model's own
parameter names, which are this project's names for llama / qwen2 / qwen3 (policy_tensors).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from transformers import TrainerCallback

from mtp_heads.cotrainer import remove_checkpoint
from rollout.accelerator import RolloutAccelerator
from rollout.fileio import atomic_write
from rollout.models.flat_weights import own_storage
from rollout.monitor import AcceptanceMonitor
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

ROLLOUT_STATE = "rollout_state.pt"   # the rollout side of a TRL checkpoint, in its checkpoint-<step> folder
SAVE_WAIT_S = 30.0                   # how long a checkpoint waits for a busy co-trainer's state


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


def train_last_layers(model: torch.nn.Module, n_layers: int) -> list[str]:
    """requires_grad only on the last n decoder layers and the final norm (-1: everything), so TRL's
    optimizer, its backward pass and every sync_policy touch only those: on a CPU, train a few
    layers. Returns the trainable names."""
    total = model.config.num_hidden_layers
    if n_layers != -1 and not 1 <= n_layers <= total:
        raise ValueError(f"train the last 1..{total} layers (or -1: all), got {n_layers}")
    keep = [f"model.layers.{i}." for i in range(0 if n_layers == -1 else total - n_layers, total)] + ["model.norm."]
    for name, p in model.named_parameters():
        p.requires_grad_(n_layers == -1 or name.startswith(tuple(keep)))
    return [n for n, p in model.named_parameters() if p.requires_grad]


def hf_model_dir(spec: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """An HF directory of `spec` (a model name, .gguf file or HF directory) for transformers/TRL, with
    the very weights the rollout workers load: the directory itself, or our export of the model to
    out_dir (default <cache>/hf/<name>), written once."""
    from rollout.models.default_model import cache_dir
    from rollout.models.loaders import export_hf_dir, load_model

    if Path(spec).is_dir():
        return Path(spec)
    out = Path(out_dir) if out_dir else cache_dir() / "hf" / Path(str(spec)).stem
    if not (out / "config.json").is_file():
        loaded = load_model(spec)
        logger.info("exporting %s to %s", loaded.source, out)
        export_hf_dir(loaded, out, overwrite=out.exists())
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
        """Resuming from a TRL checkpoint: the workers still hold the initial policy, so send all of it;
        the rollout seed counter and the co-trainer's state come back from the checkpoint's ROLLOUT_STATE."""
        if state.global_step > 0:
            saved = read_rollout_state(checkpoint_dir(args, state.global_step))
            if saved is not None:
                self._calls = int(saved["calls"])
                if saved["cotrainer"] is not None and self.accel.cotrainer is not None:
                    ray.get(self.accel.cotrainer.load_state.remote(saved["cotrainer"]), timeout=120)
            if model is not None:
                self.accel.sync_policy(policy_tensors(model, only_trainable=False, rename=self.rename),
                                       version=state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs):
        """TRL has just written checkpoint-<global_step>: add the rollout side (ROLLOUT_STATE)."""
        save_rollout_state(checkpoint_dir(args, state.global_step), self.accel, calls=self._calls,
                           global_step=state.global_step)
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


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_dir(args, global_step: int) -> Path:
    """Where TRL's Trainer writes (and a resume reads) the checkpoint of `global_step`."""
    return Path(args.output_dir) / f"checkpoint-{global_step}"



def save_rollout_state(ckpt: Path, accel: RolloutAccelerator, *, calls: int, global_step: int) -> Path:
    """Write ckpt/ROLLOUT_STATE atomically: heads and version, co-trainer state (None if it is busy
    past SAVE_WAIT_S or dead: a resume then restarts it from the saved heads), the monitor log's
    length and histogram state, and the rollout seed counter. A checkpoint without it is incomplete."""
    accel.flush(timeout=SAVE_WAIT_S)
    cotrainer = None
    if accel.cotrainer is not None:
        try:
            cotrainer = ray.get(accel.cotrainer.state.remote(), timeout=SAVE_WAIT_S)
        except Exception as e:  # noqa: BLE001 - a dead or stuck co-trainer: the heads are enough
            logger.warning("checkpoint %s without the co-trainer's state (%s)", ckpt, e)
    heads, head_version = accel.current_heads()
    mon = Path(accel.monitor.out_dir)
    jsonl, mstate = mon / AcceptanceMonitor.JSONL, mon / AcceptanceMonitor.STATE
    state = {"global_step": global_step, "calls": calls, "heads": heads, "head_version": head_version,
             "drafter": accel.drafter_spec.to_dict(), "cotrainer": cotrainer,
             "monitor_bytes": jsonl.stat().st_size if jsonl.exists() else 0,
             "monitor_state": mstate.read_bytes() if mstate.exists() else None}
    buf = io.BytesIO()
    torch.save(own_storage(state), buf)
    return atomic_write(Path(ckpt) / ROLLOUT_STATE, buf.getvalue())


def read_rollout_state(ckpt: Path) -> dict | None:
    """The checkpoint's ROLLOUT_STATE, None if it has none; a damaged one is an error naming it."""
    path = Path(ckpt) / ROLLOUT_STATE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}); delete {ckpt} to resume "
                         "from an earlier checkpoint") from None


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint-<step> folder of a TRL output_dir that holds the rollout side too."""
    done = [p for p in Path(output_dir).glob("checkpoint-*")
            if p.name.split("-", 1)[1].isdigit() and (p / ROLLOUT_STATE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-", 1)[1]), default=None)


def restore_run_files(saved: dict | None, monitor_dir: str | os.PathLike, cotrainer_dir: str | None) -> None:
    """Before building a resumed run's accelerator: monitor.jsonl cut back to its length at the
    checkpoint and its histogram state put back (every step is then logged once), and the
    co-trainer's own checkpoint files removed (on_train_begin gives it the saved state). saved=None:
    back to an empty run."""
    mon = Path(monitor_dir)
    jsonl = mon / AcceptanceMonitor.JSONL
    keep = int(saved["monitor_bytes"]) if saved else 0
    if jsonl.exists():
        if jsonl.stat().st_size < keep:
            raise ValueError(f"{jsonl} is shorter than at the checkpoint ({keep} bytes): it was cut or replaced; "
                             "cannot resume into this out_dir")
        with open(jsonl, "r+b") as f:
            f.truncate(keep)
    if saved and saved["monitor_state"] is not None:
        atomic_write(mon / AcceptanceMonitor.STATE, saved["monitor_state"])
    else:
        (mon / AcceptanceMonitor.STATE).unlink(missing_ok=True)
    if cotrainer_dir:
        remove_checkpoint(cotrainer_dir)
