"""The reward model's trainer: preference pairs scored by a sequence classifier, the Bradley-Terry loss."""
