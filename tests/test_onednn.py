"""oneDNN's linear in the training passes (models/onednn.py): the same values and gradients as F.linear's, and used
only where it applies."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import onednn
from posttrain.models.logprobs import token_logprobs

pytestmark = pytest.mark.skipif(onednn.linear_op() is None, reason="this torch has no oneDNN linear")


@pytest.fixture
def counted(monkeypatch):
    """The list of input shapes of every oneDNN product made by `cpu_linears` while the test runs (for models of any
    width: the tests' are narrower than MIN_HIDDEN)."""
    monkeypatch.setattr(onednn, "MIN_HIDDEN", 0)
    calls, op = [], onednn.linear_op()
    monkeypatch.setattr(onednn, "_OP", lambda x, *rest: calls.append(tuple(x.shape)) or op(x, *rest))
    return calls


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_values_and_gradients_equal_f_linear(with_bias, layout, counted):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24) if layout == "contiguous" else torch.randn(2, 24, 5).transpose(1, 2)
    x.requires_grad_(True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if with_bias else None
    leaves = [x, w] + ([b] if with_bias else [])
    g = torch.randn(2, 5, 40)
    with onednn._Linears():
        ours = F.linear(x, w, b)
        ours[..., 3] += 1.0  # a model may change its output in place, through a view (as one adding to its logits)
    assert counted == [(10, 24)]
    ours_grads = torch.autograd.grad(ours, leaves, g)
    theirs = F.linear(x, w, b)
    theirs[..., 3] += 1.0
    theirs_grads = torch.autograd.grad(theirs, leaves, g)
    assert torch.allclose(ours, theirs, atol=1e-5)
    for a, c in zip(ours_grads, theirs_grads):
        assert a.shape == c.shape and torch.allclose(a, c, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient(counted):
    """Only what needs a gradient gets one (a frozen base weight under LoRA, the input of the first layer)."""
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8)
    with onednn._Linears():
        y = F.linear(x, w)
    (grad_x,) = torch.autograd.grad(y.sum(), [x])
    assert torch.allclose(grad_x, torch.ones(3, 4) @ w, atol=1e-6) and counted


def _rollouts():
    torch.manual_seed(0)
    prompt_ids = torch.randint(3, 60, (4, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    completion_ids = torch.randint(3, 60, (4, 6))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, 3:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _pass(model, rollouts):
    """A policy pass: log-probs, entropies and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, 24).view(4, 6)
    logps, entropy = token_logprobs(model, *rollouts, temperature=0.8, with_entropy=True,
                                    loss_gradient=lambda lp: weights)
    (logps * weights).sum().backward()
    return [logps.detach(), entropy] + [p.grad.clone() for p in model.parameters()]


def test_token_logprobs_through_onednn_equal_the_gemm_pass(tokenizer, counted, monkeypatch):
    """The model's products in a log-prob pass go through oneDNN; log-probs, entropies and gradients are those of
    torch's GEMM, to float32 rounding."""
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=2)
    model.train()
    rollouts = _rollouts()
    ours = _pass(model, rollouts)
    assert len(counted) >= 2 * 7  # per layer q, k, v, o, gate, up, down
    monkeypatch.setattr(onednn, "_OP", False)
    theirs = _pass(model, rollouts)
    for a, c in zip(ours, theirs):
        assert torch.allclose(a, c, atol=1e-5, rtol=1e-4)


def test_not_used_where_it_does_not_apply(tokenizer, counted, monkeypatch):
    """Not under gradient checkpointing (the recomputation runs outside the block), a CPU autocast, for a 16-bit
    model or one narrower than MIN_HIDDEN: there F.linear runs as it would."""
    from posttrain.models.loading import enable_checkpointing
    from posttrain.testing import tiny_model

    rollouts = _rollouts()
    checkpointed = tiny_model(tokenizer, hidden=32, layers=1)
    enable_checkpointing(checkpointed, None)
    checkpointed.train()
    _pass(checkpointed, rollouts)
    assert counted == []
    model = tiny_model(tokenizer, hidden=32, layers=1)
    _pass(model, rollouts)  # in float32 (and the model's one-time checks, which turn autocast off)
    assert counted
    counted.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _pass(model, rollouts)
    _pass(model.to(torch.bfloat16), rollouts)
    assert counted == []
    counted.clear()
    monkeypatch.setattr(onednn, "MIN_HIDDEN", 33)  # the model is 32 wide
    _pass(model.float(), rollouts)
    assert counted == []
