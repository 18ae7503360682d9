"""compute_metrics over an evaluation pass, fed as transformers' evaluation loop feeds it (SFT, DPO, KTO, the reward
model: its scores, chosen then rejected per batch, [2P, 1], and no labels, as TRL's prediction_step gives them).

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

Both functions' signatures are checked when the trainer is built (`check_metric_functions`). A function that raises
stops the evaluation with one sentence naming it and what it was given (its own traceback kept as the cause); so does
a compute_metrics that returns anything but a dict of metric names (strings) to numbers (numpy or one-element tensors
included), or a preprocess_logits_for_metrics that returns anything but a tensor with a row per sequence.
"""

import reprlib

import numpy as np
import torch

from posttrain.configs import ConfigError
from posttrain.errors import UserFunctionError, described, detail_of, function_name, signature_mismatch
from posttrain.timeouts import waiting_on

_ANY = object()  # an argument whose value a signature check does not look at


def check_metric_functions(compute_metrics, preprocess, args) -> None:
    """Stop, when the trainer is built, a compute_metrics or preprocess_logits_for_metrics that cannot be called as the
    evaluation calls it: compute_metrics(eval_prediction) (with compute_result=... under batch_eval_metrics), and
    preprocess_logits_for_metrics(logits, labels)."""
    for name, fn in (("compute_metrics", compute_metrics), ("preprocess_logits_for_metrics", preprocess)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} is a {type(fn).__name__}, not a function: pass a function, or None.")
    batched = bool(getattr(args, "batch_eval_metrics", False))
    if compute_metrics is not None:
        problem = signature_mismatch(compute_metrics, _ANY, **({"compute_result": True} if batched else {}))
        if problem is not None:
            call = "compute_metrics(eval_prediction" + (", compute_result=...)" if batched else ")")
            fix = ("make it take one argument, the EvalPrediction (predictions, label_ids), and return a dict of "
                   "metric names to numbers")
            if batched:
                fix = ("add a compute_result parameter (True on the last batch, where it returns the metrics), or set "
                       "batch_eval_metrics=False") if signature_mismatch(compute_metrics, _ANY) is None else (
                    "make it take the EvalPrediction and a compute_result keyword (True on the last batch, where it "
                    "returns a dict of metric names to numbers)")
            raise ConfigError(f"compute_metrics {described(compute_metrics)} cannot be called as the evaluation calls "
                              f"it, {call} ({problem}): {fix}.")
    if preprocess is not None:
        problem = signature_mismatch(preprocess, _ANY, _ANY)
        if problem is not None:
            raise ConfigError(f"preprocess_logits_for_metrics {described(preprocess)} cannot be called as the "
                              f"evaluation calls it, preprocess_logits_for_metrics(logits, labels) ({problem}): make "
                              "it take a batch's logits and labels and return the tensor to keep (e.g. "
                              "logits.argmax(-1)).")


def _shape(value) -> str:
    """[rows, ...] of an array or tensor, or how many batches a list holds (eval_do_concat_batches=False)."""
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} batches"
    return str(list(getattr(value, "shape", ()))) if hasattr(value, "shape") else type(value).__name__


def _number(value):
    """A metric's value as an int or float (numpy scalars and one-element arrays or tensors read out), else None."""
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    return value if isinstance(value, (int, float)) else None


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
        check_metric_functions(compute_metrics, preprocess, args)  # also when assigned to the trainer once built
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

    def add(self, logits: torch.Tensor, labels: torch.Tensor | None, input_ids: torch.Tensor, last: bool) -> None:
        """One batch: its logits [B, T, V] (the reward model's: scores [B, 1]), labels [B, T] (-100: not a target;
        None where the trainer has none, as the reward model: label_ids is then ()) and token ids [B, T] (B may be
        0)."""
        if self.preprocess is not None:
            logits = self._preprocessed(logits, labels)
        local = {"predictions": logits, "label_ids": labels, "inputs": input_ids}
        if labels is None:
            local.pop("label_ids")
        gathered = {}
        for name, value in local.items():
            arrays = self._gather(value.detach().float().cpu().numpy() if value.is_floating_point()
                                  else value.detach().cpu().numpy())
            gathered[name] = _pad_concat(arrays if arrays else [np.zeros((0,) + tuple(value.shape[1:]),
                                                                        dtype=np.float32)])
        if self.batched:
            from transformers import EvalPrediction

            as_tensors = {k: torch.from_numpy(v) for k, v in gathered.items()}
            self._last = self._compute(self._prediction(EvalPrediction, as_tensors), compute_result=last)
        else:
            for name, value in gathered.items():
                self._parts[name].append(value)

    def _gather(self, array: np.ndarray) -> list[np.ndarray]:
        if self.accelerator.num_processes == 1:
            return [array] if len(array) else []
        from accelerate.utils import gather_object

        return [a for a in gather_object([array]) if len(a)]

    def _preprocessed(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """preprocess_logits_for_metrics(logits, labels), which must keep a row per sequence."""
        fn = self.preprocess
        try:
            out = fn(logits, labels)
        except Exception as err:  # noqa: BLE001 - the user's own exception: its traceback is kept as the cause
            raise UserFunctionError(f"preprocess_logits_for_metrics {function_name(fn)!r} raised {type(err).__name__} "
                                    f"on logits {_shape(logits)} and labels {_shape(labels)}{detail_of(err)}; fix the "
                                    "function.") from err
        if not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != logits.shape[0]:
            what = f"a tensor {_shape(out)}" if isinstance(out, torch.Tensor) else (
                "None" if out is None else f"a {type(out).__name__}")
            raise UserFunctionError(f"preprocess_logits_for_metrics {function_name(fn)!r} returned {what} for logits "
                                    f"{_shape(logits)}: return one tensor with a row per sequence ({len(logits)} rows),"
                                    " e.g. logits.argmax(-1).")
        return out

    def _compute(self, prediction, **kwargs):
        """compute_metrics(prediction, **kwargs), its own exception kept as the cause of the one sentence."""
        fn = self.compute_metrics
        try:
            with waiting_on(f"compute_metrics {function_name(fn)!r}"):  # user code: an interrupt stops it
                return fn(prediction, **kwargs)
        except Exception as err:  # noqa: BLE001 - the user's own exception: its traceback is kept as the cause
            raise UserFunctionError(f"compute_metrics {function_name(fn)!r} raised {type(err).__name__} on an "
                                    f"EvalPrediction of predictions {_shape(prediction.predictions)} and label_ids "
                                    f"{_shape(prediction.label_ids)}{detail_of(err)}; fix the function.") from err

    def _checked(self, metrics) -> dict:
        """compute_metrics' result: a dict of metric names (strings) to numbers (read out of numpy and tensors)."""
        name = repr(function_name(self.compute_metrics))
        last = " on the last batch (compute_result=True)" if self.batched else ""
        if not isinstance(metrics, dict):
            what = "None" if metrics is None else f"a {type(metrics).__name__}"
            raise UserFunctionError(f"compute_metrics {name} returned {what}{last}: return a dict of metric names to "
                                    "numbers, e.g. {'accuracy': 0.9}.")
        out = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise UserFunctionError(f"compute_metrics {name} returned the metric name {key!r} "
                                        f"({type(key).__name__}): metric names must be strings, e.g. 'accuracy'.")
            number = _number(value)
            if number is None:
                what = (f"an array {_shape(value)}" if hasattr(value, "shape") else
                        f"{reprlib.repr(value)} ({type(value).__name__})")
                raise UserFunctionError(f"compute_metrics {name} returned {what} for the metric {key!r}: a metric's "
                                        "value must be one number (an int or float, or a one-element array or "
                                        "tensor).")
            out[key] = number
        return out

    def _prediction(self, cls, values: dict):
        kwargs = {"inputs": values["inputs"]} if self.with_inputs else {}
        labels = values.get("label_ids")
        return cls(predictions=values["predictions"], label_ids=labels if labels is not None and len(labels) else (),
                   **kwargs)

    def result(self, prefix: str) -> dict:
        """compute_metrics' metrics, each key with the `prefix`_ (eval_, or eval_<name>_) it lacks."""
        if self.batched:
            metrics = self._last
        else:
            from transformers import EvalPrediction

            concat = getattr(self.args, "eval_do_concat_batches", True)
            values = {name: (_pad_concat(parts) if concat else parts) for name, parts in self._parts.items() if parts}
            metrics = self._compute(self._prediction(EvalPrediction, values))
        return {(key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"): value
                for key, value in self._checked(metrics).items()}
