"""posttrain's side of the KTO benchmark: its KTOTrainer on the workload of bench/kto_workload.py.

Usage: python bench/kto_step.py MODEL_DIR [--steps 8] [--batch 8] [--prompt 192] [--completion 64] [--threads 2]
                                          [--gradient-checkpointing]
Same flags, rows and JSON keys as bench/trl_kto.py (TRL's KTOTrainer), so the two lines read as a ratio.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kto_workload import main  # noqa: E402

if __name__ == "__main__":
    main("posttrain")
