"""DistillationTrainer: TRL 1.16's on-policy DistillationTrainer, a divergence objective on the online trainers' data
(grpo/online.py: the prompt stream, the round source, the generation buffer, the generation paths, checkpoints and
tools), with no reward.

    round      = rounds.next_round(step)                 # B unique prompts, the student's completions, one each
                                                         # (distillation/rollout.py)
    each optimizer step: gradient_accumulation_steps micro-batches of the round (shuffled), each
               loss = sum over its loss tokens of D_beta(student || teacher) / (step's loss tokens / processes)
               the teacher's final hidden states without gradient, the student's with, both output layers in chunks
               (models/teacher.py, models/divergence.py): no [tokens, vocabulary] logits on either side

The teacher is the round's frozen model (`ref_model`): loaded from teacher_model_name_or_path or given, checked
against the student's vocabulary, and sharded as the policy under FSDP and ZeRO-3.
"""

import torch

from posttrain.agents.rollouts import Agents
from posttrain.configs import ConfigError
from posttrain.configs.distillation import DistillationConfig
from posttrain.distillation.rollout import DistillationRound, DivergenceStatistics, evaluation_metrics
from posttrain.grpo.batch import RowLayout
from posttrain.grpo.online import OnlineTrainer
from posttrain.grpo.sampling import RoundSampler
from posttrain.models.checkpoint_classes import is_vision_language
from posttrain.models.keywords import unwrap
from posttrain.training.reference import check_teacher_given, make_teacher


class DistillationTrainer(OnlineTrainer):
    """TRL's DistillationTrainer: `DistillationTrainer(model, teacher_model, args=DistillationConfig(...),
    train_dataset=...)`, with TRL's arguments.

    Args:
        model: the student, a causal LM or the path / hub id of one.
        teacher_model: the teacher, a model or a path / hub id (default: args.teacher_model_name_or_path); it must
            share the student's vocabulary.
        args: the DistillationConfig (default: TRL's defaults, output_dir `<model name>-Distillation`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` with a `prompt` column.
        eval_dataset: prompts for evaluation (a dataset, or a dict of them).
        processing_class, callbacks, optimizers, quantization_config, peft_config: as GRPOTrainer's.
        tools: functions the student may call while it samples (docs/tools.md); their results carry no loss.
    """

    _title = "Distillation"
    _config_class = DistillationConfig
    _shown_metrics = ("loss", "entropy", "completions/mean_length")
    _nonfinite_hint = "Lower the learning_rate."
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
                       "seed", "shuffle_dataset", "beta", "temperature")

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None):
        self._teacher_given = teacher_model
        super().__init__(model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config,
                         agents=Agents(list(tools or []), None, None, None))

    @property
    def teacher_model(self):
        """The teacher, as prepared (sharded as the student under FSDP and ZeRO-3)."""
        return self.ref_model

    # ------------------------------------------------------------------ the signal: the teacher (grpo/online.py)

    def _before_model(self, agents: Agents) -> None:
        check_teacher_given(self._teacher_given, self.args)  # before the student loads

    def _frozen_model(self, model, came_with_adapter: bool) -> tuple:
        teacher = make_teacher(self._teacher_given, model, self.args, self.accelerator.device,
                               self._trust_remote_code, self.tokenizer)
        self._teacher_given = None  # the prepared one is self.ref_model
        if self.vision is not None and not is_vision_language(teacher):
            raise ConfigError(f"The prompts have images, and the teacher is a {type(unwrap(teacher)).__name__}, "
                              "which cannot read them: distil from a vision-language teacher that takes the student's "
                              "processor's images (the same family), or remove the image column.")
        return teacher, None

    def _round_stage(self, sampler: RoundSampler, layout: RowLayout) -> DistillationRound:
        """The student's completions, one per prompt, and their divergence from the teacher."""
        return DistillationRound(self.args, accelerator=self.accelerator, sampler=sampler, model=self.model,
                                 teacher=self.ref_model)

    # ------------------------------------------------------------------ the step

    def _step_loss(self, mb, norm) -> tuple[torch.Tensor, DivergenceStatistics]:
        """One micro-batch's forward: (its share of the step's loss, its divergence and entropy sums and loss
        tokens)."""
        mb = mb.padded(self.pad_to_multiple_of)
        per_token = 1.0 / max(norm.tokens_per_process, 1.0)
        with self._offloading():
            divergence, entropy = self.rollout.divergence(self.model, mb, grad_scale=per_token)
        return divergence.sum() * per_token, DivergenceStatistics.of(divergence, entropy, mb.loss_mask)

    def _optimizer_step(self) -> dict:
        micro, round_metrics = self._step_micro_batches()
        norm, seen_tokens = self._step_counts(micro)
        self.state.total_flos += self._flops_per_token * seen_tokens
        parts = self._accumulate(micro, lambda mb: self._step_loss(mb, norm),
                                 norm.tokens_per_process * self.accelerator.num_processes, self._passes(micro))
        metrics = DivergenceStatistics.total(parts).reduced(self.accelerator).metrics()
        metrics.update(grad_norm=self._apply_update(metrics["loss"]), learning_rate=self.lr_scheduler.get_last_lr()[0])
        metrics.update(round_metrics)
        return metrics

    def _evaluation_metrics(self, dataset, prefix: str) -> dict:
        metrics = evaluation_metrics(self.rollout, self.encoder, dataset, prefix,
                                     lambda: self._call("on_prediction_step"))
        return {**metrics, f"{prefix}_num_tokens": float(self.state.num_input_tokens_seen)}
