"""How the log-prob passes call a causal LM: the keywords of a forward, its logits or final hidden states, and where
its output layer's weight is whole.

The model is asked for logits at the completion positions only. Whether it can be asked depends
on the transformers version and the model class: recent ones take `logits_to_keep`, older ones
`num_logits_to_keep`, some neither. The keyword is chosen from the forward signature, and the
returned logits are checked against what was asked (some models accept the keyword and ignore
it, as Qwen2 did on transformers 4.48), slicing when more came back.
"""

import contextlib
import os

import torch

from posttrain.models.keywords import forward_accepts, logits_to_keep_kwarg, takes_boundaries, unwrap
from posttrain.models.loading import checkpointing, is_fully_shard_unit, is_plain_linear

WHOLE_ONLY_IN_FORWARD = "_posttrain_whole_only_in_forward"  # set on an output layer by training/sharding.py
# transformers' switch (integrations/sdpa_attention.py, read at each attention call) that hands grouped-query attention
# with a mask to torch's SDPA whole (enable_gqa), where by default it repeats each key/value head first
SDPA_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token. [N, L] -> [N, L]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_kwargs(model, position_ids: torch.Tensor | None, n_keep: int, boundaries=None) -> dict:
    """Keyword arguments for a no-cache forward that returns the last `n_keep` positions' logits (0: every
    position), with these [B, T] position ids (None: the model's own) and, for a packed row, its sequence
    `boundaries` (models/packed_layouts.py Boundaries) where the forward takes them."""
    kwargs = boundaries.keywords() if boundaries is not None and takes_boundaries(model) else {}
    keep = logits_to_keep_kwarg(model)
    if keep is not None:
        kwargs[keep] = n_keep
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if forward_accepts(model, "use_cache"):
        kwargs["use_cache"] = False  # a cache would also hide packed sequences' boundaries from sdpa and eager
    return kwargs


def mask_positions(model, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """[N, L] position ids of left-padded rows (from their [N, L] mask), when the model's forward takes them."""
    return positions_from_mask(attention_mask) if forward_accepts(model, "position_ids") else None


def forward_kwargs(model, attention_mask: torch.Tensor, n_keep: int) -> dict:
    """sequence_kwargs for left-padded rows: position ids from their [N, L] mask."""
    return sequence_kwargs(model, mask_positions(model, attention_mask), n_keep)


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_keep: int,
                      model_inputs: dict | None = None) -> torch.Tensor:
    """Logits of the last `n_keep` positions.

    Args:
        model: a causal LM (possibly wrapped by DDP or PEFT).
        input_ids: [N, L] token ids, left-padded prompt followed by the completion.
        attention_mask: [N, L], 1 for real tokens.
        n_keep: positions to return, counted from the end.
        model_inputs: extra forward inputs (a vision-language model's pixel values), or None; with them the model
            derives its own positions (a multimodal rotary embedding's are not the text's 0, 1, 2, ...).
    Returns:
        [N, n_keep, V] logits.
    """
    kwargs = sequence_kwargs(model, None, n_keep) if model_inputs else forward_kwargs(model, attention_mask, n_keep)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **(model_inputs or {})).logits
    if logits.size(1) < n_keep:
        keep = logits_to_keep_kwarg(model)
        raise RuntimeError(f"{type(unwrap(model)).__name__} returned logits for {logits.size(1)} positions when "
                           f"{n_keep} were asked for with {keep}: its forward does not honour that keyword.")
    return logits[:, -n_keep:]


def whole_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, boundaries=None, model_inputs: dict | None = None) -> torch.Tensor:
    """[B, T, V] logits of every position of right-padded (or, with `position_ids`, its `boundaries` and no mask, a
    packed row's) rows, as the model computes them (with the rows' `model_inputs`, its own positions): only for a
    user's compute_metrics, the training and eval passes never build them."""
    if model_inputs:
        return model(input_ids=input_ids, attention_mask=attention_mask, **sequence_kwargs(model, None, 0),
                     **model_inputs).logits
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 **sequence_kwargs(model, position_ids, 0, boundaries)).logits


def output_layer(model) -> torch.nn.Linear | None:
    """The model's output projection if it is a plain Linear (not LoRA-wrapped or custom)."""
    get = getattr(unwrap(model), "get_output_embeddings", None)
    layer = get() if get is not None else None
    return layer if is_plain_linear(layer) else None


def output_layer_input(model, layer: torch.nn.Module, n_keep: int, **inputs) -> torch.Tensor:
    """`output_layer_input_and_output`'s hidden states alone."""
    return output_layer_input_and_output(model, layer, n_keep, **inputs)[0]


def output_layer_input_and_output(model, layer: torch.nn.Module, n_keep: int, **inputs) -> tuple:
    """([B, n, H] what the model's output `layer` receives in its own forward on `inputs` (its keywords, with
    `sequence_kwargs` for n_keep positions: the last n_keep, or every one for 0, or every one where the model has no
    logits_to_keep), and the model's output (its cache, with use_cache). The layer itself multiplies nothing (its
    input is cut to no position), and no layer's hidden states are kept but the last: `output_hidden_states=True`
    would hold every layer's, gigabytes at long rows in a pass without gradient."""
    captured = []

    def take(module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],)

    handle = layer.register_forward_pre_hook(take)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    hidden = captured[-1]
    if n_keep and hidden.size(-2) < n_keep:
        raise RuntimeError(f"{type(unwrap(model)).__name__} gave its output layer {hidden.size(-2)} positions when "
                           f"{n_keep} were asked for with {logits_to_keep_kwarg(model)}: its forward does not honour "
                           "that keyword.")
    unread = _unread_outputs(out) if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    return (hidden if unread is None else hidden + unread), out


def _unread_outputs(out) -> torch.Tensor | None:
    """0, with a gradient path to each tensor of the model's output that the passes do not read (a vision-language
    model's `image_outputs`: its vision tower's last hidden state, which LLaVA's features, taken a layer earlier, leave
    out). DDP looking for unused parameters counts whatever the forward's output reaches as used, and would wait in
    vain for the gradients of the layers only those tensors reach; through this path each gets a gradient of 0 (taken
    under DDP only: elsewhere those layers keep no gradient, as in TRL, and an optimizer leaves them alone). An
    empty slice's sum: exactly 0 whatever the values (an inf among them too). None where there is none (a text
    model's output), so that the hidden states are not copied for nothing."""
    if not torch.is_grad_enabled() or not isinstance(out, dict):
        return None
    total = None
    for name, value in out.items():
        if name == "logits":  # cut to no position by the hook above; the output layer's gradient comes the loss's way
            continue
        tensors = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                zero = tensor.reshape(-1)[:0].sum()
                total = zero if total is None else total + zero
    return total


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L, H] input of the output layer for [N, L] left-padded rows, from the model's own forward (no logits)."""
    return output_layer_input(model, output_layer(model), 0, input_ids=input_ids, attention_mask=attention_mask,
                              **forward_kwargs(model, attention_mask, 0))


def whole_only_in_forward(layer: torch.nn.Module) -> bool:
    """Whether the layer's weight is whole only inside the model's forward and backward: DeepSpeed ZeRO-3
    partitions it and gathers it around the layer's own; FSDP1 gathers it around its root wrapper's (marked so);
    FSDP2, where the layer is a unit of its own (as accelerate makes it), around its group's."""
    return hasattr(layer.weight, "ds_tensor") or whole_in_model_forward(layer)


def whole_in_model_forward(layer: torch.nn.Module) -> bool:
    """Whether the chunked output layer must run inside the model's forward, and its check through the model: FSDP1
    gathers the layer's weight only around its root wrapper's forward (the layer is marked so); FSDP2 gathers a
    unit's weights around its group's forward and, unless told otherwise, reshards them after it."""
    return getattr(layer, WHOLE_ONLY_IN_FORWARD, False) or is_fully_shard_unit(layer)


def agree_within_rounding(plain, together: torch.Tensor, apart: torch.Tensor) -> bool:
    """Whether two computations of the same values (a fast path's one-time check against the model's own forward)
    agree within what the model's own rounding allows: 1e-4 in float32, 3e-2 in a 16-bit dtype, relative to the
    largest value; a position that sees other tokens misses."""
    precise = plain.get_input_embeddings().weight.dtype == torch.float32
    tolerance = (1e-4 if precise else 3e-2) * max(1.0, float(apart.abs().max()))
    return bool((together - apart).abs().max() <= tolerance)


@contextlib.contextmanager
def in_eval_mode(plain: torch.nn.Module):
    """The model in eval mode for the block (dropout would make two forwards of a check differ), then as it was."""
    was_training = plain.training
    plain.eval()
    try:
        yield
    finally:
        plain.train(was_training)


@contextlib.contextmanager
def masked_gqa_on_cpu(model):
    """For the block, a masked grouped-query attention under transformers' sdpa goes to torch's SDPA with its key and
    value heads as they are (enable_gqa), not repeated for each query head (repeat_kv: a copy of every key and value
    per layer in the forward, their sums in the backward; 8% of the reward benchmark's step). Exact: torch's CPU flash
    kernel takes the mask and the groups together and gives the same values; transformers leaves the default off
    because on CUDA a mask sends GQA to the math kernel. A no-op where the model is not on a CPU, has no key/value
    groups, checkpoints activations (their recomputation in the backward runs outside the block, and would save
    other shapes), or the switch is set already."""
    plain = unwrap(model)
    config = getattr(plain, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    first = next(plain.parameters(), None)
    if (first is None or first.device.type != "cpu" or not heads or not kv_heads or kv_heads >= heads
            or checkpointing(plain) or SDPA_FORCE_GQA in os.environ):
        yield
        return
    os.environ[SDPA_FORCE_GQA] = "1"
    try:
        yield
    finally:
        os.environ.pop(SDPA_FORCE_GQA, None)
