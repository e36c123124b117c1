"""The `mtp-rollout` command: one subcommand per runnable job.

Bad input (a ValueError or OSError from a job: a wrong key, value, path or file) is printed as
one line and exits 2; any other failure prints one line and exits 1; `--debug` (anywhere on
the command line) shows the full traceback instead.
"""
from __future__ import annotations

import importlib
import sys
import traceback

# subcommand -> module whose main(argv) runs it (imported lazily: each pulls in different stacks)
COMMANDS = {
    "run": ("experiments.async_rl", "async RL (GRPO) with speculative rollouts, head co-training, monitoring"),
    "generate": ("experiments.generate", "chat with the policy through speculative decoding"),
    "train-heads": ("experiments.pretrain_heads", "pre-train MTP heads by self-distillation"),
    "bench-decode": ("experiments.bench_decode", "speculative vs plain decoding throughput"),
    "sweep": ("experiments.entropy_sweep", "acceptance vs entropy per draft mode and heads, temperature scanned"),
    "ablate": ("experiments.entropy_ablation", "draft mode x head objective over async RL runs whose entropy rises"),
    "refresh-study": ("experiments.refresh_study", "co-trainer refresh schedules over async RL runs: acceptance and cost"),
    "survey-tasks": ("experiments.survey_tasks", "which reasoning-gym datasets give the policy reward with variance in a group"),
    "trl-grpo": ("experiments.trl_grpo", "TRL's GRPOTrainer rolling out through the accelerator"),
    "clean-ray": ("rollout.ray_guard", "stop Ray processes left behind by a killed mtp-rollout run"),
}

BAD_INPUT = (ValueError, OSError)     # includes omegaconf's and our validation errors, missing files
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def usage() -> str:
    lines = ["usage: mtp-rollout [--debug] COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "--debug: show the full traceback of an error (default: one line)",
              "`mtp-rollout COMMAND --help` lists a command's arguments."]
    return "\n".join(lines)


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"mtp-rollout: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    name = argv[0]
    try:
        module = importlib.import_module(COMMANDS[name][0])
        result = module.main(argv[1:])
    except KeyboardInterrupt:
        print(f"mtp-rollout {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
        if debug:
            traceback.print_exc()
        code = EXIT_BAD_INPUT if isinstance(e, BAD_INPUT) else EXIT_FAILED
        kind = "error" if code == EXIT_BAD_INPUT else f"failed ({type(e).__name__})"
        hint = "" if debug else " [--debug shows the traceback]"
        print(f"mtp-rollout {name}: {kind}: {one_line(e)}{hint}", file=sys.stderr)
        return code
    # jobs return an exit code, None, or a result (train-heads returns its report): success either way
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
