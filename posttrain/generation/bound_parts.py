"""A decoder layer's parts bound once per decode as plain calls on their tensors (generation/lean_decoder.py).

For a small model a decode step is mostly per-call overhead: a float32 Linear, RMSNorm or SiLU becomes a direct call
(`direct`), q/k/v and gate/up each one product on weights concatenated once (`concatenated`), the residual adds go
inside the products (`plus`), and on a CPU the float32 products run through oneDNN's linear on weights packed once per
decode (`Packer`). Anything else (LoRA layers, other dtypes) stays the module itself.
"""

import torch
import torch.nn.functional as F

from posttrain.models.loading import class_before_fully_shard
from posttrain.models.onednn import linear_op


class Packer:
    """Float32 weights as oneDNN's linear reads them fastest: packed for `rows` rows (a copy made once per decode)
    while the copies total at most `budget` bytes (lean_decoder's PACKED_COPY_BUDGET), as they are (read in place)
    beyond it."""

    def __init__(self, rows: int, budget: int):
        self.rows, self.left = rows, budget

    def fits(self, weights) -> bool:
        """Whether packed copies of these weights fit in what is left of the budget."""
        return sum(w.nbytes for w in weights) <= self.left

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.nbytes > self.left:
            return weight
        self.left -= weight.nbytes
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.rows)


def linear(weight: torch.Tensor, bias, packer):
    """`x -> F.linear(x, weight, bias)` for a float32 weight: through oneDNN when `packer` is given."""
    if packer is None:
        return lambda x: F.linear(x, weight, bias)
    op, weight = linear_op(), packer(weight)
    return lambda x: op(x, weight, bias, "none", [None], "")


def direct(module, packer=None):
    """A plain function computing `module(x)`, bound once per decode: a float32 `nn.Linear`, RMSNorm or SiLU
    becomes a direct call on its tensors, skipping nn.Module's call and attribute machinery (about 10% of a
    small model's decode step), a Linear through oneDNN when `packer` is given; anything else (LoRA layers,
    other dtypes) stays the module itself."""
    weight = getattr(module, "weight", None)
    if plain_linear(module):
        return linear(weight, module.bias, packer)
    eps = getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and eps is not None and weight.dtype == torch.float32:
        shape = weight.shape
        return lambda x: F.rms_norm(x, shape, weight, eps)
    if type(module) is torch.nn.SiLU:
        return F.silu
    return module


def plain_linear(module) -> bool:
    """A float32 nn.Linear, also as FSDP2's `fully_shard` retypes it (whole for the decode: `whole_weights`)."""
    return linear_class(module) and module.weight.dtype == torch.float32


def linear_class(module) -> bool:
    return torch.nn.Linear in (type(module), class_before_fully_shard(type(module)))


def concatenated(modules, fuse: bool, packer=None):
    """`x -> cat([m(x) for m in modules], -1)`. For plain float32 Linears, one product with the weights (and biases)
    concatenated once per decode (one kernel instead of three for q/k/v) when `fuse`, or when they will be packed
    (the packed copy is made from the concatenation, which is then dropped: no more memory than packing each)."""
    if all(plain_linear(m) for m in modules) and (
            fuse or (packer is not None and packer.fits([m.weight for m in modules]))):
        weight, bias = torch.cat([m.weight for m in modules]), None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])
        return linear(weight, bias, packer)
    calls = [direct(m, packer) for m in modules]
    return lambda x: torch.cat([call(x) for call in calls], dim=-1)


def plus(module, packer=None, fuse_add: bool = True):
    """`(x, y) -> x + module(y)`; for a bias-free float32 Linear one product that adds into its output (oneDNN's
    fused add with `packer`, else `addmm`) when `fuse_add` (not under an autocast, where the sum must stay in the
    residual stream's float32, as the model's own `x + module(y)` keeps it)."""
    if plain_linear(module) and module.bias is None and fuse_add:
        if packer is not None:
            op, weight = linear_op(), packer(module.weight)
            return lambda x, y: op.binary(y.flatten(0, -2), x.flatten(0, -2), weight, None, "add").view(x.shape)
        weight_t = module.weight.T
        return lambda x, y: torch.addmm(x.flatten(0, -2), y.flatten(0, -2), weight_t).view(x.shape)
    call = direct(module, packer)
    return lambda x, y: x + call(y)


def fused_bytes(layers) -> int:
    """Bytes that concatenated q/k/v and gate/up weights of every layer would take."""
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    total = 0
    for layer in layers:
        for dotted in parts:
            module = layer.get_submodule(dotted)
            weight = getattr(module, "weight", None)
            total += weight.numel() * weight.element_size() if weight is not None else 0
    return total


class BoundLayer:
    """One decoder layer's parts as direct calls (see `direct`); q/k/v and gate/up each as one product when
    `fuse` (small models, where a decode step is mostly per-kernel overhead) or when their weights are packed."""

    def __init__(self, layer, fuse: bool, packer=None, fuse_add: bool = True):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in, self.norm_mid = direct(layer.input_layernorm), direct(layer.post_attention_layernorm)
        self.qkv = concatenated((attn.q_proj, attn.k_proj, attn.v_proj), fuse, packer)  # [.., (h + 2k) * D]
        self.o_plus = plus(attn.o_proj, packer, fuse_add)
        q_norm = getattr(attn, "q_norm", None)  # Qwen3-style per-head norms
        self.q_norm = direct(q_norm) if q_norm is not None else None
        self.k_norm = direct(attn.k_norm) if q_norm is not None else None
        self.gate_up = concatenated((mlp.gate_proj, mlp.up_proj), fuse, packer)  # [.., 2 I]
        self.down_plus = plus(mlp.down_proj, packer, fuse_add)
        self.act = direct(mlp.act_fn)


def rotate_half_matrix(head_dim: int, dtype, device) -> torch.Tensor:
    """R [D, D] with x @ R = cat(-x[D/2:], x[:D/2]) exactly (one signed 1 per column)."""
    half = head_dim // 2
    r = torch.zeros((head_dim, head_dim), dtype=dtype, device=device)
    r[torch.arange(half, head_dim), torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half, head_dim)] = 1.0
    return r
