"""A reward for the multi-process test: records which prompts each process scored."""

import json
import os


def recording_length_reward(prompts, completions, trainer_state, **kwargs):
    rewards = [float(len(c)) for c in completions]
    path = os.path.join(os.environ["POSTTRAIN_TEST_LOG"], f"rank{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step + 1, "prompts": prompts, "rewards": rewards}) + "\n")
    return rewards
