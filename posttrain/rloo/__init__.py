"""RLOO (TRL 1.16's RLOOTrainer) on GRPO's round: the same sampling, scoring and log-prob passes, with the
leave-one-out advantage (rollout.py) and the sequence-level clipped loss (grpo/losses.py's "rloo")."""
