"""Adapters that plug the rollout accelerator into other RL trainers (they sit above rollout.accelerator).

trl: TRL's GRPOTrainer (`rollout_func` + a TrainerCallback). verl and OpenRLHF are mapped on
paper in docs/integrations.md.
"""
