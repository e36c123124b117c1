"""An on-policy token store from the RL job's reasoning-gym task source only (no ShareGPT).

    PYTHONPATH=$PWD python experiments/results/heads_rg_smollm2/build_rg_store.py configs/head_data.yaml \
        [samples_per_prompt=8] [key=value ...]          # keys of experiments/build_head_data.py

Train split: the task source's fixed training prompts (`TaskSource(tasks).train`, the job's default
mix and size), each sampled `samples_per_prompt` times at onpolicy.temperature, as the job samples a
group per prompt. Held-out split: its held-out prompts (`TaskSource(tasks).heldout`, never in the
training set), sampled the same way. The items are laid out repetition-major (every prompt once,
then every prompt again, ...) so a token target reached early still covers every prompt; each shard
gets its own range of per-request seeds so repeats of a prompt are independent samples. Everything
else (teacher forcing, shards, manifest, resume) is experiments/build_head_data.py's code.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

import numpy as np
import torch

from experiments.build_head_data import (HeadDataConfig, engine_generate, log, make_engine, store_meta,
                                         store_root)
from mtp_heads.data.builder import Example, build_shards, completion_example
from mtp_heads.data.onpolicy import task_prompts
from mtp_heads.data.sharegpt import ChatEncoder
from mtp_heads.data.token_store import StoreWriter, TokenStore
from rollout.config_loader import load_config
from rollout.models.loaders import load_policy
from trainers.tasks import TaskSource


def repeated(prompts, reps: int, seed: int):
    """reps passes over the prompts, each pass in its own seeded order."""
    out = []
    for r in range(reps):
        order = np.random.default_rng([seed, 11, r]).permutation(len(prompts))
        out += [prompts[i] for i in order]
    return out


def main(argv: list[str]) -> None:
    reps = 8
    rest = []
    for a in argv:
        if a.startswith("samples_per_prompt="):
            reps = int(a.split("=", 1)[1])
        else:
            rest.append(a)
    cfg, _ = load_config(HeadDataConfig, rest)
    torch.set_num_threads(cfg.threads)
    root = store_root(cfg)
    op = cfg.onpolicy
    policy, loaded = load_policy(cfg.model, cfg.compute_dtype)
    meta = {**store_meta(cfg, policy, loaded), "source_prompts": "reasoning-gym tasks only",
            "tasks": json.loads(json.dumps(asdict(cfg.tasks), default=list)), "samples_per_prompt": reps}
    writer = StoreWriter(root, meta)
    encoder = ChatEncoder(loaded)
    src = TaskSource(cfg.tasks)
    # task_prompts dedupes texts; keep the job's training set as it is (a repeated question is revisited more)
    train = [p for t in src.train for p in task_prompts([t.prompt], encoder)]
    held = task_prompts([t.prompt for t in src.heldout], encoder)
    assert not {p.key for p in train} & {p.key for p in held}, "held-out prompts must never be trained on"
    log(f"store {root}: {len(train)} train prompts ({len({p.key for p in train})} distinct), {len(held)} held-out; "
        f"{reps} samples per prompt, T={op.temperature}, {op.max_new_tokens} new tokens")
    generate = engine_generate(make_engine(op.engine, policy, cfg), op)

    def make(prompts, shard_index: int) -> list[Example]:
        comps = generate([list(p.ids) for p in prompts], cfg.seed * 1_000_003 + shard_index * 4096)
        out = []
        for p, c in zip(prompts, comps):
            ex = completion_example(p.key, p.ids, c)
            out.append(Example(ex.key, ex.tokens[:cfg.max_len], ex.assistant[:cfg.max_len]))
        return out

    params = {"kind": "onpolicy-tasks", "samples_per_prompt": reps,
              **{k: v for k, v in asdict(op).items() if k not in ("train_tokens", "heldout_tokens")}}
    reports = []
    for split, prompts, target in (("heldout", held, op.heldout_tokens), ("train", train, op.train_tokens)):
        reports.append(build_shards(writer, policy, source="onpolicy", split=split,
                                    items=repeated(prompts, reps, cfg.seed), make_examples=make,
                                    items_per_shard=op.prompts_per_shard, target_tokens=target, params=params,
                                    max_batch_tokens=cfg.max_batch_tokens, log=log))
    for r in reports:
        log(f"{r.source}/{r.split}: {r.tokens} tokens; kept {r.shards_kept} shards, built {r.shards_built}, "
            f"{r.tokens_built} tokens in {r.seconds:.0f} s = {r.tokens_per_s:.0f} tok/s")
    log(f"DONE {root}: {json.dumps(TokenStore(root).summary())}")


if __name__ == "__main__":
    main(sys.argv[1:])
