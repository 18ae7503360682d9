"""A tied input embedding's gradient handed to autograd as sparse in the training passes, on a CPU.

Where the input embedding and the output layer share one [V, H] weight (tie_word_embeddings: Qwen2.5-0.5B, Gemma,
...), a backward gives that weight two gradients: the output layer's, dense, and the lookup's. nn.Embedding's dense
backward makes a zero [V, H] tensor, adds the looked-up rows' gradients into it, and autograd adds it to the output
layer's before the weight's `.grad` receives the sum. At Qwen2.5-0.5B's shape that temporary is 545 MB of float32,
alive at the backward's peak and zero-filled and added once per embedding call (two in GRPO's shared-prompt passes).
As a sparse tensor (the looked-up rows and their gradients, [tokens, H]) autograd adds it into the output layer's
dense gradient in place: the same sum up to float32 rounding, without the temporary.

Applied only where the output layer's dense gradient is certain to be there to receive it: a plain float32 or 16-bit
CPU weight that trains, the same tensor as the model's plain Linear output layer's, whole on this process (not
DeepSpeed ZeRO-3's partitions or FSDP's shards), and gradients on. Should a backward ever give the weight the sparse
part alone, a hook makes its `.grad` dense again (optimizers take no sparse gradients), as the dense backward
would have. On CUDA the lookup's backward is left as it is (untested there), and so are the passes of rows with
extra model inputs (a vision-language model's images: models/logprobs.py): examples/vlm_colours.py's GRPO run, which
tests/test_vlm_grpo.py holds to a reward above 0.9 in 200 steps, reaches it from seed 0 only (0.73-0.78 from seeds
1-3), and with this sum's rounding at one thread it stays at 0.75 from seed 0 too: the example is first to learn from
every seed.
"""

import contextlib
import weakref

import torch

from posttrain.models.forwards import output_layer, whole_only_in_forward

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_HOOKED: dict[int, weakref.ref] = {}  # id -> the weight that carries the hook making a sparse `.grad` dense


def _tied_embedding(plain) -> torch.nn.Embedding | None:
    """`plain`'s input embedding where its gradient may be sparse (see the module's doc), else None."""
    get = getattr(plain, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    layer = output_layer(plain)
    if not isinstance(embedding, torch.nn.Embedding) or layer is None or layer.weight is not embedding.weight:
        return None
    weight = embedding.weight
    if (type(weight) not in _PLAIN or not weight.requires_grad or weight.device.type != "cpu" or weight.dim() != 2
            or whole_only_in_forward(layer)):
        return None
    return embedding


def _dense_grad(weight: torch.Tensor) -> None:
    if weight.grad is not None and weight.grad.is_sparse:
        weight.grad = weight.grad.to_dense()


def _hook_once(weight: torch.Tensor) -> None:
    hooked = _HOOKED.get(id(weight))
    if hooked is None or hooked() is not weight:  # (a tensor's == compares values: identity through its id)
        weight.register_post_accumulate_grad_hook(_dense_grad)
        key = id(weight)
        _HOOKED[key] = weakref.ref(weight, lambda _, key=key: _HOOKED.pop(key, None))


@contextlib.contextmanager
def sparse_tied_embedding_grad(plain):
    """For the block's forwards with gradient, the tied embedding's lookups give a sparse gradient; a no-op for a
    model without one."""
    embedding = _tied_embedding(plain) if torch.is_grad_enabled() else None
    if embedding is None or embedding.sparse:
        yield
        return
    _hook_once(embedding.weight)
    embedding.sparse = True
    try:
        yield
    finally:
        embedding.sparse = False
