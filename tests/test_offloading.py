"""Activation checkpointing and offloading: what autograd saves for the backward falls as expected, gradients equal
the plain run's bit for bit, and every offloaded tensor comes back."""

import logging

import pytest
import torch

from posttrain.models import token_logprobs
from posttrain.models.loading import enable_checkpointing
from posttrain.testing import tiny_model
from posttrain.training.offloading import ActivationOffloader, SavedBytes


def _batch():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 90, (4, 12), generator=g)
    completion = torch.randint(4, 90, (4, 48), generator=g)
    return prompt, torch.ones_like(prompt, dtype=torch.bool), completion, torch.ones_like(completion, dtype=torch.bool)


def _step(model, block=None):
    """One training forward and backward of a GRPO-shaped loss; returns (what the block saw, the gradients)."""
    model.zero_grad()
    block = block or SavedBytes(model)
    with block:
        logps, _ = token_logprobs(model, *_batch())
    (-logps.mean()).backward()
    return block, {n: p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture
def model(tokenizer):
    m = tiny_model(tokenizer, layers=3).train()
    m.config.use_cache = False
    return m


def test_checkpointing_saves_less_and_changes_no_gradient(model):
    plain, expected = _step(model)
    enable_checkpointing(model, {"use_reentrant": False})
    checkpointed, grads = _step(model)
    _same(grads, expected)
    assert checkpointed.bytes < 0.5 * plain.bytes, (checkpointed.bytes, plain.bytes)


class RecordingOffloader(ActivationOffloader):
    """The offloader, told to move CPU tensors as it would move device ones (nothing is on an accelerator on this
    machine), recording what each moved tensor held and checking each one that comes back against it."""

    def __init__(self, model, **kw):
        super().__init__(model, moves=lambda t: True, **kw)
        self.originals, self.sizes, self.wrong = {}, [], 0

    def _pack(self, tensor):
        packed = super()._pack(tensor)
        self.sizes.append((tensor.numel() * tensor.element_size(), packed is not tensor,
                           tensor.untyped_storage().data_ptr()))
        if packed is not tensor:
            self.originals[id(packed)] = tensor.detach().clone()
        return packed

    def _unpack(self, packed):
        tensor = super()._unpack(packed)
        if id(packed) in self.originals and not torch.equal(tensor, self.originals[id(packed)]):
            self.wrong += 1
        return tensor


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_activations_come_back_and_change_no_gradient(model, checkpointing):
    if checkpointing:
        enable_checkpointing(model, {"use_reentrant": False})
    _, expected = _step(model)
    offloader = RecordingOffloader(model)
    _, grads = _step(model, offloader)
    _same(grads, expected)
    assert offloader.moved > 0 and offloader.moved_bytes > 1 << 15 and offloader.wrong == 0
    # every tensor offloaded comes back: the forward computes no logits of its own (its output layer is cut to no
    # position; the chunked output layer makes the loss's), so no saved tensor is left whose node never runs
    assert offloader.returned == offloader.moved
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for size, moved, storage in offloader.sizes:
        assert not moved or (size >= 1024 and storage not in storages)


def test_every_offloaded_tensor_of_a_network_comes_back():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                              torch.nn.Linear(256, 64), torch.nn.Tanh())
    x = torch.randn(32, 64)
    net(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    offloader = RecordingOffloader(net)
    with offloader:
        loss = net(x).square().mean()
    loss.backward()
    _same({n: p.grad for n, p in net.named_parameters()}, expected)
    assert offloader.moved >= 4 and offloader.returned == offloader.moved and offloader.wrong == 0


def test_on_a_cpu_nothing_moves(model):
    offloader = ActivationOffloader(model)
    _step(model, offloader)
    assert offloader.moved == 0


def test_grpo_says_once_that_offloading_does_nothing_on_a_cpu(tokenizer, tmp_path, caplog):
    from conftest import length_reward, tiny_config
    from datasets import Dataset

    from posttrain.grpo.trainer import GRPOTrainer

    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer = GRPOTrainer(tiny_model(tokenizer), reward_funcs=length_reward,
                              args=tiny_config(tmp_path, max_steps=1, activation_offloading=True),
                              train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="] * 4}),
                              processing_class=tokenizer)
        trainer.train()
    said = [r.message for r in caplog.records if "activation_offloading" in r.message]
    assert said == ["activation_offloading=True changes nothing on a CPU: the activations saved for the backward "
                    "are in host memory already."]
