"""posttrain's side of the distillation benchmark: its DistillationTrainer on the workload of bench/distillation_workload.py.

Usage: python bench/distillation_step.py MODEL_DIR TEACHER_DIR [--steps 4] [--batch 8] [--completion 128] [--beta 1.0]
                                  [--threads 2] [--gradient-checkpointing]
Prints one JSON line on stdout (the trainer's own logs go to stderr): wall seconds of train(), seconds/step, the
median step, CPU seconds, construction seconds, peak RSS MiB (and before the trainer), step 1's and the last loss.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distillation_workload import main  # noqa: E402

if __name__ == "__main__":
    main("posttrain")
