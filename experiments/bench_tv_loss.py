"""Fused vs naive TV loss at SmolLM2 sizes, and the toy study behind TV_EPS.

    python -m experiments.bench_tv_loss configs/bench_tv_loss.yaml         # memory/time table
    python -m experiments.bench_tv_loss 'chunk_sizes=[256,512,1024]'
    python -m experiments.bench_tv_loss study=smoothing                   # TV smoothing toy study
    python -m experiments.bench_tv_loss --help                            # every key

Each (variant, N, chunk) runs in its own subprocess (``--worker``) so that its peak
memory is its own. Peak memory = ru_maxrss (peak resident set, KiB on Linux) after
the first forward+backward minus the resident set right after the inputs are
allocated, with the high-water mark reset there (``/proc/self/clear_refs`` = 5, so an
earlier peak, e.g. from importing torch, does not hide a small one): the extra memory
the loss needs on top of its inputs. Time = median (and min) of ``repeats``
forward+backward runs after that first (untimed) one.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from mtp_heads.fused_tv import DEFAULT_CHUNK_SIZE, fused_linear_tv_loss
from mtp_heads.losses import draft_loss
from rollout.config_loader import config_help, load_config, wants_help

USAGE = "python -m experiments.bench_tv_loss [configs/bench_tv_loss.yaml] [key=value ...]"
STUDIES = ("memory", "smoothing")


@dataclass(frozen=True)
class BenchTVLossConfig:
    """Fused vs naive TV memory/time at SmolLM2 sizes, or the TV smoothing toy study."""

    study: str = "memory"               # `memory` (fused vs naive, peak memory and time) or `smoothing` (toy study)
    n: tuple[int, ...] = (2048, 8192)   # memory: rows N of the loss
    d: int = 576                        # memory: hidden size (SmolLM2-135M)
    v: int = 49152                      # memory: vocabulary size (SmolLM2)
    chunk_sizes: tuple[int, ...] = (DEFAULT_CHUNK_SIZE,)   # memory: fused kernel chunk sizes compared
    repeats: int = 3                    # memory: timed forward+backward runs per case (median and min)
    threads: int = 0                    # memory: torch threads per worker process; 0 = torch's default
    steps: int = 400                    # smoothing: optimiser steps per run
    seeds: int = 2                      # smoothing: seeds per setting

    def __post_init__(self) -> None:
        if self.study not in STUDIES:
            raise ValueError(f"study must be one of {STUDIES}, got {self.study!r}")
        if not self.n or min(self.n) < 1 or not self.chunk_sizes or min(self.chunk_sizes) < 1:
            raise ValueError(f"n and chunk_sizes must be non-empty and >= 1, got {self.n}, {self.chunk_sizes}")


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _reset_peak_mib() -> float:
    """Reset the peak-RSS mark to the current RSS (Linux) and return it in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kib / 1024.0


def _worker(variant: str, n: int, d: int, v: int, chunk: int, repeats: int, threads: int) -> dict:
    try:    # shared machine: if memory runs out, the kernel should kill this worker first
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, d, generator=g) * d ** -0.5                 # [V, d]
    hs = torch.randn(n, d, generator=g).requires_grad_(True)           # [N, d]
    ht = torch.randn(n, d, generator=g)                                 # [N, d]

    def step(rows: int = n) -> float:
        s, t = hs[:rows], ht[:rows]
        if variant == "naive":
            loss = draft_loss("tv", s @ weight.t(), target_logits=t @ weight.t())
        else:
            loss = fused_linear_tv_loss(s, t, weight, chunk_size=chunk)
        loss.backward()
        hs.grad = None
        return loss.item()

    step(rows=min(n, 16, chunk))   # load kernels' code pages and lazy buffers before measuring
    base = _reset_peak_mib()
    value = step()
    peak = _maxrss_mib() - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "n": n, "chunk": chunk, "peak_mib": peak,
            "time_s": statistics.median(times), "min_s": min(times), "loss": value}


def _run_worker(args: BenchTVLossConfig, variant: str, n: int, chunk: int) -> dict | None:
    job = {"variant": variant, "n": n, "d": args.d, "v": args.v, "chunk": chunk, "repeats": args.repeats,
           "threads": args.threads}
    cmd = [sys.executable, "-m", "experiments.bench_tv_loss", "--worker", json.dumps(job)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:   # e.g. killed for memory: report it, keep going
        tail = (proc.stderr.strip().splitlines() or ["no stderr"])[-1]
        print(f"{n:>6} {variant:>12} FAILED rc={proc.returncode}: {tail}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(args: BenchTVLossConfig) -> None:
    print(f"d={args.d} V={args.v} float32, threads={args.threads or torch.get_num_threads()}, "
          f"repeats={args.repeats} (median, min), peak = RSS high-water mark over the inputs' RSS")
    print(f"{'N':>6} {'variant':>12} {'peak MiB':>9} {'median s':>8} {'min s':>7} {'mem f/n':>8} "
          f"{'time f/n':>9} {'min f/n':>8}")
    for n in args.n:
        naive = _run_worker(args, "naive", n, 0)
        if naive:
            print(f"{n:>6} {'naive':>12} {naive['peak_mib']:>9.0f} {naive['time_s']:>8.2f} "
                  f"{naive['min_s']:>7.2f}", flush=True)
        for chunk in args.chunk_sizes:
            f = _run_worker(args, "fused", n, chunk)
            if f is None:
                continue
            ratios = ""
            if naive:
                assert abs(f["loss"] - naive["loss"]) < 1e-4, (f["loss"], naive["loss"])
                ratios = (f"{f['peak_mib'] / naive['peak_mib']:>8.3f} "
                          f"{f['time_s'] / naive['time_s']:>9.2f} {f['min_s'] / naive['min_s']:>8.2f}")
            print(f"{n:>6} {'fused c=' + str(chunk):>12} {f['peak_mib']:>9.0f} {f['time_s']:>8.2f} "
                  f"{f['min_s']:>7.2f} {ratios}", flush=True)


# --- TV smoothing toy study ------------------------------------------------------------

def _toy_problem(seed: int, realizable: bool, v: int = 512, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(v, d, generator=g) * 0.5                            # teacher head [V, d]
    b = torch.randn(v, d, generator=g) * 0.2
    c = torch.randn(d, d, generator=g) * 0.5

    def teacher(x):                                                     # [M, d] -> [M, V]
        logits = x @ a.t()
        return logits if realizable else logits + torch.relu(x @ c.t()) @ b.t()

    x_train = torch.randn(4096, d, generator=g)
    x_test = torch.randn(1024, d, generator=g)
    return x_train, teacher(x_train), x_test, teacher(x_test), a, g


SGD_LR = 30.0   # deliberately high: the regime where a non-shrinking gradient jitters


def _toy_run(method: tuple[str, float, float], seed: int, realizable: bool, opt: str,
             steps: int) -> list[float]:
    kind, eps, kl_mix = method
    x_train, t_train, x_test, t_test, a, g = _toy_problem(seed, realizable)
    head = torch.nn.Linear(x_train.shape[1], t_train.shape[1], bias=False)
    with torch.no_grad():   # start near the teacher's linear part: the regime near the optimum
        head.weight.copy_(a + 0.2 * torch.randn(a.shape, generator=g))
    optim = (torch.optim.Adam(head.parameters(), lr=3e-3) if opt == "adam"
             else torch.optim.SGD(head.parameters(), lr=SGD_LR))
    curve = []
    for step in range(steps):
        idx = torch.randint(0, x_train.shape[0], (256,), generator=g)
        s = head(x_train[idx])
        loss = draft_loss(kind, s, target_logits=t_train[idx], eps=eps)
        if kl_mix:
            loss = loss + kl_mix * draft_loss("fkl", s, target_logits=t_train[idx])
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 10 == 9:
            with torch.no_grad():
                curve.append(float(draft_loss("tv", head(x_test), target_logits=t_test, eps=0.0)))
    return curve


def smoothing_study(args: BenchTVLossConfig) -> None:
    torch.set_num_threads(1)
    methods = {"tv eps=0": ("tv", 0.0, 0.0), "tv eps=1e-5": ("tv", 1e-5, 0.0),
               "tv eps=1e-4": ("tv", 1e-4, 0.0), "tv eps=1e-3": ("tv", 1e-3, 0.0),
               "tv+0.1fkl": ("tv", 0.0, 0.1), "fkl": ("fkl", 0.0, 0.0)}
    print(f"toy: V=512 d=16 linear head started near the teacher's linear part, batch 256, "
          f"{args.steps} steps, Adam lr 3e-3 / SGD lr {SGD_LR}, seeds 0-{args.seeds - 1}; held-out "
          "exact TV every 10 steps; final = mean of last 5 evals; jitter = mean |delta| over the last third")
    print(f"{'setting':>16} {'method':>12} {'final TV':>9} {'best TV':>8} {'jitter':>8}")
    for realizable in (True, False):
        for opt in ("adam", "sgd"):
            for name, method in methods.items():
                finals, bests, jitters = [], [], []
                for seed in range(args.seeds):
                    c = torch.tensor(_toy_run(method, seed, realizable, opt, args.steps))
                    late = c[len(c) * 2 // 3:]
                    finals.append(float(late[-5:].mean()))
                    bests.append(float(c.min()))
                    jitters.append(float((late[1:] - late[:-1]).abs().mean()))
                setting = ("realizable" if realizable else "misspecified") + "/" + opt
                print(f"{setting:>16} {name:>12} {statistics.mean(finals):>9.4f} "
                      f"{statistics.mean(bests):>8.4f} {statistics.mean(jitters):>8.5f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:          # internal: one measurement in a fresh process
        print(json.dumps(_worker(**json.loads(argv[1]))))
        return
    if wants_help(argv):
        print(config_help(BenchTVLossConfig, usage=USAGE), end="")
        return
    args, resolved = load_config(BenchTVLossConfig, argv)
    print(resolved, end="")
    if args.study == "smoothing":
        smoothing_study(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
