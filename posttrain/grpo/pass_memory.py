"""How many passes a training micro-batch runs in under `max_completion_tokens_per_pass: "auto"`: the count that the
model's shape says lowers the step's peak, or one.

Per process, in bytes, for a pass of P positions (its distinct prompts and its rows' completions):

    one pass:   max(K * P, G_body) + L * P              K * P: what the forward keeps for the backward (with
                                                        checkpointing, each layer's input); G_body: the gradients
                                                        but the input embedding's, which arrive one layer at a
                                                        time as the kept activations go; L * P: what one layer's
                                                        recompute and backward hold on top (0 without checkpointing)
    n passes:   G + (K + L) * P_n                       every pass after the first beside the whole gradient G
                                                        the earlier passes left (the first, a one-pass estimate
                                                        over fewer positions, is never above it: G >= G_body)

where P_n is the largest pass's positions (TrainingBatch.pass_positions). Passes run only where the fewest passes
within 5% of the lowest estimate save at least a quarter of one pass's estimate and 256 MiB: a pass costs a rerun
of its prompts and a smaller product, worth it only for a real saving.

The per-position bytes follow a decoder layer's saved tensors (_layer_values): with checkpointing each layer keeps
its input (1.4 x hidden values a position: the hidden state and what the layer call keeps beside it) and L is the
largest layer's saved values; without it every layer keeps its saved values and L is 0. At Qwen2.5-0.5B's shape in
float32, with 8 rows of 2,048 tokens (16,640 positions; bench/memory_trace.py) a layer kept 80 MiB and its recompute
and backward held up to 1.8 GB, against 80 MiB and 1.87 GB from these counts. On tiny models of today's
architectures at their real proportions (tests/test_pass_memory.py) the counts come within a quarter of what
autograd saves. docs/performance.md has the rows the rule was checked against.
"""

from dataclasses import dataclass

import torch

from posttrain.grpo.batch import TrainingBatch

CHECKPOINT_VALUES_PER_HIDDEN = 1.4  # a checkpointed layer's kept values a position, per hidden unit
MLP_VALUES_PER_UNIT = 4  # a layer's saved values a position, per MLP unit (gate, up, activation, product)
NORM_VALUES_PER_HIDDEN = 5  # and per hidden unit (the residual stream, the norms' inputs and outputs)
LINEAR_ATTENTION_VALUES_PER_WIDTH = 12  # per unit of a linear-attention layer's query, key and value widths
SAVING_SHARE = 4  # passes must save at least 1/SAVING_SHARE of one pass's estimate
MIN_SAVING_BYTES = 256 * 2**20  # and at least this
NEAR_LOWEST = 1.05  # the fewest passes whose estimate is within this factor of the lowest


@dataclass(frozen=True)
class PassMemory:
    """What decides whether passes pay, per process, in bytes."""

    kept_per_position: float  # K: all layers' activations kept from the forward to the backward
    layer_per_position: float  # L: one layer's recompute and backward on top (0 without checkpointing)
    gradients: float  # G: the trainable parameters' whole gradients, as a process holds them between passes
    embedding_gradients: float  # the input embedding's part of G

    def one_pass(self, positions: int) -> float:
        body = self.gradients - self.embedding_gradients
        return max(self.kept_per_position * positions, body) + self.layer_per_position * positions

    def in_passes(self, positions: int) -> float:
        """The peak of several passes, the largest of `positions`: a later pass's, beside the whole gradient."""
        return self.gradients + (self.kept_per_position + self.layer_per_position) * positions

    def pass_count(self, batch: TrainingBatch) -> int:
        """How many passes `batch` runs in: the fewest near the lowest estimate, where it saves enough; else 1."""
        whole_positions = batch.pass_positions(1)
        most = batch.most_passes(whole_positions)
        if most <= 1:
            return 1
        whole = self.one_pass(whole_positions)
        rows = len(batch)  # each largest pass size once, at the fewest passes that make it
        counts = sorted({-(-rows // size) for size in range(1, rows + 1)} & set(range(2, most + 1)))
        estimates = {n: self.in_passes(batch.pass_positions(n)) for n in counts}
        lowest = min(estimates.values())
        if whole - lowest < max(whole / SAVING_SHARE, MIN_SAVING_BYTES):
            return 1
        return min(n for n, peak in estimates.items() if peak <= lowest * NEAR_LOWEST)


def pass_memory(model: torch.nn.Module, gradient_checkpointing: bool, mixed_precision: bool) -> PassMemory | None:
    """The model's PassMemory, or None where its config does not name a decoder's sizes (the auto rule then runs
    one pass)."""
    text = _text_config(getattr(model, "config", None))
    values = _layer_values(text) if text is not None else None
    parameters = [p for p in model.parameters() if p.requires_grad]
    if values is None or not parameters:
        return None
    embedding = _input_embedding_weight(model)
    value_bytes = (embedding if embedding is not None else parameters[0]).element_size()  # the hidden states'
    if mixed_precision:
        value_bytes = min(2, value_bytes)
    if gradient_checkpointing:
        kept = len(values) * CHECKPOINT_VALUES_PER_HIDDEN * text.hidden_size * value_bytes
        on_top = max(values) * value_bytes
    else:
        kept, on_top = sum(values) * value_bytes, 0.0
    embedding_bytes = _whole_bytes(embedding) if embedding is not None and embedding.requires_grad else 0
    return PassMemory(kept_per_position=kept, layer_per_position=on_top,
                      gradients=float(sum(_whole_bytes(p) for p in parameters)), embedding_gradients=embedding_bytes)


def _text_config(config):
    """The text decoder's config (a vision-language checkpoint's text_config), or None."""
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_values(text) -> list[int] | None:
    """Each decoder layer's values saved for the backward a position (its `layer_types`, where the config names
    them), or None where the config lacks a decoder's sizes:

        MLP         4 x the units a token runs through (gate, up, activation, product); a mixture of experts counts
                    the experts it is routed to and the shared ones, and 2 x routed x hidden more (its copies of
                    the token in and out of the experts)
        norms       5 x hidden (the residual stream and the two norms' inputs and outputs)
        attention   4 x (query + key/value heads) x head dimension (projections, rotary outputs, the output),
                    and 4 x query heads x head dimension more where a hybrid gates the output; a linear-attention
                    layer (Gated DeltaNet) 12 x its query, key and value widths, what transformers' PyTorch chunked
                    delta rule keeps (flash-linear-attention's kernels keep less)
    """
    hidden, layers = getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None)
    mlp, heads = _mlp_values(text, hidden), getattr(text, "num_attention_heads", None)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, mlp, heads)):
        return None
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    attention = 4 * (heads + (getattr(text, "num_key_value_heads", None) or heads)) * head_dim
    linear = _linear_attention_values(text)
    if linear:  # a hybrid's attention layers (Qwen3.5, Qwen3-Next) gate their output by a query-sized projection
        attention += 4 * heads * head_dim
    types = getattr(text, "layer_types", None) or ["full_attention"] * layers
    return [mlp + NORM_VALUES_PER_HIDDEN * hidden + (linear if kind == "linear_attention" and linear else attention)
            for kind in types[:layers]]


def _mlp_values(text, hidden) -> int | None:
    routed = getattr(text, "num_experts_per_tok", None) or 1
    expert = getattr(text, "moe_intermediate_size", None)
    if expert:  # Qwen's shared_expert_intermediate_size, DeepSeek's n_shared_experts
        shared = getattr(text, "shared_expert_intermediate_size", None) or (
            (getattr(text, "n_shared_experts", None) or 0) * expert)
        return MLP_VALUES_PER_UNIT * (expert * routed + shared) + 2 * routed * hidden
    units = getattr(text, "intermediate_size", None)
    if not isinstance(units, int) or not isinstance(hidden, int):
        return None
    if getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None):  # Mixtral, gpt-oss
        return MLP_VALUES_PER_UNIT * units * routed + 2 * routed * hidden
    return MLP_VALUES_PER_UNIT * units


def _linear_attention_values(text) -> int | None:
    key_heads, value_heads = (getattr(text, "linear_num_key_heads", None), getattr(text, "linear_num_value_heads",
                                                                                   None))
    key_dim, value_dim = getattr(text, "linear_key_head_dim", None), getattr(text, "linear_value_head_dim", None)
    if not all(isinstance(v, int) and v > 0 for v in (key_heads, value_heads, key_dim, value_dim)):
        return None
    return LINEAR_ATTENTION_VALUES_PER_WIDTH * (2 * key_heads * key_dim + value_heads * value_dim)


def _input_embedding_weight(model: torch.nn.Module) -> torch.nn.Parameter | None:
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embedding, "weight", None)


def _whole_bytes(parameter: torch.Tensor) -> int:
    """The bytes of a parameter's whole gradient: what a process holds between passes, whose gradients are reduced
    only after the step's last one (FSDP's no_sync passes accumulate unsharded gradients). The estimate is made
    before sharding, where only DeepSpeed ZeRO-3's loading has partitioned a parameter: its ds_numel counts (ZeRO
    keeps its gradients partitioned, so there the count errs toward one pass)."""
    return (getattr(parameter, "ds_numel", None) or parameter.numel()) * parameter.element_size()
