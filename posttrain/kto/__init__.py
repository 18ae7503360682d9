"""KTO: unpaired (prompt, completion, label) examples; its data preparation so far (data.py)."""
