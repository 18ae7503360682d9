"""Token sequences of every trainer that trains on fixed rows (SFT, DPO, KTO, the reward model): the flat token rows
and their packing (rows.py), a micro-batch's tensors (collate.py), the micro-batches of each optimizer step from a
map-style or iterable dataset with their data position (batches.py), what chat data shares (chat.py), and the
preference pairs' source: their formats (preference.py), their preparation against completions (pair_data.py) and
their micro-batches (pair_batch.py). Each trainer turns its rows into TokenRows and back."""
