"""DPO's metrics, with TRL's names, from the sums every micro-batch adds to."""

import torch

# the step's sums every micro-batch adds to; metrics and the logged loss are read from them
SUMS = ("loss", "pairs", "chosen_reward", "rejected_reward", "correct_pairs", "chosen_logps", "rejected_logps",
        "chosen_logits", "chosen_tokens", "rejected_logits", "rejected_tokens", "entropy", "correct_tokens")


def step_metrics(totals: torch.Tensor, prefix: str = "") -> dict:
    """TRL's DPO metrics (loss, rewards/*, logps/*, logits/*, entropy, mean_token_accuracy) from the [len(SUMS)]
    sums over a step or an evaluation, each name prefixed with `prefix`."""
    s = dict(zip(SUMS, (float(x) for x in totals)))
    pairs = max(s["pairs"], 1.0)
    targets = max(s["chosen_tokens"] + s["rejected_tokens"], 1.0)
    out = {"loss": s["loss"],
           "rewards/chosen": s["chosen_reward"] / pairs, "rewards/rejected": s["rejected_reward"] / pairs,
           "rewards/accuracies": s["correct_pairs"] / pairs,
           "rewards/margins": (s["chosen_reward"] - s["rejected_reward"]) / pairs,
           "logps/chosen": s["chosen_logps"] / pairs, "logps/rejected": s["rejected_logps"] / pairs,
           "logits/chosen": s["chosen_logits"] / max(s["chosen_tokens"], 1.0),
           "logits/rejected": s["rejected_logits"] / max(s["rejected_tokens"], 1.0),
           "entropy": s["entropy"] / targets,
           "mean_token_accuracy": s["correct_tokens"] / max(s["chosen_tokens"], 1.0)}
    return {prefix + k: v for k, v in out.items()}
