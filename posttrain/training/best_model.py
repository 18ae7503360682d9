"""The best checkpoint, as transformers' Trainer tracks it: metric_for_best_model, greater_is_better,
save_strategy="best" and load_best_model_at_end.

After each evaluation the metric is compared with `state.best_metric`; a better value becomes the best and its step
`state.best_global_step`. The checkpoint written at that step is `state.best_model_checkpoint`: rotation never
removes it (training/checkpoint.py) and load_best_model_at_end loads its weights before the final save. All three
are saved in each checkpoint and restored on resume.
"""

import logging
import math
import os

from posttrain.configs import ConfigError

logger = logging.getLogger("posttrain")


def metric_key(name: str) -> str:
    """The evaluation record's key for metric_for_best_model (the eval_ prefix added where it is missing)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def record_best(args, state, metrics: dict) -> bool:
    """Compare one evaluation's `metrics` with the best so far; True (and the state updated) when it is better."""
    if args.metric_for_best_model is None:
        return False
    key = metric_key(args.metric_for_best_model)
    if key not in metrics:
        raise ConfigError(f"metric_for_best_model={args.metric_for_best_model!r} is not among the evaluation's "
                          f"metrics ({', '.join(sorted(metrics))}): name one of them.")
    value = float(metrics[key])
    best = state.best_metric
    if best is None:
        best = -math.inf if args.greater_is_better else math.inf
    if not (value > best if args.greater_is_better else value < best):
        return False
    state.best_metric, state.best_global_step = value, state.global_step
    return True


def note_best_checkpoint(args, state) -> None:
    """Before a checkpoint is written: the best step's checkpoint, when it is this one or still on disk, is the
    best checkpoint (transformers' rule)."""
    if args.metric_for_best_model is None or not state.best_global_step:
        return
    path = os.path.join(args.output_dir, f"checkpoint-{state.best_global_step}")
    if state.best_global_step == state.global_step or os.path.isdir(path):
        state.best_model_checkpoint = path


def check_best_checkpoint(state) -> None:
    """After a resume: a best checkpoint that is no longer on disk is forgotten, with a warning."""
    path = state.best_model_checkpoint
    if path is not None and not os.path.isdir(path):
        logger.warning(f"The best checkpoint {path} recorded in the resumed state does not exist any more: "
                       "load_best_model_at_end will use the best one saved from now on.")
        state.best_model_checkpoint = None
