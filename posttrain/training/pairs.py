"""The trainers of preference pairs scored against their completions (DPO, ORPO): their source, written once. The
pairs are sequences/pair_data.py's (TRL's formats and DPOTrainer's preparation) in sequences/pair_batch.py's
micro-batches; a trainer adds its objective (training/batched.py) and, where it has one, its reference.

    _load_pair_policy(model, processing_class, peft_config)   the dataset's format checked first, then the policy and
                                                               the tokenizer (pad token, EOS); (policy, came with an
                                                               adapter)
    _set_pair_data(train_dataset, eval_dataset)               the train pairs (map-style or a stream) and the eval set
"""

from dataclasses import dataclass, replace

import torch

from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.models.forwards import whole_logits
from posttrain.models.logprobs import MIN_SHARED_SAVING_FLOP, prefix_layout
from posttrain.models.prompt_sharing import ONE_ROW, UNSHARED, every_process_least
from posttrain.sequences.batches import MapBatches, first_row, is_iterable
from posttrain.sequences.pair_batch import PairBatch, collate_pairs
from posttrain.sequences.pair_data import PairEncoder, PairPreparation, detect_format, pairs_as_dataset, prepare_pairs
from posttrain.sequences.pairs import PairRows
from posttrain.sequences.prefixes import PrefixBatch
from posttrain.training.batched import BatchedDataTrainer
from posttrain.training.statistics import StepCounts
from posttrain.training.vision import (dataset_has_images, layout_refusals, processor_for, vision_processing,
                                       with_images)


@dataclass
class PairCounts(StepCounts):
    """A pair trainer's step: items are its pairs; chosen_targets its chosen completions' targets (the normaliser of a
    term over the chosen tokens: DPO's sft, ORPO's NLL)."""

    chosen_targets: float = 0.0


class PairTrainer(BatchedDataTrainer):
    _data_noun = "pairs"
    _data_parts = "the pairs or their order"
    _setup_model = None  # the policy as loaded, before the accelerator wraps it

    def _load_pair_policy(self, model, train_dataset, processing_class, peft_config, eval_dataset=None):
        if train_dataset is None:
            raise DataError(f"{self._title}Trainer needs a train_dataset of preference pairs (prompt, chosen, "
                            "rejected).")
        images = with_images(train_dataset, eval_dataset) if self._takes_images else None
        # the format before the model loads
        detect_format(first_row(train_dataset), "train_dataset", self._title, images=images is not None)
        processing_class = processor_for(processing_class, model, images, self._trust_remote_code)
        model, came_with_adapter = self._load_policy(model, processing_class, peft_config)
        self.vision = vision_processing(images, self.processing_class, model, self._title,
                                        layout_refusals(self.args))
        self._setup_model = model
        self._configure_tokenizer(model)
        self.pad_to_multiple_of = self._padding_multiple()
        return model, came_with_adapter

    def _set_pair_data(self, train_dataset, eval_dataset) -> None:
        self._train_source = train_dataset
        self.train_preparation = self._preparation(train_dataset, "train_dataset")
        self._set_batches(train_dataset, self.train_preparation, prepare_pairs)
        self.eval_dataset = eval_dataset

    _takes_images = True  # a vision-language model's pairs with images (TRL's DPO takes them)
    vision = None  # the processor's rows (sequences/images.py) when a dataset has images

    def _preparation(self, dataset, name: str) -> PairPreparation:
        if not is_iterable(dataset) and len(dataset) == 0:
            raise DataError(f"{name} is empty: it needs at least one pair.")
        encoder = PairEncoder(self.tokenizer, first_row(dataset), name, self._vocab_rows, needs=self._title,
                              vision=self.vision if dataset_has_images(dataset) else None,
                              source=None if is_iterable(dataset) else dataset)
        return PairPreparation(encoder, self.args, name, announce=self.accelerator.is_main_process)

    def _configure_tokenizer(self, model) -> None:
        """pad_token onto the tokenizer and the model's configs, as in TRL; the EOS must exist."""
        args, tok = self.args, self.tokenizer
        if args.pad_token is not None and args.pad_token not in tok.get_vocab():
            raise ConfigError(f"pad_token={args.pad_token!r} is not in the tokenizer's vocabulary: use one of its "
                              f"tokens (its EOS is {tok.eos_token!r}).")
        if tok.eos_token is None:
            raise ConfigError(f"The tokenizer has no EOS token, which {self._title} appends to every chosen and "
                              "rejected text so the model learns to stop: set tokenizer.eos_token before passing it.")
        self._set_pad_token(model)

    @property
    def _no_grad_model(self):
        """What forwards without gradient call, also before the accelerator has prepared the policy."""
        return self.forward_policy if self.forward_policy is not None else self._setup_model

    def _forward_models(self) -> tuple:
        """The models a micro-batch's forwards run (all must keep a packed row's sequences apart to go padding-free)."""
        return (self._no_grad_model,)

    def _collate(self, pairs: PairRows) -> PairBatch:
        padding_free = self._runs_padding_free(self.args.padding_free, *self._forward_models())
        return collate_pairs(pairs, self.tokenizer.pad_token_id, padding_free, self.pad_to_multiple_of,
                             self._shared_prefix_floor)

    @property
    def _shared_prefix_floor(self) -> int | None:
        """The positions a micro-batch must save for its pairs to run with their common prefixes once (GRPO's
        shared prompts' floor: a layout as theirs), or None where they never do."""
        return self._prefix_sharing_floor(MIN_SHARED_SAVING_FLOP, self._no_grad_model)

    def _prefixes(self, model, batch: PairBatch, grad: bool) -> PrefixBatch | None:
        """The batch's shared-prefix layout, marked with how `model` runs it (logprobs.prefix_layout), else None: the
        trained model's forward (`grad`) runs the same layout on every process training together
        (prompt_sharing.every_process_least: each runs as many forwards as the others)."""
        if self._shared_prefix_floor is None:
            return None
        prefixes = batch.prefixes
        layout = UNSHARED if prefixes is None else prefix_layout(model, prefixes.row_width)
        if grad:
            layout = every_process_least(model, layout)
        return None if layout == UNSHARED else replace(prefixes, in_rows=layout == ONE_ROW)

    def _step_counts(self, batches: list) -> PairCounts:
        return PairCounts(items=sum(b.pairs for b in batches), tokens=sum(b.sequences.tokens for b in batches),
                          chosen_targets=sum(int(b.targets[0::2].sum()) for b in batches))

    def _prepare_eval(self, rows, model) -> PairRows:
        return prepare_pairs(rows, self._preparation(rows, "eval_dataset"))

    def _logits_and_inputs(self, batch: PairBatch) -> tuple:
        """compute_metrics' view of an eval batch, as TRL gives it: (logits [2P, T, V], labels = input_ids [2P, T],
        input_ids) with the chosen rows first, then the rejected (padded rows; padding-free: the one packed row)."""
        s = batch.sequences
        with self.accelerator.autocast():
            logits = whole_logits(self._no_grad_model, s.input_ids, s.attention_mask, s.position_ids, s.boundaries,
                                  s.model_inputs)
        if not batch.pairs:
            return logits[:0], s.input_ids[:0], s.input_ids[:0]
        order = slice(None) if s.attention_mask is None else \
            torch.cat([torch.arange(0, len(s.input_ids), 2), torch.arange(1, len(s.input_ids), 2)])
        return logits[order], s.input_ids[order], s.input_ids[order]

    @property
    def train_dataset(self):
        """The pairs as TRL shows its prepared dataset: prompt_ids, chosen_ids, rejected_ids (here already truncated
        to max_length, which TRL's collator does later) and, when precomputed, ref_chosen_logps / ref_rejected_logps.
        Built on access."""
        if not isinstance(self.batches, MapBatches):
            return self._train_source
        return pairs_as_dataset(self.batches.rows)

    def _prepared_view(self, dataset):
        return pairs_as_dataset(self._prepared_eval(dataset))
