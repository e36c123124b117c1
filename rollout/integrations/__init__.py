"""Adapters that plug the rollout accelerator into other RL trainers (they sit above rollout.accelerator).

trl: TRL's GRPOTrainer (`rollout_func` + a TrainerCallback). verl (0.9.1, its own environment): a
rollout replica, its weight adapter (verl.py) and an object-store checkpoint backend (verl_checkpoint.py).
OpenRLHF is mapped on paper in docs/integrations.md.
"""
