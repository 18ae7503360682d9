"""GRPO evaluation, as TRL's: sample `num_generations_eval` completions for every eval prompt, score them, and compute
the loss (on-policy) and the step metrics on each eval batch; report the means over batches with the `eval_` prefix.

An eval batch holds `per_device_eval_batch_size` completions per process. The last batch may hold fewer prompts;
when they do not split evenly over processes, the first prompts are repeated to fill every process's share and the
repeats are left out of every metric.
"""

import math
import time

import torch

from posttrain.data import PromptSource
from posttrain.grpo.advantages import Advantages, group_advantages
from posttrain.grpo.completions import RewardLogs
from posttrain.grpo.losses import LossInputs, StepNormalizer, micro_batch_loss
from posttrain.grpo.metrics import completion_metrics, loss_metrics, reward_metrics
from posttrain.models import token_logprobs
from posttrain.rewards import reward_inputs, score
from posttrain.training.distributed import guarded
from posttrain.weights import export_weights


def _batch_metrics(trainer, prompt_round, G: int) -> dict:
    """Generate, score and compute the loss of one eval round (its prompts spread over the processes)."""
    args, acc = trainer.args, trainer.accelerator
    real = len(prompt_round.rows)
    padded = real + (-real % acc.num_processes)
    order = [i % real for i in range(padded)]  # repeats of the first prompts fill the last processes' shares
    rows = trainer._local_share([prompt_round.rows[i] for i in order for _ in range(G)])
    prompt_ids = trainer._local_share([prompt_round.prompt_ids[i] for i in order for _ in range(G)])
    indices = trainer._local_share([prompt_round.indices[i] for i in order for _ in range(G)])
    is_real = trainer._local_share([n < real for n in range(padded) for _ in range(G)])
    row_keys = trainer._local_share(list(range(padded * G)))
    logs = RewardLogs()
    with guarded(acc):  # generation and reward functions can fail on one process only
        with trainer.sharding.whole_weights(trainer.model):  # sharded training: whole weights for the decode
            trainer.generator.sync_weights(export_weights(trainer.model))
            rollouts = trainer.generator.generate(prompt_ids, row_keys)
        prompts = [row["prompt"] for row in rows]
        completion_ids, _, completions = reward_inputs(trainer.tokenizer, rollouts, isinstance(prompts[0], list))
        local_rewards = score(trainer.reward_funcs, prompts, completions, completion_ids,
                              {c: [row[c] for row in rows] for c in trainer.reward_columns}, trainer.state,
                              trainer.state.global_step, prompt_indices=indices, loggers=logs.loggers(),
                              timeout=args.reward_timeout)
        ref_logps = trainer._reference_logps(rollouts)
    device = acc.device
    rewards = acc.gather(local_rewards.to(device)).cpu()  # [padded * G, F]
    adv = group_advantages(rewards, trainer.reward_weights, G, args.scale_rewards, args.multi_objective_aggregation)
    keep = torch.arange(real * G)
    kept = Advantages(adv.advantages[keep], adv.rewards[keep], adv.group_std[keep])
    out = reward_metrics(rewards[keep], kept, [f.name for f in trainer.reward_funcs])

    local = slice(acc.process_index * len(rows), (acc.process_index + 1) * len(rows))
    real_rows = torch.tensor(is_real, device=device)
    mask = rollouts.completion_mask & real_rows.unsqueeze(1)
    if args.mask_truncated_completions:
        mask = mask & rollouts.is_eos.unsqueeze(1)
    lengths = acc.gather(rollouts.completion_mask.sum(1)).cpu()[keep]
    out.update(completion_metrics(lengths, acc.gather(rollouts.is_eos).cpu()[keep]))
    out.update(_loss_metrics(trainer, rollouts, ref_logps, adv.advantages[local].to(device), mask))
    out.update(logs.reduced_metrics(acc))
    return out


def _loss_metrics(trainer, rollouts, ref_logps, advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """The on-policy loss of the batch and its loss metrics (entropy, kl, clip ratios)."""
    args, acc = trainer.args, trainer.accelerator
    tokens = float(mask.sum())
    total = float(acc.reduce(torch.tensor(tokens, device=acc.device), reduction="sum"))
    norm = StepNormalizer(sequences=max(int(mask.any(1).sum()), 1), tokens=tokens,
                          tokens_per_process=total / acc.num_processes)
    r = rollouts
    bonus = trainer.entropy_control.applied() if trainer.entropy_control.enabled else 0.0
    with torch.no_grad(), acc.autocast():
        logps, entropy = token_logprobs(trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                        r.completion_mask, args.temperature, with_entropy=True,
                                        packing=trainer.packing, share_prompts=trainer.share_prompts)
        result = micro_batch_loss(trainer.loss_fn, trainer.loss_params,
                                  LossInputs(logps, None, ref_logps, advantages, mask), entropy, norm,
                                  args.top_entropy_quantile, bonus)
    out = loss_metrics([dict(result.stats, tokens=mask.sum())], acc, args.beta)
    out["loss"] = float(acc.reduce(result.loss.detach(), reduction="mean"))
    return out


def evaluation_metrics(trainer, dataset, prefix: str = "eval") -> dict:
    """`prefix`_loss, _reward, _reward_std, _rewards/<f>/mean|std, _completions/*, _entropy, _kl, ... averaged over
    eval batches, and _runtime, _samples_per_second, _steps_per_second."""
    from transformers.trainer_utils import speed_metrics

    args = trainer.args
    G = args.num_generations_eval or args.num_generations
    per_round = max(1, args.per_device_eval_batch_size * trainer.accelerator.num_processes // G)
    source = PromptSource(dataset, trainer.encoder, per_round, shuffle=False, seed=args.seed, full_rounds=False)
    start, batches, samples, sums = time.time(), 0, 0, {}
    for prompt_round in source.one_pass():
        metrics = _batch_metrics(trainer, prompt_round, G)
        for key, value in metrics.items():
            if value is not None and not math.isnan(value):
                sums.setdefault(key, []).append(value)
        batches += 1
        samples += len(prompt_round.rows) * G
        trainer._call("on_prediction_step")
    out = {f"{prefix}_{k}": sum(v) / len(v) for k, v in sorted(sums.items())}
    out.update(speed_metrics(prefix, start, num_samples=samples, num_steps=batches))
    return out
