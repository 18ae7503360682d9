"""DPOConfig: TRL 1.16's DPOConfig, field for field, plus the v0.18 names an older config may still carry.

The shared groups (configs/fields.py) give the training loop, model, devices, logging, evaluation and checkpoints;
this module adds how preference pairs become token rows, the reference model, and the losses (dpo/losses.py).
TRL fields accepted at posttrain's behaviour come from configs/trl_compat.py (DPO_COMPAT).
"""

from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, ConfigError, Range, _help,
                                    check_choice, check_padding_multiple, check_positive, check_ranges, check_types)
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.sft import SAMPLING_STRATEGIES, TRUNCATION_MODES
from posttrain.configs.trl_compat import DPO_COMPAT, DPOCompatConfig, check_compat

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the losses that read the (f-divergence) scores; the others use the plain log-ratios, as in TRL
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
BATCH_DEPENDENT_LOSSES = ("aot", "aot_unpaired")  # they sort the pairs of a micro-batch
BETA_DIVIDES = ("ipo", "sppo_hard")  # their target margin is 1 / (2 beta); sft is the one loss without beta


@dataclass
class DPODataConfig:
    """How preference pairs become token rows, and the order they are trained in."""

    max_length: Optional[int] = _help(
        "Longest sequence (prompt + chosen, prompt + rejected), each truncated on its own (truncation_mode). A pair "
        "whose prompt alone fills it is dropped (with keep_start), and the count logged. None truncates nothing.",
        range=AT_LEAST_ONE, default=1024)
    truncation_mode: str = _help(
        "keep_start keeps each sequence's first max_length tokens; keep_end (deprecated in TRL) its last ones.",
        default="keep_start")
    padding_free: bool = _help(
        "Train each micro-batch's sequences end to end as one row, with position ids restarting per sequence, TRL's "
        "sequence boundaries and no attention mask, where the model keeps them apart (checked once per model; else "
        "padded rows, said once: docs/packing.md). TRL 1.16 falls back to padding; here it works.", default=False)
    pad_to_multiple_of: Optional[Union[int, str]] = _help(
        "Pad every batch's length (the flattened row's, padding-free) to a multiple of this; \"auto\" pads to 128 "
        "on Neuron devices (which compile once per shape) and nowhere else.",
        range=Range(1, note='or "auto", or None for no padding'), default="auto")
    pad_token: Optional[str] = _help(
        "Padding token (default: the tokenizer's, else its EOS). TRL deprecates this field; it works here.",
        default=None)
    train_sampling_strategy: str = _help(
        "Order of the pairs in each epoch: random (a new seeded order per epoch), sequential (the dataset's order) "
        "or group_by_length (random mega-batches of 50 global batches, each sorted longest first).", default="random")
    dataloader_drop_last: bool = _help("Drop the last, incomplete batch of each epoch.", default=False)

    def _check(self):
        check_choice(self, "truncation_mode", TRUNCATION_MODES)
        check_choice(self, "train_sampling_strategy", SAMPLING_STRATEGIES)
        check_padding_multiple(self)


@dataclass
class DPOReferenceConfig:
    """The reference model the log-ratios are taken against."""

    precompute_ref_log_probs: bool = _help(
        "Compute every pair's reference log-probs once, before training, and keep no reference model. They are cached "
        "on disk (keyed by the data, the reference weights, the chat template, max_length, truncation_mode and "
        "ld_alpha) and saved in every checkpoint.", default=False)
    precompute_ref_batch_size: Optional[int] = _help(
        "Pairs per batch of that pass; default per_device_train_batch_size (per_device_eval_batch_size for eval).",
        range=AT_LEAST_ONE, default=None)
    sync_ref_model: bool = _help(
        "TR-DPO: every ref_model_sync_steps steps, move the reference towards the policy: ref = alpha * policy + "
        "(1 - alpha) * ref. Needs a reference model (not LoRA, not precompute_ref_log_probs).", default=False)
    ref_model_mixup_alpha: float = _help("TR-DPO's alpha for sync_ref_model.", range=FRACTION, default=0.6)
    ref_model_sync_steps: int = _help("TR-DPO's tau: optimizer steps between reference syncs.",
                                      range=AT_LEAST_ONE, default=512)

    def _check(self):
        check_positive(self, "ref_model_sync_steps")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ConfigError("sync_ref_model=True moves the reference during training, so log-probs precomputed "
                              "before it would be stale: set precompute_ref_log_probs=False or sync_ref_model=False.")


def _check_beta(beta: float, loss_types: list[str]) -> None:
    """beta=0 leaves no loss but sft anything to learn: ipo and sppo_hard divide by it (their target margin is
    1 / (2 beta)), and every other loss reads the log-ratios only through beta * (...), so it is a constant with no
    gradient (sigmoid: log 2). Negative values are refused by the field's range."""
    if beta != 0.0:
        return
    divided = [t for t in loss_types if t in BETA_DIVIDES]
    if divided:
        raise ConfigError(f"beta=0 divides by zero in the {' and '.join(divided)} loss (its target margin is "
                          "1 / (2 beta)): set beta > 0 (TRL's default is 0.1).")
    constant = [t for t in loss_types if t != "sft"]
    if constant:
        what = f"the {constant[0]} loss a constant" if len(constant) == 1 else \
            f"the {', '.join(constant[:-1])} and {constant[-1]} losses constants"
        raise ConfigError(f"beta=0 makes {what} with no gradient (the log-ratios enter only as beta times them), so "
                          "the run would learn nothing from the preferences: set beta > 0 (TRL's default is 0.1).")


@dataclass
class DPOLossConfig:
    """The preference loss (docs/dpo.md has every formula)."""

    loss_type: Union[str, list[str]] = _help(
        f"Loss, or a list of losses summed with loss_weights: {', '.join(DPO_LOSSES)}. E.g. MPO is "
        "[sigmoid, bco_pair, sft] with weights [0.8, 0.2, 1.0].", default_factory=lambda: ["sigmoid"])
    loss_weights: Optional[list[float]] = _help("One weight per loss_type entry; default 1.0 each.", default=None)
    beta: float = _help(
        "Temperature of the log-ratios (the KL strength); for ipo the regularisation tau. 0 is refused for every "
        "loss but sft (it makes them constant, or divides by zero in ipo and sppo_hard).", range=NON_NEGATIVE,
        default=0.1)
    label_smoothing: float = _help(
        "Probability that a preference label is flipped. sigmoid: conservative DPO (cDPO), -(1-e) log s(bD) - e log "
        "s(-bD), as TRL 0.18 computed it (TRL 1.16 ignores it there); robust: in [0, 0.5); exo_pair: must be > 0 "
        "(1e-3 suggested); aot / aot_unpaired: as in TRL.", range=Range(0, 1, high_open=True), default=0.0)
    ld_alpha: Optional[float] = _help(
        "LD-DPO (arXiv 2409.06411): in each pair, the tokens up to the shorter completion's length count fully and "
        "the longer completion's tail is weighted by ld_alpha, for the policy and the reference alike. 1 is DPO, 0 "
        "keeps the shared length only; 0.5 is the paper's suggestion. None disables.", range=FRACTION, default=None)
    f_divergence_type: str = _help(
        f"Divergence of the f-DPO scores: {', '.join(F_DIVERGENCES)} (reverse_kl is standard DPO).",
        default="reverse_kl")
    f_alpha_divergence_coef: float = _help("alpha of alpha_divergence.", default=0.5)
    use_weighting: bool = _help(
        "WPO: weight each pair's loss by w_c * w_r, w = exp(mean over the completion of log p(token) - log sum_v "
        "p(v)^2), detached.", default=False)
    discopop_tau: float = _help("DiscoPOP's temperature tau.", range=POSITIVE, default=0.05)

    def _check(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [t.strip() for t in self.loss_type.split(",")] if "," in self.loss_type else [
                self.loss_type]
        if not self.loss_type:
            raise ConfigError(f"loss_type is empty: name at least one of {', '.join(DPO_LOSSES)}.")
        for name in self.loss_type:
            if name not in DPO_LOSSES:
                from posttrain.configs.parsing import suggest

                raise ConfigError(f"loss_type {name!r} is not one of: {', '.join(DPO_LOSSES)}."
                                  f"{suggest(str(name), DPO_LOSSES)}")
        if self.loss_weights is not None:
            if len(self.loss_weights) != len(self.loss_type):
                raise ConfigError(f"loss_weights has {len(self.loss_weights)} entries for {len(self.loss_type)} "
                                  f"loss types ({', '.join(self.loss_type)}): give one weight per loss type.")
            self.loss_weights = [float(w) for w in self.loss_weights]
        check_choice(self, "f_divergence_type", F_DIVERGENCES)
        if self.f_divergence_type != "reverse_kl":
            other = [t for t in self.loss_type if t not in F_DIVERGENCE_LOSSES]
            if other:
                raise ConfigError(f"f_divergence_type={self.f_divergence_type!r} works with the losses "
                                  f"{', '.join(F_DIVERGENCE_LOSSES)}, not {', '.join(other)}: use reverse_kl with "
                                  "those.")
        if "robust" in self.loss_type and not self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5) for the robust loss, "
                              "which divides by 1 - 2 * label_smoothing.")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ConfigError("The exo_pair loss needs label_smoothing > 0 (its target distribution takes its log): "
                              "set label_smoothing=1e-3, as the EXO paper suggests.")
        if self.use_weighting and any(t in BATCH_DEPENDENT_LOSSES for t in self.loss_type):
            raise ConfigError("use_weighting=True cannot be combined with aot or aot_unpaired, which sort the pairs "
                              "and so lose which weight belongs to which: drop one of them.")
        _check_beta(self.beta, self.loss_type)

    @property
    def weights(self) -> list[float]:
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_type)


# TRL 0.18's DPOConfig names that TRL 1.16 removed: {name: (type, default, what it becomes or why it is refused)}.
# A value other than the default is mapped when posttrain can honour it, or refused naming the replacement.
LEGACY = {
    "rpo_alpha": (Optional[float], None, "mapped: loss_type gains 'sft' with weight rpo_alpha (TRL 1.16's RPO)"),
    "reference_free": (bool, False, "mapped: the reference log-probs are 0 (no reference model is loaded)"),
    "use_logits_to_keep": (bool, False, "accepted: posttrain always sends only the completion positions through "
                                        "the output layer"),
    "force_use_ref_model": (bool, False, "accepted: a ref_model passed to the trainer is always used"),
    "ref_model_init_kwargs": (Union[dict, str, None], None, "mapped: used to load a ref_model given as a path"),
    "max_prompt_length": (Optional[int], None,
                          "removed in TRL 0.29: each sequence (prompt + completion) is truncated to max_length; "
                          "drop max_prompt_length and set max_length"),
    "max_completion_length": (Optional[int], None,
                              "removed in TRL 0.29: each sequence (prompt + completion) is truncated to max_length; "
                              "drop max_completion_length and set max_length"),
    "padding_value": (Optional[int], None, "removed in TRL 0.29: set pad_token (a token, not an id) instead"),
    "label_pad_token_id": (int, -100, "removed in TRL 0.29: labels are built from the completion boundaries, with "
                                      "no pad label; remove it"),
    "model_adapter_name": (Optional[str], None,
                           "removed in TRL 0.29: the active adapter of a PeftModel is trained; remove it"),
    "ref_adapter_name": (Optional[str], None,
                         "removed in TRL 0.29: the reference of a PeftModel is a frozen copy of its adapter (or the "
                         "base model when adapters are new); remove it"),
    "tools": (Optional[list[dict]], None, "removed in TRL 0.29: put the tools in a 'tools' column of the dataset"),
    "generate_during_eval": (bool, False, "removed in TRL 0.29: generate from a saved checkpoint instead; remove it"),
}
_LEGACY_ACCEPTED = {"rpo_alpha", "reference_free", "use_logits_to_keep", "force_use_ref_model",
                    "ref_model_init_kwargs"}


def _legacy_fields():
    import dataclasses

    fields = []
    for name, (tp, default, why) in LEGACY.items():
        fields.append((name, tp, dataclasses.field(default=default, metadata={"help": f"TRL 0.18 name, {why}."})))
    return dataclasses.make_dataclass("DPOLegacyConfig", fields)


DPOLegacyConfig = _legacy_fields()
DPOLegacyConfig.__doc__ = "TRL 0.18's DPOConfig names, mapped to TRL 1.16's or refused naming the replacement."


def _check_legacy(cfg) -> None:
    for name, (_, default, why) in LEGACY.items():
        value = getattr(cfg, name)
        if value != default and name not in _LEGACY_ACCEPTED:
            raise ConfigError(f"{name}={value!r} is a TRL 0.18 DPOConfig field, {why}.")
    if cfg.rpo_alpha is not None:
        if "sft" in cfg.loss_type:
            raise ConfigError("rpo_alpha adds the sft loss, and loss_type already has it: set its weight in "
                              "loss_weights and drop rpo_alpha.")
        weights = cfg.weights
        cfg.loss_type = [*cfg.loss_type, "sft"]
        cfg.loss_weights = [*weights, float(cfg.rpo_alpha)]
        cfg.rpo_alpha = None  # applied once: a config copied from this one must not add sft again
    if cfg.reference_free and cfg.precompute_ref_log_probs:
        raise ConfigError("reference_free=True has no reference to precompute: set precompute_ref_log_probs=False.")
    if cfg.reference_free and cfg.sync_ref_model:
        raise ConfigError("reference_free=True has no reference to sync: set sync_ref_model=False.")


@dataclass
class DPOConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                DPODataConfig, DPOReferenceConfig, DPOLossConfig, DPOCompatConfig, DPOLegacyConfig):
    """Everything that configures a DPO run (TRL's `DPOConfig` names and defaults)."""

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              DPODataConfig, DPOReferenceConfig, DPOLossConfig)
    COMPAT = DPOCompatConfig
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    learning_rate: float = _help("Peak learning rate (TRL's DPO default).", range=NON_NEGATIVE, default=1e-6)
    disable_dropout: bool = _help("Set every dropout probability in the policy and the reference to 0 (TRL's DPO "
                                  "default).", default=True)

    def __post_init__(self):
        check_types(self)
        check_compat(self, DPO_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        _check_legacy(self)
        check_ranges(self)
