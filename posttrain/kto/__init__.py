"""KTO: unpaired (prompt, completion, label) examples. Built so far: its data preparation (data.py) and its losses
(losses.py); the trainer is issue 36's next step."""
