"""KTO: unpaired (prompt, completion, label) examples. data.py prepares them as TRL does, batch.py collates a
micro-batch with its KL pairs, losses.py holds the kto and apo_zero_unpaired losses, metrics.py TRL's metric names,
trainer.py the KTOTrainer on the shared loop."""
