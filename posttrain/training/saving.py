"""Writing models to disk: the policy (or its adapter) and merged LoRA weights.

Callers run these on the main process only.
"""

import os

from posttrain.models.keywords import safetensors_kwargs
from posttrain.models.loading import without_progress_bars
from posttrain.models.peft import is_peft_model
from posttrain.weights import embeddings_still_tied, export_weights


def save_policy_atomically(policy, tokenizer, config: dict, output_dir: str, state_dict: dict | None = None) -> None:
    """save_policy into output_dir/.final.tmp, then each file renamed into output_dir: a run killed while saving
    never leaves a half-written model file in output_dir."""
    import shutil

    tmp = os.path.join(output_dir, ".final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_policy(policy, tokenizer, config, tmp, state_dict)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that failed (a full disk) leaves no partial files behind
        raise
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


def save_policy(policy, tokenizer, config: dict, output_dir: str, state_dict: dict | None = None) -> None:
    """The model, or a LoRA policy's adapter (safetensors), with the tokenizer and posttrain_config.yaml.

    Args:
        state_dict: the whole state dict of a sharded policy (training/sharding.py), instead of its own.
    """
    import yaml

    from posttrain.training.sharding import fsdp1_wrappers_set_aside

    os.makedirs(output_dir, exist_ok=True)
    with without_progress_bars():  # one bar per save otherwise
        if state_dict is None:
            policy.save_pretrained(output_dir, **safetensors_kwargs(policy))
        else:  # peft picks the adapter's entries by module name: the names the gathered state dict has
            with fsdp1_wrappers_set_aside(policy):
                policy.save_pretrained(output_dir, state_dict=state_dict, **safetensors_kwargs(policy))
    tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, "posttrain_config.yaml"), "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


def save_merged(policy, tokenizer, output_dir: str) -> None:
    """Full weights that load with plain `AutoModelForCausalLM.from_pretrained` (LoRA merged, plain names).

    If the exported output layer no longer equals the input embedding (lm_head trained through
    modules_to_save), the config is saved untied, as `merge_and_unload` does.
    """
    plain = policy.get_base_model() if is_peft_model(policy) else policy
    state = dict(export_weights(policy))
    tied = getattr(plain.config, "tie_word_embeddings", None)
    if tied and not embeddings_still_tied(plain, state):
        plain.config.tie_word_embeddings = False  # restored below: the training model stays as it was
    try:
        with without_progress_bars():
            plain.save_pretrained(output_dir, state_dict=state, **safetensors_kwargs(plain))
    finally:
        if tied is not None:
            plain.config.tie_word_embeddings = tied
    tokenizer.save_pretrained(output_dir)
