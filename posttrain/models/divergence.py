"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions (on-policy
distillation's loss), through both output layers a chunk of positions at a time: neither model's [positions, V]
logits are ever kept, on a CPU as on a GPU.

Per position, with z = transform(h W^T + b) (the model's own logit scale and soft-capping: scale * z, then
softcap * tanh(z / softcap)) and the temperature T:

    p_s = softmax(z_s / T)        p_t = softmax(z_t / T)
    beta = 0      KL(p_t || p_s)                                   (forward KL)
    beta = 1      KL(p_s || p_t)                                   (reverse KL)
    otherwise     beta KL(p_t || m) + (1 - beta) KL(p_s || m),     m = (1 - beta) p_s + beta p_t

as TRL 1.16's DistillationTrainer defines it (no T^2 factor), and the student's entropy H(p_s). Only the student
gets a gradient, d div / d u with u = z_s / T:

    beta = 0      p_s - p_t
    beta = 1      p_s (log p_s - log p_t - div)
    otherwise     (1 - beta) p_s (log p_s - log m - KL(p_s || m))

then through the temperature and the transform to the student's logits, and dh = dz W, dW = dz^T h, db = sum dz.

Forward: for each chunk of positions, both log-softmaxes in workspace buffers, the divergence and the entropy, and
the per-position term the gradient needs (the divergence, or KL(p_s || m) for the JSD). When the caller announces the
gradient its loss gives every position (`grad_scale`: a loss of sum(div) / N gives 1 / N), the chunk's student
gradients are computed there too, and the backward only scales them: three products over V per chunk instead of
five. Otherwise (or when the incoming gradient is not the same at every position) the backward recomputes each
chunk's logits. Peak extra memory: three [rows, V] float32 buffers of CHUNK_ELEMENTS (four for a soft-capped
student's gradient in the forward), whatever the sequence length.
"""

import math

import torch

from posttrain.models.output_products import OutputProducts, compute_dtype

CHUNK_ELEMENTS = 1 << 23  # 32 MiB of float32 logits per buffer: at 16 MiB the benchmark's step took 17% longer


class Head:
    """An output layer as the divergence reads it: weight [V, H], bias [V] or None, the logit scale and the final
    soft-capping (None: none) the model applies to its logits; `float32`: its products stay float32 on a GPU too
    (cast_lm_head_to_fp32's layer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0,
                 softcap: float | None = None, float32: bool = False):
        self.weight, self.bias, self.scale, self.softcap = weight, bias, float(scale), softcap
        self.float32 = float32

    def logits(self, h: torch.Tensor, products: OutputProducts) -> torch.Tensor:
        """[r, V] float32, the transformed logits z of hidden states [r, H] (`products`: this layer's)."""
        # into a tensor of its own, the product the forward's buffers get (oneDNN's would round otherwise)
        z = products.logits(h, h.new_empty((h.size(0), products.weight.size(0)), dtype=torch.float32))
        z = z * self.scale if self.scale != 1.0 else z
        return self.softcap * torch.tanh(z / self.softcap) if self.softcap else z

    def slope(self, z: torch.Tensor) -> torch.Tensor | float:
        """d z / d (h W^T + b) at transformed logits z: the scale, times 1 - tanh^2 under soft-capping."""
        if not self.softcap:
            return self.scale
        return self.scale * (1 - (z / self.softcap) ** 2)


def _log_probs(head: Head, h: torch.Tensor, products: OutputProducts,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    z = head.logits(h, products)
    return z, torch.log_softmax(z / temperature, dim=-1)


def _grad_u(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float, aux: torch.Tensor) -> torch.Tensor:
    """[r, V] d div / d u, u = z_s / T (the module's docstring)."""
    ps = log_ps.exp()
    if beta == 0.0:
        return ps - log_pt.exp()
    if beta == 1.0:
        return ps * (log_ps - log_pt - aux[:, None])
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    return (1 - beta) * ps * (log_ps - log_m - aux[:, None])


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[r] sum over the vocabulary of a * b ([r, V] each): a dot per row makes no [r, V] temporary (vecdot and
    (a * b).sum make one; a batched bmm is 10x slower on a CPU)."""
    return torch.stack([x @ y for x, y in zip(a, b)]) if a.size(0) else a.new_zeros(0)


def _log_softmax_into(head: Head, h: torch.Tensor, products: OutputProducts, temperature: float, out: torch.Tensor,
                      probs: torch.Tensor, slope: torch.Tensor | None = None) -> torch.Tensor:
    """[r, V] log softmax(transform(h W^T + b) / T) written into `out` and the softmax itself into `probs` (workspace
    buffers); with `slope` (another one, for a soft-capped head) the transform's derivative d z / d (h W^T + b)."""
    z = products.logits(h, out)
    if head.scale != 1.0:
        z *= head.scale
    if head.softcap:
        z.div_(head.softcap).tanh_()
        if slope is not None:  # scale * (1 - tanh^2)
            torch.mul(z, z, out=slope[:h.size(0)]).neg_().add_(1.0).mul_(head.scale)
        z.mul_(head.softcap)
    if temperature != 1.0:
        z /= temperature
    z.sub_(z.amax(dim=-1, keepdim=True))  # max, exp, sum: 2x logsumexp's speed on a CPU, and the exp serves twice
    e = torch.exp(z, out=probs[:h.size(0)])
    total = e.sum(dim=-1, keepdim=True)
    e.div_(total)
    return z.sub_(total.log_())


def _chunk_terms(log_ps, ps, log_pt, beta: float, with_grad: bool):
    """(divergence [r], entropy [r], aux [r], d div / d u [r, V] or None) of one chunk, u = z_s / T, from the
    student's log-probs and probabilities and the teacher's log-probs. Overwrites log_pt; d div / d u, when asked
    for, is left in its buffer."""
    entropy = -_row_dot(ps, log_ps)
    if beta == 0.0:  # KL(p_t || p_s) = sum p_t (log p_t - log p_s); d/du = p_s - p_t
        diff = log_pt - log_ps  # one [r, V] temporary: log_pt is needed for p_t below
        div = _row_dot(log_pt.exp_(), diff)
        return div, entropy, div, (torch.sub(ps, log_pt, out=log_pt) if with_grad else None)
    if beta == 1.0:  # KL(p_s || p_t); d/du = p_s (log p_s - log p_t - div)
        diff = torch.sub(log_ps, log_pt, out=log_pt)
        div = _row_dot(ps, diff)
        return div, entropy, div, (diff.sub_(div[:, None]).mul_(ps) if with_grad else None)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    kl_teacher = _row_dot(log_pt.exp(), log_pt - log_m)
    diff = torch.sub(log_ps, log_m, out=log_pt)
    kl_student = _row_dot(ps, diff)
    div = beta * kl_teacher + (1 - beta) * kl_student
    grad = diff.sub_(kl_student[:, None]).mul_(ps).mul_(1 - beta) if with_grad else None
    return div, entropy, kl_student, grad


def _zeros32(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device)


class _ChunkedDivergence(torch.autograd.Function):
    """Forward: each chunk's two log-softmaxes in workspace buffers, the divergence and entropy by a dot per row.
    With `grad_scale` (the caller's d loss / d div, the same at every position), the student's gradients are computed
    from each chunk while it is in memory, and the backward, given that gradient, only scales them: no chunk is
    recomputed (three products over V per chunk instead of five). Any other incoming gradient recomputes."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, student: Head, teacher: Head, beta: float, temperature: float,
                grad_scale):
        # the products' dtypes are read while the caller's autocast is on; the arithmetic after them is float32
        ctx.dtypes = (compute_dtype(h_s.device, w_s.dtype, student.float32),
                      compute_dtype(h_t.device, w_t.dtype, teacher.float32))
        with torch.autocast(device_type=h_s.device.type, enabled=False):
            return _ChunkedDivergence._forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, student, teacher, beta, temperature,
                                               grad_scale)

    @staticmethod
    def _forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, student: Head, teacher: Head, beta: float, temperature: float,
                 grad_scale):
        rows = max(1, CHUNK_ELEMENTS // max(w_s.size(0), 1))
        ps, pt = OutputProducts(w_s, b_s, ctx.dtypes[0]), OutputProducts(w_t, b_t, ctx.dtypes[1])
        n, vocab = h_s.size(0), w_s.size(0)
        width = min(rows, max(n, 1))
        with_slope = bool(student.softcap) and grad_scale is not None  # the soft-cap's derivative, for the gradient
        buffers = [torch.empty((width, vocab), dtype=torch.float32, device=h_s.device)
                   for _ in range(3 + with_slope)]
        div = h_s.new_zeros(n, dtype=torch.float32)
        aux, entropy = torch.zeros_like(div), torch.zeros_like(div)
        grads = None
        if grad_scale is not None:
            grads = (_zeros32(h_s) if ctx.needs_input_grad[0] else None,
                     _zeros32(w_s) if ctx.needs_input_grad[1] else None,
                     _zeros32(b_s) if b_s is not None and ctx.needs_input_grad[2] else None)
        for start in range(0, n, rows):
            chunk = slice(start, min(start + rows, n))
            h = h_s[chunk].float()
            slope = buffers[3] if with_slope else None
            # the teacher's first, its exp in the probabilities' buffer (no [rows, V] temporary), then the student's
            log_pt = _log_softmax_into(teacher, h_t[chunk].float(), pt, temperature, buffers[1], buffers[2])
            log_ps = _log_softmax_into(student, h, ps, temperature, buffers[0], buffers[2], slope)
            probs = buffers[2][:h.size(0)]
            div[chunk], entropy[chunk], aux[chunk], du = _chunk_terms(log_ps, probs, log_pt, beta, grads is not None)
            if grads is not None:
                # d div / d u -> d loss / d (h W^T + b): the incoming gradient, 1 / T and the transform's slope
                dz = du.mul_(grad_scale / temperature * (1.0 if slope is not None else student.scale))
                if slope is not None:
                    dz.mul_(slope[:dz.size(0)])
                if grads[0] is not None:
                    ps.hidden_grad(dz, out=grads[0][chunk])
                if grads[1] is not None:
                    ps.add_weight_grad(grads[1], dz, h)
                if grads[2] is not None:
                    grads[2].add_(dz.sum(0))
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, aux)
        ctx.student, ctx.teacher, ctx.beta, ctx.temperature, ctx.rows = student, teacher, beta, temperature, rows
        ctx.grads, ctx.grad_scale = grads, grad_scale
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_div, _):
        with torch.autocast(device_type=grad_div.device.type, enabled=False):
            return _ChunkedDivergence._backward(ctx, grad_div)

    @staticmethod
    def _backward(ctx, grad_div):
        h_s, w_s, b_s, h_t, w_t, b_t, aux = ctx.saved_tensors
        if ctx.grads is not None and grad_div.numel() and bool((grad_div == grad_div[0]).all()):
            factor = float(grad_div[0]) / ctx.grad_scale  # the gradient is linear in the incoming one
            grads, ctx.grads = ctx.grads, None
            out = [None if g is None else (g if factor == 1.0 else g * factor).to(like.dtype)
                   for g, like in zip(grads, (h_s, w_s, b_s))]
            return (*out, None, None, None, None, None, None, None, None)
        student, teacher, beta, temperature = ctx.student, ctx.teacher, ctx.beta, ctx.temperature
        ps, pt = OutputProducts(w_s, b_s, ctx.dtypes[0]), OutputProducts(w_t, b_t, ctx.dtypes[1])
        grad_h = _zeros32(h_s) if ctx.needs_input_grad[0] else None
        grad_w = _zeros32(w_s) if ctx.needs_input_grad[1] else None
        grad_b = _zeros32(b_s) if b_s is not None and ctx.needs_input_grad[2] else None
        n = h_s.size(0)
        for start in range(0, n, ctx.rows):
            chunk = slice(start, min(start + ctx.rows, n))
            g = grad_div[chunk].float()
            if not bool((g != 0).any()):
                continue  # masked positions: no gradient to recompute
            h = h_s[chunk].float()
            z, log_ps = _log_probs(student, h, ps, temperature)
            _, log_pt = _log_probs(teacher, h_t[chunk].float(), pt, temperature)
            dz = _grad_u(log_ps, log_pt, beta, aux[chunk]) * (g[:, None] / temperature) * student.slope(z)
            if grad_h is not None:
                grad_h[chunk] = ps.hidden_grad(dz)
            if grad_w is not None:
                ps.add_weight_grad(grad_w, dz, h)
            if grad_b is not None:
                grad_b += dz.sum(0)
        cast = (lambda grad, like: grad.to(like.dtype) if grad is not None else None)
        return (cast(grad_h, h_s), cast(grad_w, w_s), cast(grad_b, b_s) if b_s is not None else None,
                None, None, None, None, None, None, None, None)


def chunked_divergence(student_hidden: torch.Tensor, student: Head, teacher_hidden: torch.Tensor, teacher: Head,
                       beta: float, temperature: float = 1.0, grad_scale: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence [N] float32, student entropy [N] float32 without gradient) at N positions (the module's
    docstring).

    Args:
        student_hidden: [N, Hs] the student's final hidden states at the positions (its gradient flows back).
        student: the student's output layer (its weight and bias get gradients).
        teacher_hidden: [N, Ht] the teacher's, at the same positions (no gradient; its width may differ).
        teacher: the teacher's output layer, over the same vocabulary.
        beta: 0 forward KL, 1 reverse KL, between them the generalized JSD.
        temperature: both distributions are softmax(z / temperature).
        grad_scale: the gradient the loss will give every position's divergence (a loss of sum(div) / N: 1 / N),
            when the caller knows it: the student's gradients are then computed in the forward (exact for any
            incoming gradient: another one is recomputed).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} is outside [0, 1]")
    if student.weight.size(0) != teacher.weight.size(0):
        raise ValueError(f"the student's vocabulary ({student.weight.size(0)}) is not the teacher's "
                         f"({teacher.weight.size(0)})")
    return _ChunkedDivergence.apply(student_hidden, student.weight, student.bias, teacher_hidden.detach(),
                                    teacher.weight.detach(),
                                    teacher.bias.detach() if teacher.bias is not None else None, student, teacher,
                                    float(beta), float(temperature),
                                    None if grad_scale is None else float(grad_scale))
