"""Supervised fine-tuning: data formats, token rows and packing, and the SFT trainer."""
