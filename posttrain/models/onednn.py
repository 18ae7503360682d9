"""oneDNN's linear for float32 products on a CPU.

torch's `F.linear` / `torch.mm` on a CPU call MKL's GEMM. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`,
what torch's own compiler emits for a linear on CPU) computes the same product faster at the shapes a language model
runs: 2-4x for a decode step's few rows (generation/lean_decoder.py), 10-40% for a training pass's thousands of rows
(docs/performance.md has the figures). Three users:

- `linear_op()`: the op itself, when this torch has it and it agrees with `F.linear` on a probe (else None);
- `linear(x, w, b)`: one product without autograd (the chunked output layer's logits, models/chunked.py);
- `cpu_linears(model)`: for a block, every `F.linear` on plain float32 CPU tensors computes its forward through
  oneDNN (its backward stays F.linear's), for models from MIN_HIDDEN wide. Used around the model calls of the
  log-prob passes (models/logprobs.py).

The results differ from MKL's by float32 rounding (a few units in the 7th digit), as two GEMM libraries do.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from posttrain.models.loading import checkpointing

_OP = None  # None: not probed yet; False: unavailable (tests set it to turn oneDNN off)


def linear_op():
    """oneDNN's linear `(x, weight, bias, "none", [None], "")`, when this torch has it and it agrees with `F.linear`
    on a probe (with the weight as it is and packed by `torch.ops.mkldnn._reorder_linear_weight`); else None."""
    global _OP
    if _OP is None:
        _OP = False
        try:
            if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
                op = torch.ops.mkldnn._linear_pointwise
                probe = torch.Generator().manual_seed(0)
                x, w, b = (torch.randn(shape, generator=probe) for shape in ((3, 2, 24), (40, 24), (40,)))
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
                want = F.linear(x, w, b)
                if all(torch.allclose(op(x, weight, b, "none", [None], ""), want, rtol=1e-5, atol=1e-5)
                       for weight in (w, packed, w.t().contiguous().t())):
                    _OP = op
        except (AttributeError, RuntimeError):
            pass
    return _OP or None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eligible(*tensors) -> bool:
    """Plain float32 CPU tensors (no tensor subclass such as DTensor or a quantized weight; None passes) outside a
    CPU autocast, which would have F.linear compute in another dtype."""
    return (all(t is None or (type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu")
                for t in tensors)
            and not torch.is_autocast_enabled("cpu"))


def applies(*tensors) -> bool:
    """Whether `linear` on these tensors goes through oneDNN."""
    return linear_op() is not None and _eligible(*tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it applies. No gradient: for use inside autograd Functions
    and no-grad code."""
    if applies(x, weight, bias):
        return _OP(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


class _OneDnnLinear(torch.autograd.Function):
    """(x [M, K], weight [N, K], bias [N] | None) -> x weight^T + bias [M, N]: the forward through oneDNN, the
    backward F.linear's own, torch's GEMM (oneDNN's input gradient, on the transposed weight, was not faster by more
    than the noise, and its rounding depends on where the weight lies in memory: FSDP2's gathered weights got other
    gradients than the same weights unsharded). Saves what F.linear saves (x and the weight).

    Two-dimensional: oneDNN returns a view for more dimensions, and a view made inside a custom Function may not be
    modified in place (a model adding to its logits would fail), so the caller flattens and unflattens."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _OP(x, weight, bias, "none", [None], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(weight)
        if ctx.needs_input_grad[1]:
            grad_w = grad.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def _differentiable_linear(x, weight, bias):
    """F.linear through `_OneDnnLinear`, for x of any number of dimensions."""
    return _OneDnnLinear.apply(x.reshape(-1, x.size(-1)), weight, bias).view(*x.shape[:-1], weight.size(0))


class _Linears(TorchFunctionMode):
    """Sends `F.linear` calls on eligible tensors to `_OneDnnLinear`; every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], kwargs.get("weight", args[1] if len(args) > 1 else None)
            bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
            if weight is not None and weight.dim() == 2 and x.dim() >= 1 and _eligible(x, weight, bias):
                return _differentiable_linear(x, weight, bias)
        return func(*args, **kwargs)


# below this hidden size a pass's products are too small for oneDNN to save reliably what routing every call through
# Python costs: the demo's 64-wide model trained 15-25% slower with it, the 128-wide 152k benchmark model as fast, the
# 256-wide default model 15% faster in one comparison and 18% slower in the next (docs/performance.md)
MIN_HIDDEN = 512


def _hidden_size(plain) -> int:
    get = getattr(plain, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    weight = getattr(embedding, "weight", None)
    return weight.size(-1) if weight is not None and weight.dim() == 2 else 0


@contextlib.contextmanager
def cpu_linears(plain):
    """For the block, the model's float32 CPU products through oneDNN (`_Linears`). A no-op where oneDNN is missing,
    the model is not on a CPU or narrower than MIN_HIDDEN, or it checkpoints activations (their recomputation in the
    backward runs outside the block, and would take the other library's rounding)."""
    first = next(plain.parameters(), None)
    if (first is None or first.device.type != "cpu" or linear_op() is None or _hidden_size(plain) < MIN_HIDDEN
            or checkpointing(plain)):
        yield
        return
    with _Linears():
        yield
