"""KTO's metrics, with TRL's names, from the sums every micro-batch adds to."""

import torch

# the step's sums every micro-batch adds to; metrics and the logged loss are read from them
SUMS = ("loss", "chosen", "rejected", "chosen_reward", "rejected_reward", "chosen_logps", "rejected_logps",
        "chosen_logits", "chosen_tokens", "rejected_logits", "rejected_tokens", "entropy")


def step_metrics(totals: torch.Tensor, kl: float, prefix: str = "") -> dict:
    """TRL's KTO metrics (loss, kl, rewards/*, logps/*, logits/*, entropy) from the [len(SUMS)] sums over a step or an
    evaluation and its KL reference point, each name prefixed with `prefix`. As in TRL, the chosen (rejected) ones are
    left out when no example was desirable (undesirable), and the margin unless there were both."""
    s = dict(zip(SUMS, (float(x) for x in totals)))
    out = {"loss": s["loss"], "kl": kl}
    targets = s["chosen_tokens"] + s["rejected_tokens"]
    out["entropy"] = s["entropy"] / targets if targets > 0 else 0.0
    for side in ("chosen", "rejected"):
        if s[f"{side}_tokens"] > 0:
            out[f"logits/{side}"] = s[f"{side}_logits"] / s[f"{side}_tokens"]
        if s[side] > 0:
            out[f"rewards/{side}"] = s[f"{side}_reward"] / s[side]
            out[f"logps/{side}"] = s[f"{side}_logps"] / s[side]
    if s["chosen"] > 0 and s["rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return {prefix + k: v for k, v in out.items()}
