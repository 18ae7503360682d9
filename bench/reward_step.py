"""posttrain's side of the reward-model benchmark: its RewardTrainer on the workload of bench/reward_workload.py.

Usage: python bench/reward_step.py MODEL_DIR [--steps 8] [--pairs 8] [--prompt 192] [--chosen 64] [--rejected 64]
                                             [--peft] [--threads 2] [--gradient-checkpointing]
Same flags, rows and JSON keys as bench/trl_reward.py (TRL's RewardTrainer), so the two lines read as a ratio.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reward_workload import main  # noqa: E402

if __name__ == "__main__":
    main("posttrain")
