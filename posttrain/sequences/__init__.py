"""Token sequences of every trainer that trains on fixed rows (SFT, DPO; next KTO, Reward, Distillation): the flat
token rows and their packing (rows.py), a micro-batch's tensors (collate.py), the micro-batches of each optimizer step
from a map-style or iterable dataset with their data position (batches.py), and what chat data shares (chat.py).
Nothing here knows a trainer's format; each trainer turns its rows into TokenRows and back."""
