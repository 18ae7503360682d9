"""compute_metrics over an evaluation pass, fed as transformers' evaluation loop feeds it (SFT, DPO).

posttrain's own evaluation never builds whole logits. A user's `compute_metrics` asks for them, so each eval batch
is run once more through the model for its [B, T, V] logits, as TRL 1.16 does (it too recomputes them, in an extra
forward). As in transformers:
- `preprocess_logits_for_metrics(logits, labels)` is applied to each batch's logits first (to keep memory down);
- the batches are concatenated along the rows, padded along the sequence with -100, gathered from every process,
  and passed as numpy arrays in an `EvalPrediction(predictions, label_ids)`; `include_for_metrics: [inputs]` adds
  `inputs` (the token ids);
- `eval_do_concat_batches: false` passes lists of batches instead; `batch_eval_metrics: true` calls
  `compute_metrics(EvalPrediction, compute_result=...)` on each gathered batch (tensors) and keeps the last result;
- `prediction_loss_only: true` skips it; the returned keys get the `eval_` prefix (or the dataset's) when they lack it.
"""

import numpy as np
import torch

from posttrain.configs import ConfigError


def _pad_concat(arrays: list[np.ndarray], pad: int = -100) -> np.ndarray:
    """Arrays [n_i, T_i, ...] -> [sum n_i, max T_i, ...], padded with `pad` (transformers' nested_concat)."""
    if arrays[0].ndim < 2:
        return np.concatenate(arrays)
    width = max(a.shape[1] for a in arrays)
    out = np.full((sum(a.shape[0] for a in arrays), width, *arrays[0].shape[2:]), pad, dtype=arrays[0].dtype)
    row = 0
    for a in arrays:
        out[row:row + a.shape[0], :a.shape[1]] = a
        row += a.shape[0]
    return out


class UserMetrics:
    """One evaluation pass's inputs to compute_metrics. `add` each batch (every process the same number of times),
    then `result`."""

    def __init__(self, compute_metrics, preprocess, args, accelerator):
        self.compute_metrics, self.preprocess = compute_metrics, preprocess
        self.args, self.accelerator = args, accelerator
        include = list(getattr(args, "include_for_metrics", None) or [])
        unknown = [name for name in include if name != "inputs"]
        if unknown:
            raise ConfigError(f"include_for_metrics={include!r}: posttrain passes 'inputs' to compute_metrics, not "
                              f"{', '.join(map(repr, unknown))}; remove it.")
        self.with_inputs = "inputs" in include
        self.batched = bool(getattr(args, "batch_eval_metrics", False))
        self._parts: dict[str, list[np.ndarray]] = {"predictions": [], "label_ids": [], "inputs": []}
        self._last: dict = {}

    @classmethod
    def of(cls, trainer) -> "UserMetrics | None":
        """For the trainer's compute_metrics, or None when it has none or prediction_loss_only is set."""
        if trainer.compute_metrics is None or getattr(trainer.args, "prediction_loss_only", False):
            return None
        return cls(trainer.compute_metrics, trainer.preprocess_logits_for_metrics, trainer.args, trainer.accelerator)

    def add(self, logits: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor, last: bool) -> None:
        """One batch: its logits [B, T, V], labels [B, T] (-100: not a target) and token ids [B, T] (B may be 0)."""
        if self.preprocess is not None:
            logits = self.preprocess(logits, labels)
        local = {"predictions": logits, "label_ids": labels, "inputs": input_ids}
        gathered = {}
        for name, value in local.items():
            arrays = self._gather(value.detach().float().cpu().numpy() if value.is_floating_point()
                                  else value.detach().cpu().numpy())
            gathered[name] = _pad_concat(arrays if arrays else [np.zeros((0,) + tuple(value.shape[1:]),
                                                                        dtype=np.float32)])
        if self.batched:
            from transformers import EvalPrediction

            as_tensors = {k: torch.from_numpy(v) for k, v in gathered.items()}
            self._last = self.compute_metrics(self._prediction(EvalPrediction, as_tensors), compute_result=last) or {}
        else:
            for name, value in gathered.items():
                self._parts[name].append(value)

    def _gather(self, array: np.ndarray) -> list[np.ndarray]:
        if self.accelerator.num_processes == 1:
            return [array] if len(array) else []
        from accelerate.utils import gather_object

        return [a for a in gather_object([array]) if len(a)]

    def _prediction(self, cls, values: dict):
        kwargs = {"inputs": values["inputs"]} if self.with_inputs else {}
        return cls(predictions=values["predictions"], label_ids=values["label_ids"], **kwargs)

    def result(self, prefix: str) -> dict:
        """compute_metrics' metrics, each key with the `prefix`_ (eval_, or eval_<name>_) it lacks."""
        if self.batched:
            metrics = self._last
        else:
            from transformers import EvalPrediction

            concat = getattr(self.args, "eval_do_concat_batches", True)
            values = {name: (_pad_concat(parts) if concat else parts) for name, parts in self._parts.items()}
            metrics = self.compute_metrics(self._prediction(EvalPrediction, values)) or {}
        if not isinstance(metrics, dict):
            raise ConfigError(f"compute_metrics returned a {type(metrics).__name__}: it must return a dict of "
                              "metric names to numbers.")
        return {(key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"): (value.item() if hasattr(value, "item")
                                                                              else value)
                for key, value in metrics.items()}
