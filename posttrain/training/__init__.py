"""Pieces of the training loop shared by every trainer: optimizer, schedule, metrics and logging, saving."""
