"""An output layer's products over the vocabulary (the logits, and the gradients to the hidden states and to the
weight) in the run's compute dtype, with float32 results.

A language model's output layer is its widest product ([rows, H] x [H, V], V up to 262k): in IEEE float32 on a GPU
it would take several times the body's bf16 time. So on a device in LOW_PRECISION_DEVICES (CUDA), under a bf16 or
fp16 autocast, or with weights stored in bf16 or fp16, the products take inputs in that dtype and write float32
(`torch.mm(..., out_dtype=torch.float32)`: cuBLAS accumulates in float32 either way), as TRL's `lm_head` runs
under autocast. Only what follows (log-sum-exp, softmax, the chosen log-probs, the divergences) is float32
arithmetic. Elsewhere, on a CPU or in a float32 run, the products are float32 (through oneDNN on a CPU, models/onednn.py;
TF32 on CUDA when the run sets `tf32=True`).

Shapes: k rows, H hidden size, V vocabulary.
"""

import torch

from posttrain.models import onednn

# devices whose low-precision products are fast enough to take: on a CPU, float32 through oneDNN is the fast path
LOW_PRECISION_DEVICES = {"cuda"}
_LOW = (torch.bfloat16, torch.float16)

# oneDNN computes float32 logits into a new tensor of its own (it has no `out=`): the page faults of a fresh 128 MiB
# cost less than its speed-up over MKL's GEMM into a buffer only when each logit takes enough work, i.e. from this
# hidden size (768: 1.3x faster; 128: 1.4x slower, docs/performance.md)
ONEDNN_LOGITS_MIN_HIDDEN = 512


def compute_dtype(device: torch.device, weight_dtype: torch.dtype, keep_float32: bool = False) -> torch.dtype:
    """The dtype the output layer's products take on `device`: the autocast's (bf16 or fp16) when one is on there,
    else the weight's when it is bf16 or fp16, on a device in LOW_PRECISION_DEVICES; float32 otherwise, and always
    with `keep_float32` (the run's cast_lm_head_to_fp32). Read it where the caller's autocast is still on (before an
    autograd Function turns it off)."""
    if keep_float32 or device.type not in LOW_PRECISION_DEVICES:
        return torch.float32
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) in _LOW:
        return torch.get_autocast_dtype(device.type)
    return weight_dtype if weight_dtype in _LOW else torch.float32


_WIDENING_OK: dict = {}  # (device type, dtype) -> whether torch's out_dtype products run there and agree


def _widening(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.mm`/`torch.addmm` with `out_dtype=torch.float32` run on this device for `dtype` inputs (CUDA's
    cuBLAS path; the CPU has none) and agree with the product computed in float32, checked once; else each product
    is computed in `dtype` and then widened."""
    key = (device.type, dtype)
    if key not in _WIDENING_OK:
        ok = False
        try:
            a = torch.arange(12, device=device, dtype=torch.float32).view(3, 4).div_(8).to(dtype)
            b = torch.arange(8, device=device, dtype=torch.float32).view(4, 2).div_(4).to(dtype)
            want = a.float() @ b.float()
            acc = torch.ones((3, 2), device=device)
            ok = (torch.allclose(torch.mm(a, b, out_dtype=torch.float32), want)
                  and torch.allclose(torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc), want + 1))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _WIDENING_OK[key] = ok
    return _WIDENING_OK[key]


class OutputProducts:
    """One call's products with an output layer, its weight [V, H] cast once to `dtype` (from `compute_dtype`).

    Args:
        weight: [V, H] in any dtype; bias: [V] or None (added in float32).
        dtype: float32, or the bf16/fp16 the products take.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.dtype = dtype
        self.weight = weight.to(dtype)
        self.bias = bias.float() if bias is not None else None
        self.low = dtype != torch.float32
        self.widening = self.low and _widening(weight.device, dtype)

    def own_buffer(self, h: torch.Tensor) -> bool:
        """Whether `logits` wants an `out` buffer: not where oneDNN computes them into a tensor of its own (float32
        on a CPU, from ONEDNN_LOGITS_MIN_HIDDEN wide)."""
        return self.low or not (self.weight.size(1) >= ONEDNN_LOGITS_MIN_HIDDEN
                                and onednn.applies(h, self.weight, self.bias))

    def _mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """a @ b in float32: the product of the cast inputs (widened by cuBLAS, or afterwards)."""
        if not self.low:
            return torch.mm(a.float(), b, out=out) if out is not None else torch.mm(a.float(), b)
        a = a.to(self.dtype)
        if self.widening:
            if out is not None:
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            return torch.mm(a, b, out_dtype=torch.float32)
        product = torch.mm(a, b)
        return out.copy_(product) if out is not None else product.float()

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[k, V] float32 logits h W^T + b of hidden states h [k, H], into `out` ([>= k, V]) when given (else where
        oneDNN computes them, a tensor of its own)."""
        if out is None and not self.low:
            return onednn.linear(h.float(), self.weight, self.bias)
        logits = self._mm(h, self.weight.T, out[:h.size(0)] if out is not None else None)
        if self.bias is not None:
            logits += self.bias
        return logits

    def hidden_grad(self, d_logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[k, H] float32 d_logits W, from d_logits [k, V] float32."""
        return self._mm(d_logits, self.weight, out)

    def add_weight_grad(self, acc: torch.Tensor, d_logits: torch.Tensor, h: torch.Tensor) -> None:
        """acc [V, H] float32 += d_logits^T h."""
        if not self.low:
            acc.addmm_(d_logits.T, h.float())
        elif self.widening:
            torch.addmm(acc, d_logits.T.to(self.dtype), h.to(self.dtype), out_dtype=torch.float32, out=acc)
        else:
            acc += torch.mm(d_logits.T.to(self.dtype), h.to(self.dtype))
