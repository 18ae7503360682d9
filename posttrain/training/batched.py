"""The shared part of the trainers whose data are prepared token rows, taken step by step from a batcher
(sequences/batches.py's MapBatches for a map-style dataset, StreamBatches for an iterable one): SFT, DPO, KTO and the
reward model. The step and the evaluation loop are this module's; a trainer gives its objective:

    _statistics                     its Statistics class (training/statistics.py): the sums its metrics are made of
    _step_counts(batches) -> StepCounts          what this process's micro-batches of a step hold (items, tokens, ...)
    _step_context(batches)          what the whole step's loss needs before any micro-batch (KTO's KL point); None
    _step_loss(batch, counts, context, share) -> (its share of the step's loss, its Statistics)
                                    counts: the step's, over every process; share: 1 / micro-batches (a router loss's)
    _eval_statistics(batch) -> (Statistics, view)   an eval micro-batch's; view() -> compute_metrics' (logits, labels,
                                    inputs) of it
    _prepare_eval(rows, model)      an eval dataset's rows (read whole) prepared, once per dataset (`_prepared_eval`)

A subclass sets, during its set-up (`_set_batches`):
    self.batches            the batcher: next_step(), epoch_progress(), skip_rest_of_epoch(), position(),
                            restore(position), and steps_per_epoch unless it is a stream
    self.data_fingerprint   a hash of the prepared rows (None for a stream), checked when resuming
counts the tokens it trains on in self._tokens_seen, and provides `_collate(share)` and `_prepared_eval(dataset)`,
from which
    _step_batches(batcher) -> list          the collated micro-batches of the batcher's next step (this process's)
    _eval_micro_batches(dataset) -> iter    the collated micro-batches evaluation runs over `dataset`
are built (a trainer whose collation takes more overrides them), which the steps and get_train_dataloader /
get_eval_dataloader share (training/loaders.py).
"""

import itertools
import math
import time

import torch

from posttrain.data import DataError
from posttrain.models.keywords import unwrap
from posttrain.models.packed_layouts import packs_one_row
from posttrain.models.prompt_sharing import body_parameters
from posttrain.sequences.batches import MapBatches, StreamBatches, eval_batches, is_iterable, read_whole
from posttrain.sequences.rows import EpochPlan
from posttrain.training.checkpoint import CheckpointError, CheckpointExtras
from posttrain.training.loaders import MicroBatches
from posttrain.training.prediction import UserMetrics
from posttrain.training.statistics import Statistics, StepCounts
from posttrain.training.setup import run_length_unknown
from posttrain.training.trainer import Trainer


class BatchedDataTrainer(Trainer):
    _statistics = Statistics  # the trainer's (training/statistics.py)
    _collects_router_loss = True  # whether its training forwards add a mixture-of-experts router loss
    _cumulative_metrics = ("num_tokens",)
    _train_source = None  # the train_dataset as given (what get_train_dataloader and train_dataset start from)
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

    def _prefix_sharing_floor(self, min_flop: float, model) -> int | None:
        """The positions a micro-batch's pairs laid out with their common prefixes once (sequences/prefixes.py) must
        save to be run so: `min_flop` of the body's forward FLOPs (what pays for the second forward) in `model`; None
        where they never are: padding-free rows (their own layout), a fixed padded width (`pad_to_multiple_of`: shapes
        kept for a compiler), parameters sharded across processes (FSDP, ZeRO-3: one forward per backward), DDP's
        static graph, a router loss (it balances one forward's tokens)."""
        args = self.args
        if args.padding_free or getattr(self, "pad_to_multiple_of", None) is not None or \
                self.sharding.shards_parameters or args.ddp_static_graph or \
                (self._collects_router_loss and self.router_loss.enabled):
            return None
        return math.ceil(min_flop / (2 * max(body_parameters(unwrap(model)), 1)))

    def _set_batches(self, train_dataset, preparation, prepare_all) -> None:
        """self.batches and self.data_fingerprint: an IterableDataset's stream, prepared block by block, or a map-style
        dataset's rows, prepared at once (`prepare_all(dataset, preparation)`, which has `lengths` and
        `fingerprint()`) and taken in its EpochPlan's order; one sentence when not one global batch is left."""
        args, acc = self.args, self.accelerator
        if is_iterable(train_dataset):
            self._new_batches = lambda: StreamBatches(
                train_dataset, preparation, micro_batch_size=args.per_device_train_batch_size,
                num_processes=acc.num_processes, accumulation=args.gradient_accumulation_steps, rank=acc.process_index)
            self.batches, self.data_fingerprint = self._new_batches(), None
            return
        rows = prepare_all(train_dataset, preparation)
        plan = EpochPlan(rows.lengths, args.per_device_train_batch_size, num_processes=acc.num_processes,
                         accumulation=args.gradient_accumulation_steps, strategy=args.train_sampling_strategy,
                         seed=self._data_seed, drop_last=args.dataloader_drop_last)
        if plan.micro_batches == 0:
            dropped = len(train_dataset) - len(rows) if self._data_noun == "pairs" else 0
            left = f" ({dropped} of {len(train_dataset)} dropped: see the warning)" if dropped > 0 else ""
            noun = self._data_noun if self._data_noun == "pairs" else f"training {self._data_noun}"
            raise DataError(f"train_dataset gives {len(rows)} {noun}{left}, fewer than one global batch "
                            f"({args.per_device_train_batch_size} x {acc.num_processes} processes) with "
                            "dataloader_drop_last=True: set it to False or lower per_device_train_batch_size.")
        self.data_fingerprint = rows.fingerprint()
        self._new_batches = lambda: MapBatches(rows, plan, acc.process_index)
        self.batches = self._new_batches()

    def _step_batches(self, batches) -> list:
        """The collated micro-batches of the batcher's next step (this process's shares), as the step takes them."""
        return [self._collate(share) for share in batches.next_step()]

    def _eval_shares(self, rows):
        """This process's share of each eval micro-batch of the prepared `rows`, every row once, in order."""
        acc = self.accelerator
        return eval_batches(rows, self.args.per_device_eval_batch_size, acc.num_processes, acc.process_index)

    def _eval_micro_batches(self, dataset):
        """The collated micro-batches evaluation runs over `dataset` (prepared once, `_prepared_eval`)."""
        for share in self._eval_shares(self._prepared_eval(dataset)):
            yield self._collate(share)

    def _train_loader(self) -> MicroBatches:
        """One epoch of this process's micro-batches, as the steps collate them, from a fresh batcher."""
        def one_epoch():
            batches = self._new_batches()
            steps = getattr(batches, "steps_per_epoch", None)
            for step in itertools.count():
                if (step >= steps) if steps is not None else batches.epoch > 0:
                    return
                yield from self._step_batches(batches)

        plan = getattr(self.batches, "plan", None)
        return MicroBatches(one_epoch, None if plan is None else plan.micro_batches, self._train_source)

    def _eval_loader(self, dataset) -> MicroBatches:
        return MicroBatches(lambda: self._eval_micro_batches(dataset), None, dataset)

    # ------------------------------------------------------------------ the objective (the trainer's)

    def _collate(self, rows, *args):
        """A micro-batch's prepared rows as the tensors its forward takes."""
        raise NotImplementedError

    def _step_counts(self, batches: list) -> StepCounts:
        """What this process's micro-batches of a step hold: items (what the loss is normalised over), tokens, ..."""
        raise NotImplementedError

    def _step_context(self, batches: list):
        """What the whole step's loss needs before its first micro-batch (KTO's KL point); None."""
        return None

    def _step_loss(self, batch, counts: StepCounts, context, share: float) -> tuple:
        """(a micro-batch's share of the step's loss, its Statistics); `counts` the step's over every process,
        `share` the micro-batch's part of the step (1 / micro-batches, for a router loss)."""
        raise NotImplementedError

    def _eval_statistics(self, batch) -> tuple:
        """(an eval micro-batch's Statistics, a function giving compute_metrics' (logits, labels, inputs) of it)."""
        raise NotImplementedError

    def _prepare_eval(self, rows: list, model):
        """An eval dataset's rows (read whole) prepared as the training rows are (`len()`: how many examples)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the step

    def _optimizer_step(self) -> dict:
        acc = self.accelerator
        batches = self._step_batches(self.batches)
        counts = self._step_counts(batches).reduced(acc)
        context = self._step_context(batches)
        share = 1.0 / len(batches)
        parts = self._accumulate(batches, lambda b: self._step_loss(b, counts, context, share), counts.items)
        metrics = self._statistics.total(parts).reduced(acc).metrics()
        return self._finish_step(metrics, counts.tokens)

    def _finish_step(self, metrics: dict, tokens: float) -> dict:
        """The step's update after its backward passes, from its metrics (its loss among them) and the tokens its
        forwards saw on every process: the router's load-balancing term, the update (grad_norm), the learning rate,
        num_tokens and total_flos; the metrics to log."""
        if self._collects_router_loss:
            router = self._router_metrics()
            metrics.update(router)
            metrics["loss"] += self.router_loss.coef * router.get("aux_loss", 0.0)
        metrics["grad_norm"] = self._apply_update(metrics["loss"])
        metrics["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
        self._tokens_seen += int(tokens)
        metrics["num_tokens"] = float(self._tokens_seen)
        self.state.total_flos += self._flops_per_token * tokens
        return metrics

    # ------------------------------------------------------------------ evaluation

    def _prepared_eval(self, dataset, model=None):
        """An eval dataset's prepared rows (`_prepare_eval`), once per dataset object, as TRL prepares it once."""
        cache = vars(self).setdefault("_eval_prepared", {})
        key = id(dataset)
        if key not in cache:  # the dataset is kept beside its rows, so its id is not reused
            cache[key] = (dataset, self._prepare_eval(read_whole(dataset), model))  # an IterableDataset to its end
        return cache[key][1]

    def _evaluation_metrics(self, dataset, prefix: str) -> dict:
        start = time.time()
        size = len(self._prepared_eval(dataset))
        user = UserMetrics.of(self)
        parts = []
        with torch.no_grad():
            for batch, last in _with_last(self._eval_micro_batches(dataset)):
                stats, view = self._eval_statistics(batch)
                parts.append(stats)
                if user is not None:
                    user.add(*view(), last=last)
        metrics = self._statistics.total(parts).reduced(self.accelerator).metrics(f"{prefix}_")
        runtime = time.time() - start
        metrics.update({f"{prefix}_runtime": round(runtime, 4),
                        f"{prefix}_samples_per_second": round(size / max(runtime, 1e-9), 3),
                        f"{prefix}_num_tokens": float(self._tokens_seen)})
        return {**metrics, **user.result(prefix)} if user is not None else metrics

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


def _with_last(items):
    """(item, whether it is the last) of each of `items`, read one ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
