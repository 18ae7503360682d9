"""Activation offloading (TRL's `activation_offloading`): the tensors autograd saves for the backward leave the
accelerator during the forward and come back when the backward uses them.

    offloader = ActivationOffloader(model)
    with offloader:                 # the training forward
        loss = ...
    loss.backward()                 # each saved tensor is copied back to its device as its node runs

A tensor moves when it lives on an accelerator (`moves`), holds at least `min_bytes`, and is not a parameter or a
view of one (those stay where the optimizer keeps them). On CUDA the host copy is pinned. On a CPU nothing moves (the
activations are in host memory already); the trainer says so once. Counters (`moved`, `returned`, `moved_bytes`)
let tests check that every offloaded tensor came back.
"""

import torch


class ActivationOffloader:
    """Args:
        model: whose parameters (and views of them) are never moved.
        min_bytes: smaller tensors stay (the copy would cost more than it saves).
        moves: which saved tensors to move; default: those not on the CPU.
    """

    def __init__(self, model: torch.nn.Module, min_bytes: int = 1024, moves=None):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.min_bytes = min_bytes
        self.moves = moves or (lambda t: t.device.type != "cpu")
        self.moved = self.returned = self.moved_bytes = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if (size < self.min_bytes or not self.moves(tensor) or tensor.layout != torch.strided
                or tensor.untyped_storage().data_ptr() in self.parameter_storages):
            return tensor
        pinned = tensor.device.type == "cuda"
        host = torch.empty_like(tensor, device="cpu", pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        self.moved += 1
        self.moved_bytes += size
        return _Offloaded(tensor.device, host)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self.returned += 1
        return packed.host.to(packed.device, non_blocking=packed.device.type == "cuda")

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False


class _Offloaded:
    """A saved tensor's host copy and the device it returns to."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor):
        self.device, self.host = device, host


class SavedBytes:
    """Counts what autograd saves for the backward inside the block: `tensors` and `bytes`, each saved tensor counted
    once per save; with `model`, its parameters (and views of them) are left out, leaving the activations. For tests
    and bench/activation_bytes.py."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self.tensors = self.bytes = 0

    def _pack(self, tensor):
        if tensor.untyped_storage().data_ptr() not in self.parameter_storages:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
