"""On-policy distillation's forward: the student's and the teacher's final hidden states at the completion tokens
they are trained on, and the divergence between their next-token distributions through both output layers in chunks
(models/divergence.py). Neither model's [tokens, vocabulary] logits are ever kept.

    teacher   without gradient: its body over prompt + completion; the hidden states [M, Ht] that predict the M loss
              tokens
    student   its body with gradient; at the same positions, chunked_divergence -> [M] divergence, [M] entropy

Each body runs in the model's own forward (through the output layer's forward where the layer's weight is whole only
there: FSDP, ZeRO-3; models/logprobs.py through_output_layer), so sharded weights are gathered as for any forward.
A teacher's output weight sharded so is gathered whole for the step (it is frozen: a copy, read again by the
student's backward).
"""

import contextlib

import torch

from posttrain.models.divergence import Head, chunked_divergence
from posttrain.models.forwards import mask_positions, output_layer
from posttrain.models.keywords import unwrap
from posttrain.models.logprobs import through_output_layer
from posttrain.models.partitioned import gathered


def logit_transform(model) -> tuple[float, float | None]:
    """(scale, softcap) the model applies to its output layer's result, read from its config as TRL 1.16 reads them:
    logit_scale, output_multiplier or lm_head_multiplier multiply; logits_scaling divides (multiplies for
    HyperCLOVA X); final_logit_softcapping caps, after the scale."""
    config = unwrap(model).config.get_text_config()
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, name, None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if config.model_type == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else float(scale)), getattr(config, "final_logit_softcapping", None)


def _plain_output_layer(model, role: str) -> torch.nn.Linear:
    layer = output_layer(model)
    if layer is None:
        raise ValueError(f"The {role}'s output layer is not a plain Linear layer (a LoRA adapter on it, or a custom "
                         "head), and distillation reads its weight directly: train without an adapter on lm_head.")
    return layer


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's whole value: an FSDP2 DTensor gathered (a collective), anything else as it is."""
    if tensor is not None and hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


@contextlib.contextmanager
def teacher_head(teacher):
    """The teacher's output layer as the divergence reads it, its weight whole (gathered from ZeRO-3's or FSDP2's
    shards into a copy for the block; as it is otherwise)."""
    layer = _plain_output_layer(teacher, "teacher")
    scale, softcap = logit_transform(teacher)
    sharded = any(hasattr(p, "ds_tensor") or hasattr(p, "full_tensor") for p in (layer.weight, layer.bias)
                  if p is not None)
    with gathered([p for p in (layer.weight, layer.bias) if p is not None]):
        weight, bias = _full(layer.weight), _full(layer.bias)
        if sharded:  # a gathered value does not outlive its block, and the student's backward reads it again
            weight, bias = weight.detach().clone(), None if bias is None else bias.detach().clone()
    yield Head(weight.detach(), None if bias is None else bias.detach(), scale, softcap)


def _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    return input_ids, attention_mask


def teacher_hidden(teacher, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask) -> torch.Tensor:
    """[M, Ht] the teacher's final hidden states at the positions that predict the M tokens of `loss_mask` [N, C]
    (row-major), without gradient."""
    input_ids, attention_mask = _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    width, mask = completion_ids.size(1), loss_mask.bool()
    with torch.no_grad():
        return through_output_layer(teacher, input_ids, attention_mask, mask_positions(teacher, attention_mask),
                                    width + 1, lambda hidden: hidden[:, -width - 1:-1][mask].detach().clone())


def completion_divergence(student, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask,
                          hidden_t: torch.Tensor, head_t: Head, beta: float, temperature: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """([M] divergence with the student's gradient, [M] student entropy) at the M tokens of `loss_mask` [N, C]
    against the teacher's hidden states there (teacher_hidden) and its head (teacher_head)."""
    input_ids, attention_mask = _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    width, mask = completion_ids.size(1), loss_mask.bool()
    layer = _plain_output_layer(student, "student")
    scale, softcap = logit_transform(student)

    def divergence(hidden):
        head = Head(layer.weight, layer.bias, scale, softcap)
        return chunked_divergence(hidden[:, -width - 1:-1][mask], head, hidden_t, head_t, beta, temperature)

    return through_output_layer(student, input_ids, attention_mask, mask_positions(student, attention_mask),
                                width + 1, divergence)
