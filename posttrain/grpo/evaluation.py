"""GRPO evaluation, as TRL's: sample `num_generations_eval` completions for every eval prompt, score them, and compute
the loss (on-policy) and the step metrics on each eval batch; report the means over batches with the `eval_` prefix.

An eval batch holds `per_device_eval_batch_size` completions per process. The last batch may hold fewer prompts;
when they do not split evenly over processes, the first prompts are repeated to fill every process's share and the
repeats are left out of every metric.
"""

import math
import time
from dataclasses import replace
from typing import Callable

import torch

from posttrain.data import PromptSource
from posttrain.grpo.advantages import Advantages
from posttrain.grpo.losses import LossInputs, MicroBatchLoss, StepNormalizer
from posttrain.grpo.metrics import completion_metrics, loss_metrics, reward_metrics, tool_metrics
from posttrain.grpo.rollout import Rollout

PolicyLoss = Callable[[LossInputs, torch.Tensor, StepNormalizer], MicroBatchLoss]  # grpo/losses.py micro_batch_loss


def _batch_metrics(rollout: Rollout, policy_loss: PolicyLoss, prompt_round, G: int, step: int) -> dict:
    """Generate, score and compute the loss of one eval round (its prompts spread over the processes)."""
    args, acc = rollout.args, rollout.accelerator
    scored, share = rollout.sample(prompt_round, G, step, pad_prompts=True)
    rollouts = scored.rollouts
    device = acc.device
    local = slice(acc.process_index * len(share.rows), (acc.process_index + 1) * len(share.rows))
    mask = rollouts.model_tokens & torch.tensor(share.real, device=device).unsqueeze(1)
    if args.mask_truncated_completions:
        mask = mask & rollouts.is_eos.unsqueeze(1)
    logps = rollout.log_probs(rollouts, old=rollout.kl_in_reward)  # a KL penalty reads the policy's log-probs
    adv, adv_metrics = rollout.advantages(scored.rewards, G, logps, mask)  # [padded * G] over every process's rows
    keep = torch.arange(len(prompt_round.rows) * G)
    kept = Advantages(adv.advantages[keep], adv.rewards[keep], adv.group_std[keep])
    out = reward_metrics(scored.rewards[keep], kept, rollout.rewards.names)
    out.update(adv_metrics)
    lengths = acc.gather(rollouts.model_tokens.sum(1)).cpu()[keep]
    out.update(completion_metrics(lengths, acc.gather(rollouts.is_eos).cpu()[keep]))
    out.update(_loss_metrics(rollout, policy_loss, rollouts, logps.ref, adv.advantages[local].to(device), mask))
    out.update(scored.logs.reduced_metrics(acc))
    out.update(tool_metrics(scored.tool_counts, acc))  # every row generated, repeats included, as TRL counts them
    return out


def _loss_metrics(rollout: Rollout, policy_loss: PolicyLoss, rollouts, ref_logps, advantages: torch.Tensor,
                  mask: torch.Tensor) -> dict:
    """The on-policy loss of the batch and its loss metrics (entropy, kl, clip ratios)."""
    acc = rollout.accelerator
    tokens = float(mask.sum())
    total = float(acc.reduce(torch.tensor(tokens, device=acc.device), reduction="sum"))
    norm = StepNormalizer(sequences=max(int(mask.any(1).sum()), 1), tokens=tokens,
                          tokens_per_process=total / acc.num_processes)
    with torch.no_grad(), acc.autocast():
        logps, entropy = rollout.policy_logps(rollout.model, rollouts, with_entropy=True)
        result = policy_loss(LossInputs(logps, None, ref_logps, advantages, mask), entropy, norm)
    out = loss_metrics([replace(result.stats, tokens=mask.sum())], acc)
    out["loss"] = float(acc.reduce(result.loss.detach(), reduction="mean"))
    return out


def evaluation_metrics(rollout: Rollout, policy_loss: PolicyLoss, encoder, dataset, step: int, prefix: str = "eval",
                       on_batch: Callable[[], None] = lambda: None) -> dict:
    """`prefix`_loss, _reward, _reward_std, _rewards/<f>/mean|std, _completions/*, _entropy, _kl, ... averaged over
    eval batches, and _runtime, _samples_per_second, _steps_per_second.

    Args:
        rollout: the trainer's round stage (grpo/rollout.py).
        policy_loss: a micro-batch's loss, as training computes it.
        encoder: the trainer's PromptEncoder.
        step: the step the reward functions are told.
        on_batch: called after each eval batch (on_prediction_step).
    """
    from transformers.trainer_utils import speed_metrics

    args = rollout.args
    G = args.num_generations_eval or args.num_generations
    per_round = max(1, args.per_device_eval_batch_size * rollout.accelerator.num_processes // G)
    source = PromptSource(dataset, encoder, per_round, shuffle=False, seed=args.seed, full_rounds=False)
    start, batches, samples, sums = time.time(), 0, 0, {}
    for prompt_round in source.one_pass():
        metrics = _batch_metrics(rollout, policy_loss, prompt_round, G, step)
        for key, value in metrics.items():
            if value is not None and not math.isnan(value):
                sums.setdefault(key, []).append(value)
        batches += 1
        samples += len(prompt_round.rows) * G
        on_batch()
    out = {f"{prefix}_{k}": sum(v) / len(v) for k, v in sorted(sums.items())}
    out.update(speed_metrics(prefix, start, num_samples=samples, num_steps=batches))
    return out
