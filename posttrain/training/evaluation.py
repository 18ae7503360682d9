"""evaluate() and the eval dataset, with transformers' Trainer's names (a mixin of training/trainer.py's Trainer):
the trainer's `_evaluation_metrics(dataset, prefix)` computes the metrics; here they are split over a dict of
datasets, logged, and passed to the on_evaluate callbacks.
"""

from posttrain.configs import ConfigError


class EvaluationMixin:
    """evaluate(), eval_dataset, and evaluation during training."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Metrics over an eval dataset (default: the trainer's), logged and passed to on_evaluate.

        Args:
            eval_dataset: a dataset, or a dict of them (each evaluated with the prefix eval_<name>).
        """
        dataset = eval_dataset if eval_dataset is not None else self._eval_source
        if dataset is None:
            raise ConfigError("evaluate() needs an eval_dataset: pass it to the trainer or to evaluate().")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        was_training = self.model.training
        self.model.eval()
        try:
            metrics = self._evaluation_metrics(dataset, metric_key_prefix)
        finally:
            self.model.train(was_training)
        self.log(metrics)
        self._call("on_evaluate", metrics=metrics)
        return metrics

    @property
    def eval_dataset(self):
        """The eval dataset (or dict of them) as TRL shows it after preparation (SFT: input_ids and labels; DPO:
        prompt_ids, chosen_ids, rejected_ids; GRPO: the rows as given). Set it to evaluate on other rows."""
        source = self._eval_source
        if source is None:
            return None
        if isinstance(source, dict):
            return {name: self._prepared_view(part) for name, part in source.items()}
        return self._prepared_view(source)

    @eval_dataset.setter
    def eval_dataset(self, dataset) -> None:
        self._eval_source = dataset

    def _prepared_view(self, dataset):
        """A dataset as the trainer prepares it, for users to read (the trainer trains on its own rows)."""
        return dataset

    def _evaluate_during_training(self) -> None:
        if self._eval_source is None:
            raise ConfigError(f"eval_strategy={self.args.eval_strategy!r} (or eval_on_start) needs an eval_dataset: "
                              "pass one to the trainer, or set eval_strategy='no'.")
        return self.evaluate()
