"""FSDP1, FSDP2 (torch's fully_shard) and DeepSpeed ZeRO-3 on 2 gloo processes: the pieces a sharded GRPO step goes
through (posttrain/training/sharding.py, the weight export) give what an unsharded copy of the model gives;
DeepSpeed's config entries come from the trainer's config; and FSDP1 without use_orig_params, which the trainers do
not run, is refused in one sentence."""

import json
from types import SimpleNamespace

import pytest
from conftest import two_gloo_processes


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2", "zero3"])
def test_sharded_generation_training_and_export_equal_the_unsharded_model(strategy, tmp_path):
    """Each process generates its own prompts inside the run's whole_weights, its completions ending at another step
    than the other process's (3 against 12 tokens: no collective waits inside the decode), then trains (no
    inference-tensor error after generation) and exports whole tensors. Completions, log-probs and the export equal
    an unsharded copy's exactly; gradients (summed over both batches) to 0 under FSDP2, and to 1e-6 relative under
    ZeRO-3 with every parameter partitioned (the tied embedding's two gradients are reduced separately, so they sum
    in another order). Under ZeRO-3 and FSDP1 the output layer's weight is whole only inside the model's forward:
    the chunked log-probs run as the layer's forward; DeepSpeed's hooks are off while generating, and FSDP1 runs its
    summoned weights through the plain modules, so the decodes do not wait."""
    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    two_gloo_processes("multiproc_sharding.py", strategy, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks[0]["lengths"] == [3, 3] and ranks[1]["lengths"] == [12, 12]
    tolerance = 1e-6 if strategy == "zero3" else 0.0
    for result in ranks:
        assert result["completions_equal"] and result["export_names_equal"] and result["export_shapes_full"]
        assert result["logps_max_diff"] == 0.0 and result["export_max_diff"] == 0.0
        assert result["grad_max_diff"] <= tolerance * result["grad_max"], result


@pytest.mark.multiproc
def test_a_zero3_reference_mixed_toward_the_policy_computes_with_the_mixed_weights(tmp_path):
    """sync_ref_model's update under ZeRO-3 reaches the reference's forward, persistent parameters included (ZeRO-3
    keeps a small parameter whole between forwards, and a forward reads that copy: updating the shard alone left
    them at their old values)."""
    pytest.importorskip("deepspeed")
    two_gloo_processes("multiproc_zero3_mix.py", str(tmp_path))
    for rank in (0, 1):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        assert result["persistent"] > 0  # the case this is about
        assert result["max_diff"] <= 1e-6 * result["max_logit"], result


def test_fsdp1_without_original_parameters_is_refused_in_one_sentence():
    from accelerate.utils import DistributedType

    from posttrain.configs import ConfigError
    from posttrain.training.sharding import check_supported

    def fsdp1(use_orig_params):
        return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=SimpleNamespace(
            fsdp_version=1, use_orig_params=use_orig_params)))

    with pytest.raises(ConfigError) as err:
        check_supported(fsdp1(False))
    assert str(err.value) == ("This run was launched with FSDP1 and fsdp_use_orig_params: false, which posttrain does "
                              "not train with (its optimizer would see flattened parameters): set "
                              "fsdp_use_orig_params: true in the accelerate config (accelerate's default), or launch "
                              "with fsdp2.")
    check_supported(fsdp1(True))
    for state in ({"distributed_type": DistributedType.FSDP, "fsdp_plugin": SimpleNamespace(fsdp_version=2)},
                  {"distributed_type": DistributedType.DEEPSPEED, "deepspeed_plugin": SimpleNamespace(zero_stage=3)}):
        check_supported(SimpleNamespace(state=SimpleNamespace(**state)))


def _args(**fields):
    fields = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, **fields}
    return SimpleNamespace(**fields)


def test_deepspeed_config_entries_come_from_the_trainers_config():
    from posttrain.training.zero import fill_config

    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
              "bf16": {"enabled": "auto"}}
    fill_config(config, _args(), num_processes=3)
    assert config == {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                      "gradient_clipping": 1.0, "bf16": {"enabled": "auto", "check_grad_overflow": True}}
    config = {}
    fill_config(config, _args(max_grad_norm=0.0), num_processes=1)
    assert config["gradient_clipping"] == 0.0 and config["train_batch_size"] == 8


@pytest.mark.parametrize("config, message", [
    ({"gradient_accumulation_steps": 4}, "The DeepSpeed config sets gradient_accumulation_steps=4, but the trainer's "
     "gradient_accumulation_steps gives 2: set it to \"auto\" in the DeepSpeed config (or to the same value)."),
    ({"gradient_clipping": 0.5}, "The DeepSpeed config sets gradient_clipping=0.5, but the trainer's max_grad_norm "
     "gives 1.0: set it to \"auto\" in the DeepSpeed config (or to the same value)."),
    ({"optimizer": {"type": "AdamW"}}, "The DeepSpeed config has its own \"optimizer\" section, but posttrain builds the "
     "optimizer (optim, learning_rate, ...) from the trainer's config, as TRL does by default: remove the "
     "\"optimizer\" section."),
])
def test_a_deepspeed_config_that_contradicts_the_trainers_stops_in_one_sentence(config, message):
    from posttrain.configs import ConfigError
    from posttrain.training.zero import fill_config

    with pytest.raises(ConfigError) as err:
        fill_config(config, _args(), num_processes=2)
    assert str(err.value) == message
