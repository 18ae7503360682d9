"""posttrain's side of the RLOO benchmark: its RLOOTrainer on the workload of bench/rloo_workload.py (the same
flags and JSON keys as bench/trl_rloo.py, so the two lines read as a ratio).

Usage: python bench/rloo_step.py MODEL_DIR [--steps 6] [--gens 8] [--batch 16] [--completion 64] [--beta 0.05] [--peft]
                                  [--threads 2] [--gradient-checkpointing]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rloo_workload import main  # noqa: E402

if __name__ == "__main__":
    main("posttrain")
