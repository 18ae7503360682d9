"""The reward model's trainer: preference pairs (data.py) scored by a sequence classifier with one label, the
Bradley-Terry loss, on the shared loop (training/trainer.py).

    step          = this process's pairs of gradient_accumulation_steps micro-batches
    P             = pairs of the whole step, summed over processes
    each micro-batch: one forward of its 2p sequences (chosen 2i, rejected 2i + 1; padded, or padding-free end to
                      end), or, where the pairs begin alike and that pays, each pair's common prefix once and both
                      continuations against its cache (sequences/prefixes.py); each sequence's reward r is the score
                      head's output at its last non-pad token (models/scores.py)
                      loss = sum_pairs [-log sigmoid(r_c - r_r - margin) + c * (r_c + r_r)^2] * num_processes / P
                      (c: center_rewards_coefficient; TRL takes the mean of (r_c + r_r)^2 over the micro-batch's
                      pairs, the same term per pair)
so the update is that of the mean over the step's pairs, however the step is split into micro-batches and processes.

Metrics, TRL's names: accuracy (share of pairs with r_c > r_r), margin (mean r_c - r_r), min_reward, mean_reward,
max_reward (over the step's 2P rewards), num_tokens. TRL takes min and max per micro-batch and averages them over the
logging window; posttrain takes them over the step (equal with one micro-batch a step, as in TRL's defaults).
"""

import logging

import torch
import torch.nn.functional as F

from posttrain.configs import ConfigError, RewardConfig
from posttrain.data import DataError
from posttrain.models.loading import load_sequence_classifier
from posttrain.models.forwards import masked_gqa_on_cpu
from posttrain.models.prefix_rows import layout
from posttrain.models.prompt_sharing import ONE_ROW, UNSHARED, every_process_least
from posttrain.models.scores import (HEAD_NAMES, prefix_row_scores, prefix_shared_scores, prefix_sharing_works,
                                     row_scores_work, score_head, score_positions, sequence_scores)
from posttrain.reward.data import (RewardEncoder, RewardPreparation, detect_format, pairs_as_dataset,
                                   prepare_reward_pairs)
from posttrain.reward.metrics import RewardStatistics
from posttrain.reward.sparse_rows import RowwiseEmbeddingUpdate, SparseRows
from posttrain.sequences.batches import MapBatches, first_row, is_iterable
from posttrain.sequences.collate import SequenceBatch, collate
from posttrain.sequences.pairs import PairRows
from posttrain.sequences.prefixes import PrefixBatch, prefix_batch
from posttrain.training.batched import BatchedDataTrainer
from posttrain.training.checkpoint import model_fingerprint
from posttrain.training.distributed import guarded
from posttrain.training.prediction import check_metric_functions
from posttrain.training.setup import take_quantization_config, trainer_config
from posttrain.training.statistics import StepCounts

logger = logging.getLogger("posttrain")

# a micro-batch's common prefixes run once (sequences/prefixes.py) when that saves at least this many forward FLOPs
# (2 per body parameter and position): the second forward costs a few milliseconds on a CPU. Measured on 2 cores with
# the 152k-vocabulary model of bench/reward_step.py (body 288k parameters), a step's forward and backward of 8 pairs:
# prompt 64 + answers 64 (3e8 saved) 47 -> 44 ms, prompt 128 + answers 64 (6e8) 82 -> 57 ms, 192 + 64: 118 -> 78 ms
MIN_PREFIX_SAVING_FLOP = 5e8
_REFUSED = {
    "data_collator": "posttrain batches the pairs itself (padded, or padding-free with padding_free=True); prepare "
                     "the rows in the dataset instead (chosen_ids / rejected_ids columns work as they are)",
}


class RewardBatch:
    """A micro-batch of pairs: its 2p sequences collated (`sequences`), `last` [2p] the flat index each sequence's
    reward is read at when they are packed (padded rows: None, the model pools them itself), `prefixes` the pairs
    with their common prefixes once where that pays (else None), `margin` [p] or None."""

    def __init__(self, sequences: SequenceBatch, last: torch.Tensor | None, prefixes: PrefixBatch | None,
                 margin: torch.Tensor | None, pairs: int):
        self.sequences, self.last, self.prefixes, self.margin, self.pairs = sequences, last, prefixes, margin, pairs

    def to(self, device) -> "RewardBatch":
        def move(t):
            return t.to(device) if t is not None else None

        return RewardBatch(self.sequences.to(device), move(self.last), move(self.prefixes), move(self.margin),
                           self.pairs)


def collate_reward_pairs(pairs: PairRows, pad_id: int, padding_free: bool, pad_to_multiple_of: int | None,
                         min_shared: int | None = None) -> RewardBatch:
    """The micro-batch's tensors; with `min_shared` (padded rows only) also its shared-prefix layout, where that
    saves at least that many positions (sequences/prefixes.py)."""
    rows = pairs.rows
    sequences = collate(rows, pad_id, padding_free, pad_to_multiple_of)
    last = torch.from_numpy(score_positions(rows.tokens, rows.offsets, pad_id)) if padding_free else None
    prefixes = prefix_batch(rows, pad_id, sequences.input_ids.size(1), min_shared) \
        if min_shared is not None and not padding_free else None
    margin = torch.from_numpy(pairs.margin).float() if pairs.margin is not None else None
    return RewardBatch(sequences, last, prefixes, margin, len(pairs))


class RewardTrainer(BatchedDataTrainer):
    """A reward model from preference pairs, with TRL's RewardTrainer signature.

    Args:
        model: a sequence classifier with num_labels=1, or the path / hub id of one or of a causal LM (loaded as
            AutoModelForSequenceClassification with num_labels=1: a new score head, as in TRL).
        args: the RewardConfig (default: TRL's defaults, output_dir `<model name>-Reward`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` of preference pairs (data.py's formats).
        eval_dataset: a dataset (or a dict of them) for the eval_* metrics.
        processing_class: the tokenizer; loaded from the model's path when None.
        callbacks: transformers TrainerCallbacks (instances or classes).
        optimizers: (optimizer, lr_scheduler); None entries are built from the config.
        optimizer_cls_and_kwargs: (optimizer class, keyword arguments), instead of optim and optim_args.
        quantization_config: a transformers quantization config for loading `model` from a path.
        peft_config: a peft LoraConfig (needs `posttrain[peft]`); the score head is trained whole beside the
            adapters (added to modules_to_save when the config leaves it out, as task_type SEQ_CLS does).
    """

    _title = "Reward"
    _statistics = RewardStatistics
    _collects_router_loss = False
    _shown_metrics = ("loss", "accuracy", "margin")
    _data_noun = "pairs"
    _data_parts = "the pairs or their order"
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "padding_free",
                       "train_sampling_strategy", "dataloader_drop_last", "seed", "data_seed",
                       "center_rewards_coefficient")

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None):
        args = trainer_config(RewardConfig, args, model, "Reward")
        if data_collator is not None:
            raise ConfigError(f"RewardTrainer(data_collator=...) is not supported: {_REFUSED['data_collator']}.")
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers, optimizer_cls_and_kwargs)
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args)  # before any slow work
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model = self._setup(model, train_dataset, eval_dataset, processing_class, peft_config)
        self._model_fingerprint = model_fingerprint(model)
        self._prepare(model, self._total_steps())
        rows = SparseRows.where_exact(
            self.policy, self.optimizer, fp16=args.fp16, one_process=self.accelerator.num_processes == 1 and
            self.model is self.policy, optimizer_built_here=optimizers == (None, None) and not optimizer_cls_and_kwargs)
        if rows is not None:  # the embedding's rows that move, updated alone
            self._update = RowwiseEmbeddingUpdate(self.sharding, rows)
        self._min_shared = self._prefix_sharing_floor(MIN_PREFIX_SAVING_FLOP, self.policy)
        self._tokens_seen = 0
        self._call("on_init_end")

    # ------------------------------------------------------------------ setup

    def _setup(self, model, train_dataset, eval_dataset, processing_class, peft_config):
        if train_dataset is None:
            raise DataError("RewardTrainer needs a train_dataset of preference pairs (chosen, rejected).")
        self._check_given_model(model)
        detect_format(first_row(train_dataset), "train_dataset")  # before the model loads
        model, _ = self._load_policy(model, processing_class, peft_config, adapt=self._adapt,
                                     load=load_sequence_classifier)
        self._configure_tokenizer(model)
        self.pad_to_multiple_of = self._padding_multiple()
        self.train_preparation = self._preparation(train_dataset, "train_dataset")
        self._train_source = train_dataset
        self._set_batches(train_dataset, self.train_preparation, prepare_reward_pairs)
        self.eval_dataset = eval_dataset
        return model

    @staticmethod
    def _check_given_model(model) -> None:
        """A model object must already be a reward model: one score per sequence, from a head posttrain can read."""
        if isinstance(model, str):
            return
        labels = getattr(getattr(model, "config", None), "num_labels", None)
        if labels != 1:
            raise ConfigError(f"The model has num_labels={labels}, and a reward model gives one score per sequence: "
                              "load it with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1), or "
                              "pass its path and posttrain loads it so.")
        if score_head(model) is None:
            raise ConfigError(f"{type(model).__name__} has no classification head named {' or '.join(HEAD_NAMES)}, "
                              "where posttrain reads the rewards: use a transformers "
                              "AutoModelForSequenceClassification model.")

    def _adapt(self, model, peft_config) -> None:
        """chat_template_path (sequences/templates.py), and with adapters the score head trained whole."""
        from posttrain.sequences.templates import apply_chat_template_path, train_added_tokens

        if self.args.chat_template_path is not None:
            added = apply_chat_template_path(self.args.chat_template_path, model, self.tokenizer,
                                             self._trust_remote_code)
            train_added_tokens(peft_config, added, tied=True)  # a classifier has no output embeddings to save
        if peft_config is not None:
            task = str(getattr(peft_config, "task_type", None) or "")
            if task and task.split(".")[-1] != "SEQ_CLS":
                raise ConfigError(f"peft_config has task_type={task.split('.')[-1]!r}, and a reward model is a "
                                  "sequence classifier: set task_type='SEQ_CLS' (--lora_task_type SEQ_CLS), or leave "
                                  "it unset.")
            head, _ = score_head(model)
            if head not in (peft_config.modules_to_save or []):
                logger.info("The score head %r is trained whole beside the adapters (added to the LoRA config's "
                            "modules_to_save, as task_type='SEQ_CLS' does): a new head left frozen would score at "
                            "random.", head)
                peft_config.modules_to_save = [*(peft_config.modules_to_save or []), head]

    def _configure_tokenizer(self, model) -> None:
        """eos_token and pad_token onto the tokenizer, pad_token_id onto the model's config (where it reads the
        scores), as in TRL."""
        args, tok = self.args, self.tokenizer
        self._check_named_tokens()
        if args.eos_token is not None:
            tok.eos_token = args.eos_token
            model.config.get_text_config().eos_token_id = tok.eos_token_id
        if tok.eos_token is None and tok.pad_token is None and args.pad_token is None:
            raise ConfigError("The tokenizer has neither a pad nor an EOS token, and the reward is read at each "
                              "sequence's last token that is not padding: set pad_token (or eos_token).")
        self._set_pad_token(model)
        model.config.get_text_config().pad_token_id = tok.pad_token_id

    def _preparation(self, dataset, name: str) -> RewardPreparation:
        if not is_iterable(dataset) and len(dataset) == 0:
            raise DataError(f"{name} is empty: it needs at least one pair.")
        encoder = RewardEncoder(self.tokenizer, first_row(dataset), name, self._vocab_rows)
        return RewardPreparation(encoder, self.args, name, announce=self.accelerator.is_main_process)

    # ------------------------------------------------------------------ the step

    @property
    def _no_grad_model(self):
        return self.forward_policy

    def _collate(self, pairs: PairRows) -> RewardBatch:
        padding_free = self._runs_padding_free(self.args.padding_free, self.forward_policy)
        return collate_reward_pairs(pairs, self.tokenizer.pad_token_id, padding_free, self.pad_to_multiple_of,
                                    self._min_shared)

    def _scores(self, model, batch: RewardBatch) -> torch.Tensor:
        """[2p] rewards, the common prefixes run once where the batch has them laid out so and the model allows it: as
        a row per pair, else as two forwards through a cache (prefix_rows.layout; every process training together in
        the same layout)."""
        shared = batch.prefixes
        with masked_gqa_on_cpu(model):
            local = UNSHARED if shared is None else layout(model, shared.row_width, row_scores_work,
                                                           prefix_sharing_works)
            chosen = UNSHARED if self._min_shared is None else every_process_least(model, local)
            if chosen != UNSHARED:
                scores = prefix_row_scores if chosen == ONE_ROW else prefix_shared_scores
                return scores(model, shared.prefix_ids, shared.prefix_mask, shared.suffix_ids, shared.suffix_mask)
            s = batch.sequences
            return sequence_scores(model, s.input_ids, s.attention_mask, s.position_ids, batch.last, s.boundaries)

    def _micro_loss(self, batch: RewardBatch, grad: bool):
        """(the micro-batch's loss summed over its pairs, its RewardStatistics, [2p] detached rewards)."""
        with self.accelerator.autocast():
            rewards = self._scores(self.model if grad else self._no_grad_model, batch)
        chosen, rejected = rewards[0::2], rewards[1::2]
        difference = chosen - rejected
        per_pair = -F.logsigmoid(difference - batch.margin if batch.margin is not None else difference)
        coefficient = self.args.center_rewards_coefficient
        if coefficient is not None:
            per_pair = per_pair + coefficient * (chosen + rejected) ** 2
        with torch.no_grad():
            every = rewards.detach().double()
            none = not every.numel()
            stats = RewardStatistics(
                loss=per_pair.detach().sum(), pairs=float(batch.pairs), correct_pairs=(difference > 0).float().sum(),
                margin=difference.detach().sum(), reward_sum=every.sum(), rewards=float(every.numel()),
                min_reward=float("inf") if none else every.min(), max_reward=float("-inf") if none else every.max())
        return per_pair.sum(), stats, rewards.detach()

    def _step_counts(self, batches: list) -> StepCounts:
        return StepCounts(items=sum(b.pairs for b in batches), tokens=sum(b.sequences.tokens for b in batches))

    def _step_loss(self, batch: RewardBatch, counts: StepCounts, context, share: float):
        """One micro-batch's forward: (its share of the step's loss, its statistics)."""
        with self._offloading():
            loss, stats, _ = self._micro_loss(batch.to(self.accelerator.device), grad=True)
        return loss * (self.accelerator.num_processes / max(counts.items, 1.0)), stats

    # ------------------------------------------------------------------ evaluation

    def _prepare_eval(self, rows, model) -> PairRows:
        return prepare_reward_pairs(rows, self._preparation(rows, "eval_dataset"))

    def _eval_statistics(self, batch: RewardBatch):
        """An eval micro-batch's statistics, and compute_metrics' view of it as TRL's prediction_step gives it: the
        chosen scores, then the rejected ones; no labels."""
        batch = batch.to(self.accelerator.device)
        _, stats, rewards = self._micro_loss(batch, grad=False)
        ids = batch.sequences.input_ids
        return stats, lambda: (torch.cat([rewards[0::2], rewards[1::2]])[:, None], None,
                               torch.cat([ids[0::2], ids[1::2]]))

    @property
    def train_dataset(self):
        """The pairs as TRL shows its prepared dataset: chosen_ids, rejected_ids (and margin). Built on access."""
        if not isinstance(self.batches, MapBatches):
            return self._train_source
        return pairs_as_dataset(self.batches.rows)

    def _prepared_view(self, dataset):
        return pairs_as_dataset(self._prepared_eval(dataset))
