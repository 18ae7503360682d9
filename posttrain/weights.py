"""Export a policy's weights for a generation engine, with the parameter names of the plain model."""

from typing import Iterator

import torch

from posttrain.models.loading import unwrap


def export_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every parameter and persistent buffer of the unwrapped model.

    Lazy: a generator that shares the policy's weights never consumes it, so it costs nothing there.
    """
    plain = unwrap(model)
    with torch.no_grad():
        yield from ((name, tensor.detach()) for name, tensor in plain.state_dict().items())
