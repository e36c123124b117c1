"""`mtp-rollout generate`: chat with the policy through speculative decoding, with live progress.

    mtp-rollout generate --prompt "What is the capital of France?" --temperature 0
    mtp-rollout generate num_draft_tokens=3 temperature=0.7 'prompts=[Write a haiku about the sea.]'
    mtp-rollout generate [configs/generate.yaml] [key=value ...]     (--help: every key)

Flags are aliases of config keys: --prompt X (repeatable) -> prompts, --k N -> num_draft_tokens,
--model, --heads, --num-depths, --draft-mode, --temperature, --top-p, --max-new-tokens, --dtype, --seed.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

from rollout.config_loader import config_help, load_config, packaged_config, wants_help
from rollout.models.loaders import DEFAULT_MODEL
from rollout.models.tokenizer import check_text
from rollout.types import DRAFT_MODES, SamplingParams

DEFAULT_CONFIG = packaged_config("generate")
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]
FLAGS = {    # flag -> config key (the flags predate the config; scripts still pass them)
    "--model": "model", "--heads": "heads", "--num-depths": "num_depths", "--k": "num_draft_tokens",
    "--num-draft-tokens": "num_draft_tokens", "--draft-mode": "draft_mode", "--temperature": "temperature",
    "--top-p": "top_p", "--max-new-tokens": "max_new_tokens", "--dtype": "dtype", "--seed": "seed",
}


@dataclass(frozen=True)
class GenerateJobConfig:
    """One chat session: the policy, its draft heads and how to sample."""

    model: str = DEFAULT_MODEL          # named model, .gguf file or HF directory
    heads: str = "shipped"              # shipped | init | a heads checkpoint path
    num_depths: int | None = None       # depths of heads=init (None = 1); a number must match a checkpoint's
    num_draft_tokens: int = 3           # draft tokens per round (0 = plain decoding)
    draft_mode: str = "rejection"       # greedy | rejection
    temperature: float = 0.0            # 0 = greedy sampling
    top_p: float = 1.0                  # nucleus sampling (1 = off)
    max_new_tokens: int = 64            # per answer
    seed: int = 0                       # sampling seed
    dtype: str = "auto"                 # float32 | bfloat16 | auto (bfloat16 where the hardware computes it)
    prompts: list[str] = field(default_factory=list)   # user messages; [] = four demo prompts

    def __post_init__(self) -> None:
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.num_depths is not None and self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1 (or null), got {self.num_depths}")
        for i, prompt in enumerate(self.prompts):
            check_text(prompt, f"prompts[{i}]")
        try:                             # bad values fail before the model loads, named as keys
            self.sampling().validate()
        except ValueError as e:
            raise ValueError(str(e).replace("num_draft_tokens (k)", "num_draft_tokens")) from None

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              num_draft_tokens=self.num_draft_tokens, draft_mode=self.draft_mode, seed=self.seed)


def flags_to_overrides(argv: list[str], used: dict[str, str] | None = None) -> list[str]:
    """The old flags (`--k 3`, `--prompt X` repeated, `--top-p=0.9`) as key=value overrides; YAML files
    and overrides pass through. Values are quoted as YAML strings where the key is a string. `used`
    collects key -> the flag that set it (for error messages)."""
    out, prompts, i = [], [], 0
    used = {} if used is None else used
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg in ("--help",):
            out.append(arg)
            i += 1
            continue
        flag, eq, value = arg.partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if flag == "--prompt":
            prompts.append(check_text(value, f"--prompt {len(prompts) + 1}"))
            used["prompts"] = flag
        elif flag in FLAGS:
            key = FLAGS[flag]
            used[key] = flag
            text = json.dumps(value) if key in ("model", "heads", "dtype", "draft_mode") else value
            out.append(f"{key}={text}")
        else:
            raise ValueError(f"unknown flag {flag}; flags: --prompt, {', '.join(FLAGS)} (or key=value, see --help)")
    if prompts:
        out.append(f"prompts={json.dumps(prompts)}")
    return out


def load_generate_config(argv: list[str]) -> tuple[GenerateJobConfig, str]:
    """configs/generate.yaml (unless a YAML file is given), then the flags' and key=value overrides.
    A bad flag value fails naming the flag as well as its key."""
    used: dict[str, str] = {}
    argv = flags_to_overrides(argv, used)
    if all("=" in a for a in argv):
        argv = [str(DEFAULT_CONFIG), *argv]
    try:
        return load_config(GenerateJobConfig, argv)
    except ValueError as e:
        named = [flag for key, flag in used.items() if re.search(rf"(^|[^\w.]){key}\b", str(e))]
        raise ValueError(f"{e} (flag {named[0]})" if named else str(e)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        rest = flags_to_overrides([a for a in argv if not wants_help([a])])
        print(config_help(GenerateJobConfig, usage=__doc__,
                          argv=rest if any("=" not in a for a in rest) else [str(DEFAULT_CONFIG), *rest]), end="")
        return 0
    cfg, _ = load_generate_config(argv)
    import torch
    from tqdm import tqdm

    from mtp_heads.shipped import resolve_heads
    from rollout.models.loaders import apply_chat_template, load_policy
    from rollout.torch_engine import TorchEngine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    sampling = cfg.sampling()
    policy, loaded = load_policy(cfg.model, cfg.dtype)
    heads, heads_desc = resolve_heads(policy, cfg.heads, model=cfg.model, num_depths=cfg.num_depths, seed=cfg.seed)
    engine = TorchEngine(policy, heads if cfg.num_draft_tokens > 0 else None)
    print(f"model: {cfg.model} ({loaded.config.num_hidden_layers} layers, d={loaded.config.hidden_size})  "
          f"heads: {heads_desc}  num_draft_tokens={cfg.num_draft_tokens} {cfg.draft_mode}")
    prompts = list(cfg.prompts) or DEFAULT_PROMPTS
    totals = {"accepted": 0, "proposed": 0}
    with tqdm(total=cfg.max_new_tokens * len(prompts), unit="tok") as bar:
        def progress(new_tokens: int, accepted: int, proposed: int) -> None:
            totals["accepted"] += accepted
            totals["proposed"] += proposed
            rate = totals["accepted"] / totals["proposed"] if totals["proposed"] else float("nan")
            bar.set_postfix(acceptance=f"{rate:.2f}")
            bar.update(new_tokens)

        answers = []
        for message in prompts:
            ids = apply_chat_template(loaded, [{"role": "user", "content": message}])
            batch = engine.generate([ids], sampling, progress=progress)
            answers.append((message, batch))
    for message, batch in answers:
        comp = batch.completions[0]
        stats = batch.spec_stats()
        print(f"\n>>> {message}\n{loaded.tokenizer.decode(comp.tokens, skip_special_tokens=True)}")
        print(f"[{len(comp.tokens)} tokens, {batch.tokens_per_s:.1f} tok/s"
              + (f", acceptance {stats.acceptance_rate:.2f}, tau {stats.acceptance_length:.2f}]"
                 if cfg.num_draft_tokens else "]"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
