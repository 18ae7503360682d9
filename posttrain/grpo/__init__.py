"""GRPO: advantages, the loss table, and the trainer."""
