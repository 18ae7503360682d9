"""The router load-balancing loss of mixture-of-experts models, as TRL adds it to every trainer's loss.

A mixture-of-experts model of transformers (Qwen3-MoE, Mixtral, GPT-OSS, ...) computes the Switch Transformer
load-balancing loss of its routers when `output_router_logits` is on, and returns it unscaled as `aux_loss`, over the
tokens its attention mask marks real. TRL 1.16 adds `router_aux_loss_coef * aux_loss` to the policy's training loss,
scaled like one micro-batch's share of the step, and logs `aux_loss`; `router_aux_loss_coef=None` takes the model
config's coefficient (0 for a model that declares none, which turns the loss off).

Here `output_router_logits` is switched on only around the policy's loss forwards (`RouterLoss.collecting`), never
for generation (a decode step's router logits do not match its attention mask) or the reference passes, and the
model's `aux_loss` is read by a forward hook, so the log-prob passes of models/logprobs.py need no change.
"""

import contextlib

import torch

from posttrain.configs import ConfigError
from posttrain.errors import UserError
from posttrain.models.keywords import unwrap


def _text_config(model):
    config = unwrap(model).config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def router_coefficient(model, configured: float | None) -> float:
    """The coefficient the trainer applies: `configured`, else the model config's `router_aux_loss_coef` (0 when it
    has none). A non-zero coefficient for a model without routers (no `output_router_logits`) is an error."""
    text = _text_config(model)
    coef = float(getattr(text, "router_aux_loss_coef", None) or 0.0) if configured is None else float(configured)
    if coef != 0.0 and not hasattr(text, "output_router_logits"):
        raise ConfigError(f"router_aux_loss_coef={coef} asks for a router load-balancing loss, but "
                          f"{type(unwrap(model)).__name__} is not a mixture-of-experts model (its config has no "
                          "output_router_logits): remove router_aux_loss_coef.")
    return coef if hasattr(text, "output_router_logits") else 0.0


class RouterLoss:
    """The router loss of the micro-batches of a step: collected around each policy forward, added to its loss.

    Args:
        coef: the coefficient (router_coefficient); 0 turns everything here into a no-op.
    """

    def __init__(self, coef: float):
        self.coef = coef
        self._values: list[torch.Tensor] = []  # this step's aux_loss per micro-batch (detached)

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0

    @contextlib.contextmanager
    def collecting(self, model, share: float):
        """Around one micro-batch's policy forward: yields a list that afterwards holds the term to add to the loss
        (`coef * aux_loss * share`, `share` being the micro-batch's part of the step, 1 / micro-batches), or nothing
        when the loss is off. Every training forward of `model` inside the block (train mode, gradient on) counts; their
        aux losses are averaged."""
        term: list[torch.Tensor] = []
        if not self.enabled:
            yield term
            return
        plain = unwrap(model)
        seen: list[torch.Tensor] = []

        def record(module, args, output):  # a fast path's one-time check (eval mode, no gradient) is not the loss's
            if module.training and torch.is_grad_enabled():
                seen.append(getattr(output, "aux_loss", None))

        hook = plain.register_forward_hook(record)
        config, before = plain.config, getattr(plain.config, "output_router_logits", False)
        config.output_router_logits = True
        try:
            yield term
        finally:
            config.output_router_logits = before
            hook.remove()
        if not seen or any(value is None for value in seen):
            raise UserError(f"router_aux_loss_coef={self.coef} asks for the router load-balancing loss, but "
                            f"{type(plain).__name__}'s forward returned no aux_loss with output_router_logits on (its "
                            "class computes no such loss): set router_aux_loss_coef to 0.")
        aux = torch.stack([value.float() for value in seen]).mean()
        self._values.append(aux.detach())
        term.append(self.coef * share * aux)

    def metrics(self, reduce_mean) -> dict:
        """{"aux_loss": the step's mean over micro-batches and processes} (`reduce_mean`: a tensor -> its mean over
        processes), or {} when the loss is off; starts the next step's collection."""
        if not self.enabled:
            return {}
        local = torch.stack(self._values).mean() if self._values else torch.tensor(0.0)
        self._values = []
        return {"aux_loss": float(reduce_mean(local))}
