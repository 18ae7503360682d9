"""The KTO trainer: its data (unpaired examples as token rows: data.py, batch.py), its losses (losses.py) and its
step, on the shared loop (training/trainer.py), with DPO's reference (training/reference.py).

    step          = this process's examples of gradient_accumulation_steps micro-batches
    N             = examples of the whole step, summed over processes
    KL pairs      each example's prompt with the completion of the example before it in the step's order (every
                    process's micro-batches in turn, the first taking the last): TRL's rotation by one, over the step
    z0 (kto)      = the step's KL reference point: one pass without gradient over the step's KL pairs, the mean of
                    policy - reference log-prob over all of them, clamped at 0 (losses.py)
    each micro-batch: one forward of its n examples (padded; only the completion targets reach the output layer, in
                      chunks); an example's log-prob is the sum over its completion targets
                      loss = sum over examples of w * loss(example) * num_processes / N        (losses.py)
so the update is that of the mean over the step's examples against the step's z0, and the KL pairs are the same,
however the step is split into micro-batches and processes. TRL pairs within each process's micro-batch (blocks of
per_device_train_batch_size of its prepared dataset), averages each micro-batch's losses and takes z0 per micro-batch
(the mean over processes of each one's mean); with one micro-batch a step on one process, sequential, the two are the
same.
"""

import contextlib
import logging

import numpy as np
import torch

from posttrain.configs import ConfigError, KTOConfig
from posttrain.data import DataError
from posttrain.kto.batch import KTOBatch, collate_examples
from posttrain.kto.data import (KTOEncoder, UnpairedPreparation, UnpairedRows, balance_advice, detect_format,
                                prepare_unpaired, rotated)
from posttrain.kto.losses import example_losses, kl_reference_point
from posttrain.kto.metrics import KTOStatistics
from posttrain.models.forwards import whole_logits
from posttrain.models.logprobs import next_token_logprobs
from posttrain.sequences.batches import MapBatches, first_row, is_iterable, predecessor_positions
from posttrain.sequences.rows import EpochPlan
from posttrain.training.against_reference import AgainstReferenceTrainer
from posttrain.training.prediction import check_metric_functions
from posttrain.training.reference import make_reference, precompute_logps
from posttrain.training.setup import take_quantization_config, trainer_config
from posttrain.training.statistics import StepCounts
from posttrain.training.vision import dataset_has_images, processor_for, vision_processing, with_images

logger = logging.getLogger("posttrain")


class KTOTrainer(AgainstReferenceTrainer):
    """Kahneman-Tversky optimisation on unpaired examples, with TRL's KTOTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        ref_model: the reference (a model or a path); default: a frozen copy of the initial policy, or for LoRA the
            policy with adapters off (training/reference.py).
        args: the KTOConfig (default: TRL's defaults, output_dir `<model name>-KTO`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` of unpaired examples (prompt, completion, label) or of
            preference pairs, which are unpaired (data.py).
        eval_dataset: a dataset (or a dict of them) for the eval_* metrics.
        processing_class: the tokenizer; loaded from the model's path when None.
        callbacks: transformers TrainerCallbacks (instances or classes).
        optimizers: (optimizer, lr_scheduler); None entries are built from the config.
        quantization_config: a transformers quantization config for loading `model` from a path.
        peft_config: a peft LoraConfig to train adapters (needs `posttrain[peft]`).
    """

    _title = "KTO"
    _statistics = KTOStatistics
    _shown_metrics = ("loss", "rewards/margins", "kl")
    _data_noun = "examples"
    _data_parts = "the examples or their order"
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length",
                       "train_sampling_strategy", "dataloader_drop_last", "seed", "data_seed",
                       "precompute_ref_log_probs", "loss_type", "beta", "desirable_weight", "undesirable_weight")

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        args = trainer_config(KTOConfig, args, model, "KTO")
        if data_collator is not None:
            raise ConfigError("KTOTrainer(data_collator=...) is not supported: posttrain batches the examples and "
                              "their KL pairs itself; prepare the rows in the dataset instead.")
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers, None)
        check_settings(args, self.accelerator.num_processes)
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, None
        check_metric_functions(compute_metrics, None, args)  # before any slow work
        self._build(model, ref_model, train_dataset, eval_dataset, processing_class, peft_config)

    # ------------------------------------------------------------------ setup

    def _setup(self, model, ref_model, train_dataset, eval_dataset, processing_class, peft_config):
        args = self.args
        if train_dataset is None:
            raise DataError("KTOTrainer needs a train_dataset of unpaired examples (prompt, completion, label) or of "
                            "preference pairs.")
        if is_iterable(train_dataset) and args.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs=True needs every example up front, and train_dataset is an "
                              "IterableDataset: pass a map-style Dataset, or set precompute_ref_log_probs=False.")
        images = with_images(train_dataset, eval_dataset)  # the first dataset with images, by name
        detect_format(first_row(train_dataset), "train_dataset", images=images is not None)  # before the model loads
        processing_class = processor_for(processing_class, model, images, self._trust_remote_code)
        model, came_with_adapter = self._load_policy(model, processing_class, peft_config)
        self.vision = vision_processing(images, self.processing_class, model, "KTO", {})
        self._setup_model = model
        if self.tokenizer.eos_token is None:
            raise ConfigError("The tokenizer has no EOS token, which KTO appends to every standard completion so the "
                              "model learns to stop: set tokenizer.eos_token before passing it.")
        self._set_pad_token(model)
        self.ref_model, self.reference_adapter = make_reference(model, ref_model, args, came_with_adapter,
                                                                self.accelerator.device, self._trust_remote_code,
                                                                self.tokenizer)
        self.pad_to_multiple_of = self._padding_multiple()
        self._train_source = train_dataset
        self._set_batches(train_dataset, self._preparation(train_dataset, "train_dataset"), prepare_unpaired_rows)
        if isinstance(self.batches, MapBatches) and args.uses_kl and len(self.batches.rows) < 2:
            raise DataError("train_dataset has one example, and loss_type='kto' pairs each example with another's "
                            "completion for its KL reference point, so it would be paired with its own (its loss "
                            "stuck at 0.5): give at least two examples, or use loss_type='apo_zero_unpaired'.")
        if isinstance(self.batches, MapBatches) and self.accelerator.is_main_process:
            rows = self.batches.rows
            advice = balance_advice(int(rows.desirable.sum()), int((~rows.desirable).sum()), args.desirable_weight,
                                    args.undesirable_weight)
            if advice is not None:
                logger.warning(advice)
        self.eval_dataset = eval_dataset
        return model

    def _preparation(self, dataset, name: str) -> UnpairedPreparation:
        if not is_iterable(dataset) and len(dataset) == 0:
            raise DataError(f"{name} is empty: it needs at least one example.")
        encoder = KTOEncoder(self.tokenizer, first_row(dataset), name, self._vocab_rows,
                             vision=self.vision if dataset_has_images(dataset) else None,
                             source=None if is_iterable(dataset) else dataset)
        return UnpairedPreparation(encoder, self.args.max_length, name, announce=self.accelerator.is_main_process)

    # ------------------------------------------------------------------ the reference

    def _sequence_logps(self, model, sequences, target_seq, n: int) -> torch.Tensor:
        """[n] completion log-probs of n sequences under `model`, without gradient."""
        with torch.no_grad(), self.accelerator.autocast():
            logps, _, _ = next_token_logprobs(model, *_inputs(sequences), model_inputs=sequences.model_inputs)
        return torch.zeros(n, dtype=logps.dtype, device=logps.device).index_add(0, target_seq, logps)

    def _reference_logps(self, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N] reference log-probs of the completions, [N] of the KL pairs or None), precomputed or computed."""
        if batch.ref is not None:
            return batch.ref[:, 0], batch.ref[:, 1]
        model = self.ref_model if self.ref_model is not None else self._no_grad_model
        with self._reference_context():
            completions = self._sequence_logps(model, batch.examples, batch.target_seq, batch.size)
            kl = None if batch.kl is None else self._sequence_logps(model, batch.kl, batch.kl_target_seq, batch.size)
        return completions, kl

    def _precompute_references(self, model) -> None:
        """precompute_ref_log_probs: the train examples' (and their KL pairs') and the eval datasets' reference
        log-probs, while the policy still is the reference. The KL pairs are those of the sequential epoch, step by
        step (the only strategy that draws the same steps every epoch, check_settings)."""
        args = self.args
        rows = self.batches.rows
        sources = predecessor_positions(self.batches.plan, len(rows))  # the sequential order: positions are rows
        rows.ref = self._precomputed_reference(model, rows, sources, "train_dataset",
                                               args.precompute_ref_batch_size or args.per_device_train_batch_size)
        source = self._eval_source
        if source is not None:
            for dataset in (source.values() if isinstance(source, dict) else [source]):
                self._prepared_eval(dataset, model)

    @staticmethod
    def _eval_sources(rows: UnpairedRows, batch_size: int, processes: int) -> np.ndarray:
        """[N] whose completion each eval example's KL pair takes: the one before it in its process's share of its
        eval micro-batch (as TRL pairs within a batch)."""
        plan = EpochPlan(rows.lengths, batch_size, num_processes=processes, accumulation=1, strategy="sequential")
        order, sources = plan.order(0), np.arange(len(rows))
        for m in range(plan.micro_batches):
            for rank in range(processes):
                share = plan.share(order, m, rank)
                sources[share] = share[rotated(len(share))]
        return sources

    def _precomputed_reference(self, model, rows: UnpairedRows, sources: np.ndarray, name: str,
                               batch_size: int) -> np.ndarray:
        """[N, 2] reference log-probs of every example's completion and KL pair (0 without KL), from the cache or
        computed (each process a share, gathered)."""
        def compute(part):
            partners = rows.select(sources[part]) if self.args.uses_kl else None
            completions, kl = self._reference_logps(self._collate(rows.select(part), partners))
            kl = torch.zeros_like(completions) if kl is None else kl
            return torch.stack([completions, kl], 1).double().cpu().numpy()

        reference = None
        if self.reference_adapter is None:
            reference = self.ref_model if self.ref_model is not None else model
        settings = (self.args.max_length, self.args.loss_type, self.args.per_device_train_batch_size,
                    self.accelerator.num_processes)
        return precompute_logps(self.accelerator, model, reference, rows, 2, settings, self.tokenizer, name,
                                "examples", compute, batch_size)

    # ------------------------------------------------------------------ the step

    def _collate(self, examples: UnpairedRows, partners: UnpairedRows | None) -> KTOBatch:
        """A micro-batch's tensors on the accelerator's device (with the KL pairs of `partners`' completions)."""
        return collate_examples(examples, self.tokenizer.pad_token_id, self.args.max_length, self.pad_to_multiple_of,
                                partners).to(self.accelerator.device)

    def _kl_point(self, batches: list[KTOBatch]) -> torch.Tensor:
        """z0 of these micro-batches, over every process's (0 without KL); each micro-batch's reference log-probs
        computed once here, for the step's loss (batch.ref)."""
        acc = self.accelerator
        sums = torch.zeros(2, dtype=torch.float64, device=acc.device)
        for batch in batches:
            completions, ref_kl = self._reference_logps(batch)
            batch.ref = torch.stack([completions.float(), (ref_kl if ref_kl is not None else
                                                           torch.zeros_like(completions)).float()], 1)
            if self.args.uses_kl and batch.size:
                policy_kl = self._sequence_logps(self._no_grad_model, batch.kl, batch.kl_target_seq, batch.size)
                sums += torch.stack([(policy_kl.double() - batch.ref[:, 1].double()).sum(),
                                     torch.tensor(float(batch.size), dtype=torch.float64, device=acc.device)])
        if self.args.uses_kl and acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
        return kl_reference_point(sums[0], sums[1]).float()

    def _micro_loss(self, batch: KTOBatch, kl: torch.Tensor, grad: bool, router_share: float | None = None):
        """(loss summed over the micro-batch's examples, still to be divided by the step's; its KTOStatistics against
        the KL point `kl`; the router loss term to add, 0 unless `router_share` is given (training: models/router.py))."""
        args = self.args
        with self.accelerator.autocast():
            model = self.model if grad else self._no_grad_model
            collect = (self.router_loss.collecting(model, router_share) if router_share is not None
                       else contextlib.nullcontext([]))
            with collect as router_term:
                logps, entropy, _, stats = next_token_logprobs(model, *_inputs(batch.examples), with_entropy=True,
                                                               with_stats=True,
                                                               model_inputs=batch.examples.model_inputs)
        policy = torch.zeros(batch.size, dtype=logps.dtype, device=logps.device).index_add(0, batch.target_seq, logps)
        losses, rewards = example_losses(policy, batch.ref[:, 0].to(policy.dtype), batch.desirable, kl, args.beta,
                                         args.loss_type, args.desirable_weight, args.undesirable_weight)
        with torch.no_grad():
            chosen, rejected = batch.desirable, ~batch.desirable
            target_chosen = chosen[batch.target_seq]
            statistics = KTOStatistics(
                loss=losses.detach().sum(), chosen=chosen.sum(), rejected=rejected.sum(),
                chosen_reward=rewards[chosen].sum(), rejected_reward=rewards[rejected].sum(),
                chosen_logps=policy.detach()[chosen].sum(), rejected_logps=policy.detach()[rejected].sum(),
                chosen_logits=stats[target_chosen, 0].sum(), chosen_tokens=target_chosen.sum(),
                rejected_logits=stats[~target_chosen, 0].sum(), rejected_tokens=(~target_chosen).sum(),
                entropy=entropy.sum(), kl=kl.detach(), kl_points=1.0)
        return losses.sum(), statistics, sum(router_term)

    def _step_counts(self, batches: list) -> StepCounts:
        return StepCounts(items=sum(b.size for b in batches), tokens=sum(b.examples.tokens for b in batches))

    def _step_context(self, batches: list) -> torch.Tensor:
        return self._kl_point(batches)

    def _step_loss(self, batch: KTOBatch, counts: StepCounts, kl: torch.Tensor, share: float):
        """One micro-batch's forward against the step's KL point: (its share of the step's loss, its statistics)."""
        n = self.accelerator.num_processes
        with self._offloading():
            loss_sum, stats, router = self._micro_loss(batch, kl, grad=True,
                                                       router_share=share if batch.size else 0.0)
        return loss_sum * (n / max(counts.items, 1.0)) + router, stats

    def _step_batches(self, batches) -> list:
        shares = batches.next_step()
        partners = batches.step_predecessors() if self.args.uses_kl else [None] * len(shares)
        return [self._collate(share, mine) for share, mine in zip(shares, partners)]

    def _eval_micro_batches(self, dataset):
        for share in self._eval_shares(self._prepared_eval(dataset)):
            yield self._collate(share, share.select(rotated(len(share))) if self.args.uses_kl else None)

    # ------------------------------------------------------------------ evaluation

    def _prepare_eval(self, rows, model) -> UnpairedRows:
        args = self.args
        examples = prepare_unpaired_rows(rows, self._preparation(rows, "eval_dataset"))
        if args.precompute_ref_log_probs:
            self._check_reference_computable(model)
            size = args.per_device_eval_batch_size
            sources = self._eval_sources(examples, size, self.accelerator.num_processes)
            examples.ref = self._precomputed_reference(model if model is not None else self.policy, examples,
                                                       sources, "eval_dataset", args.precompute_ref_batch_size or size)
        return examples

    def _eval_statistics(self, batch: KTOBatch):
        """Each eval micro-batch (every process's share of it) against its own z0, as TRL takes it per batch: the
        loss is the mean over the eval examples, kl the mean of the micro-batches' points."""
        kl = self._kl_point([batch])
        return self._micro_loss(batch, kl, grad=False)[1], lambda: self._logits_and_inputs(batch)

    def _logits_and_inputs(self, batch: KTOBatch) -> tuple:
        """compute_metrics' view of an eval batch, as TRL gives it: (logits [N, T, V], labels = input_ids, input_ids)."""
        s = batch.examples
        with self.accelerator.autocast():
            logits = whole_logits(self._no_grad_model, s.input_ids, s.attention_mask, s.position_ids,
                                  model_inputs=s.model_inputs)
        return logits[:batch.size], s.input_ids[:batch.size], s.input_ids[:batch.size]

    @property
    def train_dataset(self):
        """The examples as TRL shows its prepared dataset: prompt_ids, completion_ids, label (and ref_logps when
        precomputed). Built on access."""
        if not isinstance(self.batches, MapBatches):
            return self._train_source
        return examples_as_dataset(self.batches.rows)

    def _prepared_view(self, dataset):
        return examples_as_dataset(self._prepared_eval(dataset))



def _inputs(s) -> tuple:
    return s.input_ids, s.attention_mask, s.position_ids, s.source_mask, s.targets


def check_settings(args: KTOConfig, processes: int) -> None:
    """What the KL reference point needs, in one sentence each: checked before the model and the data load."""
    if not args.uses_kl:
        return
    if args.per_device_train_batch_size * args.gradient_accumulation_steps * processes < 2:
        raise ConfigError("loss_type='kto' estimates its KL reference point by pairing each prompt with another "
                          "example's completion in the same optimizer step, and a step of one example would pair it "
                          "with its own (its reward): set per_device_train_batch_size or gradient_accumulation_steps "
                          "to 2 or more, or use loss_type='apo_zero_unpaired'.")
    if args.precompute_ref_log_probs and args.train_sampling_strategy != "sequential":
        raise ConfigError(f"precompute_ref_log_probs=True with loss_type='kto' needs train_sampling_strategy="
                          f"'sequential' (TRL's KTO default), not {args.train_sampling_strategy!r}: the KL pairs are "
                          "formed within each optimizer step, and only the sequential order draws the same steps "
                          "every epoch, so only then can their reference log-probs be computed once.")


def prepare_unpaired_rows(dataset, preparation: UnpairedPreparation) -> UnpairedRows:
    return prepare_unpaired(dataset, preparation.encoder, preparation.max_length, preparation.announce)


def examples_as_dataset(examples: UnpairedRows):
    """Prepared examples as TRL shows them: a Dataset of prompt_ids, completion_ids, label (and ref_logps)."""
    from datasets import Dataset

    rows = examples.rows
    columns = {"prompt_ids": [], "completion_ids": [], "label": examples.desirable.tolist()}
    for i in range(len(examples)):
        tokens, labels = rows.tokens[rows.row(i)], rows.labels[rows.row(i)]
        columns["prompt_ids"].append(tokens[~labels].tolist())
        columns["completion_ids"].append(tokens[labels].tolist())
    if examples.ref is not None:
        columns["ref_logps"], columns["ref_KL_logps"] = examples.ref[:, 0].tolist(), examples.ref[:, 1].tolist()
    return Dataset.from_dict(columns)
