"""On-policy distillation (TRL 1.16's DistillationTrainer) on GRPO's trainer: rollout.py samples one completion per
prompt from the student and computes the divergence from the teacher (models/teacher.py); trainer.py is the trainer."""
