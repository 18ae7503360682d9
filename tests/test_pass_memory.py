"""max_completion_tokens_per_pass="auto" (grpo/pass_memory.py): the estimate from today's model configs, the pass
count it picks at Qwen2.5-0.5B's shape against the peaks measured there, and the trainer running what it picks with
the update of one pass."""

from dataclasses import replace

import pytest
import torch
import transformers
from conftest import assert_same_updates, length_reward, tiny_config, train_recording_passes

from posttrain.configs import ConfigError, GRPOConfig
from posttrain.generation import Rollouts
from posttrain.grpo import online, pass_memory
from posttrain.grpo.batch import TrainingBatch
from posttrain.grpo.pass_memory import PassMemory
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.testing import tiny_model

MiB = 2**20

# Qwen2.5-0.5B's shape (its config.json), the shape the memory rows of bench/compare_real_shape.sh ran
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def _meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _rows(prompt_width: int, widths: list[int], prompts: list[int]) -> TrainingBatch:
    """One row per entry of `widths`, its completion that many real tokens (padded to the widest), its prompt the
    id in `prompts`."""
    n, width = len(widths), max(widths)
    mask = torch.arange(width)[None, :] < torch.tensor(widths)[:, None]
    rollouts = Rollouts(torch.tensor(prompts)[:, None].repeat(1, prompt_width),
                        torch.ones(n, prompt_width, dtype=torch.bool), torch.ones(n, width, dtype=torch.long),
                        mask, torch.zeros(n, dtype=torch.bool), torch.zeros(n, width))
    return TrainingBatch(rollouts, torch.ones(n), mask)


def test_the_estimate_counts_a_decoder_layers_saved_values():
    """Qwen2.5-0.5B's shape in float32: with checkpointing each layer keeps 1.4 x 896 values a position and one
    layer's recompute holds 4 x 4,864 (MLP) + 5 x 896 (norms) + 4 x (14 + 2) x 64 (attention); without it every
    layer keeps the latter. The gradients are every parameter's (the tied embedding once), the embedding's part
    apart; in bfloat16 half the bytes."""
    model = _meta_model(transformers.Qwen2Config(**QWEN25_05B))
    parameters = sum(p.numel() for p in model.parameters())
    layer = (4 * 4864 + 5 * 896 + 4 * 16 * 64) * 4
    checkpointed = pass_memory.pass_memory(model, gradient_checkpointing=True, mixed_precision=False)
    assert checkpointed == PassMemory(kept_per_position=24 * 1.4 * 896 * 4, layer_per_position=layer,
                                      gradients=parameters * 4, embedding_gradients=151936 * 896 * 4)
    whole = pass_memory.pass_memory(model, gradient_checkpointing=False, mixed_precision=False)
    assert (whole.kept_per_position, whole.layer_per_position) == (24 * layer, 0)
    mixed = pass_memory.pass_memory(model, gradient_checkpointing=True, mixed_precision=True)
    assert mixed.layer_per_position == layer / 2 and mixed.gradients == checkpointed.gradients


_SMALL = dict(vocab_size=128, num_hidden_layers=2)
# today's architectures at their real proportions, narrower: what autograd saves a position in each layer
TODAYS_DECODERS = {
    "Llama-3.2-1B at 1/4": transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                                    num_key_value_heads=2, **_SMALL),
    "Qwen2.5-0.5B": transformers.Qwen2Config(**{**QWEN25_05B, **_SMALL}),
    "Qwen3-0.6B at 1/2": transformers.Qwen3Config(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                                                  num_key_value_heads=4, head_dim=128, **_SMALL),
    "Gemma-3-1B at 1/2": transformers.Gemma3TextConfig(hidden_size=576, intermediate_size=3456, num_attention_heads=2,
                                                       num_key_value_heads=1, head_dim=256, **_SMALL),
    "Qwen3-30B-A3B at 1/4": transformers.Qwen3MoeConfig(hidden_size=512, moe_intermediate_size=192, num_experts=32,
                                                        num_experts_per_tok=8, num_attention_heads=8,
                                                        num_key_value_heads=1, head_dim=128, **_SMALL),
    "Qwen3.5-0.8B-like at 1/2": transformers.Qwen3_5TextConfig(
        hidden_size=512, intermediate_size=1792, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        linear_num_key_heads=8, linear_num_value_heads=8, vocab_size=128, num_hidden_layers=5),
}


def _saved_values_per_layer(model, positions: int) -> list[float]:
    """What autograd saves for the backward in each decoder layer of one forward, in float32 values a position
    (each storage once, parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, layer = [{} for _ in model.model.layers], [0]
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: layer.__setitem__(0, i))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[layer[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(4, 128, (1, positions)))
    return [sum(s.values()) / 4 / positions for s in saved]


@pytest.mark.parametrize("name", list(TODAYS_DECODERS))
def test_the_per_layer_counts_come_within_a_quarter_of_what_autograd_saves(name):
    """Every layer but the last (which also runs the final norm and the output layer): dense and grouped-query
    attention, query/key norms, Gemma's four norms, a mixture of experts, Qwen3.5's Gated DeltaNet layers (through
    transformers' PyTorch delta rule, as on a CPU) beside its gated attention."""
    config = TODAYS_DECODERS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    measured = _saved_values_per_layer(model, positions=256)
    estimated = pass_memory._layer_values(config)
    for i, (m, e) in enumerate(zip(measured[:-1], estimated[:-1])):
        assert 0.75 <= e / m <= 1.25, (name, i, e, m)


@pytest.mark.parametrize("config, mlp_values", [
    (transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts_per_tok=4, num_experts=8,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 vocab_size=128), 4 * 4 * 32 + 2 * 4 * 64),
    (transformers.Qwen3NextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  num_experts_per_tok=2, num_experts=8, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=128), 4 * (2 * 32 + 48) + 2 * 2 * 64),
    (transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_experts_per_tok=2, num_local_experts=4,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
     4 * 2 * 96 + 2 * 2 * 64),
    (transformers.Qwen3_5Config(text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 vocab_size=128)), 4 * 96),
])
def test_the_mlp_a_token_runs_through_on_todays_configs(config, mlp_values):
    """A mixture of experts counts the experts a token is routed to and the shared one, and its copies of the token
    in and out of them; a vision-language or hybrid checkpoint's config, its text decoder's."""
    assert pass_memory._mlp_values(pass_memory._text_config(config), 64) == mlp_values


def _hybrid_decoder():
    """A tiny Qwen3.5 text decoder: Gated DeltaNet layers beside attention, at transformers' default linear-attention
    widths."""
    config = transformers.Qwen3_5TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_hybrid_decoders_largest_layer_is_its_linear_attention():
    estimate = pass_memory.pass_memory(_hybrid_decoder(), True, False)
    linear = 12 * (2 * 16 * 128 + 32 * 128)
    assert estimate.layer_per_position == (4 * 96 + 5 * 64 + linear) * 4
    assert estimate.embedding_gradients == 128 * 64 * 4


@pytest.mark.peft
def test_a_lora_policys_gradients_are_its_adapters():
    """A LoRA policy's gradients are its adapters' alone, its frozen embedding none of them; its activations the
    decoder's."""
    import peft

    model = _hybrid_decoder()
    full = pass_memory.pass_memory(model, True, False)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    estimate = pass_memory.pass_memory(lora, True, False)
    assert adapters > 0 and estimate.gradients == adapters * 4 and estimate.embedding_gradients == 0
    assert estimate.layer_per_position == full.layer_per_position


def test_a_config_without_a_decoders_sizes_runs_one_pass():
    assert pass_memory._layer_values(transformers.PretrainedConfig()) is None
    assert pass_memory.pass_memory(torch.nn.Linear(4, 4), True, False) is None


@pytest.mark.parametrize("completion_tokens, passes", [(256, 1), (512, 1), (1024, 1), (2048, 8), (4096, 8)])
def test_at_qwen25_05b_passes_run_where_they_were_measured_to_lower_the_peak(completion_tokens, passes):
    """The memory row's micro-batch (8 completions of one prompt, checkpointing, float32, full fine-tuning): at
    1,024 tokens 2 passes peaked 296 MiB above one pass, at 2,048 4 passes 893 MiB below it, at 4,096 8 passes held
    what 4 did at 2,048 (docs/performance.md). The rule splits only from 2,048 tokens, into a row a pass."""
    estimate = pass_memory.pass_memory(_meta_model(transformers.Qwen2Config(**QWEN25_05B)), True, False)
    assert estimate.pass_count(_rows(32, [completion_tokens] * 8, [0] * 8)) == passes


def test_the_rule_needs_a_real_saving_and_takes_the_fewest_passes_near_the_lowest():
    """Activations far below the gradients: one pass. Far above: the fewest passes within 5% of the lowest
    estimate. A saving of a quarter but under 256 MiB (a tiny model): one pass."""
    batch = _rows(4, [100] * 8, [1, 2] * 4)  # 2 prompts of 4 tokens: up to 8 passes
    assert PassMemory(1000.0, 1000.0, 8e9, 1e9).pass_count(batch) == 1
    heavy = PassMemory(1e6, 1e6, 1e8, 1e7)  # 2 MB a position against 100 MB of gradients
    assert heavy.pass_count(batch) == 8
    estimates = {n: heavy.in_passes(batch.pass_positions(n)) for n in range(1, 9)}
    assert estimates[8] == min(estimates.values()) and estimates[7] > 1.05 * estimates[8]
    small = PassMemory(1e4, 1e4, 1e5, 1e4)  # the same proportions, a hundredth of the bytes
    assert small.in_passes(batch.pass_positions(8)) < 0.75 * small.one_pass(batch.pass_positions(1))
    assert small.pass_count(batch) == 1


def test_pass_positions_count_a_parts_prompts_and_its_widest_row():
    """8 rows of 2 prompts (6 tokens each) in 2 passes: a pass is one prompt's 4 rows, at its widest completion."""
    batch = _rows(6, [10, 3, 10, 3, 10, 3, 10, 3], [1, 2] * 4)
    assert batch.pass_positions(1) == 2 * 6 + 8 * 10
    assert batch.pass_positions(2) == 6 + 4 * 10
    assert batch.pass_positions(8) == 6 + 10
    uneven = _rows(5, [7, 2, 9, 4, 1, 8, 3, 6, 5, 2, 7], [4, 1, 4, 2, 1, 3, 4, 2, 1, 3, 4])
    for count in range(1, 12):  # the parts in_passes really makes
        parts = uneven.in_passes(count)
        largest = max(len(p.rollouts.prompt_ids.unique(dim=0)) * 5 + p.rollouts.completion_ids.numel() for p in parts)
        assert uneven.pass_positions(count) == largest, count


@pytest.mark.parametrize("value, stored", [("auto", "auto"), ("none", None), ("12", 12), (None, None), (7, 7)])
def test_the_setting_takes_a_count_auto_or_none(tmp_path, value, stored):
    config = GRPOConfig(output_dir=str(tmp_path), max_completion_tokens_per_pass=value)
    assert config.max_completion_tokens_per_pass == stored
    assert GRPOConfig(output_dir=str(tmp_path)).max_completion_tokens_per_pass == "auto"


@pytest.mark.parametrize("value", ["often", 0, -3])
def test_a_bad_setting_is_one_sentence(tmp_path, value):
    with pytest.raises(ConfigError, match="max_completion_tokens_per_pass="):
        GRPOConfig(output_dir=str(tmp_path), max_completion_tokens_per_pass=value)


def test_auto_runs_the_passes_it_picks_with_the_update_of_one_pass(tokenizer, addition_dataset, tmp_path, monkeypatch):
    """A tiny model's activations never save 256 MiB, so "auto" runs one pass; with its kept bytes scaled up as a
    long completion's would be (and the floor off), it splits the 8 rows into passes, and the gradient and update
    are one pass's."""
    real = pass_memory.pass_memory

    def long_completions(model, checkpointing, mixed):
        measured = real(model, checkpointing, mixed)
        return PassMemory(measured.kept_per_position * 1e4, measured.layer_per_position * 1e4, measured.gradients,
                          measured.embedding_gradients)

    results, passes = {}, {}
    for label, key in (("default", (8, 1)), ("long", "long")):
        if label == "long":
            monkeypatch.setattr(online, "pass_memory", long_completions)
            monkeypatch.setattr(pass_memory, "MIN_SAVING_BYTES", 0)
        trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=2), length_reward,
                              tiny_config(tmp_path / label, max_steps=1, max_completion_length=10, beta=0.04,
                                          gradient_checkpointing=True),
                              train_dataset=addition_dataset, processing_class=tokenizer)
        passes[label], results[key] = train_recording_passes(trainer)
    assert passes["default"] == [8] and len(passes["long"]) > 1 and sum(passes["long"]) == 8, passes
    assert_same_updates(results)


def test_the_forwards_without_gradient_run_in_the_same_passes(tokenizer, addition_dataset, tmp_path):
    """The reference log-probs of a micro-batch the rule splits come from as many passes as the training runs (here
    4: 8 rows of up to 9 completion tokens at 12 a pass, capped by their prompts' reruns), in the rows' own order,
    equal to one pass's."""
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=2), length_reward,
                          tiny_config(tmp_path, max_steps=1, beta=0.04, max_completion_tokens_per_pass=12),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    rollouts = _rows(3, [5, 9, 2, 7, 6, 3, 8, 4], [1, 2, 1, 2, 1, 2, 1, 2]).rollouts
    rollouts = replace(rollouts, completion_ids=torch.randint(4, 60, rollouts.completion_ids.shape,
                                                              generator=torch.Generator().manual_seed(0)))
    trainer.rollout.log_probs(rollouts, old=False)  # the fast paths' checks (models/fast_paths.py) run once, here
    forwards = []
    trainer.ref_model.register_forward_hook(lambda module, args, out: forwards.append(1))
    split = trainer.rollout.log_probs(rollouts, old=False).ref
    split_forwards = len(forwards)
    forwards.clear()
    trainer.rollout.row_passes = None
    whole = trainer.rollout.log_probs(rollouts, old=False).ref
    passes = TrainingBatch(rollouts, None, rollouts.completion_mask).pass_count(12)
    assert passes == 4 and split_forwards == passes * len(forwards), (split_forwards, len(forwards))
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert (split[rollouts.completion_mask] != 0).all()
