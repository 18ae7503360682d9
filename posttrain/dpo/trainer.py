"""The DPO trainer: its data (preference pairs as token rows: data.py, batch.py), its reference (reference.py) and its
step, on the shared loop (training/trainer.py).

    step          = this process's pairs of gradient_accumulation_steps micro-batches
    P, Tc         = pairs of the whole step, and their chosen completion targets, summed over processes
    each micro-batch: one forward of its 2p sequences (chosen and rejected in one batch, use_cache=False); only the
                      completion targets reach the output layer, in chunks; sequence log-prob = sum of its targets'
                      log-probs (with ld_alpha: the tail beyond the shorter completion weighted by ld_alpha)
                      loss = sum_k w_k * sum_pairs loss_k(pair) * num_processes / P     (losses.py)
                           + w_sft * sum over chosen targets of -logp * num_processes / Tc   (the sft term)
so the update is that of the mean over the step's pairs (and chosen tokens), however the step is split into
micro-batches and processes (aot and aot_unpaired excepted: they sort within a micro-batch).
"""

import contextlib
import logging

import numpy as np
import torch

from posttrain.configs import ConfigError, DPOConfig
from posttrain.sequences.pair_batch import PairBatch
from posttrain.sequences.pairs import PairRows
from posttrain.dpo.losses import PAIR_LOSSES, PairTerms
from posttrain.dpo.metrics import PairStatistics
from posttrain.training.reference import make_reference, precompute_logps
from posttrain.models.logprobs import next_token_logprobs
from posttrain.sequences.batches import is_iterable
from posttrain.training.against_reference import AgainstReferenceTrainer
from posttrain.training.pairs import PairCounts, PairTrainer
from posttrain.training.prediction import check_metric_functions
from posttrain.training.setup import take_quantization_config, trainer_config

logger = logging.getLogger("posttrain")

_REFUSED = {
    "data_collator": "posttrain batches the pairs itself (padded, or padding-free with padding_free=True); prepare "
                     "the rows in the dataset instead (prompt_ids / chosen_ids / rejected_ids columns work as "
                     "they are)",
}


class DPOTrainer(AgainstReferenceTrainer, PairTrainer):
    """Direct preference optimisation, with TRL's DPOTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        ref_model: the reference (a model or a path); default: a frozen copy of the initial policy, or for LoRA the
            policy with adapters off (reference.py).
        args: the DPOConfig (default: TRL's defaults, output_dir `<model name>-DPO`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` of preference pairs (data.py's formats).
        eval_dataset: a dataset (or a dict of them) for the eval_* metrics.
        processing_class: the tokenizer; loaded from the model's path when None.
        callbacks: transformers TrainerCallbacks (instances or classes).
        optimizers: (optimizer, lr_scheduler); None entries are built from the config.
        optimizer_cls_and_kwargs: (optimizer class, keyword arguments), instead of optim and optim_args.
        quantization_config: a transformers quantization config for loading `model` from a path.
        peft_config: a peft LoraConfig to train adapters (needs `posttrain[peft]`).
    """

    _title = "DPO"
    _statistics = PairStatistics
    _shown_metrics = ("loss", "rewards/accuracies", "rewards/margins")
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "truncation_mode",
                       "padding_free", "train_sampling_strategy", "dataloader_drop_last", "seed", "data_seed",
                       "precompute_ref_log_probs", "ld_alpha", "loss_type", "reference_free")

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None):
        args = trainer_config(DPOConfig, args, model, "DPO")
        if data_collator is not None:
            raise ConfigError(f"DPOTrainer(data_collator=...) is not supported: {_REFUSED['data_collator']}.")
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers, optimizer_cls_and_kwargs)
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args)  # before any slow work
        self._build(model, ref_model, train_dataset, eval_dataset, processing_class, peft_config)

    # ------------------------------------------------------------------ setup

    def _setup(self, model, ref_model, train_dataset, eval_dataset, processing_class, peft_config):
        args = self.args
        model, came_with_adapter = self._load_pair_policy(model, train_dataset, processing_class, peft_config,
                                                          eval_dataset)
        self.ref_model, self.reference_adapter = make_reference(model, ref_model, args, came_with_adapter,
                                                                self.accelerator.device, self._trust_remote_code,
                                                                self.tokenizer)
        if is_iterable(train_dataset) and args.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs=True needs every pair up front, and train_dataset is an "
                              "IterableDataset: pass a map-style Dataset, or set precompute_ref_log_probs=False.")
        self._set_pair_data(train_dataset, eval_dataset)
        return model

    def _precompute_references(self, model) -> None:
        """precompute_ref_log_probs: the train pairs' and the eval datasets' reference log-probs, while the policy
        still is the reference."""
        args = self.args
        rows = self.batches.rows
        rows.ref = self._precomputed_reference(model, rows, "train_dataset",
                                               args.precompute_ref_batch_size or args.per_device_train_batch_size)
        if self._eval_source is not None:
            source = self._eval_source
            datasets = source.values() if isinstance(source, dict) else [source]
            for dataset in datasets:
                self._prepared_eval(dataset, model)

    # ------------------------------------------------------------------ the reference

    def _reference_logps(self, batch: PairBatch) -> torch.Tensor:
        """[P, 2] reference sequence log-probs of a batch (precomputed, 0 when reference_free, else computed)."""
        if batch.ref is not None:
            return batch.ref
        if self.args.reference_free:
            return torch.zeros((batch.pairs, 2), device=batch.targets.device)
        model = self.ref_model if self.ref_model is not None else self._no_grad_model
        with torch.no_grad(), self._reference_context(), self.accelerator.autocast():
            logps, _, _ = next_token_logprobs(model, *self._inputs(batch), boundaries=batch.sequences.boundaries,
                                              model_inputs=batch.sequences.model_inputs,
                                              prefixes=self._prefixes(model, batch, grad=False))
        return self._sequence_logps(logps, batch).view(-1, 2)

    def _precomputed_reference(self, model, pairs: PairRows, name: str, batch_size: int) -> np.ndarray:
        """[P, 2] reference log-probs of every pair, from the cache or computed (each process a share, gathered)."""
        def compute(part):
            batch = self._collate(pairs.select(part)).to(self.accelerator.device)
            return self._reference_logps(batch).double().cpu().numpy()

        reference = None
        if self.reference_adapter is None:
            reference = self.ref_model if self.ref_model is not None else model
        settings = (self.args.max_length, self.args.truncation_mode, self.args.ld_alpha)
        return precompute_logps(self.accelerator, model, reference, pairs, 2, settings, self.tokenizer, name, "pairs",
                                compute, batch_size)

    # ------------------------------------------------------------------ the step

    def _inputs(self, batch: PairBatch) -> tuple:
        s = batch.sequences
        return s.input_ids, s.attention_mask, s.position_ids, s.source_mask, s.targets

    def _token_weights(self, batch: PairBatch) -> torch.Tensor | None:
        """LD-DPO's weight of each target [M]: 1 within the pair's shared length, ld_alpha beyond it."""
        alpha = self.args.ld_alpha
        if alpha is None:
            return None
        shared = torch.minimum(batch.targets[0::2], batch.targets[1::2])  # [P]
        beyond = batch.target_pos > shared[batch.target_seq // 2]
        return torch.where(beyond, alpha, 1.0)

    def _sequence_logps(self, logps: torch.Tensor, batch: PairBatch, weighted: bool = True) -> torch.Tensor:
        """[2P] per-sequence sums of [M] target log-probs (LD-weighted unless weighted=False)."""
        weights = self._token_weights(batch) if weighted else None
        terms = logps if weights is None else logps * weights
        return torch.zeros(batch.targets.numel(), dtype=logps.dtype, device=logps.device).index_add(
            0, batch.target_seq, terms)

    def _pair_losses(self, terms: PairTerms) -> torch.Tensor:
        """[P] sum over loss_type of weight * that loss (the sft term excluded: see _micro_loss)."""
        total = torch.zeros_like(terms.chosen_logps)
        for name, weight in zip(self.args.loss_type, self.args.weights):
            if name != "sft":
                total = total + weight * PAIR_LOSSES[name](terms)
        return total

    def _wpo_weights(self, logps, stats, batch: PairBatch) -> torch.Tensor:
        """WPO's detached weight of each pair, w_c * w_r, w = exp(mean over its targets of logp - log sum p^2)."""
        with torch.no_grad():
            aligned = torch.zeros(batch.targets.numel(), device=logps.device).index_add(
                0, batch.target_seq, logps.detach() - stats[:, 1])
            w = torch.exp(aligned / batch.targets.clamp(min=1))
            return w[0::2] * w[1::2]

    def _micro_loss(self, batch: PairBatch, grad: bool, router_share: float | None = None):
        """(loss sum of the micro-batch: preference terms summed over pairs, sft term summed over chosen targets,
        each still to be divided by the step's pairs / chosen targets; its PairStatistics; the router loss term to
        add, 0 unless `router_share` is given (training: models/router.py))."""
        args = self.args
        with self.accelerator.autocast():
            model = self.model if grad else self._no_grad_model
            collect = (self.router_loss.collecting(model, router_share) if router_share is not None
                       else contextlib.nullcontext([]))
            with collect as router_term:
                logps, entropy, top1, stats = next_token_logprobs(model, *self._inputs(batch), with_entropy=True,
                                                                  with_top1=True, with_stats=True,
                                                                  boundaries=batch.sequences.boundaries,
                                                                  model_inputs=batch.sequences.model_inputs,
                                                                  prefixes=self._prefixes(model, batch, grad))
        sequences = self._sequence_logps(logps, batch).view(-1, 2)
        ref = self._reference_logps(batch).to(sequences.dtype)
        completion = batch.completion.view(-1, 2).float()
        terms = PairTerms(sequences[:, 0], sequences[:, 1], ref[:, 0], ref[:, 1], completion[:, 0], completion[:, 1],
                          args.beta, args.label_smoothing, args.discopop_tau, args.f_divergence_type,
                          args.f_alpha_divergence_coef)
        per_pair = self._pair_losses(terms)
        pair_weight = self._wpo_weights(logps, stats, batch) if args.use_weighting else None
        if pair_weight is not None:
            per_pair = per_pair * pair_weight
        chosen = batch.target_seq % 2 == 0
        sft = torch.zeros((), device=logps.device)
        if "sft" in args.loss_type:
            weight = args.weights[args.loss_type.index("sft")]
            token_terms = -logps[chosen]
            if pair_weight is not None:
                token_terms = token_terms * pair_weight[batch.target_seq[chosen] // 2]
            sft = weight * token_terms.sum()
        statistics = self._pair_statistics(terms, per_pair, sft, entropy, top1, stats, chosen, batch)
        return per_pair.sum(), sft, statistics, sum(router_term)

    def _pair_statistics(self, terms, per_pair, sft, entropy, top1, stats, chosen, batch) -> PairStatistics:
        with torch.no_grad():
            beta = self.args.beta
            rc, rr = beta * terms.chosen_logratios.detach(), beta * terms.rejected_logratios.detach()
            rejected = ~chosen
            return PairStatistics(
                pair_loss=per_pair.detach().sum(), sft_loss=sft.detach(), pairs=float(batch.pairs),
                chosen_reward=rc.sum(), rejected_reward=rr.sum(), correct_pairs=(rc > rr).float().sum(),
                chosen_logps=terms.chosen_logps.detach().sum(), rejected_logps=terms.rejected_logps.detach().sum(),
                chosen_logits=stats[chosen, 0].sum(), chosen_tokens=chosen.sum().float(),
                rejected_logits=stats[rejected, 0].sum(), rejected_tokens=rejected.sum().float(),
                entropy=entropy.sum(), correct_tokens=top1[chosen].sum().float())

    def _step_loss(self, batch: PairBatch, counts: PairCounts, context, share: float):
        """One micro-batch's forward (`share`: its part of the step, for a router loss): (its share of the step's
        loss, its statistics)."""
        n = self.accelerator.num_processes
        batch = batch.to(self.accelerator.device)
        with self._offloading():
            pair_sum, sft_sum, stats, router = self._micro_loss(batch, grad=True,
                                                                router_share=share if batch.pairs else 0.0)
        loss = pair_sum * (n / max(counts.items, 1.0)) + sft_sum * (n / max(counts.chosen_targets, 1.0))
        return loss + router, stats

    def _forward_models(self) -> tuple:
        return self._no_grad_model, self.ref_model

    # ------------------------------------------------------------------ evaluation

    def _prepare_eval(self, rows, model) -> PairRows:
        args = self.args
        pairs = super()._prepare_eval(rows, model)
        if args.precompute_ref_log_probs:
            self._check_reference_computable(model)
            pairs.ref = self._precomputed_reference(model if model is not None else self.policy, pairs,
                                                    "eval_dataset", args.precompute_ref_batch_size or
                                                    args.per_device_eval_batch_size)
        return pairs

    def _eval_statistics(self, batch: PairBatch):
        batch = batch.to(self.accelerator.device)
        return self._micro_loss(batch, grad=False)[2], lambda: self._logits_and_inputs(batch)
