"""Our loss and its metrics equal TRL 1.16's `GRPOTrainer._compute_loss` on the same tensors, for every loss type.

TRL's method runs on a stand-in trainer (one process, one micro-batch per optimizer step, where both normalise the
same way); its log-prob pass is replaced by the tensors we feed ours. Skipped when TRL is not installed.
"""

import math
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from posttrain.configs import GRPOConfig
from posttrain.grpo.entropy import EntropyControl
from posttrain.grpo.losses import LossInputs, LossParams, StepNormalizer, get_loss, micro_batch_loss
from posttrain.grpo.metrics import loss_metrics

trl = pytest.importorskip("trl")


class OneProcess:
    """The accelerator methods TRL's loss calls, for a single process."""

    num_processes = 1
    sync_gradients = True
    device = torch.device("cpu")

    def gather(self, x):
        return x.reshape(-1) if x.dim() == 0 else x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_loss(cfg: GRPOConfig, logps, entropy, old, ref, adv, mask, tool_mask=None):
    from trl import GRPOTrainer as TRLTrainer

    coef = cfg.entropy_coef
    stand_in = SimpleNamespace(
        args=SimpleNamespace(use_bias_correction_kl=cfg.use_bias_correction_kl, delta=cfg.delta,
                             sapo_temperature_pos=cfg.sapo_temperature_pos,
                             sapo_temperature_neg=cfg.sapo_temperature_neg, vespo_k_pos=cfg.vespo_k_pos,
                             vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                             vespo_lambda_neg=cfg.vespo_lambda_neg, steps_per_generation=1,
                             entropy_target=cfg.entropy_target),
        top_entropy_quantile=cfg.top_entropy_quantile, off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta, loss_type=cfg.loss_type,
        epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=OneProcess(),
        max_completion_length=cfg.max_completion_length, _entropy_bonus_enabled=coef != 0.0,
        entropy_coef=coef, use_adaptive_entropy=False, _metrics={"train": defaultdict(list)}, aux_loss_enabled=False,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None))
    stand_in.get_high_entropy_mask = lambda e, m, t: TRLTrainer.get_high_entropy_mask(stand_in, e, m, t)
    stand_in.get_off_policy_mask = TRLTrainer.get_off_policy_mask
    stand_in.get_gamma_weights = TRLTrainer.get_gamma_weights
    inputs = {"prompt_ids": torch.zeros(adv.size(0), 1, dtype=torch.long),
              "prompt_mask": torch.ones(adv.size(0), 1, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv,  # TRL counts the loss mask's tokens (completion_mask * tool_mask), as _generate does
              "num_items_in_batch": mask.sum() if tool_mask is None else (mask & tool_mask).sum()}
    if tool_mask is not None:  # TRL's multi-turn rollouts: 0 on the tool results' tokens
        inputs["tool_mask"] = tool_mask.long()
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = TRLTrainer._compute_loss(stand_in, None, inputs)
    return loss, {k: v[0] for k, v in stand_in._metrics["train"].items()}


def _ours(cfg: GRPOConfig, logps, entropy, old, ref, adv, mask, tool_mask=None):
    """The trainer's own micro-batch loss (grpo/losses.py's micro_batch_loss, which training and evaluation call), on
    the loss mask the rollout gives it (the completion's tokens, less a tool result's)."""
    mask = mask if tool_mask is None else mask & tool_mask
    norm = StepNormalizer(sequences=adv.size(0), tokens=float(mask.sum()), tokens_per_process=float(mask.sum()))
    control = EntropyControl.from_config(cfg)
    out = micro_batch_loss(get_loss(cfg.loss_type), LossParams.from_config(cfg), LossInputs(logps, old, ref, adv, mask),
                           entropy, norm, cfg.top_entropy_quantile, control.applied() if control.enabled else 0.0)
    return out.loss, loss_metrics([replace(out.stats, tokens=mask.sum())], OneProcess())


CASES = [dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")] + [
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", beta=0.1),
    dict(loss_type="grpo", beta=0.1, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False),
    dict(loss_type="cispo", beta=0.05, epsilon_high=1.1),
    dict(loss_type="dapo", delta=1.6, epsilon_high=0.28),
    dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    dict(loss_type="dapo", top_entropy_quantile=0.5),
    dict(loss_type="dr_grpo", entropy_coef=0.01),
    dict(loss_type="sapo", beta=0.04, sapo_temperature_neg=1.3),
]


# a multi-turn rollout's tool mask: tool results inside completions (0), the model's tokens around them (1)
TOOL_MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()


@pytest.mark.parametrize("tools", [False, True], ids=["", "tool-mask"])
@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_gradient_and_metrics_equal_trl(case, on_policy, tools):
    """...with a tool mask too: TRL's loss over completion_mask * tool_mask, ours over the rollout's loss mask."""
    torch.manual_seed(0)
    cfg = GRPOConfig(max_completion_length=6, **case)
    base = -torch.rand(4, 6) * 2  # [b, C] log-probs
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()
    old = None if on_policy else base + 0.15 * torch.randn(4, 6)
    ref = base + 0.3 * torch.randn(4, 6) if cfg.beta else None
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5])
    entropy_values = torch.rand(4, 6) * 3
    results = []
    for compute in (_trl_loss, _ours):
        logps = base.clone().requires_grad_()
        entropy = entropy_values.clone().requires_grad_()
        loss, metrics = compute(cfg, logps, entropy, old, ref, adv, mask, TOOL_MASK if tools else None)
        loss.backward()
        results.append((loss.item(), logps.grad * mask, entropy.grad * mask if entropy.grad is not None else None,
                        metrics))
        if tools:  # a tool result's tokens get no gradient
            assert not logps.grad[mask & ~TOOL_MASK].any()
    (trl_loss, trl_grad, trl_egrad, trl_metrics), (loss, grad, egrad, metrics) = results
    assert math.isclose(loss, trl_loss, rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(grad, trl_grad, rtol=1e-5, atol=1e-7)
    if cfg.entropy_coef:
        assert torch.allclose(egrad, trl_egrad, rtol=1e-5, atol=1e-7)
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean"):
        if name in trl_metrics:
            assert math.isclose(metrics[name], trl_metrics[name], rel_tol=1e-5, abs_tol=1e-7), name
