"""Rewards for the multi-process tests: one records which prompts each process scored; one varies with what was
sampled when every completion has the same length."""

import json
import os


def recording_length_reward(prompts, completions, trainer_state, **kwargs):
    rewards = [float(len(c)) for c in completions]
    path = os.path.join(os.environ["POSTTRAIN_TEST_LOG"], f"rank{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step + 1, "prompts": prompts, "rewards": rewards}) + "\n")
    return rewards


def digit_share(completions, **kwargs):
    """The share of each completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def vowel_share(completions, **kwargs):
    """The share of the answer's characters that are vowels (conversational completions: the answer's content)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(1, len(t)) for t in texts]
