"""The whole-logits path's reductions: log-probs, entropy and statistics from logits the model computed whole (where
its log-probs cannot come from its output layer in chunks: models/chunked_check.py), a chunk of rows at a time so
that the temporaries stay bounded."""

import torch

CHUNK_ELEMENTS = 1 << 25  # logits turned into log-probs at a time (128 MiB of float32), bounding temporaries


def completion_logprobs_from_logits(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float,
                                    with_entropy: bool, entropy_grad: bool = False):
    """Log-probs of the completion tokens under softmax(logits / temperature).

    Args:
        logits: [N, C, V] the logits that predict the completion tokens.
        completion_ids: [N, C] the completion tokens.
        with_entropy: also return each position's entropy (with its gradient only if `entropy_grad`).
    Returns:
        (logps [N, C] float32, entropy [N, C] float32 or None).
    """
    # No full-size copy unless needed: float32 at temperature 1 is used as it comes back.
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    flat = logits.reshape(-1, logits.size(-1))  # [N*C, V]
    ids = completion_ids.reshape(-1)
    step = max(1, CHUNK_ELEMENTS // flat.size(1))
    logps, entropies = [], []
    for start in range(0, flat.size(0), step):
        rows = flat[start:start + step]  # [k, V]
        lse = rows.logsumexp(-1)
        logps.append(rows.gather(-1, ids[start:start + step, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(lse - (rows.softmax(-1) * rows).sum(-1))
    shape = completion_ids.shape
    return torch.cat(logps).view(shape), (torch.cat(entropies).view(shape) if with_entropy else None)


def target_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, with_top1: bool,
                                with_stats: bool):
    """Log-probs of target tokens from the float32 logits [M, V] that predict them; entropy, top-1 and statistics
    without gradient.

    Args:
        logits: [M, V] float32.
        targets: [M] token ids.
    Returns:
        (logps [M] float32, entropy [M] or None, is_top1 [M] bool or None), and with `with_stats` [M, 2]: each row's
        mean logit and log sum_v p(v)^2.
    """
    step = max(1, CHUNK_ELEMENTS // logits.size(1))
    logps, entropies, tops, stats = [], [], [], []
    for start in range(0, logits.size(0), step):
        rows, ids = logits[start:start + step], targets[start:start + step]
        lse = rows.logsumexp(-1)
        chosen = rows.gather(-1, ids[:, None]).squeeze(-1)
        logps.append(chosen - lse)
        with torch.no_grad():
            if with_entropy:
                entropies.append(lse - (rows.softmax(-1) * rows).sum(-1))
            tops.append(chosen >= rows.amax(-1))
            if with_stats:
                stats.append(torch.stack([rows.mean(-1), (2 * rows).logsumexp(-1) - 2 * lse], -1))
    logps = torch.cat(logps)
    result = (logps, torch.cat(entropies) if with_entropy else None, torch.cat(tops) if with_top1 else None)
    if with_stats:
        return result + ((torch.cat(stats) if stats else logps.new_zeros((0, 2))),)
    return result
