"""Every field of TRL 1.16's GRPOConfig works here or says why (configs/trl_compat.py, docs/config.md)."""

import ast
import re
import dataclasses

import pytest

from posttrain.configs import ConfigError, GRPOConfig, suggest
from posttrain.configs.reference import DEFAULT_DIFFERENCES, IMPLEMENTED, trl_field_status
from posttrain.configs.trl_compat import COMPAT, SAME, UNSUPPORTED, installed_trl_fields, trl_snapshot
from posttrain.registry import TRAINERS as TRAINER_ENTRIES


def _trl_fields() -> list[dict]:
    """The installed TRL's field list when TRL 1.16 is importable, else the committed snapshot."""
    installed = installed_trl_fields()
    return installed if installed is not None else trl_snapshot()["fields"]


def _value(default: str):
    return ast.literal_eval(default)


def test_snapshot_matches_the_installed_trl():
    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16."):
        pytest.skip(f"TRL {trl.__version__} is installed; the snapshot is of 1.16")
    assert installed_trl_fields() == trl_snapshot()["fields"]


def test_every_trl_field_is_implemented_or_accounted_for():
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    statuses = {}
    for f in _trl_fields():
        status, note = trl_field_status(f["name"])
        statuses[f["name"]] = status
        assert status in (IMPLEMENTED, SAME, UNSUPPORTED), f["name"]
        assert f["name"] in ours, f["name"]  # a real field: never an unexpected keyword
        if status == IMPLEMENTED and f["name"] not in DEFAULT_DIFFERENCES:
            field = ours[f["name"]]
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            assert repr(default) == f["default"], f["name"]  # TRL's default, unless documented otherwise
    assert list(statuses.values()).count(IMPLEMENTED) >= 110


def test_trl_defaults_all_at_once_construct():
    """A config spelling out every TRL field at TRL's default is accepted as it is."""
    values = {f["name"]: _value(f["default"]) for f in _trl_fields()}
    cfg = GRPOConfig(**values)
    assert cfg.output_dir == "trainer_output" and cfg.use_bias_correction_kl and cfg.loss_type == "dapo"


@pytest.mark.parametrize("entry", [c for c in COMPAT if c.status == UNSUPPORTED and not callable(c.accepts)],
                         ids=lambda c: c.name)
def test_unsupported_values_are_refused_with_one_sentence(entry):
    from posttrain.configs.base import base_type

    bad = {bool: not entry.default, str: "x", int: 3, float: 0.5, dict: {"a": 1}, list: ["x"]}.get(
        base_type(entry.type), "x")
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**{entry.name: bad})
    message = str(err.value)
    assert message.startswith(f"{entry.name}={bad!r} is not supported: ") and message.count(". ") == 0
    GRPOConfig(**{entry.name: entry.default})  # its default is accepted


def test_accepted_values_of_same_behaviour_fields():
    GRPOConfig(dataloader_num_workers=4, dataloader_pin_memory=False, label_smoothing_factor=0.1, use_vllm=False,
               vllm_mode="server", cache_implementation="static", do_eval=True, local_rank=3, fsdp="", debug=[],
               accelerator_config={}, use_liger_kernel=False)
    with pytest.raises(ConfigError, match="average_tokens_across_devices=False is not supported"):
        GRPOConfig(average_tokens_across_devices=False)


def test_the_fields_a_trl_user_tries_first():
    """The 22 fields of the drop-in report: all accepted (implemented or at posttrain's behaviour)."""
    cfg = GRPOConfig(fp16=False, bf16=False, use_vllm=False, logging_dir="logs", eval_strategy="no",
                     push_to_hub=False, run_name="r", optim="adamw_torch", remove_unused_columns=False,
                     dataloader_num_workers=2, use_liger_kernel=False, report_to="none", save_strategy="steps",
                     logging_steps=0.1, save_steps=0.5, warmup_steps=0.1, lr_scheduler_type="cosine_with_min_lr",
                     lr_scheduler_kwargs={"min_lr_rate": 0.1}, gradient_checkpointing=True, seed=1,
                     use_bias_correction_kl=False, trust_remote_code=False)
    assert cfg.run_name == "r" and cfg.optim == "adamw_torch" and cfg.logging_steps == 0.1


@pytest.mark.parametrize("kwargs,message", [
    (dict(logging_steps=1.5), "logging_steps=1.5 must be a whole number of steps >= 1, or a fraction"),
    (dict(optim="lomo"), "optim='lomo' is not one of"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "lr_scheduler_type='reduce_lr_on_plateau' is not one of"),
    (dict(fp16=True, bf16=True), "choose one precision"),
    (dict(sync_ref_model=True), "sync_ref_model=True needs a reference model, and beta=0.0"),
    (dict(hub_strategy="checkpoint"), "hub_strategy='checkpoint' is not supported"),
    (dict(optim_args="momentum"), "key=value"),
    (dict(reward_weights=[1.0, float("nan")]), "finite numbers"),
    (dict(eval_strategy="steps", per_device_eval_batch_size=6, num_generations=4), "multiple of 4"),
    (dict(pad_to_multiple_of="big"), "pad_to_multiple_of='big'"),
    (dict(deepspeed="no/such/ds_config.json"), "deepspeed='no/such/ds_config.json' is not a file: give the path"),
])
def test_new_fields_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**kwargs)


def test_activation_checkpointing_is_transformers_5_name_for_gradient_checkpointing():
    cfg = GRPOConfig(activation_checkpointing=False)
    assert cfg.gradient_checkpointing is False and cfg.activation_checkpointing is False
    assert GRPOConfig().activation_checkpointing is True  # mirrors TRL's gradient_checkpointing=True


def test_suggestions_are_real_near_misses_only():
    known = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert suggest("learning_rat", known) == " Did you mean learning_rate?"
    assert suggest("num_generation", known) == " Did you mean num_generations?"
    assert suggest("eval_strategyy", known) == " Did you mean eval_strategy?"
    assert suggest("eval_stratagy", known) == " Did you mean eval_strategy?"
    for far in ("evaluate_strategy", "per_device_batch_size", "use_flash_attention", "kl_coef"):
        assert suggest(far, known) == "", far
    assert suggest("acuracy", ["accuracy", "length"]) == " Did you mean accuracy?"


def test_hub_token_is_redacted_in_what_is_written():
    cfg = GRPOConfig(hub_token="hf_secret")
    assert cfg.to_dict()["hub_token"] == "<HUB_TOKEN>" and cfg.hub_token == "hf_secret"


def _stated_counts(config_name: str) -> list[tuple[int, ...]]:
    """(fields, implemented, accepted, refused) of a TRL config as the README's compatibility table and
    docs/compatibility.md state them."""
    import os

    root = os.path.join(os.path.dirname(__file__), "..")
    readme = open(os.path.join(root, "README.md")).read()
    detail = " ".join(open(os.path.join(root, "docs", "compatibility.md")).read().split())
    trainer = config_name.replace("Config", "Trainer")
    row = re.search(rf"^\| `{trainer}` \| (\d+) / (\d+) / (\d+) of (\d+) \|", readme, re.M)
    prose = (re.search(r"All (\d+) fields of TRL 1\.16's `GRPOConfig`.*?(\d+) are implemented.*?; (\d+) configure.*?; "
                       r"(\d+) accept only", detail) if config_name == "GRPOConfig" else
             re.search(rf"All (\d+) fields of TRL 1\.16's `{config_name}`.*?(\d+) implemented, (\d+) accepted at "
                       rf"TRL's behaviour, (\d+) refused", detail))
    assert row and prose, f"the counts of {config_name}'s fields are missing from the README's table or the docs"
    total, implemented, accepted, refused = (int(x) for x in row.group(4, 1, 2, 3))
    return [(total, implemented, accepted, refused), tuple(map(int, prose.groups()))]


def test_readme_counts_match_the_table():
    from posttrain.configs.reference import trl_field_status

    counts = {}
    for f in trl_snapshot()["fields"]:
        status = trl_field_status(f["name"])[0]
        counts[status] = counts.get(status, 0) + 1
    actual = (len(trl_snapshot()["fields"]), counts[IMPLEMENTED], counts[SAME], counts[UNSUPPORTED])
    assert _stated_counts("GRPOConfig") == [actual, actual]


def test_every_trl_field_at_its_default_is_a_flag():
    """`--<field> <TRL's default>` for every TRL field parses to that default (None as `none`)."""
    from posttrain.cli import parse_grpo

    for f in _trl_fields():
        default = _value(f["default"])
        if default == [] or default == "":
            continue  # an empty list or string has no flag spelling; its default applies when the flag is absent
        text = ["none"] if default is None else [str(default).lower()] if isinstance(default, bool) else (
            [str(v) for v in default] if isinstance(default, list) else [str(default)])
        _, _, cfg = parse_grpo([f"--{f['name']}", *text])
        value = getattr(cfg, f["name"])
        if f["name"] not in ("output_dir", "bf16", "epsilon_high", "steps_per_generation", "generation_batch_size",
                             "pad_to_multiple_of", "activation_checkpointing", "gradient_checkpointing_kwargs",
                             "report_to"):  # derived at construction
            assert value == default, (f["name"], value, default)


def test_every_numeric_field_has_a_documented_range_that_is_checked():
    from posttrain.configs.base import base_type, field_range, field_types

    types = field_types(GRPOConfig)
    numeric = [f for f in dataclasses.fields(GRPOConfig) if base_type(types[f.name]) in (int, float)]
    assert len(numeric) > 60
    missing = [f.name for f in numeric if field_range(f) is None]
    assert not missing, missing
    refused = 0
    for f in numeric:
        bounds = field_range(f)
        for outside in ([bounds.low - 1] if bounds.low is not None else []) + (
                [bounds.high + 1] if bounds.high is not None else []):
            value = int(outside) if base_type(types[f.name]) is int else float(outside)
            with pytest.raises(ConfigError, match=rf"^{f.name}=") as err:
                GRPOConfig(**{f.name: value})
            assert err.value.args[0].endswith("."), f.name
            refused += 1
    assert refused > 60  # each bound of each field refuses a value beyond it, naming the field


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_p=1.5), "min_p=1.5 must be in [0, 1]."), (dict(repetition_penalty=0), "repetition_penalty=0 must be > 0"),
    (dict(repetition_penalty=-1.0), "must be > 0"), (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0 must be >= 0"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be >= 0"), (dict(warmup_ratio=1.5), "warmup_ratio=1.5 must be in"),
    (dict(epsilon=1.0), "epsilon=1.0 must be in [0, 1)"), (dict(save_total_limit=0), "must be a positive integer"),
    (dict(seed=-1), "seed=-1 must be in [0, 4294967295]"), (dict(learning_rate=float("inf")), "must be a finite"),
])
def test_values_the_issue_found_accepted_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        GRPOConfig(**kwargs)


# ---------------------------------------------------------------------- SFTConfig


def _trl_fields_of(trainer: str) -> list[dict]:
    installed = installed_trl_fields(trainer)
    return installed if installed is not None else trl_snapshot(trainer)["fields"]


@pytest.mark.parametrize("trainer", [entry.name for entry in TRAINER_ENTRIES])
def test_trainer_snapshot_matches_the_installed_trl(trainer):
    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16."):
        pytest.skip(f"TRL {trl.__version__} is installed; the snapshot is of 1.16")
    assert installed_trl_fields(trainer) == trl_snapshot(trainer)["fields"]


@pytest.mark.parametrize("trainer,implemented,check", [
    ("sft", 80, lambda cfg: cfg.learning_rate == 2e-5 and cfg.max_length == 1024 and cfg.loss_type == "nll"),
    ("dpo", 85, lambda cfg: (cfg.learning_rate, cfg.beta, cfg.loss_type, cfg.max_length, cfg.disable_dropout) == (
        1e-6, 0.1, ["sigmoid"], 1024, True)),
    ("rloo", 110, lambda cfg: (cfg.num_generations, cfg.beta, cfg.normalize_advantages, cfg.reward_clip_range,
                               cfg.loss_type, cfg.vllm_importance_sampling_correction) == (
        2, 0.05, False, None, "dapo", False)),
    ("reward", 75, lambda cfg: (cfg.learning_rate, cfg.max_length, cfg.disable_dropout, cfg.center_rewards_coefficient,
                                cfg.pad_to_multiple_of) == (1e-4, 1024, True, None, "auto")),
    ("kto", 84, lambda cfg: (cfg.learning_rate, cfg.beta, cfg.loss_type, cfg.max_length, cfg.disable_dropout,
                             cfg.train_sampling_strategy, cfg.desirable_weight, cfg.undesirable_weight) == (
        1e-6, 0.1, "kto", 1024, True, "sequential", 1.0, 1.0)),
    ("distillation", 100, lambda cfg: (cfg.learning_rate, cfg.beta, cfg.max_completion_length, cfg.disable_dropout,
                                       cfg.temperature, cfg.num_generations, cfg.teacher_model_name_or_path) == (
        1e-6, 1.0, 512, False, 1.0, 1, None)),
    ("async_grpo", 93, lambda cfg: (cfg.async_generation, cfg.max_staleness, cfg.weight_sync_steps,
                                     cfg.max_inflight_tasks, cfg.queue_maxsize, cfg.heartbeat_stale_after_s,
                                     cfg.learning_rate, cfg.lr_scheduler_type, cfg.max_completion_length,
                                     cfg.server_url, cfg.model_init_kwargs) == (
        True, 4, 1, -1, 1024, 300.0, 1e-6, "constant", 2048, "http://localhost:8000", {"dtype": "float32"})),
])
def test_every_trl_field_of_the_trainer_is_implemented_or_accounted_for(trainer, implemented, check):
    from posttrain.configs.reference import TRAINERS

    config = TRAINERS[trainer][0]
    ours = {f.name: f for f in dataclasses.fields(config)}
    statuses = []
    for f in _trl_fields_of(trainer):
        status, _ = trl_field_status(f["name"], trainer)
        statuses.append(status)
        assert status in (IMPLEMENTED, SAME, UNSUPPORTED) and f["name"] in ours, f["name"]
        if status == IMPLEMENTED and f["name"] not in DEFAULT_DIFFERENCES:
            field = ours[f["name"]]
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            assert repr(default) == f["default"], f["name"]
    assert statuses.count(IMPLEMENTED) >= implemented
    values = {f["name"]: _value(f["default"]) for f in _trl_fields_of(trainer)}
    assert check(config(**values))  # every field at TRL's default, all at once


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="chunked_nll"), None), (dict(packing_strategy="bfd-requeue"), None),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1 is not supported: label smoothing needs"),
    (dict(loss_type="xent"), "loss_type='xent' is not one of: nll, dft"),
    (dict(truncation_mode="middle"), "truncation_mode='middle' is not one of: keep_start, keep_end"),
    (dict(dataset_kwargs={"skip_prepare": True}), "dataset_kwargs has 'skip_prepare': the only key is"),
    (dict(train_sampling_strategy="length"), "train_sampling_strategy='length' is not one of"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef=-1.0 must be >= 0."),
])
def test_sft_fields_are_validated_or_mapped(kwargs, message):
    from posttrain.configs import SFTConfig

    if message is None:  # TRL's deprecated names map to the current ones
        cfg = SFTConfig(**kwargs)
        assert (cfg.loss_type, cfg.packing_strategy) == ("nll", "bfd_split" if "packing_strategy" in kwargs else "bfd")
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        SFTConfig(**kwargs)


# ---------------------------------------------------------------------- DPOConfig


def test_every_trl_dpo_field_at_its_default_is_a_flag():
    from posttrain.cli import parse_dpo

    for f in _trl_fields_of("dpo"):
        default = _value(f["default"])
        if default == [] or default == "":
            continue
        text = ["none"] if default is None else [str(default).lower()] if isinstance(default, bool) else (
            [str(v) for v in default] if isinstance(default, list) else [str(default)])
        _, _, cfg = parse_dpo([f"--{f['name']}", *text])
        if f["name"] not in ("output_dir", "bf16", "pad_to_multiple_of", "activation_checkpointing",
                             "gradient_checkpointing_kwargs", "report_to"):
            assert getattr(cfg, f["name"]) == default, f["name"]
    _, _, cfg = parse_dpo(["--loss_type", "sigmoid", "bco_pair", "sft", "--loss_weights", "0.8", "0.2", "1.0"])
    assert cfg.loss_type == ["sigmoid", "bco_pair", "sft"] and cfg.weights == [0.8, 0.2, 1.0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="sigmod"), "loss_type 'sigmod' is not one of: sigmoid, hinge"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), "loss_weights has 1 entries for 2 loss types"),
    (dict(ld_alpha=1.5), "ld_alpha=1.5 must be in [0, 1]"),
    (dict(ld_alpha=-0.1), "ld_alpha=-0.1 must be in [0, 1]"),
    (dict(loss_type="exo_pair"), "The exo_pair loss needs label_smoothing > 0"),
    (dict(loss_type="robust", label_smoothing=0.5), "must be in [0, 0.5) for the robust loss"),
    (dict(f_divergence_type="forward_kl", loss_type="bco_pair"), "works with the losses"),
    (dict(f_divergence_type="kl"), "f_divergence_type='kl' is not one of"),
    (dict(use_weighting=True, loss_type="aot"), "use_weighting=True cannot be combined with aot"),
    (dict(sync_ref_model=True, precompute_ref_log_probs=True), "would be stale"),
    (dict(max_prompt_length=512), "max_prompt_length=512 is a TRL 0.18 DPOConfig field, removed in TRL 0.29"),
    (dict(padding_value=0), "set pad_token"),
    (dict(generate_during_eval=True), "generate from a saved checkpoint"),
    (dict(label_smoothing_factor=0.1), "DPO's label smoothing is the label_smoothing field"),
    (dict(neftune_noise_alpha=5.0), "NEFTune noise is for supervised fine-tuning"),
    (dict(rpo_alpha=0.5, loss_type=["sigmoid", "sft"]), "loss_type already has it"),
    (dict(reference_free=True, precompute_ref_log_probs=True), "no reference to precompute"),
])
def test_dpo_fields_are_validated_or_refused_with_the_replacement(kwargs, message):
    from posttrain.configs import DPOConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        DPOConfig(**kwargs)


def test_dpo_v018_names_that_map():
    from posttrain.configs import DPOConfig

    cfg = DPOConfig(rpo_alpha=0.5)
    assert cfg.loss_type == ["sigmoid", "sft"] and cfg.weights == [1.0, 0.5] and cfg.rpo_alpha is None
    again = DPOConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})
    assert again.loss_type == ["sigmoid", "sft"]  # mapped once: a copy of the config does not add sft twice
    assert DPOConfig(loss_type="sigmoid,hinge").loss_type == ["sigmoid", "hinge"]
    assert DPOConfig(use_logits_to_keep=True, force_use_ref_model=True, label_pad_token_id=-100).beta == 0.1


# ---------------------------------------------------------------------- RLOOConfig


@pytest.mark.parametrize("trainer", ["rloo", "reward", "kto", "distillation"])
def test_every_trl_field_of_rloo_reward_kto_and_distillation_at_its_default_is_a_flag(trainer):
    from posttrain.cli import parse_command
    from posttrain.configs.rloo import GRPO_ONLY

    trl_names = set()
    for f in _trl_fields_of(trainer):
        trl_names.add(f["name"])
        default = _value(f["default"])
        if default == [] or default == "":
            continue
        text = ["none"] if default is None else [str(default).lower()] if isinstance(default, bool) else (
            [str(v) for v in default] if isinstance(default, list) else [str(default)])
        cfg = parse_command(trainer, [f"--{f['name']}", *text])[2]
        if f["name"] not in ("output_dir", "bf16", "epsilon_high", "steps_per_generation", "generation_batch_size",
                             "pad_to_multiple_of", "activation_checkpointing", "gradient_checkpointing_kwargs",
                             "report_to"):  # derived at construction
            assert getattr(cfg, f["name"]) == default, f["name"]
    if trainer != "rloo":
        return
    assert not trl_names & set(GRPO_ONLY)  # what RLOOConfig refuses, TRL's RLOOConfig does not have
    cfg = parse_command("rloo", ["--reward_clip_range", "-1", "2.5"])[2]
    assert cfg.reward_clip_range == (-1.0, 2.5)
    for name in ("loss_type", "scale_rewards", "vllm_importance_sampling_correction"):
        with pytest.raises(ConfigError, match=f"Unknown argument '--{name}'"):
            parse_command("rloo", [f"--{name}", "x"])


@pytest.mark.parametrize("trainer,name", [("sft", "SFTConfig"), ("dpo", "DPOConfig"), ("rloo", "RLOOConfig"),
                                          ("reward", "RewardConfig"), ("kto", "KTOConfig"),
                                          ("distillation", "DistillationConfig"), ("async_grpo", "AsyncGRPOConfig"),
                                          ("orpo", "ORPOConfig")])
def test_readme_counts_of_the_other_trainers_match_their_tables(trainer, name):
    counts = {IMPLEMENTED: 0, SAME: 0, UNSUPPORTED: 0}
    for f in trl_snapshot(trainer)["fields"]:
        counts[trl_field_status(f["name"], trainer)[0]] += 1
    actual = (len(trl_snapshot(trainer)["fields"]), counts[IMPLEMENTED], counts[SAME], counts[UNSUPPORTED])
    assert _stated_counts(name) == [actual, actual]


