"""Where draft heads come from: the one place a `heads` setting is turned into heads.

    heads, desc = resolve_heads(policy, "shipped", model="smollm2-135m")   # or "init", or a file

`shipped`: mtp_heads/default_heads/<model>.safetensors (bf16, with a model card <model>.md beside
it), made by `mtp-rollout train-heads heads_smollm2`; for a model the package ships none for, the
heads `mtp-rollout train-heads model=<model>` cached under $MTP_ROLLOUT_CACHE/heads. `shipped-eagle3`:
the EAGLE-3 drafter shipped for the model, mtp_heads/default_heads/<model>-eagle3/ (vLLM's layout, card
<model>-eagle3.md), made by `mtp-rollout train-heads eagle3_smollm2`. `init`:
untrained heads (a copy of the policy's last layer). Anything else is a checkpoint file written by
mtp_heads.checkpoint.save_heads (train-heads or a co-trainer checkpoint), or an EAGLE-3 drafter
directory in vLLM's `eagle3` layout (mtp_heads.eagle3_checkpoint), which drafts through the same
interface (mtp_heads.eagle3_drafter.Eagle3Heads).
"""
from __future__ import annotations

from pathlib import Path

from mtp_heads.checkpoint import HeadMeta, default_heads_path, load_heads
from mtp_heads.eagle3_checkpoint import CONFIG_FILE, drafter_layout, load_eagle3
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads, init_heads
from rollout.models.decoder import CausalLM

SHIPPED_DIR = Path(__file__).resolve().parent / "default_heads"
HEAD_SOURCES = ("shipped", "init")   # or a checkpoint path
HEADS_FILE = "heads.safetensors"     # what train-heads writes into its out_dir
RETIRED = {"pretrained": "shipped", "auto": "shipped", "path": "<the checkpoint path itself>"}   # old spellings
SHIPPED: dict[str, str] = {          # model spec -> file in SHIPPED_DIR
    "smollm2-135m": "smollm2-135m.safetensors",
}
SHIPPED_EAGLE3_NAME = "shipped-eagle3"
SHIPPED_EAGLE3: dict[str, str] = {   # model spec -> EAGLE-3 drafter directory in SHIPPED_DIR
    "smollm2-135m": "smollm2-135m-eagle3",
}


def shipped_eagle3_path(model_spec: str) -> Path:
    """The EAGLE-3 drafter shipped for a model; ValueError naming `heads=shipped-eagle3` when none is."""
    name = SHIPPED_EAGLE3.get(str(model_spec))
    if name is None or not (SHIPPED_DIR / name).is_dir():
        raise ValueError(f"heads={SHIPPED_EAGLE3_NAME}: the package ships no EAGLE-3 drafter for model {model_spec!r} "
                         f"(it ships one for {sorted(SHIPPED_EAGLE3)}); train one with `mtp-rollout train-heads "
                         f"train_heads train.drafter=eagle3 model={model_spec}` and pass heads=<its eagle3 directory>")
    return SHIPPED_DIR / name


def drafter_location(spec: str, model_spec: str) -> str:
    """The path a `heads` setting stands for where it names a shipped EAGLE-3 drafter; every other setting
    as given (shipped, init and paths are resolved by resolve_heads)."""
    return str(shipped_eagle3_path(model_spec)) if spec == SHIPPED_EAGLE3_NAME else spec


def shipped_heads_path(model_spec: str) -> Path | None:
    """The shipped heads file for a model spec, or None when the package ships none for it."""
    name = SHIPPED.get(str(model_spec))
    path = SHIPPED_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def load_shipped_heads(policy: CausalLM, model_spec: str) -> tuple[MTPHeads, HeadMeta] | None:
    """The shipped heads in the policy's dtype, or None when none are shipped for `model_spec`;
    ValueError when they exist but were trained for another architecture."""
    path = shipped_heads_path(model_spec)
    return None if path is None else load_heads(path, policy)


def trained_heads_dir(model_spec: str) -> Path:
    """$MTP_ROLLOUT_CACHE/heads/<model>/: train-heads' default out_dir (the model's name made path-safe
    exactly as mtp_heads.checkpoint names cached heads files)."""
    path = default_heads_path(model_spec, 1, "x")
    return path.parent / path.name.removesuffix("-D1-x.safetensors")


def trained_heads_path(model_spec: str) -> Path:
    """$MTP_ROLLOUT_CACHE/heads/<model>/heads.safetensors: where `train-heads` leaves heads for a
    model the package ships none for (what heads=shipped falls back to)."""
    return trained_heads_dir(model_spec) / HEADS_FILE


def check_heads_spec(key: str, spec: object) -> None:
    """A `heads` setting is shipped, init or a checkpoint path; the retired spellings (and an empty
    value) fail at load time, naming the key and the new spelling, rather than as a missing file."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{key} must be shipped, init or a heads checkpoint path, got {spec!r}")
    if spec in RETIRED:
        raise ValueError(f"{key}={spec} is no longer accepted: write {key}={RETIRED[spec]} "
                         "(heads is shipped, init or a checkpoint path)")


def resolve_heads(policy: CausalLM, spec: str, *, model: str, num_depths: int | None = None,
                  seed: int = 0) -> tuple[MTPHeads | Eagle3Heads, str]:
    """Heads for `policy` from a `heads` setting, and a one-line description for logs.

    spec: "shipped", "shipped-eagle3", "init", a checkpoint path or an EAGLE-3 directory (or its config.json). model: the
    policy's model spec (names the shipped file). num_depths: head modules (one recurrent depth drafts
    every position; None = 1 for "init", what the file holds otherwise); a number must match the
    file's (an EAGLE-3 drafter has one). ValueError naming the file or the setting otherwise.
    """
    check_heads_spec("heads", spec)
    spec = drafter_location(spec, model)
    if spec == "init":
        return init_heads(policy, num_depths or 1, seed=seed), "init (untrained: expect low acceptance)"
    if spec == "shipped":
        path = shipped_heads_path(model) or trained_heads_path(model)
        if not path.is_file():
            raise ValueError(f"heads=shipped: the package ships no heads for model {model!r} and none were trained "
                             f"({path} is missing); run `mtp-rollout train-heads model={model}`, pass heads=<file>, "
                             "or heads=init")
    else:
        path = Path(spec).expanduser()
        if path.is_dir() or (path.name == CONFIG_FILE and path.is_file()):
            return _resolve_eagle3(policy, path, num_depths)
        if not path.is_file():
            raise ValueError(f"heads={spec!r}: no such heads file or EAGLE-3 directory; use shipped, init or a "
                             "checkpoint path")
    heads, meta = load_heads(path, policy)
    if num_depths is not None and meta.num_depths != num_depths:
        raise ValueError(f"{path} holds {meta.num_depths} MTP depths but {num_depths} were asked for; "
                         f"set num_depths={meta.num_depths}")
    return heads, f"{spec if spec != 'shipped' else path.name} ({meta.loss} loss, {meta.steps} steps)"


def _resolve_eagle3(policy: CausalLM, path: Path, num_depths: int | None) -> tuple[Eagle3Heads, str]:
    """An EAGLE-3 drafter directory as the engine's drafter; its config is checked against the policy
    before a tensor is read (load_eagle3 names the file and the mismatch)."""
    drafter_layout(path)                      # a directory in neither layout: says which are accepted
    if num_depths not in (None, 1):
        raise ValueError(f"{path} is an EAGLE-3 drafter (one recurrent layer) but num_depths={num_depths} was asked "
                         "for; set num_depths=1 or leave it unset")
    drafter = load_eagle3(path, policy)
    vocab = "" if drafter.d2t is None else f", draft vocabulary {drafter.draft_vocab_size}"
    return Eagle3Heads(drafter), f"{path} (EAGLE-3, aux layers {list(drafter.aux_layer_ids)}{vocab})"
