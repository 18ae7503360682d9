"""KTO's losses (TRL's loss_type kto and apo_zero_unpaired) on the sequence log-probs of a micro-batch's examples.

Notation, per example (all [N]):
    pi, ref     policy / reference log-prob of the completion (summed over its tokens)
    lr          the log-ratio pi - ref;  b = beta;  s the sigmoid
    z0          the KL reference point: the step's mean of pi(y'|x) - ref(y'|x) over mismatched pairs (x, y') (each
                prompt with another example's completion), detached and clamped at 0 (kl_reference_point)
    w           desirable_weight for a desirable example, undesirable_weight for an undesirable one

    kto                 desirable: w (1 - s(b (lr - z0)))     undesirable: w (1 - s(b (z0 - lr)))   (KTO, Eq. 7)
    apo_zero_unpaired   desirable: w (1 - s(b lr))            undesirable: w s(b lr)                (APO-zero)

`example_losses` returns the per-example loss [N] and the reward b * lr (detached). TRL averages the losses over each
micro-batch (and its KL estimate over each micro-batch's mismatched pairs, a mean over processes); posttrain sums them
over the optimizer step and divides by the step's example count, and takes z0 over the whole step's mismatched pairs
(every process's), so the update does not depend on how the step is split into micro-batches and processes. With one
micro-batch a step the two are the same.
"""

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kl_reference_point(kl_logratio_sum: torch.Tensor, kl_pairs: torch.Tensor) -> torch.Tensor:
    """z0 from the step's sum of pi(y'|x) - ref(y'|x) over its mismatched pairs and their count (both summed over
    every process): their mean, clamped at 0, no gradient; 0 where there are none."""
    mean = kl_logratio_sum.detach() / kl_pairs.clamp(min=1)
    return mean.clamp(min=0)


def example_losses(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
                   beta: float, loss_type: str = "kto", desirable_weight: float = 1.0,
                   undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example loss [N] float32, reward b * lr [N] detached) of `loss_type` (the module's docstring).

    Args:
        policy_logps, ref_logps: [N] completion log-probs under the policy and the reference.
        desirable: [N] bool, each example's label.
        kl: the KL reference point z0 (a 0-d tensor; unused by apo_zero_unpaired).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: KTO's losses are {', '.join(LOSS_TYPES)}")
    logratios = (policy_logps - ref_logps).float()
    if loss_type == "kto":
        desirable_losses = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable_losses = 1 - F.sigmoid(beta * (kl - logratios))
    else:
        desirable_losses = 1 - F.sigmoid(beta * logratios)
        undesirable_losses = F.sigmoid(beta * logratios)
    losses = torch.where(desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses)
    return losses, (beta * logratios).detach()
