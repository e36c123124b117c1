"""The `mtp-rollout` command: one subcommand per runnable job."""
from __future__ import annotations

import importlib
import sys

# subcommand -> module whose main(argv) runs it (imported lazily: each pulls in different stacks)
COMMANDS = {
    "run": ("experiments.async_rl", "async RL (GRPO) with speculative rollouts, head co-training, monitoring"),
    "generate": ("experiments.generate", "chat with the policy through speculative decoding"),
    "train-heads": ("experiments.pretrain_heads", "pre-train MTP heads by self-distillation"),
    "bench-decode": ("experiments.bench_decode", "speculative vs plain decoding throughput"),
}


def usage() -> str:
    lines = ["usage: mtp-rollout COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"mtp-rollout: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
