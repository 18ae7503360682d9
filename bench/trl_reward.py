"""Anchor run: TRL 1.16's RewardTrainer on CPU on a local tiny model, the workload of bench/reward_workload.py.

Usage: python bench/trl_reward.py MODEL_DIR [--steps 8] [--pairs 8] [--prompt 192] [--chosen 64] [--rejected 64]
                                            [--peft] [--threads 2] [--gradient-checkpointing]
Prints one JSON line on stdout (TRL's own logs go to stderr): wall seconds of train(), seconds/step, tokens/s, CPU
seconds, trainer construction seconds, peak RSS MiB, step-1 loss, accuracy, margin and mean reward, last loss and
margin.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reward_workload import main  # noqa: E402

if __name__ == "__main__":
    main("trl")
