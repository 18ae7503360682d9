"""A sequence-classification model's score of each sequence (the reward model's reward).

transformers' sequence classifiers project every position's final hidden state to `num_labels` scores (`score`, a
[H -> 1] linear for a reward model) and read each row's at its last token that is not the pad token (the argmax
over positions of position * (token != pad_token_id)). So does this module, per sequence, which also lets the
sequences of a micro-batch run end to end in one row (padding-free, position ids restarting per sequence): the
scores come from the head's output, captured by a forward hook during the model's own forward (wrapped by DDP,
FSDP, DeepSpeed or PEFT as it is), never from its pooled logits.

    last  [S] long   flat index (row * T + position) of the position each sequence's score is read at
"""

import numpy as np
import torch

from posttrain.models.forwards import sequence_kwargs
from posttrain.models.keywords import unwrap

HEAD_NAMES = ("score", "classifier")  # transformers' names for a decoder's classification head


def score_head(model) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of the model's classification head (a PEFT ModulesToSaveWrapper included), or None."""
    plain = unwrap(model)
    for name in HEAD_NAMES:
        head = getattr(plain, name, None)
        if isinstance(head, torch.nn.Module):
            return name, head
    return None


def score_positions(tokens: np.ndarray, offsets: np.ndarray, pad_id: int, row_length: int | None) -> np.ndarray:
    """[S] flat index of each sequence's score position: its last token that is not `pad_id` (its first, when every
    token is), as transformers pools. Padded (row_length T): sequence s is row s, index s * T + position;
    padding-free (None): the sequences end to end, index offsets[s] + position."""
    out = np.zeros(len(offsets) - 1, dtype=np.int64)
    for s in range(len(out)):
        real = np.flatnonzero(tokens[offsets[s]:offsets[s + 1]] != pad_id)
        position = int(real[-1]) if len(real) else 0
        out[s] = (s * row_length if row_length is not None else int(offsets[s])) + position
    return out


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, last: torch.Tensor) -> torch.Tensor:
    """[S] scores (float32) of the sequences in [B, T] `input_ids`, read at the flat positions `last`."""
    _, head = score_head(model)
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, **sequence_kwargs(model, position_ids, 0))
    finally:
        handle.remove()
    scores = captured[-1]  # [B, T, 1]
    return scores.reshape(-1)[last].float()
