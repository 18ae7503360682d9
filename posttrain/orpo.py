"""The ORPO trainer (TRL 1.16's experimental `trl.experimental.orpo.ORPOTrainer`): odds ratio preference optimisation,
with no reference model, on the pair trainers' source (training/pairs.py: DPO's formats and preparation).

    step       = this process's pairs of gradient_accumulation_steps micro-batches
    P, Tc      = pairs of the whole step and their chosen completions' targets, summed over processes
    each micro-batch: one forward of its 2p sequences; only completion targets reach the output layer
        lp_c, lp_r = each completion's mean target log-prob (TRL's average_log_prob)
        log_odds   = (lp_c - lp_r) - (log(1 - exp(lp_c)) - log(1 - exp(lp_r)))
        loss       = sum over chosen targets of -logp * n / Tc  -  beta * sum over pairs of logsigmoid(log_odds) * n / P
so the update is that of the step's means, however it is split into micro-batches and processes. TRL's NLL is the
mean over each micro-batch's chosen sequences' tokens, prompt tokens included; posttrain's, as the ORPO paper's, is
over the chosen completions (docs/orpo.md).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.configs import ConfigError
from posttrain.configs.orpo import ORPOConfig
from posttrain.models.logprobs import next_token_logprobs
from posttrain.sequences.pair_batch import PairBatch
from posttrain.training.checkpoint import model_fingerprint
from posttrain.training.distributed import guarded
from posttrain.training.pairs import PairCounts, PairTrainer
from posttrain.training.prediction import check_metric_functions
from posttrain.training.setup import trainer_config
from posttrain.training.statistics import SidedStatistics


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float):
    """([P] beta * logsigmoid(log odds ratio), [P] the log odds ratio) of the completions' mean log-probs [P] each:
    the term ORPO subtracts from the NLL (TRL's odds_ratio_loss `losses`), and what it logs."""
    chosen, rejected = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return beta * F.logsigmoid(log_odds), log_odds


@dataclass
class ORPOStatistics(SidedStatistics):
    """A micro-batch's sums: the NLL over its chosen targets, the odds-ratio term and the log odds over its pairs,
    the pairs ranked right; the rewards (beta * mean log-prob), mean log-probs, logits and entropy by side."""

    nll: float = 0.0
    odds_ratio: float = 0.0
    log_odds: float = 0.0
    pairs: float = 0.0
    correct_pairs: float = 0.0

    def metrics(self, prefix: str = "") -> dict:
        """TRL's ORPO metrics: loss, nll_loss, log_odds_ratio, log_odds_chosen, rewards/*, logps/*, logits/*."""
        pairs, chosen_tokens = max(self.pairs, 1.0), max(self.chosen_tokens, 1.0)
        nll = self.nll / chosen_tokens
        out = {"loss": nll - self.odds_ratio / pairs, "nll_loss": nll,
               "log_odds_ratio": self.odds_ratio / pairs, "log_odds_chosen": self.log_odds / pairs,
               "rewards/chosen": self.chosen_reward / pairs, "rewards/rejected": self.rejected_reward / pairs,
               "rewards/accuracies": self.correct_pairs / pairs,
               "rewards/margins": (self.chosen_reward - self.rejected_reward) / pairs,
               "logps/chosen": self.chosen_logps / pairs, "logps/rejected": self.rejected_logps / pairs,
               "logits/chosen": self.chosen_logits / chosen_tokens,
               "logits/rejected": self.rejected_logits / max(self.rejected_tokens, 1.0),
               "entropy": self.entropy / max(self.chosen_tokens + self.rejected_tokens, 1.0)}
        return {prefix + k: v for k, v in out.items()}


class ORPOTrainer(PairTrainer):
    """Odds ratio preference optimisation, with TRL's experimental ORPOTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        args: the ORPOConfig (default: TRL's defaults, output_dir `<model name>-ORPO`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` of preference pairs (DPO's formats).
        eval_dataset: a dataset (or a dict of them) for the eval_* metrics.
        processing_class: the tokenizer; loaded from the model's path when None.
        callbacks, optimizers, compute_metrics, preprocess_logits_for_metrics: as transformers' Trainer takes them.
        peft_config: a peft LoraConfig to train adapters (needs `posttrain[peft]`).
    """

    _title = "ORPO"
    _takes_images = False  # TRL's experimental ORPOTrainer takes text pairs only
    _statistics = ORPOStatistics
    _shown_metrics = ("loss", "rewards/accuracies", "log_odds_ratio")
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "truncation_mode",
                       "padding_free", "train_sampling_strategy", "dataloader_drop_last", "seed", "data_seed", "beta")

    def __init__(self, model=None, args: ORPOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, peft_config=None, compute_metrics=None):
        args = trainer_config(ORPOConfig, args, model, self._title)
        for name, value in (("data_collator", data_collator), ("model_init", model_init)):
            if value is not None:
                raise ConfigError(f"ORPOTrainer({name}=...) is not supported: posttrain batches the pairs itself "
                                  "and takes the model itself; pass model (a model or its path) and the pairs.")
        super().__init__(args, callbacks, optimizers)
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        check_metric_functions(compute_metrics, preprocess_logits_for_metrics, args)  # before any slow work
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model, _ = self._load_pair_policy(model, train_dataset, processing_class, peft_config)
            self._set_pair_data(train_dataset, eval_dataset)
        self._model_fingerprint = model_fingerprint(model)
        self._prepare(model, self._total_steps())
        self._tokens_seen = 0
        self._call("on_init_end")

    def _micro_loss(self, batch: PairBatch, grad: bool, router_share: float | None = None):
        """(the NLL summed over the chosen targets, the odds-ratio term summed over the pairs, the ORPOStatistics,
        the router loss term to add)."""
        s = batch.sequences
        with self.accelerator.autocast():
            model = self.model if grad else self._no_grad_model
            collect = (self.router_loss.collecting(model, router_share) if router_share is not None
                       else contextlib.nullcontext([]))
            with collect as router_term:
                logps, entropy, _, stats = next_token_logprobs(model, s.input_ids, s.attention_mask, s.position_ids,
                                                               s.source_mask, s.targets, with_entropy=True,
                                                               with_stats=True, boundaries=s.boundaries,
                                                               prefixes=self._prefixes(model, batch, grad))
        sums = torch.zeros(batch.targets.numel(), dtype=logps.dtype, device=logps.device).index_add(
            0, batch.target_seq, logps)
        means = (sums / batch.targets.clamp(min=1)).view(-1, 2)  # [P, 2] each completion's mean target log-prob
        odds, log_odds = odds_ratio_terms(means[:, 0], means[:, 1], self.args.beta)
        chosen = batch.target_seq % 2 == 0
        nll = -logps[chosen].sum()
        with torch.no_grad():
            rewards = self.args.beta * means.detach()
            statistics = ORPOStatistics(
                nll=nll.detach(), odds_ratio=odds.detach().sum(), log_odds=log_odds.detach().sum(),
                pairs=float(batch.pairs), correct_pairs=(rewards[:, 0] > rewards[:, 1]).float().sum(),
                chosen_reward=rewards[:, 0].sum(), rejected_reward=rewards[:, 1].sum(),
                chosen_logps=means[:, 0].detach().sum(), rejected_logps=means[:, 1].detach().sum(),
                chosen_logits=stats[chosen, 0].sum(), chosen_tokens=chosen.sum().float(),
                rejected_logits=stats[~chosen, 0].sum(), rejected_tokens=(~chosen).sum().float(),
                entropy=entropy.sum())
        return nll, odds.sum(), statistics, sum(router_term)

    def _step_loss(self, batch: PairBatch, counts: PairCounts, context, share: float):
        n = self.accelerator.num_processes
        batch = batch.to(self.accelerator.device)
        with self._offloading():
            nll, odds, stats, router = self._micro_loss(batch, grad=True, router_share=share if batch.pairs else 0.0)
        loss = nll * (n / max(counts.chosen_targets, 1.0)) - odds * (n / max(counts.items, 1.0))
        return loss + router, stats

    def _eval_statistics(self, batch: PairBatch):
        batch = batch.to(self.accelerator.device)
        return self._micro_loss(batch, grad=False)[2], lambda: self._logits_and_inputs(batch)
