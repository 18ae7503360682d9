"""Log-probabilities (and entropy) of chosen tokens through the output projection, without ever
materialising [rows, V] logits for more than a chunk of rows at a time.

Forward: for each chunk of rows, logits = h W^T (+ b), divided by the temperature; keep only the
log-sum-exp, the chosen token's log-prob and the entropy. Backward: recompute each chunk's logits,
d logits = (onehot(id) - softmax) * g / T, then dh = d logits W and dW = d logits^T h.
Peak extra memory is one chunk of logits (CHUNK_ELEMENTS floats) instead of rows x V.

Predicted gradient: when the caller can say, at forward time, what the gradient of the loss with
respect to each log-prob will be (`predict_grad`; GRPO's token-level losses can, since each token's
term depends on its own log-prob only), the forward also computes dh and dW from each chunk's logits
while they are in memory, and the backward has no logits to recompute: three products over V per
chunk instead of four. The backward compares the gradient it receives with the prediction, and rows
where they differ get the difference through the recomputing path, so the result is exact whatever
the prediction (gradients are linear in g).

The products over V take the run's compute dtype on CUDA (bf16 or fp16 inputs, float32 results) and float32
elsewhere (models/output_products.py); everything after them is float32 arithmetic whatever the autocast: the
log-sum-exp over V entries needs that precision.
"""

from typing import Callable

import torch

from posttrain.models.output_products import OutputProducts, compute_dtype

CHUNK_ELEMENTS = 1 << 25  # 128 MiB of float32 logits per chunk: big enough for the matmul to run near peak

# (row slice, log-probs of those rows [k]) -> predicted d loss / d log-prob of those rows [k]
GradPredictor = Callable[[slice, torch.Tensor], torch.Tensor]


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _workspace(rows: int, vocab: int, device, count: int) -> list[torch.Tensor]:
    """`count` [rows, V] float32 buffers that every chunk of a call reuses (a view of the first k rows for a
    shorter last chunk). A fresh 128 MiB tensor per chunk costs page faults on CPU (the allocator hands large
    blocks back to the OS), which made a chunk's logits product and exp about 1.6 and 3.5 times slower."""
    return [torch.empty((rows, vocab), dtype=torch.float32, device=device) for _ in range(count)]


def _chunk_logits(h, products: OutputProducts, temperature, out: torch.Tensor | None):
    """[k, V] float32 logits of k rows, written into `out` ([>= k, V]), or by oneDNN into a new tensor when `out` is
    None (`products.own_buffer` says which)."""
    logits = products.logits(h, out)
    if temperature != 1.0:
        logits /= temperature
    return logits


def _chunk_stats(logits: torch.Tensor, ids: torch.Tensor, spare: torch.Tensor | None,
                 stats: torch.Tensor | None = None):
    """Statistics of [k, V] logits, which it overwrites with logits - max.

    With a `spare` buffer ([>= k, V]) the entropy is computed too, and exp(logits - max) goes into the spare;
    without one, into `logits` itself. With `stats` ([k, 2]) it receives each row's mean logit (over the vocabulary)
    and log sum_v p(v)^2.
    Returns (log-sum-exp [k], chosen log-prob [k], entropy [k] or None, exp(logits - max) [k, V], its row sums [k],
    whether the chosen token has the largest logit [k]).
    """
    k = logits.size(0)
    chosen = logits.gather(-1, ids[:, None]).squeeze(-1)
    top = logits.amax(-1, keepdim=True)  # amax: max() also computes indices, 20x slower here
    is_top = chosen >= top.squeeze(-1)
    shifted = logits.sub_(top)
    if stats is not None:
        stats[:, 0] = top.squeeze(-1) + shifted.mean(-1)
    entropy = None
    if spare is not None:
        weights = torch.exp(shifted, out=spare[:k])
        z = weights.sum(-1)
        # log Z - E_p[shifted logits]; a batched dot (bmm) makes no [k, V] temporary, unlike vecdot
        entropy = z.log() - torch.bmm(weights.unsqueeze(1), shifted.unsqueeze(2)).view(k) / z
    else:
        weights = shifted.exp_()
        z = weights.sum(-1)
    lse = top.squeeze(-1) + z.log()
    if stats is not None:  # log sum p^2 = log sum exp(2 shifted) - 2 log z
        stats[:, 1] = torch.bmm(weights.unsqueeze(1), weights.unsqueeze(2)).view(k).log() - 2 * z.log()
    return lse, chosen - lse, entropy, weights, z, is_top


class _Grads:
    """Gradients of (h, weight, bias) accumulated chunk by chunk from d logits."""

    def __init__(self, h, weight, bias, needs):
        need_h, need_w, need_b = needs[0], needs[1], bias is not None and needs[2]
        self.h = torch.zeros_like(h) if need_h else None
        self.w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        self.b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None

    def add(self, rows, d_logits, h_rows, products: OutputProducts):
        """Accumulate one chunk: `rows` indexes h (a slice or an index tensor), d_logits is [k, V] float32."""
        if self.h is not None:
            self.h[rows] += products.hidden_grad(d_logits).to(self.h.dtype)
        if self.w is not None:
            products.add_weight_grad(self.w, d_logits, h_rows)
        if self.b is not None:
            self.b += d_logits.sum(0)

    def result(self, weight, bias):
        return (self.h, self.w.to(weight.dtype) if self.w is not None else None,
                self.b.to(bias.dtype) if self.b is not None else None)


def _d_logits(probs: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, temperature: float) -> torch.Tensor:
    """d loss / d logits = (onehot(id) - softmax) * g / T, from [k, V] softmax probabilities (overwritten)."""
    d = probs.mul_(-g[:, None])
    d.scatter_add_(-1, ids[:, None], g[:, None])
    if temperature != 1.0:
        d /= temperature
    return d


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(h [M, H], weight [V, H], bias [V] | None, ids [M], temperature, with_entropy, predict_grad, entropy_grad,
    with_stats) -> (logps [M], entropy [M], is_top1 [M] bool: the chosen token has the largest logit, stats [M, 2]:
    mean logit and log sum_v p(v)^2, zeros unless with_stats)."""

    @staticmethod
    def forward(ctx, h, weight, bias, ids, temperature, with_entropy, predict_grad, entropy_grad=False,
                with_stats=False, float32_products=False):
        # read while the caller's autocast is on
        ctx.product_dtype = compute_dtype(h.device, weight.dtype, float32_products)
        with torch.autocast(device_type=h.device.type, enabled=False):
            return ChunkedTokenLogprobs._forward(ctx, h, weight, bias, ids, temperature, with_entropy, predict_grad,
                                                 entropy_grad, with_stats)

    @staticmethod
    def _forward(ctx, h, weight, bias, ids, temperature, with_entropy, predict_grad, entropy_grad, with_stats):
        products = OutputProducts(weight, bias, ctx.product_dtype)
        logps = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        entropy = torch.zeros_like(logps)
        lse_all = torch.empty_like(logps)
        top1 = torch.empty(h.size(0), dtype=torch.bool, device=h.device)
        stats = torch.zeros((h.size(0), 2), dtype=torch.float32, device=h.device)
        predicted = torch.zeros_like(logps) if predict_grad is not None else None
        grads = _Grads(h, weight, bias, ctx.needs_input_grad) if predict_grad is not None else None
        step = max(1, min(_rows_per_chunk(weight.size(0)), h.size(0)))
        own = products.own_buffer(h)
        buffers = _workspace(step, weight.size(0), h.device, own + int(with_entropy))
        for start in range(0, h.size(0), step):
            rows = slice(start, start + step)
            logits = _chunk_logits(h[rows], products, temperature, buffers[0] if own else None)  # [k, V]
            lse, chosen, ent, weights, z, is_top = _chunk_stats(logits, ids[rows], buffers[-1] if with_entropy else None,
                                                                stats[rows] if with_stats else None)
            lse_all[rows], logps[rows], top1[rows] = lse, chosen, is_top
            if ent is not None:
                entropy[rows] = ent
            if grads is not None:
                g = predict_grad(rows, chosen).float()
                predicted[rows] = g
                grads.add(rows, _d_logits(weights.div_(z[:, None]), ids[rows], g, temperature), h[rows], products)
            del logits, weights  # a chunk's logits tensor of its own (oneDNN's) is freed before the next one is made
        ctx.save_for_backward(h, weight, bias, ids, lse_all, predicted, entropy if entropy_grad else None)
        ctx.temperature = temperature
        ctx.grads = grads
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(top1, stats)
        return logps, entropy, top1, stats

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, grad_top1=None, grad_stats=None):
        with torch.autocast(device_type=grad_logps.device.type, enabled=False):
            return ChunkedTokenLogprobs._backward(ctx, grad_logps, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logps, grad_entropy):
        h, weight, bias, ids, lse_all, predicted, entropy = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        grad_logps = grad_logps.float()
        grad_entropy = grad_entropy.float() if ctx.entropy_grad and grad_entropy is not None else None
        if grads is None:
            grads = _Grads(h, weight, bias, ctx.needs_input_grad)
            rows = torch.arange(h.size(0), device=h.device)
        else:  # only what the prediction missed (the entropy's gradient is never predicted)
            grad_logps = grad_logps - predicted
            missed = grad_logps != 0 if grad_entropy is None else (grad_logps != 0) | (grad_entropy != 0)
            rows = missed.nonzero().squeeze(1)
        _recompute_into(grads, OutputProducts(weight, bias, ctx.product_dtype), h, ids, lse_all, grad_logps, rows,
                        ctx.temperature, grad_entropy, entropy)
        return (*grads.result(weight, bias), None, None, None, None, None, None, None)


def _recompute_into(grads: _Grads, products: OutputProducts, h, ids, lse_all, grad_logps, rows: torch.Tensor,
                    temperature, grad_entropy=None, entropy=None):
    """Add the gradient of sum(grad_logps * logps) (+ sum(grad_entropy * entropy)) over `rows` (indices into h) to
    `grads`, recomputing logits.

    With s = logits / T and p = softmax(s): d logp_id / ds = onehot(id) - p, and d H / ds = -p (log p + H).
    """
    if rows.numel() == 0:
        return
    vocab = products.weight.size(0)
    step = max(1, min(_rows_per_chunk(vocab), rows.numel()))
    own = products.own_buffer(h)
    buffers = _workspace(step, vocab, h.device, own + int(grad_entropy is not None))
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        h_rows = h[idx]
        log_p = _chunk_logits(h_rows, products, temperature, buffers[0] if own else None).sub_(lse_all[idx, None])
        if grad_entropy is None:
            d = _d_logits(log_p.exp_(), ids[idx], grad_logps[idx], temperature)
        else:
            probs = torch.exp(log_p, out=buffers[-1][:idx.numel()])
            # p * (g_logp + g_H (log p + H)), negated, plus g_logp at the chosen token
            coeff = log_p.add_(entropy[idx, None]).mul_(grad_entropy[idx, None]).add_(grad_logps[idx, None])
            d = coeff.mul_(probs).neg_()
            d.scatter_add_(-1, ids[idx, None], grad_logps[idx, None])
            if temperature != 1.0:
                d /= temperature
        grads.add(idx, d, h_rows, products)
        log_p = d = coeff = None  # as in the forward (all three name one tensor)


def chunked_token_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                           temperature: float = 1.0, with_entropy: bool = True,
                           predict_grad: GradPredictor | None = None, entropy_grad: bool = False,
                           with_top1: bool = False, with_stats: bool = False,
                           float32_products: bool = False) -> tuple[torch.Tensor, ...]:
    """log softmax(h W^T / T)[ids] and the entropy of that distribution, row by row.

    Args:
        h: [M, H] final hidden states (the output layer's input) of the M positions that matter.
        weight: [V, H] output layer weight; bias: [V] or None.
        ids: [M] token ids whose log-prob is wanted.
        with_entropy: also compute the entropy (one more pass over each chunk); zeros otherwise.
        predict_grad: optional (row slice, log-probs of those rows) -> the d loss / d log-prob that the backward
            is expected to receive for them. A right prediction saves recomputing the logits in the backward; a
            wrong one costs a recompute of the rows it got wrong, never correctness.
        entropy_grad: the entropy carries a gradient too (an entropy bonus in the loss); its rows are recomputed in
            the backward.
        with_top1: also return whether each chosen token has the largest logit (token accuracy; a tie counts).
        with_stats: also return [M, 2] statistics of each row (no gradient): its mean logit over the vocabulary
            (TRL's logits/* metrics) and log sum_v p(v)^2 (WPO's weights).
        float32_products: the products over V in float32 even where they would take the compute dtype
            (cast_lm_head_to_fp32's layer, loading.keeps_float32).
    Returns:
        (logps [M] float32 with gradient to h, weight and bias; entropy [M] float32, with gradient only when
        entropy_grad), then with `with_top1` is_top1 [M] bool, then with `with_stats` the statistics.
    """
    logps, entropy, top1, stats = ChunkedTokenLogprobs.apply(h, weight, bias, ids, temperature,
                                                             with_entropy or entropy_grad, predict_grad, entropy_grad,
                                                             with_stats, float32_products)
    return (logps, entropy) + ((top1,) if with_top1 else ()) + ((stats,) if with_stats else ())
