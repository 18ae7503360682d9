"""Anchor run: TRL 1.16's RLOOTrainer on CPU on a local tiny model, the workload of bench/rloo_workload.py.

Usage: python bench/trl_rloo.py MODEL_DIR [--steps 6] [--gens 8] [--batch 16] [--completion 64] [--beta 0.05] [--peft]
                                  [--threads 2] [--gradient-checkpointing]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rloo_workload import main  # noqa: E402

if __name__ == "__main__":
    main("trl")
