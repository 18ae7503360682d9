"""The online trainers' data, on the shared loop (training/trainer.py): rounds of prompts sampled from the policy.

    round      = rounds.next_round(step)                # a round source (grpo/round_source.py): B prompts, sampled
    batch      = rollout.scored_batch(rounds, step)     # the trainer's round stage: GRPO's scores it (rewards,
                                                        # advantages), distillation's keeps the completions
    buffer    += batch.micro_batches(...) x num_iterations
    each optimizer step: gradient_accumulation_steps micro-batches from the buffer, a batch made whenever it is empty

`OnlineTrainer` owns that: the prompts, the generator, the buffer, the round source and the data position in
checkpoints. A trainer on it (grpo/trainer.py GRPOTrainer, distillation/trainer.py DistillationTrainer) brings its
signal and its objective through these hooks:

    _before_model()                        check what the signal needs before the policy loads (reward functions,
                                           the teacher)
    _frozen_model(model, came_with_adapter) -> (frozen model or None, reference adapter or None): the round's
    _after_agents(agents)                  the signal's setup once the prompts and agents are known (optional)
    _set_objective(args)                   the objective's setup once the policy is prepared (optional)
    _round_stage(sampler, layout)          the round stage: `scored_batch(rounds, step)`, `training_round(round, step)`
    _optimizer_step(), _evaluation_metrics(dataset, prefix): the loop's (training/trainer.py)
"""

import logging
import math

import torch

from posttrain.agents.chat_templates import tool_chat_template
from posttrain.agents.rollouts import Agents
from posttrain.data import PromptEncoder, PromptSource, check_eval_columns, prompt_dataset_columns
from posttrain.generation import SamplingParams, make_generator
from posttrain.grpo.agent_setup import agent_dataset, agent_rollouts, tool_vision
from posttrain.grpo.batch import RowLayout, TrainingBatch, buffer_from_tensors, buffer_tensors
from posttrain.grpo.completions import CompletionLog
from posttrain.grpo.losses import StepNormalizer
from posttrain.grpo.metrics import with_tokens_seen
from posttrain.grpo.pass_memory import PassMemory, pass_memory
from posttrain.grpo.round_source import SampledNow, open_round_source, resume_point
from posttrain.grpo.sampling import RoundSampler
from posttrain.models.peft import refuse_prefix_tuning_for_sampling
from posttrain.training.checkpoint import CheckpointExtras, model_fingerprint
from posttrain.training.distributed import guarded, run_name
from posttrain.training.loaders import eval_prompt_batches, train_prompt_batches
from posttrain.training.setup import run_length_unknown, take_quantization_config, trainer_config
from posttrain.training.trainer import Trainer
from posttrain.training.vision import processor_for, vision_processing, with_images

logger = logging.getLogger("posttrain")


class OnlineTrainer(Trainer):
    """The loop's data for trainers that learn from the policy's own completions.

    Args:
        model: the policy, or the path / hub id of one.
        args: the trainer's config (a GRPOConfig or one derived from it), or None for its defaults.
        train_dataset, eval_dataset: prompts; processing_class, callbacks, optimizers, quantization_config,
            peft_config: as GRPOTrainer's.
        agents: the tools, environments or rollout_func the policy samples with.
    """

    def __init__(self, model, args, *, train_dataset, eval_dataset, processing_class, callbacks, optimizers,
                 quantization_config, peft_config, agents: Agents):
        args = trainer_config(self._config_class, args, model, self._title)
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers)
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model = self._setup(model, train_dataset, eval_dataset, processing_class, peft_config, agents)
            self._pass_memory = self._estimate_pass_memory(model)  # before sharding: whole parameters
        self._model_fingerprint = model_fingerprint(model)  # before any update: what checkpoints are checked against
        self._prepare(model, self._total_steps())
        rank, run_id = self.accelerator.process_index, run_name(self.accelerator)
        with guarded(self.accelerator):  # a server one process cannot reach stops every process; one seed on every
            # process: each row's key (its index in the round) tells the rows apart, whatever the number of processes
            generator = make_generator(args, self.policy, self.tokenizer, seed=args.seed, process_index=rank,
                                       run_id=run_id, num_processes=self.accelerator.num_processes,
                                       local_process_index=self.accelerator.local_process_index,
                                       image_token_ids=tuple(self.vision.image_token_ids) if self.vision else (),
                                       mixed_precision=self.accelerator.mixed_precision)
        self.sampling_params = SamplingParams.from_config(args)
        self._set_objective(args)
        self.pad_to_multiple_of = self._padding_multiple()
        # padded widths are fixed for a reason: keep them; a router loss counts each real token of the padded rows
        # once, under their attention mask, as in TRL (packed rows and shared prompts would count others)
        self.packing = self.pad_to_multiple_of is None and not self.router_loss.enabled
        # each distinct prompt once (two forwards before a backward) where every process holds the whole weights: one
        # process, DDP (not with a static graph, recorded for one forward) or DeepSpeed ZeRO-1/2; not FSDP or ZeRO-3
        self.share_prompts = self.packing and not self.sharding.shards_parameters and not args.ddp_static_graph
        sampler = RoundSampler(accelerator=self.accelerator, sharding=self.sharding, model=self.model,
                               generator=generator, tokenizer=self.tokenizer, agents=self.agents,
                               token_types=self.vision.token_types if self.vision else None)
        self.rollout = self._round_stage(sampler, RowLayout(self.packing, self.share_prompts, self.pad_to_multiple_of,
                                                            self._pass_count))
        self.shuffle_rng = torch.Generator().manual_seed(self._data_seed)
        self.buffer: list[TrainingBatch] = []
        self._stream = self.prompts.rounds()
        self.rounds_consumed = 0  # generation rounds drawn from the prompts: the data position, for resuming
        # where the step's rounds come from (grpo/round_source.py): sampled on demand outside train(); within it, the
        # source the config asks for, opened where the run stands; what a closed source left to resume from
        self.rounds = self._on_demand()
        self._source_resume = None
        self._stream_epoch = 0.0
        self.completion_log = CompletionLog(args, self.accelerator, self._reward_names())
        self._call("on_init_end")

    @property
    def generator(self):
        """The generation backend (posttrain/generation) the round samples with."""
        return self.rollout.sampler.generator

    @generator.setter
    def generator(self, value) -> None:
        self.rollout.sampler.generator = value

    # ------------------------------------------------------------------ setup

    def _setup(self, model, train_dataset, eval_dataset, processing_class, peft_config, agents: Agents):
        """Load the policy and tokenizer, the round's frozen model, the agents and the prompts; returns the policy."""
        args = self.args
        train_dataset, placeholder_prompts = agent_dataset(train_dataset, agents, args)
        refuse_prefix_tuning_for_sampling(peft_config, model)
        # the data's prompts and the signal before the model loads: a dataset with no prompt, a misnamed reward, a
        # missing package or teacher stops the run at once
        images = with_images(train_dataset, eval_dataset)  # the first dataset with images, by name
        if train_dataset is not None:
            prompt_dataset_columns(train_dataset, images=images is not None)
        self._before_model(agents)
        processing_class = processor_for(processing_class, model, images, self._trust_remote_code)
        model, came_with_adapter = self._load_policy(model, processing_class, peft_config)
        self.vision = vision_processing(images, self.processing_class, model, self._title,
                                        self._refused_with_images(agents))
        self.ref_model, self.reference_adapter = self._frozen_model(model, came_with_adapter)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)  # a VLM: its text model's
        # tool results are rendered with a prefix-preserving template: the tokenizer's, or TRL's training version
        chat_template = tool_chat_template(self.tokenizer, args.chat_template_kwargs) if agents.calls_tools else None
        self.encoder = PromptEncoder.for_run(self.tokenizer, args, context, chat_template, self._vocab_rows,
                                             self.vision)
        self.agents = agent_rollouts(agents, args, self.encoder, chat_template, context, placeholder_prompts,
                                     trainer=self, vision=self.vision or tool_vision(agents, self.processing_class,
                                                                                     model))
        self.prompts = PromptSource(train_dataset, self.encoder, args.prompts_per_generation,
                                    shuffle=args.shuffle_dataset, seed=self._data_seed)
        self.train_dataset = train_dataset  # as given, as TRL keeps it (prompts are prepared round by round)
        self._after_agents(agents)
        self.eval_dataset = eval_dataset
        check_eval_columns(eval_dataset, ["prompt", *self._eval_columns()], images=images is not None)
        return model

    def _refused_with_images(self, agents: Agents) -> dict[str, str]:
        """What a run with images cannot do in this release, and each one's fix."""
        args, refused = self.args, {}
        if getattr(args, "async_generation", False):
            refused["async_generation=True"] = "set async_generation=False (its generation copy is a text model)"
        if agents.rollout_func is not None:
            refused["A rollout_func"] = ("it returns token ids without the images' pixels: train on the images "
                                         "without it, or give the images to tools or an environment")
        return refused

    def _before_model(self, agents: Agents) -> None:
        raise NotImplementedError

    def _frozen_model(self, model, came_with_adapter: bool) -> tuple:
        raise NotImplementedError

    def _round_stage(self, sampler: RoundSampler, layout: RowLayout):
        raise NotImplementedError

    def _after_agents(self, agents: Agents) -> None:
        """The signal's setup once the prompts and agents are known (GRPO's rewards); none by default."""

    def _set_objective(self, args) -> None:
        """The objective's setup once the policy is prepared (GRPO's loss); none by default."""

    def _eval_columns(self) -> list[str]:
        """The eval dataset's columns the signal reads besides `prompt`."""
        return []

    def _reward_names(self) -> list[str]:
        """The completion log's reward columns."""
        return []

    def _total_steps(self) -> int:
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            raise run_length_unknown()
        micro = rounds * args.num_train_epochs * args.steps_per_generation * args.num_iterations
        return max(1, math.ceil(micro / args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ the rounds

    def _step_micro_batches(self) -> tuple[list[TrainingBatch], dict]:
        """The step's gradient_accumulation_steps micro-batches from the buffer, a new generation batch made (its
        micro-batches, num_iterations times over) whenever it is empty; the metrics of the newest batch made ({} when
        none was)."""
        micro, round_metrics = [], {}
        for _ in range(self.args.gradient_accumulation_steps):
            if not self.buffer:
                scored = self.rollout.scored_batch(self.rounds, self.state.global_step + 1)
                self._batch_made(scored)
                parts = scored.batch.micro_batches(self.args.per_device_train_batch_size, self.shuffle_rng)
                self.buffer, round_metrics = parts * self.args.num_iterations, with_tokens_seen(scored.metrics, self.state)
            micro.append(self.buffer.pop(0))
        return micro, round_metrics

    def _batch_made(self, scored) -> None:
        """A generation batch was made: its completions to the completion log (log_completions)."""
        self.completion_log.add_round(self.state.global_step + 1, scored.logged())

    def _on_demand(self) -> SampledNow:
        """The rounds drawn and sampled when the step asks (outside train(), and within it without
        async_generation)."""
        return SampledNow(self.accelerator, draw=lambda: next(self._stream), sample=self.rollout.training_round,
                          on_taken=self._round_taken, taken=lambda: self.rounds_consumed)

    def _start_sources(self) -> None:
        self.rounds = open_round_source(self.args, self.accelerator, on_demand=self._on_demand, rollout=self.rollout,
                                        rounds=self._stream, taken=self.rounds_consumed, on_taken=self._round_taken,
                                        resumed=self._source_resume, steps_taken=self.state.global_step)
        self._source_resume = None

    def _stop_sources(self) -> None:
        self._source_resume = self.rounds.close()  # a rollout worker's rounds, kept for a later train()
        self.rounds = self._on_demand()

    def _round_taken(self, prompt_round) -> None:
        self.rounds_consumed += 1
        self._stream_epoch = prompt_round.epoch

    def _passes(self, micro: list[TrainingBatch]) -> list[list[TrainingBatch]] | None:
        """Each micro-batch as the passes it runs in (max_completion_tokens_per_pass), as many on every process: each
        forward of a model wrapped across processes is a collective (DDP broadcasts its buffers, FSDP gathers).
        None where each micro-batch runs whole: its loss looks at all its rows at once, or an override of
        training_step or compute_loss sees it as TRL's would."""
        if (not self.args.max_completion_tokens_per_pass or self._loss_sees_whole_micro_batch()
                or not self._own_step_methods()):
            return None
        counts = torch.tensor([self._pass_count(mb) for mb in micro], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.gather(counts).view(-1, len(micro)).amax(0)
        return [mb.in_passes(int(k)) for mb, k in zip(micro, counts.tolist())]

    def _pass_count(self, batch: TrainingBatch) -> int:
        """The passes this process would run `batch` in (max_completion_tokens_per_pass: a count, "auto" or None)."""
        limit = self.args.max_completion_tokens_per_pass
        if limit == "auto":
            return 1 if self._pass_memory is None else self._pass_memory.pass_count(batch)
        return batch.pass_count(limit) if limit else 1

    def _estimate_pass_memory(self, model) -> PassMemory | None:
        """What `max_completion_tokens_per_pass: "auto"` sizes passes by (grpo/pass_memory.py); None where passes
        cannot lower the device's peak: the model's shape is unknown, or the kept activations are offloaded to the
        host (activation_offloading on an accelerator)."""
        if self.args.max_completion_tokens_per_pass != "auto" or (
                self.args.activation_offloading and self.accelerator.device.type != "cpu"):
            return None
        return pass_memory(model, self.args.gradient_checkpointing, self.accelerator.mixed_precision != "no")

    def _loss_sees_whole_micro_batch(self) -> bool:
        """Whether a micro-batch's loss needs all its rows in one forward: a mixture-of-experts router loss balances
        the experts over the micro-batch's tokens."""
        return self.router_loss.enabled

    def _step_counts(self, micro: list[TrainingBatch]) -> tuple[StepNormalizer, float]:
        """What the step's loss is normalised by, and the tokens every process's forwards see (prompts and
        completions, for total_flos)."""
        tokens = sum(float(m.loss_mask.sum()) for m in micro)
        seen = sum(float(m.rollouts.prompt_mask.sum() + m.rollouts.completion_mask.sum()) for m in micro)
        totals = self.accelerator.reduce(torch.tensor([tokens, seen], device=self.accelerator.device),
                                         reduction="sum")
        norm = StepNormalizer(sequences=sum(len(m) for m in micro), tokens=tokens,
                              tokens_per_process=float(totals[0]) / self.accelerator.num_processes)
        return norm, float(totals[1])

    # ------------------------------------------------------------------ the loop's hooks (training/trainer.py)

    def _epoch(self) -> float:
        """Epochs of data trained on: micro-batches consumed over micro-batches per epoch (the stream's epoch for an
        iterable dataset)."""
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            return self._stream_epoch
        per_round = self.args.steps_per_generation * self.args.num_iterations
        return (self.rounds_consumed * per_round - len(self.buffer)) / (rounds * per_round)

    def _skip_rest_of_epoch(self) -> None:
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            return
        self.buffer = []
        self.rounds.skip_rest_of_epoch(rounds)

    def _train_loader(self):
        return train_prompt_batches(self.train_dataset, self.encoder, self.args, self._data_seed)

    def _eval_loader(self, dataset):
        return eval_prompt_batches(dataset, self.encoder, self.args, self.accelerator.num_processes)

    def log(self, logs: dict, start_time=None) -> None:
        super().log(logs, start_time)
        if "loss" in logs:
            self.completion_log.show(self.state.global_step, self.logger)  # above the progress line
            if self.logger is not None:  # trainer.log called outside train() has no trackers
                self.completion_log.to_trackers(self.logger, self.state.global_step)

    def _checkpoint_extras(self) -> CheckpointExtras:
        """The prompt stream's position, the buffered micro-batches, the round source's queue, the sampler's and
        shuffler's generators."""
        meta = {"rounds_consumed": self.rounds_consumed}
        tensors = buffer_tensors(self.buffer)
        source_meta, queued, sampler = self.rounds.snapshot(self.generator.rng)  # a worker's queue, its sampler
        if source_meta:
            meta["async"] = source_meta
        tensors.update(queued)
        return CheckpointExtras(meta=meta, tensors=tensors, generators={"sampler": sampler, "shuffle": self.shuffle_rng})

    def _restore_position(self, state: dict, tensors: dict) -> None:
        """Move the prompt stream to where the checkpoint left it (or to the start, with ignore_data_skip), and take
        back the buffered micro-batches and the round source's queue."""
        self._stream = self.prompts.rounds()
        self.rounds_consumed = state["rounds_consumed"]
        if not self.args.ignore_data_skip:
            for _ in range(self.rounds_consumed):
                next(self._stream)
        self.buffer = buffer_from_tensors({k: v for k, v in tensors.items() if k != "async_queue"},
                                          self.accelerator.device)
        self._source_resume = resume_point(state, tensors)
        self.rounds = self._on_demand()

    def close(self, failed: bool = False) -> None:
        """Release the generator, the tools' event loop and, in a multi-process run, the process group (call once, at
        the end)."""
        self.generator.close()
        if getattr(self, "agents", None) is not None:
            self.agents.close()
        super().close(failed)
