"""How many passes a training micro-batch runs in under `max_completion_tokens_per_pass: "auto"`: the count that the
model's shape says lowers the step's peak, or one.

Per process, in bytes, for a pass of P positions (its distinct prompts and its rows' completions):

    one pass:   max(K * P, G_body) + L * P              K * P: what the forward keeps for the backward (with
                                                        checkpointing, each layer's input); G_body: the gradients
                                                        but the input embedding's, which arrive one layer at a
                                                        time as the kept activations go; L * P: what one layer's
                                                        recompute and backward hold on top (0 without checkpointing)
    n passes:   max(max(K * P_n, G_body) + L * P_n,     the first pass, as one pass over its own rows;
                    G + (K + L) * P_n)                  every later one beside the whole gradient G the earlier
                                                        passes left

where P_n is the largest pass's positions (TrainingBatch.pass_positions). Passes run only where the fewest passes
within 5% of the lowest estimate save at least a quarter of one pass's estimate and 256 MiB: a pass costs a rerun
of its prompts and a smaller product, worth it only for a real saving.

The per-position bytes follow a decoder layer's saved tensors: with checkpointing the layer's input (1.4 x hidden
values a position: the hidden state and what the layer call keeps beside it), without it every layer's saved
activations, 4 x intermediate + 9 x hidden values (the MLP's gate, up, activation and product; the norms, the
projections and the residuals). Measured on Qwen2.5-0.5B's shape, float32, 8 rows of 2,048 tokens (16,640
positions; bench/memory_trace.py): 80 MiB a layer kept, and up to 1.8 GB held by a layer's recompute and backward,
against 80 MiB and 1.83 GB from these counts. docs/performance.md has the rows the rule was checked against.
"""

import math
from dataclasses import dataclass

import torch

from posttrain.grpo.batch import TrainingBatch

CHECKPOINT_VALUES_PER_HIDDEN = 1.4  # a checkpointed layer's kept values a position, per hidden unit
LAYER_VALUES_PER_INTERMEDIATE = 4  # a layer's saved values a position, per MLP unit (gate, up, activation, product)
LAYER_VALUES_PER_HIDDEN = 9  # and per hidden unit (norms, attention projections and output, residuals)
SAVING_SHARE = 4  # passes must save at least 1/SAVING_SHARE of one pass's estimate
MIN_SAVING_BYTES = 256 * 2**20  # and at least this
NEAR_LOWEST = 1.05  # the fewest passes whose estimate is within this factor of the lowest


@dataclass(frozen=True)
class PassMemory:
    """What decides whether passes pay, per process, in bytes."""

    kept_per_position: float  # K: all layers' activations kept from the forward to the backward
    layer_per_position: float  # L: one layer's recompute and backward on top (0 without checkpointing)
    gradients: float  # G: the trainable parameters' gradients on this process
    embedding_gradients: float  # the input embedding's part of G

    def one_pass(self, positions: int) -> float:
        body = self.gradients - self.embedding_gradients
        return max(self.kept_per_position * positions, body) + self.layer_per_position * positions

    def in_passes(self, positions: int) -> float:
        """The peak of several passes, the largest of `positions`."""
        later = self.gradients + (self.kept_per_position + self.layer_per_position) * positions
        return max(self.one_pass(positions), later)

    def pass_count(self, batch: TrainingBatch) -> int:
        """How many passes `batch` runs in: the fewest near the lowest estimate, where it saves enough; else 1."""
        most = batch.most_passes()
        if most <= 1:
            return 1
        whole = self.one_pass(batch.pass_positions(1))
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
    sizes = _decoder_sizes(getattr(model, "config", None))
    if sizes is None:
        return None
    hidden, intermediate, layers = sizes
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        return None
    embedding = _input_embedding_weight(model)
    value_bytes = (embedding if embedding is not None else parameters[0]).element_size()  # the hidden states'
    if mixed_precision:
        value_bytes = min(2, value_bytes)
    layer = (LAYER_VALUES_PER_INTERMEDIATE * intermediate + LAYER_VALUES_PER_HIDDEN * hidden) * value_bytes
    if gradient_checkpointing:
        kept, on_top = layers * CHECKPOINT_VALUES_PER_HIDDEN * hidden * value_bytes, layer
    else:
        kept, on_top = layers * layer, 0.0
    embedding_bytes = _local_bytes(embedding) if embedding is not None and embedding.requires_grad else 0
    return PassMemory(kept_per_position=kept, layer_per_position=on_top,
                      gradients=float(sum(_local_bytes(p) for p in parameters)), embedding_gradients=embedding_bytes)


def _decoder_sizes(config) -> tuple[int, int, int] | None:
    """(hidden, MLP units a token runs through, layers) of the text decoder; a mixture of experts counts the experts
    a token is routed to and its shared experts (Qwen's shared_expert_intermediate_size, DeepSeek's
    n_shared_experts)."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    layers = getattr(text, "num_hidden_layers", None)
    routed = getattr(text, "num_experts_per_tok", None) or 1
    expert = getattr(text, "moe_intermediate_size", None)
    if expert:
        shared = getattr(text, "shared_expert_intermediate_size", None) or (
            (getattr(text, "n_shared_experts", None) or 0) * expert)
        intermediate = expert * routed + shared
    else:
        intermediate = getattr(text, "intermediate_size", None)
        if intermediate and (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)):
            intermediate *= routed
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, intermediate)):
        return None
    return hidden, intermediate, layers


def _input_embedding_weight(model: torch.nn.Module) -> torch.nn.Parameter | None:
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embedding, "weight", None)


def _local_bytes(parameter: torch.Tensor) -> int:
    """The bytes of this process's part of a parameter (a DTensor's local shard under FSDP2)."""
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    return math.prod(local.shape) * local.element_size()
