"""The SFT trainer: its data (rows tokenized, truncated or packed: formats.py, rows.py, data.py) and its step, on the
shared loop (training/trainer.py).

    step       = this process's rows of gradient_accumulation_steps micro-batches
    N          = target tokens of the whole step, summed over processes
    each micro-batch: logps of its targets (only target positions reach the output layer, in chunks)
                      loss = sum(-logp) * num_processes / N      (DDP averages gradients over processes)
so the update is that of the mean over the step's N targets, however the rows are split into micro-batches and
processes; `loss` is logged as that mean. With loss_type="dft" each term is -logp * p (p detached).
"""

import logging
from dataclasses import dataclass

import torch

from posttrain.configs import ConfigError, SFTConfig
from posttrain.data import DataError
from posttrain.models.forwards import whole_logits
from posttrain.models.logprobs import next_token_logprobs
from posttrain.sequences.batches import MapBatches, first_row, is_iterable
from posttrain.sequences.collate import collate
from posttrain.sft.data import Preparation, prepare_map_dataset
from posttrain.sft.row_formats import detect_format
from posttrain.sft.formats import RowEncoder, check_formatting_func
from posttrain.sft.metrics import TokenStatistics
from posttrain.training.batched import BatchedDataTrainer
from posttrain.training.checkpoint import model_fingerprint
from posttrain.training.distributed import guarded
from posttrain.training.prediction import check_metric_functions
from posttrain.training.setup import take_quantization_config, trainer_config
from posttrain.training.vision import (dataset_has_images, layout_refusals, processor_for, vision_processing,
                                       with_images)
from posttrain.training.statistics import StepCounts

logger = logging.getLogger("posttrain")

# TRL SFTTrainer arguments posttrain does not take, and why
_REFUSED = {
    "data_collator": "posttrain builds its own batches (padded, or padding-free with packing); prepare the rows in the "
                     "dataset instead (pre-tokenized input_ids with labels work as they are)",
    "compute_loss_func": "the loss is computed from chunked log-probabilities, never full logits (TRL deprecates this "
                         "argument too); subclass SFTTrainer and override _token_losses instead",
}


class SFTTrainer(BatchedDataTrainer):
    """Supervised fine-tuning, with TRL's SFTTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        args: the SFTConfig (default: TRL's defaults, output_dir `<model name>-SFT`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` in one of the formats of sft/formats.py.
        eval_dataset: a dataset (or a dict of them) for eval_loss.
        processing_class: the tokenizer; loaded from the model's path when None.
        callbacks: transformers TrainerCallbacks (instances or classes).
        optimizers: (optimizer, lr_scheduler); None entries are built from the config.
        optimizer_cls_and_kwargs: (optimizer class, keyword arguments), instead of optim and optim_args.
        quantization_config: a transformers quantization config (TRL's get_quantization_config) for a model loaded
            from a path or hub id.
        peft_config: a peft LoraConfig to train adapters (needs `posttrain[peft]`).
        formatting_func: row -> str (trained on whole) or {"prompt", "completion"} (trained on the completion).
    """

    _title = "SFT"
    _statistics = TokenStatistics
    _shown_metrics = ("loss", "mean_token_accuracy")
    # fields whose change makes a checkpoint's optimizer state or data position mean something else
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "truncation_mode",
                       "packing", "packing_strategy", "padding_free", "shuffle_dataset", "train_sampling_strategy",
                       "dataloader_drop_last", "seed", "data_seed", "completion_only_loss", "assistant_only_loss")

    def __init__(self, model, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, quantization_config=None, peft_config=None,
                 formatting_func=None):
        args = trainer_config(SFTConfig, args, model, "SFT")
        refused = {"data_collator": data_collator, "compute_loss_func": compute_loss_func}
        for name, value in refused.items():
            if value is not None:
                raise ConfigError(f"SFTTrainer({name}=...) is not supported: {_REFUSED[name]}.")
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers, optimizer_cls_and_kwargs)
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args)  # before any slow work
        self.formatting_func = formatting_func
        if formatting_func is not None:
            check_formatting_func(formatting_func)
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model = self._setup(model, train_dataset, eval_dataset, processing_class, peft_config)
        self._model_fingerprint = model_fingerprint(model)
        self._prepare(model, self._total_steps())
        self._tokens_seen = 0
        self._neftune = self._add_neftune() if args.neftune_noise_alpha else None
        self._call("on_init_end")

    # ------------------------------------------------------------------ setup

    def _setup(self, model, train_dataset, eval_dataset, processing_class, peft_config):
        args = self.args
        if train_dataset is None:
            raise DataError("SFTTrainer needs a train_dataset (text, prompt-completion, messages or input_ids rows).")
        images = with_images(train_dataset, eval_dataset)  # the first dataset with images, by name
        if self.formatting_func is None:  # the dataset's format from its first row, before the model loads
            detect_format(first_row(train_dataset), args.dataset_text_field, images=images is not None)
        processing_class = processor_for(processing_class, model, images, self._trust_remote_code)
        model, _ = self._load_policy(model, processing_class, peft_config, adapt=self._apply_chat_template_path)
        self.vision = vision_processing(images, self.processing_class, model, "SFT", layout_refusals(args))
        self._configure_tokenizer(model)
        self.pad_to_multiple_of = self._padding_multiple()
        self.padding_free = args.padding_free or args.packing
        self._train_source = train_dataset
        self.train_preparation = self._preparation(train_dataset, args.packing, "train_dataset")
        self._set_batches(train_dataset, self.train_preparation,
                          lambda dataset, preparation: prepare_map_dataset(dataset, preparation, self._data_seed))
        self.eval_dataset = eval_dataset
        return model

    def _preparation(self, dataset, packing: bool, name: str) -> Preparation:
        if not is_iterable(dataset) and len(dataset) == 0:
            raise DataError(f"{name} is empty: it needs at least one row.")
        encoder = RowEncoder(self.tokenizer, self.args, self.formatting_func, first_row(dataset), name=name,
                             vocab_size=self._vocab_rows, vision=self.vision if dataset_has_images(dataset) else None,
                             source=None if is_iterable(dataset) else dataset)
        return Preparation(encoder, self.args, packing=packing, name=name,
                           main_process=self.accelerator.is_main_process, stream=is_iterable(dataset))

    def _apply_chat_template_path(self, model, peft_config) -> None:
        """chat_template_path onto the tokenizer, new tokens into the model and, with adapters, into what trains
        (sequences/templates.py); before the adapters wrap the model."""
        from posttrain.sequences.templates import apply_chat_template_path, train_added_tokens

        if self.args.chat_template_path is not None:
            added = apply_chat_template_path(self.args.chat_template_path, model, self.tokenizer,
                                             self._trust_remote_code)
            if added:
                logger.info(f"chat_template_path added {len(added)} token(s) to the vocabulary and resized the "
                            f"embeddings to {model.get_input_embeddings().num_embeddings}.")
                tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
                train_added_tokens(peft_config, added, tied)

    def _configure_tokenizer(self, model) -> None:
        """eos_token and pad_token onto the tokenizer (and the model's configs), as in TRL."""
        args, tok = self.args, self.tokenizer
        self._check_named_tokens()
        if args.eos_token is not None:
            tok.eos_token = args.eos_token
            model.config.eos_token_id = tok.eos_token_id
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                ids = generation.eos_token_id
                ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
                generation.eos_token_id = ids + [tok.eos_token_id] if tok.eos_token_id not in ids else ids
        if tok.eos_token is None:
            raise ConfigError("The tokenizer has no EOS token, which SFT appends to every sequence so the model "
                              "learns to stop: set eos_token to one of its tokens.")
        self._set_pad_token(model)

    def _add_neftune(self):
        """NEFTune: uniform noise of scale alpha / sqrt(length * hidden) added to the input embeddings in training."""
        alpha = self.args.neftune_noise_alpha
        embeddings = self.policy.get_input_embeddings()

        def add_noise(module, inputs, output):
            if not module.training:
                return output
            scale = alpha / (output.size(1) * output.size(2)) ** 0.5
            return output + torch.zeros_like(output).uniform_(-scale, scale)

        return embeddings.register_forward_hook(add_noise)

    # ------------------------------------------------------------------ the step

    def _token_losses(self, logps: torch.Tensor) -> torch.Tensor:
        """Per-target loss terms from [M] target log-probs: -logp (nll), or -logp * p with p detached (dft)."""
        if self.args.loss_type == "dft":
            return -logps * logps.detach().exp()
        return -logps

    def _predicted_gradient(self, scale: float):
        """d loss / d logp at forward time (the loss is scale * sum of `_token_losses`), so the chunked output layer
        computes its gradient in the forward (models/chunked.py). Only for the losses defined here."""
        if type(self)._token_losses is not SFTTrainer._token_losses:
            return None
        if self.args.loss_type == "dft":
            return lambda rows, lp: -(torch.exp(lp) * scale)
        return lambda rows, lp: torch.full_like(lp, -scale)

    def _forward(self, batch, scale: float | None):
        """(per-target loss terms [M], entropy [M], is_top1 [M]) of a collated batch; with `scale`, the gradient of
        scale * sum(terms) is predicted for the chunked output layer."""
        device = self.accelerator.device
        batch = batch.to(device)
        with self.accelerator.autocast():
            logps, entropy, top1 = next_token_logprobs(
                self.model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.source_mask,
                batch.targets, with_entropy=True, with_top1=True,
                predict_grad=self._predicted_gradient(scale) if scale is not None else None,
                boundaries=batch.boundaries, model_inputs=batch.model_inputs)
            return self._token_losses(logps), entropy, top1

    def _statistics_of(self, losses, entropy, top1, batch) -> TokenStatistics:
        return TokenStatistics(loss=losses.detach().sum(), entropy=entropy.sum(), correct=top1.sum().float(),
                               targets=float(batch.num_targets))

    def _step_counts(self, batches: list) -> StepCounts:
        return StepCounts(items=sum(b.num_targets for b in batches), tokens=sum(b.tokens for b in batches))

    def _step_loss(self, batch, counts: StepCounts, context, share: float):
        """One micro-batch's forward (`share`: its part of the step, for a router loss): (its share of the step's
        loss, its statistics)."""
        scale = self.accelerator.num_processes / max(counts.items, 1.0)
        with self._offloading():
            with self.router_loss.collecting(self.model, share if batch.tokens else 0.0) as router_term:
                losses, entropy, top1 = self._forward(batch, scale)
        return losses.sum() * scale + sum(router_term), self._statistics_of(losses, entropy, top1, batch)

    def _collate(self, rows, padding_free: bool):
        """A micro-batch's rows as the forward's tensors: one packed row where padding-free is asked for and the model
        keeps its sequences apart, else padded rows of one sequence each (sequences/collate.py)."""
        return collate(rows, self.tokenizer.pad_token_id, self._runs_padding_free(padding_free, self.model),
                       self.pad_to_multiple_of)

    def _step_batches(self, batches) -> list:
        return [self._collate(rows, self.padding_free) for rows in batches.next_step()]

    def _eval_micro_batches(self, dataset):
        prepared = self._prepared_eval(dataset)
        for share in self._eval_shares(prepared.rows):
            yield self._collate(share, self.args.padding_free or prepared.packing)

    @property
    def train_dataset(self):
        """The training rows as TRL shows its prepared dataset: input_ids, labels (-100 where not trained) and, for
        packed rows, seq_lengths. Built on access (the trainer itself keeps the flat rows)."""
        if not isinstance(self.batches, MapBatches):
            return self._train_source
        return self._rows_as_dataset(self.batches.rows, self.args.packing)

    def _prepared_view(self, dataset):
        prepared = self._prepared_eval(dataset)
        return self._rows_as_dataset(prepared.rows, prepared.packing)

    @staticmethod
    def _rows_as_dataset(rows, packing: bool):
        from datasets import Dataset

        ids, labels, lengths = [], [], []
        for r in range(len(rows)):
            span = rows.row(r)
            tokens = rows.tokens[span].tolist()
            ids.append(tokens)
            labels.append([t if keep else -100 for t, keep in zip(tokens, rows.labels[span].tolist())])
            starts = [i for i, s in enumerate(rows.starts[span].tolist()) if s] + [len(tokens)]
            lengths.append([b - a for a, b in zip(starts, starts[1:])])
        columns = {"input_ids": ids, "labels": labels}
        if packing:
            columns["seq_lengths"] = lengths
        return Dataset.from_dict(columns)

    # ------------------------------------------------------------------ evaluation

    def _prepare_eval(self, rows, model) -> "EvalRows":
        packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
        preparation = self._preparation(rows, packing, "eval_dataset")
        return EvalRows(prepare_map_dataset(rows, preparation, self._data_seed), packing)

    def _eval_statistics(self, batch):
        losses, entropy, top1 = self._forward(batch, None)
        return self._statistics_of(losses, entropy, top1, batch), lambda: self._logits_and_labels(batch)

    def _logits_and_labels(self, batch) -> tuple:
        """compute_metrics' view of a collated eval batch, as TRL gives it: (logits [B, T, V], labels [B, T] (the token
        ids, -100 where not trained on and on padding), input_ids [B, T]); no rows for a process's empty share."""
        batch = batch.to(self.accelerator.device)
        rows = slice(None) if batch.tokens else slice(0, 0)
        with self.accelerator.autocast():
            logits = whole_logits(self.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                  batch.boundaries, batch.model_inputs)
        labels = torch.where(batch.label_mask, batch.input_ids, -100)
        return logits[rows], labels[rows], batch.input_ids[rows]


@dataclass(frozen=True)
class EvalRows:
    """An eval dataset's prepared rows, and whether they are packed (eval_packing, else packing)."""

    rows: object
    packing: bool

    def __len__(self) -> int:
        return len(self.rows)
