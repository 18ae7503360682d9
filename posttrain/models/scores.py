"""A sequence-classification model's score of each sequence (the reward model's reward).

transformers' sequence classifiers project every position's final hidden state to `num_labels` scores (`score`, a
[H -> 1] linear for a reward model) and read each row's at its last token that is not the pad token (the argmax
over positions of position * (token != pad_token_id)). Padded rows (one sequence each) are scored by the model's own
forward, its pooled logits. Padding-free, the sequences of a micro-batch run end to end in one row (position ids
restarting per sequence), and each one's score is read from the head's output at its own last non-pad token,
captured by a forward hook during the model's own forward (wrapped by DDP, FSDP, DeepSpeed or PEFT as it is); the
pooled logits join the result with weight 0, so that the backward starts from the forward's output, where FSDP1's
root wrapper waits for it.

    last  [S] long   packed rows: the flat index of the position each sequence's score is read at
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


def score_positions(tokens: np.ndarray, offsets: np.ndarray, pad_id: int) -> np.ndarray:
    """[S] flat index, in sequences laid end to end (sequence s is tokens[offsets[s]:offsets[s + 1]], none empty), of
    each sequence's score position: its last token that is not `pad_id` (its first, when every token is), as
    transformers pools."""
    real = np.where(tokens != pad_id, np.arange(len(tokens)), -1)
    last = np.maximum.reduceat(real, offsets[:-1]) if len(offsets) > 1 else np.zeros(0, dtype=np.int64)
    return np.where(last >= 0, last, offsets[:-1]).astype(np.int64)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor:
    """[S] scores (float32) of the sequences in [B, T] `input_ids`: padded rows (no `position_ids`), the model's
    pooled logits; packed rows, the head's outputs at the flat positions `last` (score_positions)."""
    if position_ids is None:
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     **sequence_kwargs(model, None, 0)).logits[:, 0].float()
    _, head = score_head(model)
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        pooled = model(input_ids=input_ids, attention_mask=attention_mask,
                       **sequence_kwargs(model, position_ids, 0)).logits
    finally:
        handle.remove()
    scores = captured[-1].reshape(-1)[last]  # [B, T, 1] -> [S]
    return (scores + 0.0 * pooled.sum()).float()
