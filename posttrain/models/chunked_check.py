"""Whether a model's log-probs may come from its output layer in chunks (models/chunked.py) rather than from its
whole logits: checked once per model.

The chunked path needs the output layer to be a plain `nn.Linear` whose output is the model's own logits (which rules
out models that post-process logits, e.g. soft-capping), and a forward that computes (almost) no logits of its own
(`logits_to_keep` under either of its names).
"""

import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import final_hidden, forward_kwargs, in_eval_mode, output_layer, whole_in_model_forward
from posttrain.models.keywords import logits_to_keep_kwarg, missing_from_forward, unwrap
from posttrain.models.loading import CHECK_ERRORS, fallback_said, raised


def fast_path_available(model) -> bool:
    """Whether the chunked path reproduces this model's logits; decided once per model object and cached (on the
    first call, a forward of `model`: under sharding a collective, which every process reaches alike). Where it does
    not, a warning says why: the logits path holds [tokens, vocabulary] logits at once."""
    return fast_paths.decided(model, "chunked_output_layer", lambda: _decide_fast_path(model))


def _decide_fast_path(model) -> bool:
    plain = unwrap(model)
    layer = output_layer(plain)
    try:
        if layer is not None and whole_in_model_forward(layer):  # FSDP1, FSDP2: gathered by the model's forward
            works = _check_in_forward_path(model, layer)
        else:  # ZeRO-3's hooks gather the weights of the plain module's parts
            works = _check_fast_path(plain)
        reason = None if works else _why_not_chunked(plain)
    except CHECK_ERRORS as err:  # no hidden states, or not the shapes we expect: the logits path
        works, reason = False, f"its one-time check raised {raised(err)}"
    if not works:
        fallback_said(plain, "log-probs come from the model's whole logits ([tokens, vocabulary] at once, as in "
                             "TRL), not from its output layer in chunks", reason)
    return works


def _why_not_chunked(plain) -> str:
    head = plain.get_output_embeddings() if hasattr(plain, "get_output_embeddings") else None
    if output_layer(plain) is None:
        return (f"its output layer is {type(head).__name__}, not a plain Linear (a LoRA adapter on it, or a custom "
                "head)")
    missing = missing_from_forward(plain, ("logits_to_keep",))
    return missing or "its logits are not its output layer's output (it changes them, as soft-capping does)"


def _check_in_forward_path(model, layer) -> bool:
    """Whether the model returns its output layer's output as its logits, unchanged (the chunked path computed as
    that layer's forward then gives the model's log-probs). One forward through `model`, FSDP1's root wrapper,
    which gathers the weights outside the decoder layers; [1, 8] token ids, the last 4 positions' logits."""
    plain = unwrap(model)
    if logits_to_keep_kwarg(plain) is None:
        return False
    seen = []
    hook = layer.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    ids = (torch.arange(1, 9) % layer.out_features).unsqueeze(0).to(next(plain.parameters()).device)
    try:
        with in_eval_mode(plain), torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           **forward_kwargs(plain, torch.ones_like(ids), 4)).logits
        return len(seen) == 1 and seen[0].shape == logits.shape and bool(torch.equal(seen[0], logits))
    finally:
        hook.remove()


def _check_fast_path(plain) -> bool:
    """Whether the output layer applied to the final hidden states gives the model's logits: [1, 8] token ids, the
    last 4 positions."""
    layer = output_layer(plain)
    if layer is None or logits_to_keep_kwarg(plain) is None:
        return False
    ids = (torch.arange(1, 9, device=layer.weight.device) % layer.out_features).unsqueeze(0)
    mask = torch.ones_like(ids)
    with in_eval_mode(plain), torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask, **forward_kwargs(plain, mask, 4)).logits[:, -4:]
        hidden = final_hidden(plain, ids, mask)[:, -4:]
        return bool(torch.allclose(layer(hidden).float(), logits.float(), atol=1e-5, rtol=1e-4))
