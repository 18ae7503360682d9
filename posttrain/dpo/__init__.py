"""Direct preference optimisation: DPOTrainer (trainer.py) on the shared loop, TRL's preference formats (data.py),
pair batches (batch.py), the reference model and precomputed reference log-probs (reference.py), and every TRL loss
(losses.py)."""
