"""RLOOTrainer: TRL 1.16's RLOOTrainer on GRPO's trainer, which it shares everything with but the advantage and the
loss: its data (the prompt stream, the generation buffer), its round (every generation path, rewards, log-prob
passes), its loop, checkpoints and metrics.

    advantage  leave-one-out baseline, optional reward clipping and batch normalisation, KL as a reward penalty
               (rloo/rollout.py)
    loss       -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) per sequence, rho = pi(y) / pi_old(y) the
               sequence's probability ratio (exp of its summed token log-ratios), averaged over the step's
               sequences (grpo/losses.py "rloo"); no KL term
"""

from dataclasses import replace

from posttrain.configs.rloo import RLOOConfig
from posttrain.grpo.losses import LossParams, get_loss
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.rloo.rollout import RLOORollout


class RLOOTrainer(GRPOTrainer):
    """TRL's RLOOTrainer: `RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), train_dataset=...)`, with TRL's
    arguments (GRPOTrainer's, of which tools, environment_factory and rollout_func are posttrain's additions here:
    TRL's RLOOTrainer takes none)."""

    _title = "RLOO"
    _config_class = RLOOConfig
    _rollout_class = RLOORollout

    def _objective(self, args) -> tuple:
        """RLOO's loss: one clipped ratio per sequence, the product of its tokens' ratios; the KL is not in it."""
        params = replace(LossParams.from_config(args), beta=0.0, importance_sampling_level="sequence_sum",
                         delta=None, off_policy_mask_threshold=None)
        return get_loss("rloo"), params

    def _needs_old_logps(self, args) -> bool:
        """Also with a KL penalty, which is taken with the sampling policy's log-probs (as TRL takes them)."""
        return super()._needs_old_logps(args) or args.beta != 0.0
