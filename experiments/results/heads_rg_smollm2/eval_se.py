"""Held-out teacher-forced conditional acceptance per draft position, with standard errors.

    PYTHONPATH=$PWD python experiments/results/heads_rg_smollm2/eval_se.py out.json \
        shipped=mtp_heads/default_heads/smollm2-135m.safetensors finetuned=/path/heads.safetensors

The metric is mtp_heads.evaluate.teacher_forced_acceptance (the one the heads' card reports), run
one sequence at a time so that the spread between sequences gives a standard error: positions
within a sequence are correlated, so the SE is the sequence-clustered SE of a ratio mean,
sqrt(n / (n - 1) * sum_i (s_i - m * r_i)^2) / sum_i r_i (s_i: summed acceptance of sequence i,
r_i: its scored positions). The first head named is the reference: for every other head the
paired difference (same sequences) and its SE are reported too.

Evaluation sets (EVAL_SETS below): the reasoning-gym on-policy held-out split (all of it, whole
sequences) and the card's ShareGPT held-out set (the first 32 held-out conversations, cut to 256
tokens, as `eval.heldout_sequences=32 eval.max_seq_len=256`).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from mtp_heads.checkpoint import load_heads
from mtp_heads.data.token_store import TokenStore
from mtp_heads.evaluate import MODES, EvalSet, teacher_forced_acceptance
from rollout.models.loaders import load_policy

CACHE = Path("~/.cache/mtp-rollout/head_data").expanduser()
EVAL_SETS = {   # name: (store root, source, sequences (None = all), max_seq_len)
    "rg_heldout": (CACHE / "smollm2-135m-rg-len512", "onpolicy", None, 512),
    "sharegpt_heldout": (CACHE / "smollm2-135m-sgheldout-len512", "sharegpt", 32, 256),
}
TEMPERATURES = (0.7, 1.0)
STEPS = 3


def clustered(s: list[float], r: list[int]) -> tuple[float, float]:
    """(ratio mean, sequence-clustered SE)."""
    R = sum(r)
    m = sum(s) / R
    n = len(s)
    var = n / max(n - 1, 1) * sum((si - m * ri) ** 2 for si, ri in zip(s, r))
    return m, math.sqrt(var) / R


def per_sequence(policy, heads, es: EvalSet) -> dict:
    """{T: {mode: {"sums": [[seq][pos]], "rows": [[seq][pos]], "tau_sums": [seq], "chains": [seq]}}}."""
    out = {T: {m: {"sums": [], "rows": [], "tau_sums": [], "chains": []} for m in MODES} for T in es.temperatures}
    for i, b in enumerate(es.batches):
        one = EvalSet([b], {T: [es.lse[T][i]] for T in es.temperatures})
        r = teacher_forced_acceptance(policy, heads, one, STEPS)
        for T in es.temperatures:
            for m in MODES:
                x = r[T][m]
                o = out[T][m]
                o["rows"].append(x["rows"])
                o["sums"].append([a * n for a, n in zip(x["per_position"], x["rows"])])
                o["chains"].append(x["chains"])
                o["tau_sums"].append(x["tau"] * x["chains"])
    return out


def summarise(ps: dict, ref: dict | None) -> dict:
    res = {}
    for T, modes in ps.items():
        res[str(T)] = {}
        for m, o in modes.items():
            d = {"per_position": [], "se": [], "rows": [sum(r[j] for r in o["rows"]) for j in range(STEPS)],
                 "sequences": len(o["rows"])}
            for j in range(STEPS):
                mean, se = clustered([s[j] for s in o["sums"]], [r[j] for r in o["rows"]])
                d["per_position"].append(mean)
                d["se"].append(se)
            d["tau"], d["tau_se"] = clustered(o["tau_sums"], o["chains"])
            if ref is not None:
                q = ref[T][m]
                d["diff_vs_ref"], d["diff_se"] = [], []
                for j in range(STEPS):
                    mean, se = clustered([a[j] - b[j] for a, b in zip(o["sums"], q["sums"])],
                                         [r[j] for r in o["rows"]])
                    d["diff_vs_ref"].append(mean)
                    d["diff_se"].append(se)
                d["tau_diff"], d["tau_diff_se"] = clustered([a - b for a, b in zip(o["tau_sums"], q["tau_sums"])],
                                                            o["chains"])
            res[str(T)][m] = d
    return res


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    out_path, heads_args = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    t0 = time.perf_counter()
    policy, _ = load_policy("smollm2-135m", "float32")
    sets = {}
    for name, (root, src, n, max_len) in EVAL_SETS.items():
        split = TokenStore(root).split("heldout", sources=[src])
        sets[name] = EvalSet.build(policy, split, TEMPERATURES, max_sequences=n, max_seq_len=max_len, batch_tokens=1)
        print(f"{name}: {len(sets[name].batches)} sequences, {sets[name].num_positions} scored positions "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    report = {"eval_sets": {k: {"store": str(v[0]), "source": v[1], "sequences": len(sets[k].batches),
                                "max_seq_len": v[3], "positions": sets[k].num_positions} for k, v in EVAL_SETS.items()},
              "heads": {}}
    raw = {}
    for hname, path in heads_args:
        heads, meta = load_heads(path, policy)
        report["heads"][hname] = {"path": path, "steps": meta.steps, "loss": meta.loss, "results": {}}
        for sname, es in sets.items():
            ps = per_sequence(policy, heads, es)
            ref = raw.get((heads_args[0][0], sname)) if hname != heads_args[0][0] else None
            raw[(hname, sname)] = ps
            res = summarise(ps, ref)
            report["heads"][hname]["results"][sname] = res
            r = res["1.0"]
            line = " | ".join(f"{m} " + " / ".join(f"{a:.3f}±{s:.3f}" for a, s in zip(r[m]["per_position"], r[m]["se"]))
                              + f" tau {r[m]['tau']:.3f}±{r[m]['tau_se']:.3f}" for m in MODES)
            print(f"[{hname}] {sname} T=1: {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if ref is not None:
                print(f"[{hname} - {heads_args[0][0]}] {sname} T=1: " + " | ".join(
                    f"{m} " + " / ".join(f"{a:+.4f}±{s:.4f}" for a, s in zip(r[m]["diff_vs_ref"], r[m]["diff_se"]))
                    + f" tau {r[m]['tau_diff']:+.4f}±{r[m]['tau_diff_se']:.4f}" for m in MODES), flush=True)
    report["seconds"] = time.perf_counter() - t0
    out_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
