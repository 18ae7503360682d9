"""On-policy distillation's forward: the student's and the teacher's final hidden states at the completion tokens
they are trained on, and the divergence between their next-token distributions through both output layers in chunks
(models/divergence.py). Neither model's [tokens, vocabulary] logits are ever kept.

    teacher   without gradient: its body over prompt + completion; the hidden states [M, Ht] that predict the M loss
              tokens
    student   its body with gradient; at the same positions, chunked_divergence -> [M] divergence, [M] entropy

Each body runs in the model's own forward (through the output layer's forward where the layer's weight is whole only
there: FSDP, ZeRO-3; models/logprobs.py through_output_layer), so sharded weights are gathered as for any forward.
A teacher's output weight sharded so is copied whole inside its forward, for the student's pass and backward (it is
frozen).
"""

import torch

from posttrain.models.divergence import Head, chunked_divergence
from posttrain.models.forwards import mask_positions, output_layer, whole_only_in_forward
from posttrain.models.keywords import unwrap
from posttrain.models.loading import keeps_float32
from posttrain.models.logprobs import through_output_layer


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


def teacher_pass(teacher, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask,
                 model_inputs: dict | None = None) -> tuple[torch.Tensor, Head]:
    """([M, Ht] the teacher's final hidden states at the positions that predict the M tokens of `loss_mask` [N, C]
    (row-major), its output layer as the divergence reads it), without gradient. Where the layer's weight is whole
    only inside the model's forward (ZeRO-3, FSDP), it is copied there: the student's pass and backward read it
    after the teacher's forward has put it back in shards. `model_inputs`: the rows' pixels (a vision-language
    teacher's, as the student's), with which the model derives its own positions."""
    input_ids, attention_mask = _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    width, mask = completion_ids.size(1), loss_mask.bool()
    layer = _plain_output_layer(teacher, "teacher")
    sharded = whole_only_in_forward(layer)
    weights = []

    def select(hidden):
        if sharded:  # whole here, in the layer's own forward
            weights.append((layer.weight.detach().clone(),
                            None if layer.bias is None else layer.bias.detach().clone()))
        return hidden[:, -width - 1:-1][mask]  # boolean indexing copies: nothing of the forward is kept

    with torch.no_grad():
        positions = None if model_inputs else mask_positions(teacher, attention_mask)
        hidden = through_output_layer(teacher, input_ids, attention_mask, positions, width + 1, select,
                                      model_inputs=model_inputs)
    weight, bias = weights[0] if sharded else (layer.weight.detach(),
                                                None if layer.bias is None else layer.bias.detach())
    return hidden, Head(weight, bias, *logit_transform(teacher), float32=keeps_float32(layer))


def _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    return input_ids, attention_mask


def completion_divergence(student, prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask,
                          hidden_t: torch.Tensor, head_t: Head, beta: float, temperature: float,
                          grad_scale: float | None = None, model_inputs: dict | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """([M] divergence with the student's gradient, [M] student entropy) at the M tokens of `loss_mask` [N, C]
    against the teacher's hidden states there and its head (teacher_pass); `grad_scale`: the
    gradient the loss gives each divergence, when known (models/divergence.py); `model_inputs`: the rows' pixels."""
    input_ids, attention_mask = _inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    width, mask = completion_ids.size(1), loss_mask.bool()
    layer = _plain_output_layer(student, "student")
    scale, softcap = logit_transform(student)

    def divergence(hidden):
        head = Head(layer.weight, layer.bias, scale, softcap, float32=keeps_float32(layer))
        return chunked_divergence(hidden[:, -width - 1:-1][mask], head, hidden_t, head_t, beta, temperature,
                                  grad_scale)

    positions = None if model_inputs else mask_positions(student, attention_mask)
    return through_output_layer(student, input_ids, attention_mask, positions, width + 1, divergence,
                                model_inputs=model_inputs)
