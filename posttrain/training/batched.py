"""The shared part of the trainers whose data are prepared token rows, taken step by step from a batcher
(sequences/batches.py's MapBatches for a map-style dataset, StreamBatches for an iterable one): SFTTrainer and DPOTrainer.

A subclass sets, during its set-up:
    self.batches            the batcher: next_step(), epoch_progress(), skip_rest_of_epoch(), position(),
                            restore(position), and steps_per_epoch unless it is a stream
    self.data_fingerprint   a hash of the prepared rows (None for a stream), checked when resuming
and counts the tokens it trains on in self._tokens_seen.
"""

import math

from posttrain.data import DataError
from posttrain.models.packed_layouts import packs_one_row
from posttrain.sequences.batches import MapBatches, StreamBatches, is_iterable
from posttrain.sequences.rows import EpochPlan
from posttrain.training.checkpoint import CheckpointError, CheckpointExtras
from posttrain.training.setup import run_length_unknown
from posttrain.training.trainer import Trainer


class BatchedDataTrainer(Trainer):
    _cumulative_metrics = ("num_tokens",)
    _data_noun = "rows"  # what the prepared data are called in messages
    _data_parts = "the rows, their packing or their order"  # what would not continue after a change

    def _set_pad_token(self, model) -> None:
        """pad_token (default: the tokenizer's, else its EOS) onto the tokenizer and the model's configs, as TRL
        does."""
        tok = self.tokenizer
        tok.pad_token = getattr(self.args, "pad_token", None) or tok.pad_token or tok.eos_token
        model.config.pad_token_id = tok.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tok.pad_token_id

    def _check_named_tokens(self) -> None:
        """eos_token and pad_token, where the config names them, must be tokens of the tokenizer's vocabulary."""
        from posttrain.configs import ConfigError

        tok, vocab = self.tokenizer, self.tokenizer.get_vocab()
        for field in ("eos_token", "pad_token"):
            token = getattr(self.args, field, None)
            if token is not None and token not in vocab:
                raise ConfigError(f"{field}={token!r} is not in the tokenizer's vocabulary: use one of its tokens "
                                  f"(its EOS is {tok.eos_token!r}), or add it to the tokenizer first.")

    @staticmethod
    def _runs_padding_free(requested: bool, *models) -> bool:
        """Whether a micro-batch runs padding-free, as one packed row with its sequences' boundaries: asked for
        (`requested`), and every one of `models` that runs the batch (the policy, a separate reference; None: none)
        keeps a packed row's sequences apart (models/packed_layouts.py: decided once per model, at the first
        micro-batch, which every process reaches together; a model that does not is said once). Otherwise the rows
        are padded, one sequence each."""
        return requested and all(packs_one_row(model) for model in models if model is not None)

    def _set_batches(self, train_dataset, preparation, prepare_all) -> None:
        """self.batches and self.data_fingerprint: an IterableDataset's stream, prepared block by block, or a map-style
        dataset's rows, prepared at once (`prepare_all(dataset, preparation)`, which has `lengths` and
        `fingerprint()`) and taken in its EpochPlan's order; one sentence when not one global batch is left."""
        args, acc = self.args, self.accelerator
        if is_iterable(train_dataset):
            self.batches = StreamBatches(train_dataset, preparation, args.per_device_train_batch_size,
                                         acc.num_processes, args.gradient_accumulation_steps, acc.process_index)
            self.data_fingerprint = None
            return
        rows = prepare_all(train_dataset, preparation)
        plan = EpochPlan(rows.lengths, args.per_device_train_batch_size, acc.num_processes,
                         args.gradient_accumulation_steps, args.train_sampling_strategy, self._data_seed,
                         args.dataloader_drop_last)
        if plan.micro_batches == 0:
            dropped = len(train_dataset) - len(rows) if self._data_noun == "pairs" else 0
            left = f" ({dropped} of {len(train_dataset)} dropped: see the warning)" if dropped > 0 else ""
            noun = self._data_noun if self._data_noun == "pairs" else f"training {self._data_noun}"
            raise DataError(f"train_dataset gives {len(rows)} {noun}{left}, fewer than one global batch "
                            f"({args.per_device_train_batch_size} x {acc.num_processes} processes) with "
                            "dataloader_drop_last=True: set it to False or lower per_device_train_batch_size.")
        self.data_fingerprint = rows.fingerprint()
        self.batches = MapBatches(rows, plan, acc.process_index)

    def _total_steps(self) -> int:
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        if not hasattr(self.batches, "steps_per_epoch"):
            raise run_length_unknown()
        return max(1, math.ceil(args.num_train_epochs * self.batches.steps_per_epoch))

    # ------------------------------------------------------------------ the loop's hooks (training/trainer.py)

    def _epoch(self) -> float:
        return self.batches.epoch_progress()

    def _skip_rest_of_epoch(self) -> None:
        self.batches.skip_rest_of_epoch()

    def _checkpoint_extras(self) -> CheckpointExtras:
        return CheckpointExtras(meta={"data_position": self.batches.position(),
                                      "data_fingerprint": self.data_fingerprint, "tokens_seen": self._tokens_seen})

    def _restore_position(self, state: dict, tensors: dict) -> None:
        """Move the data to where the checkpoint left it (or to the start, with ignore_data_skip), after checking that
        the prepared data are the ones the checkpoint was trained on."""
        saved = state.get("data_fingerprint")
        if saved is not None and self.data_fingerprint is not None and saved != self.data_fingerprint:
            raise CheckpointError(f"Cannot resume: the training {self._data_noun} differ from the checkpoint's (the "
                                  "dataset, the tokenizer or the data fields changed, so "
                                  f"{self._data_parts} would not continue where it stopped); resume with the same "
                                  "data, or start a new run.")
        self._tokens_seen = state.get("tokens_seen", 0)
        if not self.args.ignore_data_skip:
            self.batches.restore(state["data_position"])
