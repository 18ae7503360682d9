"""Log-probabilities (and entropy) of chosen tokens through the output projection, without ever
materialising [rows, V] logits for more than a chunk of rows at a time.

Forward: for each chunk of rows, logits = h W^T (+ b), divided by the temperature; keep only the
log-sum-exp, the chosen token's log-prob and the entropy. Backward: recompute each chunk's logits,
d logits = (onehot(id) - softmax) * g / T, then dh = d logits W and dW = d logits^T h.
Peak extra memory is one chunk of logits (CHUNK_ELEMENTS floats) instead of rows x V.
The arithmetic is float32 whatever the autocast context: under bf16 autocast the matmul would otherwise
run in bf16 and the log-sum-exp over V entries would lose the precision log-probs need.
"""

import torch

CHUNK_ELEMENTS = 1 << 25  # 128 MiB of float32 logits per chunk: big enough for the matmul to run near peak


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _float32(weight, bias):
    """The output layer in float32, cast once per call (not once per chunk) when stored in another dtype."""
    return weight.float(), (bias.float() if bias is not None else None)


def _chunk_logits(h, weight, bias, temperature):
    """[k, V] float32 logits of k rows; `weight` and `bias` are already float32."""
    logits = h.float() @ weight.T
    if bias is not None:
        logits += bias
    if temperature != 1.0:
        logits /= temperature
    return logits


def _chunk_stats(logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
    """(log-sum-exp [k], chosen log-prob [k], entropy [k] or None) of [k, V] logits, which it overwrites."""
    chosen = logits.gather(-1, ids[:, None]).squeeze(-1)
    top = logits.amax(-1, keepdim=True)  # amax: max() also computes indices, 20x slower here
    shifted = logits.sub_(top)
    entropy = None
    if with_entropy:
        weights = shifted.exp()
        z = weights.sum(-1)
        entropy = z.log() - torch.linalg.vecdot(weights, shifted) / z  # log Z - E_p[shifted logits]
        log_z = z.log()
    else:
        log_z = shifted.exp_().sum(-1).log()
    lse = top.squeeze(-1) + log_z
    return lse, chosen - lse, entropy


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(h [M, H], weight [V, H], bias [V] | None, ids [M], temperature, with_entropy) -> (logps [M], entropy [M])."""

    @staticmethod
    def forward(ctx, h, weight, bias, ids, temperature, with_entropy):
        with torch.autocast(device_type=h.device.type, enabled=False):
            return ChunkedTokenLogprobs._forward(ctx, h, weight, bias, ids, temperature, with_entropy)

    @staticmethod
    def _forward(ctx, h, weight, bias, ids, temperature, with_entropy):
        w32, b32 = _float32(weight, bias)
        logps = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        entropy = torch.zeros_like(logps)
        lse_all = torch.empty_like(logps)
        step = _rows_per_chunk(weight.size(0))
        for start in range(0, h.size(0), step):
            rows = slice(start, start + step)
            logits = _chunk_logits(h[rows], w32, b32, temperature)  # [k, V]
            lse, chosen, ent = _chunk_stats(logits, ids[rows], with_entropy)
            lse_all[rows], logps[rows] = lse, chosen
            if ent is not None:
                entropy[rows] = ent
        ctx.save_for_backward(h, weight, bias, ids, lse_all)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        with torch.autocast(device_type=grad_logps.device.type, enabled=False):
            return ChunkedTokenLogprobs._backward(ctx, grad_logps)

    @staticmethod
    def _backward(ctx, grad_logps):
        h, weight, bias, ids, lse_all = ctx.saved_tensors
        t = ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        w32, b32 = _float32(weight, bias)
        step = _rows_per_chunk(weight.size(0))
        for start in range(0, h.size(0), step):
            rows = slice(start, start + step)
            g = grad_logps[rows].float()
            # d logp / d logits = onehot(id) - softmax; times g, and 1/T for the temperature scaling
            d = _chunk_logits(h[rows], w32, b32, t).sub_(lse_all[rows, None]).exp_().mul_(-g[:, None])
            d.scatter_add_(-1, ids[rows, None], g[:, None])
            if t != 1.0:
                d /= t
            if need_h:
                grad_h[rows] = (d @ w32).to(h.dtype)
            if need_w:
                grad_w.addmm_(d.T, h[rows].float())
            if need_b:
                grad_b += d.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None)


def chunked_token_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                           temperature: float = 1.0, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[ids] and the entropy of that distribution, row by row.

    Args:
        h: [M, H] final hidden states (the output layer's input) of the M positions that matter.
        weight: [V, H] output layer weight; bias: [V] or None.
        ids: [M] token ids whose log-prob is wanted.
        with_entropy: also compute the entropy (one more pass over each chunk); zeros otherwise.
    Returns:
        (logps [M] float32 with gradient to h, weight and bias; entropy [M] float32, no gradient).
    """
    return ChunkedTokenLogprobs.apply(h, weight, bias, ids, temperature, with_entropy)
