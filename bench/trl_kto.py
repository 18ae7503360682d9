"""Anchor run: TRL 1.16's KTOTrainer on CPU on a local tiny model, the workload of bench/kto_workload.py.

Usage: python bench/trl_kto.py MODEL_DIR [--steps 8] [--batch 8] [--prompt 192] [--completion 64] [--threads 2]
                                         [--gradient-checkpointing]
Prints one JSON line on stdout (TRL's own logs go to stderr): wall seconds of train(), seconds/step, the median step,
tokens/s, CPU seconds, trainer construction seconds, peak RSS MiB (and before the trainer), losses, step 2's KL
reference point, the last margin.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kto_workload import main  # noqa: E402

if __name__ == "__main__":
    main("trl")
