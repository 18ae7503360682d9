"""Turning next-token logits into a sampled token: penalties, temperature, filters, and the draw.

Sampling is inverse-CDF with one uniform number per row (see `sample`): `torch.multinomial` and the
exponential race both spend most of a CPU decode step on 151,936 random numbers per row.

Each row's uniform numbers come from a counter-based stream (`row_streams`, `stream_uniforms`): the number for
completion token t of a row depends only on the round's seed, the row's key (its index in the generation round)
and t. So a row samples the same completion whichever process, batch or server request it lands in: a run on two
processes, or through a server, generates what the one-process run does.
"""

import torch

from posttrain.generation.protocol import SamplingParams


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


# splitmix64 (Steele, Lea and Flood, 2014) on int64 tensors: multiplication wraps modulo 2**64 as on uint64, and the
# logical right shift is an arithmetic shift with the sign bits masked off
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of x + golden ratio, element-wise on int64 (bits read as uint64)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _signed(x: int) -> int:
    """x modulo 2**64 as a signed 64-bit int (what an int64 tensor can hold)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def mix64_int(x: int) -> int:
    """`mix64` on one Python int (any int, read modulo 2**64); returns the signed 64-bit result."""
    mask = (1 << 64) - 1
    z = (x + _GOLDEN) & mask
    z = ((z ^ (z >> 30)) * _MIX1) & mask
    z = ((z ^ (z >> 27)) * _MIX2) & mask
    return _signed(z ^ (z >> 31))


def row_streams(seed: int, row_keys: torch.Tensor) -> torch.Tensor:
    """The stream of each row: [N] int64 from a round's `seed` and the rows' keys ([N] int64)."""
    return mix64(row_keys * _GOLDEN + mix64_int(seed))


def stream_uniforms(streams: torch.Tensor, step: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) for token `step` of each stream: [N] int64 -> [N, 1] float64 (53 random bits)."""
    bits = _shr(mix64(streams + _signed((step + 1) * _MIX1)), 11)
    return (bits.double() * 2.0 ** -53).unsqueeze(-1)


SAMPLE_BLOCK = 2048  # vocabulary entries per block of the two-level inverse CDF


def _draw(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index i with probability weights[i] / sum(weights), per row, by a two-level inverse CDF of `uniforms`
    ([N, 1] float64 in [0, 1)).

    Each block of SAMPLE_BLOCK entries is summed (float32 is exact to ~1e-7 over a block), the block
    sums are accumulated in float64, and only the chosen block is scanned: one pass over the vocabulary,
    with tiny probabilities keeping their share. Returns (indices [N], log of the total weight [N]).
    """
    n, vocab = weights.shape
    if vocab <= 2 * SAMPLE_BLOCK:
        return _draw_one_level(weights, uniforms)
    full = vocab // SAMPLE_BLOCK * SAMPLE_BLOCK
    blocks = weights[:, :full].view(n, -1, SAMPLE_BLOCK).sum(-1)  # [N, V / block]
    if full < vocab:
        blocks = torch.cat([blocks, weights[:, full:].sum(-1, keepdim=True)], dim=1)
    cum = blocks.double().cumsum(-1)
    u = uniforms * cum[:, -1:]
    # side="right": the first block (then entry) whose cumulative weight exceeds u, never a zero-weight one
    block = torch.searchsorted(cum, u, side="right").clamp_(max=cum.size(1) - 1)  # [N, 1]
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(u))
    start = block * SAMPLE_BLOCK  # [N, 1]
    offsets = torch.arange(SAMPLE_BLOCK, device=weights.device)
    cols = (start + offsets).clamp_(max=vocab - 1)  # [N, block]
    inner = weights.gather(1, cols).masked_fill(start + offsets >= vocab, 0.0).cumsum(-1, dtype=torch.float64)
    pick = torch.searchsorted(inner, u - before, side="right").clamp_(max=SAMPLE_BLOCK - 1)
    return (start + pick).clamp_(max=vocab - 1).squeeze(-1), cum[:, -1].log().float()


def _draw_one_level(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_draw` for a small vocabulary: one float64 cumulative sum over it (a third of the two-level cost at
    V = 2,274; the two-level draw wins from about 8,192 entries)."""
    cum = weights.cumsum(-1, dtype=torch.float64)  # [N, V]
    pick = torch.searchsorted(cum, uniforms * cum[:, -1:], side="right").clamp_(max=weights.size(1) - 1)
    return pick.squeeze(-1), cum[:, -1].log().float()


def sample(logits: torch.Tensor, uniforms: torch.Tensor | None = None,
           overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(logits) and return it with its log-probability.

    Inverse-CDF sampling needs N random numbers instead of N x V: `torch.multinomial` and the
    exponential race spend most of a CPU decode step drawing 151,936 random numbers per row.

    Args:
        logits: [N, V] processed logits (-inf where filtered).
        uniforms: [N, 1] float64 in [0, 1), one per row (`stream_uniforms`); None draws them from torch's RNG.
        overwrite: the caller no longer needs `logits` (float32): exp(logits - max) is computed in place, sparing
            a fresh [N, V] tensor per token.
    Returns:
        (tokens [N] long, logprobs [N] float32).
    """
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)
    weights = logits.sub_(top).exp_() if overwrite else (logits - top).exp_()  # [N, V] in [0, 1]
    if uniforms is None:
        uniforms = torch.rand((logits.size(0), 1), dtype=torch.float64, device=logits.device)
    tokens, log_z = _draw(weights, uniforms.to(logits.device))
    # log of the chosen weight is its shifted logit to ~1e-7 (a token whose weight underflowed is never drawn)
    chosen = weights.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    return tokens, chosen - log_z
