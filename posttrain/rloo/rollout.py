"""RLOO's round: GRPO's (grpo/rollout.py), with RLOO's advantage.

    r_i = clip(sum_k w_k r_ik) - beta * sum_t (log pi_old - log pi_ref)(token t of completion i)
    A_i = r_i - mean of r_j over the other completions j of its group       (grpo/advantages.py)

The KL is a reward penalty, summed over each completion's loss tokens with the sampling policy's log-probs (TRL's
first-order estimate, which can be negative per token), gathered over processes with the rewards; its per-token mean
is logged as `kl`, as TRL logs it. Shapes: n rows on this process, C completion positions, N rows of every process.
"""

import torch

from posttrain.grpo.advantages import Advantages, leave_one_out_advantages
from posttrain.grpo.rollout import LogProbs, Rollout


class RLOORollout(Rollout):
    kl_in_reward = True

    def advantages(self, rewards: torch.Tensor, G: int, logps: LogProbs, loss_mask: torch.Tensor
                   ) -> tuple[Advantages, dict]:
        """Leave-one-out advantages of the gathered [N, F] rewards, with the KL penalty of this process's [n, C]
        log-probs over `loss_mask`; the `kl` metric (beta != 0)."""
        args, acc = self.args, self.accelerator
        kl, metrics = None, {}
        if args.beta != 0.0:
            per_token = (logps.old - logps.ref) * loss_mask  # [n, C]
            kl = acc.gather(per_token.sum(-1)).cpu()  # [N], in the rewards' order
            total = acc.reduce(torch.stack([per_token.sum(), loss_mask.sum().float()]), reduction="sum")
            metrics["kl"] = float(total[0] / total[1].clamp(min=1.0))
        return leave_one_out_advantages(rewards, self.rewards.weights, G, kl, args.beta, args.reward_clip_range,
                                        args.normalize_advantages), metrics
