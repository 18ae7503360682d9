"""Turning next-token logits into a sampled token: penalties, temperature, filters, and the draw.

Sampling uses the exponential race (Gumbel-max in another guise): argmax(p / E) with E ~ Exp(1)
picks index i with probability p_i, at the cost of one pass over the vocabulary, where
`torch.multinomial` over 151,936 entries is much slower on CPU.
"""

import torch

from posttrain.generation import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already present: positive logits divided, negative multiplied.

    Args:
        logits: [N, V] float.
        seen: [N, V] bool, tokens present in the prompt or completion so far.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering (filtered entries become -inf). [N, V] -> [N, V].

    With temperature 1 and no filter, `logits` is returned as it is (no copy).
    """
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.size(-1)
    if params.top_k and params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens strictly more likely already cover top_p
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p is not None and params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(logits) and return it with its log-probability.

    Args:
        logits: [N, V] processed logits (-inf where filtered).
    Returns:
        (tokens [N] long, logprobs [N] float32).
    """
    logits = logits.float()
    top = logits.max(-1, keepdim=True).values
    weights = (logits - top).exp_()  # p * Z, in (0, 1]
    log_z = weights.sum(-1).log()  # log-sum-exp minus the max
    race = torch.empty_like(weights).exponential_(1.0, generator=generator)
    tokens = weights.div_(race).argmax(-1)  # argmax(p / E) picks i with probability p_i
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen - top.squeeze(-1) - log_z
