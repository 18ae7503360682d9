"""TRL 1.16 GRPOConfig fields that posttrain accepts at its own behaviour, and the snapshot of TRL's field list.

Every field of TRL's GRPOConfig (including those it inherits from transformers' TrainingArguments) is either
implemented with TRL's name, default and meaning (the field groups in configs/fields.py and configs/grpo.py), or
listed here:

    same behaviour   posttrain does what TRL does for the accepted values (often: the field configures something
                     posttrain does not have, such as a DataLoader, so any value gives TRL's result);
    not supported    only the listed values are accepted; any other value stops with one sentence saying why and
                     what to do instead.

`TRLCompatConfig` is built from the table, so each entry is a real field: `GRPOConfig(use_liger_kernel=False)` and
`--use_liger_kernel false` work, and `use_liger_kernel=True` is refused. `trl_grpo_fields.json` is the snapshot of
TRL 1.16.0's field list (with transformers 5.23.0); tests/test_trl_fields.py checks that every field in it (or in the
installed TRL, when it is importable) is covered.
"""

import dataclasses
import importlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from posttrain.configs.base import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, ConfigError, Help, Range
from posttrain.registry import BY_NAME as BY_TRAINER

SNAPSHOTS = {name: os.path.join(os.path.dirname(__file__), f"trl_{name}_fields.json") for name in BY_TRAINER}
SNAPSHOT = SNAPSHOTS["grpo"]
ANY = "any value"
SAME, UNSUPPORTED = "same behaviour", "not supported"


@dataclass(frozen=True)
class Compat:
    """One TRL field posttrain does not implement as a feature of its own.

    Attributes:
        accepts: ANY, a tuple of accepted values, or a predicate on the value.
        why: what posttrain does instead, and (for refused values) what to do; one clause, no final period.
    """

    name: str
    type: Any
    default: Any
    status: str
    why: str
    accepts: Union[str, tuple, Callable[[Any], bool]] = ANY
    range: Range | None = None  # for a number: the values it can take at all

    def accepted(self, value) -> bool:
        if self.accepts == ANY:
            return True
        if callable(self.accepts):
            return self.accepts(value)
        return value in self.accepts

    def accepted_text(self) -> str:
        if self.accepts == ANY:
            return "any value"
        if callable(self.accepts):
            return getattr(self.accepts, "__doc__", None) or "see why"
        return " or ".join(repr(v) for v in self.accepts)


def _empty(value) -> bool:
    """empty or None"""
    return value in (None, "", [], {}) or (isinstance(value, list) and all(v in ("", None) for v in value))


_ACCELERATOR_CONFIG_KEYS = {"split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                            "non_blocking", "gradient_accumulation_kwargs", "use_configured_state"}


def _plain_accelerator_config(value) -> bool:
    """None, or transformers' AcceleratorConfig (a dict or the object) with split_batches, use_configured_state false
    and no gradient_accumulation_kwargs"""
    if value is None or value == {} or value == "":
        return True
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict) or set(value) - _ACCELERATOR_CONFIG_KEYS:
        return False
    return (not value.get("split_batches") and not value.get("use_configured_state")
            and not value.get("gradient_accumulation_kwargs"))


def _only(default):
    return (default,)


def same(name, tp, default, why, accepts=ANY, range=None) -> Compat:
    return Compat(name, tp, default, SAME, why, accepts, range)


def unsupported(name, tp, default, why, accepts=None, range=None) -> Compat:
    return Compat(name, tp, default, UNSUPPORTED, why, _only(default) if accepts is None else accepts, range)


_NO_LOADER = "posttrain tokenizes the prompts up front and draws them itself, with no DataLoader"
_NO_METRICS = "GRPO evaluation reports sampled rewards and the loss, with no compute_metrics"
# transformers' TrainingArguments fields, as GRPO takes them (SFT_COMPAT below adjusts them for SFT)
TRAINING_ARGS: list[Compat] = [
    same("average_tokens_across_devices", bool, True,
         "posttrain always normalises token-level losses by the tokens of every process, so any split of a batch "
         "gives the same update; False would change that", accepts=(True,)),
    same("label_smoothing_factor", float, 0.0, "GRPO's loss has no labels to smooth; TRL's GRPOTrainer ignores it too", range=FRACTION),
    unsupported("bf16_full_eval", bool, False, "evaluation runs in the training precision; set bf16 for both"),
    unsupported("fp16_full_eval", bool, False, "evaluation runs in the training precision; set fp16 for both"),
    unsupported("torch_compile", bool, False,
                "posttrain runs the model eagerly (its decode loop and chunked output layer are tuned without "
                "torch.compile); remove it"),
    unsupported("torch_compile_backend", Optional[str], None, "torch.compile is not used (see torch_compile); remove it"),
    unsupported("torch_compile_mode", Optional[str], None, "torch.compile is not used (see torch_compile); remove it"),
    unsupported("use_liger_kernel", bool, False,
                "posttrain computes log-probs through its own chunked output layer and never builds full logits, "
                "which is what Liger's fused loss saves; remove it"),
    unsupported("liger_kernel_config", Optional[dict], None, "Liger kernels are not used (see use_liger_kernel); remove it"),
    same("use_cache", bool, False,
         "training forwards never use a KV cache and generation always does, as in TRL", accepts=(False,)),
    unsupported("neftune_noise_alpha", Optional[float], None,
                "NEFTune noise is for supervised fine-tuning, not GRPO; remove it", range=NON_NEGATIVE),
    unsupported("auto_find_batch_size", bool, False,
                "halving the batch on out-of-memory would split groups of num_generations (TRL refuses it too); "
                "lower per_device_train_batch_size instead"),
    same("log_on_each_node", bool, True, "posttrain logs from the main process of the run only"),
    same("logging_nan_inf_filter", bool, True,
         "posttrain stops at a non-finite loss before applying the update, so there is never one to filter"),
    unsupported("include_num_input_tokens_seen", str, "no",
                "posttrain logs num_tokens (tokens seen so far) instead; remove it",
                accepts=("no", False)),
    unsupported("trackio_bucket_id", Optional[str], None, "posttrain passes only trackio_space_id to trackio; use that, or remove this"),
    unsupported("trackio_static_space_id", Optional[str], None, "posttrain passes only trackio_space_id to trackio; use that, or remove this"),
    same("prediction_loss_only", bool, False, _NO_METRICS),
    same("eval_do_concat_batches", bool, True, _NO_METRICS),
    same("eval_use_gather_object", bool, False, _NO_METRICS),
    same("eval_accumulation_steps", Optional[int], None, _NO_METRICS, range=AT_LEAST_ONE),
    same("include_for_metrics", list[str], [], _NO_METRICS),
    same("batch_eval_metrics", bool, False, _NO_METRICS),
    unsupported("save_on_each_node", bool, False,
                "checkpoints are written once, by the main process, to a filesystem every node shares; use a shared output_dir"),
    unsupported("enable_jit_checkpoint", bool, False,
                "posttrain checkpoints every save_steps and resumes bit-exactly from any of them; lower save_steps"),
    unsupported("restore_callback_states_from_checkpoint", bool, False,
                "callback state is not saved in checkpoints; restore it in your callback's on_train_begin"),
    unsupported("accelerator_config", Union[dict, str, None], None,
                "posttrain shares each step's rows among the processes itself (so split_batches must be false), "
                "synchronises gradients once per optimizer step (no gradient_accumulation_kwargs) and builds its own "
                "Accelerator (use_configured_state false); dispatch_batches, even_batches, use_seedable_sampler and "
                "non_blocking configure a DataLoader posttrain does not have, and any value gives TRL's rows",
                accepts=_plain_accelerator_config),
    unsupported("parallelism_config", Any, None, "tensor, context and sequence parallelism are not supported; remove it"),
    same("dataloader_drop_last", bool, False,
         f"{_NO_LOADER}; an incomplete last round of prompts is always dropped, as TRL's sampler does"),
    same("dataloader_num_workers", int, 0, _NO_LOADER, range=NON_NEGATIVE),
    same("dataloader_pin_memory", bool, True, _NO_LOADER),
    same("dataloader_persistent_workers", bool, False, _NO_LOADER),
    same("dataloader_prefetch_factor", Optional[int], None, _NO_LOADER, range=AT_LEAST_ONE),
    same("dataloader_multiprocessing_context", Optional[str], None, _NO_LOADER),
    same("dataloader_in_order", bool, True, _NO_LOADER),
    same("label_names", Optional[list[str]], None, "GRPO has no labels"),
    same("train_sampling_strategy", str, "random",
         "GRPO draws prompts in seeded, shuffled rounds of whole groups (shuffle_dataset), as TRL's own sampler "
         "does whatever this says"),
    same("length_column_name", str, "length", "only used by group_by_length sampling, which GRPO does not do"),
    unsupported("fsdp", Union[None, str, list[str]], None,
                "FSDP is set up by the launcher, not by a config field: launch with accelerate's FSDP2 config "
                "(--accelerate_config fsdp2)", accepts=_empty),
    unsupported("fsdp_config", Union[dict, str, None], None,
                "FSDP is set up by the launcher (see fsdp): put FSDP settings in the accelerate config file",
                accepts=_empty),
    unsupported("debug", Union[str, list[str]], "",
                "transformers' debug options (underflow_overflow, tpu_metrics_debug) are not wired in; remove it",
                accepts=_empty),
    same("skip_memory_metrics", bool, True,
         "posttrain adds no memory metrics to the training record (bench/ measures memory)", accepts=(True,)),
    same("do_train", bool, False, "read only by scripts; transformers' Trainer ignores it too"),
    same("do_eval", bool, False, "read only by scripts; evaluation follows eval_strategy"),
    same("do_predict", bool, False, "read only by scripts; transformers' Trainer ignores it too"),
    same("local_rank", int, -1, "launchers set the process rank through the environment, which posttrain reads", range=Range(-1)),
    unsupported("optim_target_modules", Union[None, str, list[str]], None,
                "GaLore and APOLLO optimizers are not supported; choose another optim"),
]

GRPO_ONLY: list[Compat] = [
    same("ds3_gather_for_generation", bool, True,
         "under DeepSpeed ZeRO-3 (and FSDP2) generation gathers the whole weights once for the whole decode, as "
         "True does; generating through the partitioned model (False) is not supported", accepts=(True,)),
    same("cache_implementation", Optional[str], None,
         "in-process generation runs posttrain's own decoder with a preallocated cache; \"static\" decodes at fixed "
         "shapes (attention over the whole cache under a mask, the rows' ends read every 8 tokens, no row removal), "
         "its step replayed from a CUDA graph on CUDA (docs/generation.md); other values change nothing. Never the "
         "samples"),
    unsupported("vllm_structured_outputs_regex", Optional[str], None,
                "regex-constrained decoding is not in posttrain's sampler or posttrain serve; remove it"),
    same("log_multimodal", bool, True, "with log_completions, each row's images (its prompt's, then its tools') are "
         "saved as PNG files in output_dir/completions/ (their paths in completions.jsonl) and reach wandb and trackio "
         "in the completions table's \"image\" column, as TRL logs them"),
    unsupported("log_completions_hub_repo", Optional[str], None,
                "completions are written to output_dir/completions.jsonl, not uploaded; push output_dir instead"),
    same("use_transformers_continuous_batching", bool, False,
         "generation already batches every completion of a round in posttrain's decoder; continuous batching would "
         "change speed, not the samples"),
    same("transformers_continuous_batching_config", Union[dict, str, None], None, "see use_transformers_continuous_batching"),
    same("use_transformers_paged", bool, False, "see use_transformers_continuous_batching"),
]

GRPO_COMPAT = TRAINING_ARGS + GRPO_ONLY
COMPAT = GRPO_COMPAT  # the GRPO table under its first name
RLOO_COMPAT = GRPO_COMPAT  # RLOOConfig is GRPOConfig's fields (configs/rloo.py): the same table answers for it
DISTILLATION_COMPAT = GRPO_COMPAT  # so is DistillationConfig (configs/distillation.py)


def _no_positive_budget(value) -> bool:
    return value is None or value <= 0


# AsyncGRPOConfig's own fields that posttrain accepts at its own behaviour (configs/async_grpo.py)
ASYNC_ONLY: list[Compat] = [
    same("token_budget", Optional[int], None,
         "posttrain's micro-batches are per_device_train_batch_size rollouts, packed into fewer rows where that saves "
         "positions (models/packing.py), and no rollout is ever dropped for its length; to bound memory lower "
         "per_device_train_batch_size", accepts=_no_positive_budget),
    same("fork_threshold_tokens", int, 1024,
         "a multi-turn rollout keeps each turn's token ids as sampled and appends the tool results' ids (exact "
         "token-in/token-out, agents/loop.py), never re-tokenizing the conversation, so there is no drift to fork on",
         range=NON_NEGATIVE),
]
ASYNC_GRPO_COMPAT = GRPO_COMPAT + ASYNC_ONLY

_SFT_LOADER = "posttrain batches the tokenized rows itself, with no DataLoader"
_SFT_METRICS = ("honoured as in transformers when compute_metrics is given (training/prediction.py); the eval loss "
                "and metrics never depend on it")
# TrainingArguments fields whose SFT entry differs from GRPO's (None: SFTConfig implements the field itself)
_SFT_CHANGES = {
    "label_smoothing_factor": unsupported(
        "label_smoothing_factor", float, 0.0,
        "label smoothing needs every position's full logits, which posttrain's chunked loss never builds (TRL "
        "deprecates it for the same reason); remove it", range=FRACTION),
    "neftune_noise_alpha": None, "train_sampling_strategy": None, "dataloader_drop_last": None,
    "auto_find_batch_size": unsupported(
        "auto_find_batch_size", bool, False,
        "posttrain does not retry a step at a smaller batch on out-of-memory (the loss normalisation is per optimizer "
        "step); lower per_device_train_batch_size, or set packing / padding_free"),
    "include_num_input_tokens_seen": unsupported(
        "include_num_input_tokens_seen", str, "no", "posttrain logs num_tokens (tokens seen so far) instead; remove it",
        accepts=("no", False)),
    "label_names": same("label_names", Optional[list[str]], None, "SFT builds its labels from the data"),
    "length_column_name": same("length_column_name", str, "length",
                               "group_by_length sampling measures the tokenized rows itself"),
}
_METRICS_FIELDS = ("prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
                   "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics")
_LOADER_FIELDS = ("dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
                  "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order")


def _inputs_only(value) -> bool:
    """[] or ["inputs"]"""
    return set(value or []) <= {"inputs"}


def _reasons(metrics_why: str, loader_why: str) -> dict:
    """The evaluation-metrics and DataLoader entries of TRAINING_ARGS with a trainer's own reasons."""
    by_name = {c.name: c for c in TRAINING_ARGS}
    changes = {name: dataclasses.replace(by_name[name], why=metrics_why) for name in _METRICS_FIELDS}
    changes["include_for_metrics"] = unsupported(
        "include_for_metrics", list[str], [], "compute_metrics receives the token ids as inputs on request, not the "
        "per-batch losses (the eval loss is eval_loss); remove 'loss'", accepts=_inputs_only)
    changes.update({name: dataclasses.replace(by_name[name], why=loader_why) for name in _LOADER_FIELDS})
    return changes


_SFT_CHANGES.update(_reasons(_SFT_METRICS, _SFT_LOADER))

SFT_ONLY: list[Compat] = [
    same("remove_unused_columns", bool, True,
         "posttrain keeps only the token columns it builds, so no other column ever reaches the model"),
    same("dataset_num_proc", Optional[int], None,
         "posttrain tokenizes in batches with the fast tokenizer in each process; the result is the same",
         range=AT_LEAST_ONE),
]
SFT_COMPAT = [_SFT_CHANGES.get(c.name, c) for c in TRAINING_ARGS if _SFT_CHANGES.get(c.name, c) is not None] + SFT_ONLY

_DPO_LOADER = "posttrain batches the tokenized pairs itself, with no DataLoader"
_DPO_METRICS = _SFT_METRICS
_DPO_CHANGES = dict(_SFT_CHANGES)
_DPO_CHANGES.update({
    "label_smoothing_factor": unsupported(
        "label_smoothing_factor", float, 0.0,
        "DPO's label smoothing is the label_smoothing field (the probability a preference is flipped); "
        "set that instead", range=FRACTION),
    "neftune_noise_alpha": unsupported(
        "neftune_noise_alpha", Optional[float], None,
        "NEFTune noise is for supervised fine-tuning (SFTTrainer), not DPO (TRL's DPOTrainer ignores it); remove it",
        range=NON_NEGATIVE),
    "label_names": same("label_names", Optional[list[str]], None, "DPO builds its labels from the completion boundaries"),
    "length_column_name": same("length_column_name", str, "length",
                               "group_by_length sampling measures the tokenized pairs itself"),
})
_DPO_CHANGES.update(_reasons(_DPO_METRICS, _DPO_LOADER))

DPO_ONLY = SFT_ONLY  # the same fields, the same behaviour
DPO_COMPAT = [_DPO_CHANGES.get(c.name, c) for c in TRAINING_ARGS if _DPO_CHANGES.get(c.name, c) is not None] + DPO_ONLY

_REWARD_LOADER = "posttrain batches the tokenized pairs itself, with no DataLoader"
_REWARD_CHANGES = dict(_SFT_CHANGES)
_REWARD_CHANGES.update({
    "label_smoothing_factor": unsupported(
        "label_smoothing_factor", float, 0.0,
        "the reward loss has no labels to smooth (TRL's RewardTrainer never reads it); remove it", range=FRACTION),
    "neftune_noise_alpha": unsupported(
        "neftune_noise_alpha", Optional[float], None,
        "NEFTune noise is for supervised fine-tuning (SFTTrainer), not reward models; remove it", range=NON_NEGATIVE),
    "label_names": same("label_names", Optional[list[str]], None, "the reward model's inputs are the pairs' sequences"),
    "length_column_name": same("length_column_name", str, "length",
                               "group_by_length sampling measures the tokenized pairs itself"),
})
_REWARD_CHANGES.update(_reasons(_SFT_METRICS, _REWARD_LOADER))
REWARD_ONLY = SFT_ONLY  # the same fields, the same behaviour
REWARD_COMPAT = [_REWARD_CHANGES.get(c.name, c) for c in TRAINING_ARGS
                 if _REWARD_CHANGES.get(c.name, c) is not None] + REWARD_ONLY

_KTO_CHANGES = dict(_SFT_CHANGES)
_KTO_CHANGES.update({
    "label_smoothing_factor": unsupported(
        "label_smoothing_factor", float, 0.0,
        "KTO's labels are each example's desirable / undesirable flag, which TRL's KTOTrainer never smooths; remove "
        "it", range=FRACTION),
    "neftune_noise_alpha": unsupported(
        "neftune_noise_alpha", Optional[float], None,
        "NEFTune noise is for supervised fine-tuning (SFTTrainer), not KTO; remove it", range=NON_NEGATIVE),
    "label_names": same("label_names", Optional[list[str]], None, "KTO builds its labels from the completion boundaries"),
    "length_column_name": same("length_column_name", str, "length",
                               "group_by_length sampling measures the tokenized examples itself"),
})
_KTO_CHANGES.update(_reasons(_SFT_METRICS, "posttrain batches the tokenized examples itself, with no DataLoader"))
KTO_ONLY = SFT_ONLY
KTO_COMPAT = [_KTO_CHANGES.get(c.name, c) for c in TRAINING_ARGS if _KTO_CHANGES.get(c.name, c) is not None] + KTO_ONLY

BY_NAME = {c.name: c for c in GRPO_COMPAT}


def _field(c: Compat):
    status = f"TRL field, {c.status}: {c.why}."
    accepted = "" if c.accepts == ANY else f" Accepted: {c.accepted_text()}."
    meta = {"help": Help(status + accepted, c.range)}
    if isinstance(c.default, (list, dict)):
        return field(default_factory=lambda d=c.default: type(d)(d), metadata=meta)
    return field(default=c.default, metadata=meta)


def compat_config(name: str, table: list[Compat]):
    """A dataclass with one field per table entry; a trainer config inherits it, so these are ordinary fields."""
    cls = dataclasses.make_dataclass(name, [(c.name, c.type, _field(c)) for c in table])
    cls.__doc__ = "TRL fields accepted at posttrain's behaviour (configs/trl_compat.py)."
    return cls


GRPOCompatConfig = compat_config("GRPOCompatConfig", GRPO_COMPAT)
TRLCompatConfig = GRPOCompatConfig  # its first name
SFTCompatConfig = compat_config("SFTCompatConfig", SFT_COMPAT)
DPOCompatConfig = compat_config("DPOCompatConfig", DPO_COMPAT)
RewardCompatConfig = compat_config("RewardCompatConfig", REWARD_COMPAT)
KTOCompatConfig = compat_config("KTOCompatConfig", KTO_COMPAT)
AsyncGRPOCompatConfig = compat_config("AsyncGRPOCompatConfig", ASYNC_GRPO_COMPAT)


def check_compat(config, table: list[Compat] = GRPO_COMPAT) -> None:
    """Refuse, in one sentence each, a TRL field set to a value posttrain would not honour."""
    for c in table:
        value = getattr(config, c.name)
        if not c.accepted(value):
            raise ConfigError(f"{c.name}={value!r} is not supported: {c.why}.")


def trl_snapshot(trainer: str = "grpo") -> dict:
    """The committed list of TRL 1.16.0's GRPOConfig (or SFTConfig) fields: {"trl", "transformers", "fields":
    [{name, default, source}]}."""
    with open(SNAPSHOTS[trainer]) as f:
        return json.load(f)


def installed_trl_fields(trainer: str = "grpo") -> list[dict] | None:
    """The installed TRL's GRPOConfig (or SFTConfig) fields in the snapshot's form, or None when TRL cannot be
    imported."""
    try:
        import trl  # noqa: F401 - whether TRL is there at all
        from transformers import TrainingArguments
    except ImportError:
        return None
    module, name = BY_TRAINER[trainer].trl_config.split(":")
    with warnings.catch_warnings():  # TRL's experimental trainers warn that they are, when imported
        warnings.simplefilter("ignore")
        owner = importlib.import_module(module)
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    out = []
    for f in dataclasses.fields(getattr(owner, name)):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out.append({"name": f.name, "default": repr(default),
                    "source": "TrainingArguments" if f.name in base else name})
    return out
