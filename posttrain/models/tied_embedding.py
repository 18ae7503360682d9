"""A tied embedding's gradient without the dense [V, H] lookup gradient.

When the output layer shares the input embedding's weight (Qwen2.5-0.5B to 3B, Qwen3 up to 4B, Gemma, Llama 3.2 1B
and 3B), autograd's lookup backward makes a zero [V, H] gradient and adds the looked-up rows into it, and then adds that
to the output layer's [V, H] gradient: at Qwen2.5-0.5B's shape a 545 MB temporary beside the output layer's own, in
every training pass, written whole for the few hundred rows a batch looks up.

`TiedRows` does the same sum without it, for one forward and backward (a training pass):
- the embedding's output keeps its values (the module's own forward runs), but its gradient goes to `_RoutedLookup`,
  whose backward sums the looked-up rows' gradients per distinct token (in token order, as torch's dense lookup
  backward on a CPU does) and returns none for the weight;
- a hook on the weight, which autograd calls with the weight's summed incoming gradient (the output layer's) before
  it is accumulated into `.grad`, adds those sums into it in place.

The weight's `.grad` is then autograd's bit for bit on a CPU wherever the output layer's gradient arrives once a pass,
as in every posttrain trainer's pass (tests/test_tied_embedding.py: Qwen2, Gemma 3, Qwen3.5, LLaVA; SFT and GRPO
updates), across gradient accumulation and several lookups a pass (shared prompts). Where the output layer runs twice
in a pass, autograd adds a lookup's rows between its two contributions and the route after both: equal within
rounding. A bf16 run's rows are summed in float32 and rounded once, as CUDA's lookup backward sums them. It applies
only where the lookup is known (`routable`): an `nn.Embedding` (or a subclass whose forward is the lookup times its
`embed_scale`, Gemma's) without max_norm, scale_grad_by_freq or sparse gradients, whose weight trains and is the output
layer's; a check decided once per model (models/fast_paths.py) compares the module's output with the lookup it
assumes; and only on one process holding whole weights (training/sharding: `reads_gradients_in_backward`), where
nothing reads a gradient before the backward ends.

Shapes: V vocabulary rows, H hidden size, U distinct tokens of a lookup.
"""

import contextlib

import torch
import torch.nn.functional as F

from posttrain.models import fast_paths


def tied_embedding(model) -> torch.nn.Embedding | None:
    """`model`'s input embedding where the output layer shares its weight and it trains; else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    try:
        embedding, head = get_in(), get_out()
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(embedding, "weight", None)
    if head is None or weight is None or getattr(head, "weight", None) is not weight or not weight.requires_grad:
        return None
    return embedding


def routable(embedding) -> bool:
    """Whether `embedding`'s lookup is one `TiedRows` knows: a plain `nn.Embedding` lookup, or one times a scalar
    `embed_scale` (Gemma's scaled embedding), without max_norm (which writes the weight), scale_grad_by_freq or sparse
    gradients."""
    if not isinstance(embedding, torch.nn.Embedding):
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    if type(embedding).forward is torch.nn.Embedding.forward:
        return True
    scale = getattr(embedding, "embed_scale", None)
    return scale is not None and torch.as_tensor(scale).numel() == 1


def _scale(embedding):
    """The scalar the lookup's rows are multiplied by (None: a plain lookup)."""
    if type(embedding).forward is torch.nn.Embedding.forward:
        return None
    return torch.as_tensor(embedding.embed_scale).to(embedding.weight.dtype)


class _RoutedLookup(torch.autograd.Function):
    """(weight [V, H], rows [..., H]: the module's output, ids [...], the pass's TiedRows) -> a copy of rows (a tensor
    of its own, which a vision-language model may write image features into), whose backward hands the per-token sums
    of its gradient to the TiedRows and returns none for the weight."""

    @staticmethod
    def forward(ctx, weight, rows, ids, route):
        ctx.save_for_backward(ids)
        ctx.route = route
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        ctx.route.keep(ids, grad)
        return None, None, None, None


class TiedRows:
    """The route for one training pass: `with TiedRows(embedding):` around its forward and backward."""

    def __init__(self, embedding: torch.nn.Embedding):
        self.embedding = embedding
        self.weight = embedding.weight
        self.scale = _scale(embedding)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (distinct ids [U], their gradients' sums [U, H])
        self._handles = []

    def __enter__(self):
        self._handles = [self.embedding.register_forward_hook(self._route),
                         self.weight.register_hook(self._add_rows)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.pending and exc[0] is None:  # no other gradient reached the weight (the output layer unused)
            grad = self.weight.grad
            if grad is None:
                self.weight.grad = grad = torch.zeros_like(self.weight)
            self._add_rows(grad)
        self.pending.clear()
        return False

    def _route(self, module, args, output):
        """The forward hook: the module's output with its gradient routed (None: left as it is)."""
        ids = args[0] if args else None
        if not torch.is_grad_enabled() or not isinstance(ids, torch.Tensor) or not isinstance(output, torch.Tensor):
            return None
        return _RoutedLookup.apply(self.weight, output.detach(), ids, self)

    def keep(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """A lookup's backward: the gradient [..., H] of its rows, summed per distinct id in token order."""
        flat_ids, flat = ids.reshape(-1), grad.reshape(-1, grad.size(-1))
        if self.scale is not None:
            flat = flat * self.scale.to(flat.dtype)
        padding = self.embedding.padding_idx
        if padding is not None:  # the padding row gets no gradient, as in torch's lookup
            keep = flat_ids != padding
            flat_ids, flat = flat_ids[keep], flat[keep]
        distinct, where = torch.unique(flat_ids, return_inverse=True)
        # summed in float32 at least (a bf16 run's rows, as CUDA's lookup backward sums them), rounded once when added
        dtype = torch.promote_types(flat.dtype, torch.float32)
        sums = torch.zeros((distinct.numel(), flat.size(1)), dtype=dtype, device=flat.device)
        self.pending.append((distinct, sums.index_add_(0, where, flat.to(dtype))))

    def _add_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """The weight's hook: its incoming gradient (the output layer's), the kept sums added in place."""
        if not self.pending or grad is None:  # None: nothing else reached the weight; the pass's end adds the rows
            return grad
        if grad._base is not None or not grad.is_contiguous():  # not a tensor of its own: add into a copy
            grad = grad.clone()
        for distinct, sums in self.pending:
            grad.index_add_(0, distinct, sums.to(grad.dtype))
        self.pending.clear()
        return grad


def check_route(embedding) -> bool:
    """Whether `embedding`'s output, on a lookup of two ids, is the one `TiedRows` differentiates: its rows, times
    `_scale` where it has one (decided once per model: models/fast_paths.py)."""
    ids = torch.tensor([[0, min(1, embedding.num_embeddings - 1)]], device=embedding.weight.device)
    scale = _scale(embedding)
    with torch.no_grad():
        output = embedding(ids)
        rows = F.embedding(ids, embedding.weight)
        if scale is not None:
            rows = rows * scale
    return rows.dtype == output.dtype and torch.equal(rows, output)


@contextlib.contextmanager
def tied_rows(model, enabled: bool):
    """The block of one training pass (forward and backward) of `model` with its tied embedding's rows routed
    (`TiedRows`), where `enabled` and the model has a routable tied embedding; else nothing."""
    embedding = tied_embedding(model) if enabled else None
    if embedding is None or not fast_paths.decided(model, "tied_rows",
                                                   lambda: routable(embedding) and check_route(embedding)):
        yield
        return
    with TiedRows(embedding):
        yield
