"""Distillation's divergence through both output layers in chunks (posttrain/models/divergence.py): its value, the
student's entropy and the student's gradients (hidden states, output weight and bias) against the formula on whole
logits, and against TRL 1.16's own `_chunked_divergence_loss` called on the same tensors."""

import pytest
import torch

from posttrain.models import divergence
from posttrain.models.divergence import Head, chunked_divergence

V, HS, HT, N = 37, 8, 12, 11  # a teacher wider than the student, over the same vocabulary


def _inputs(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(N, HS, generator=g, requires_grad=True)
    w_s = (torch.randn(V, HS, generator=g) * 0.7).requires_grad_()
    b_s = (torch.randn(V, generator=g) * 0.3).requires_grad_() if bias else None
    h_t, w_t = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.9
    b_t = torch.randn(V, generator=g) * 0.3 if bias else None
    weights = torch.rand(N, generator=g) * (torch.arange(N) % 4 != 3)  # some positions masked out
    return h_s, w_s, b_s, h_t, w_t, b_t, weights


def _whole(h, w, b, scale, softcap):
    z = h @ w.t() + (b if b is not None else 0)
    z = z * scale
    return softcap * torch.tanh(z / softcap) if softcap else z


def _reference(z_s, z_t, beta, temperature):
    """The divergence on whole logits, written from its definition."""
    p_s, p_t = torch.softmax(z_s / temperature, -1), torch.softmax(z_t / temperature, -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    if beta == 0.0:
        return kl(p_t, p_s), p_s
    if beta == 1.0:
        return kl(p_s, p_t), p_s
    m = (1 - beta) * p_s + beta * p_t
    return beta * kl(p_t, m) + (1 - beta) * kl(p_s, m), p_s


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("heads", ["plain", "bias_scale_softcap"])
def test_value_entropy_and_gradient_equal_the_whole_logits_formula(monkeypatch, beta, temperature, heads):
    monkeypatch.setattr(divergence, "CHUNK_ELEMENTS", 4 * V)  # chunks of 4 positions: the last one short
    extra = heads != "plain"
    h_s, w_s, b_s, h_t, w_t, b_t, weights = _inputs(7, bias=extra)
    scale, softcap = (0.8, 3.0) if extra else (1.0, None)
    student, teacher = Head(w_s, b_s, scale, softcap), Head(w_t, b_t, 1.3 if extra else 1.0, 5.0 if extra else None)
    div, entropy = chunked_divergence(h_s, student, h_t, teacher, beta, temperature)
    params = [h_s, w_s] + ([b_s] if extra else [])
    ours = torch.autograd.grad((div * weights).sum(), params)

    z_s = _whole(h_s, w_s, b_s, scale, softcap)
    z_t = _whole(h_t, w_t, b_t, teacher.scale, teacher.softcap)
    expected, p_s = _reference(z_s, z_t, beta, temperature)
    theirs = torch.autograd.grad((expected * weights).sum(), params)
    assert torch.allclose(div, expected.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(entropy, -(p_s * p_s.log()).sum(-1).detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert ours[0][3].abs().max() == 0  # a masked position gets no gradient


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("heads", ["plain", "bias_scale_softcap"])
@pytest.mark.parametrize("incoming", ["as_predicted", "scaled", "per_position"])
def test_the_gradient_computed_in_the_forward_is_the_recomputed_one(monkeypatch, beta, heads, incoming):
    """grad_scale: the student's gradients come from the forward's chunks; the loss that gives every position
    grad_scale, twice that (scaled), or a gradient of its own per position (recomputed) gets the exact gradient."""
    monkeypatch.setattr(divergence, "CHUNK_ELEMENTS", 4 * V)
    extra = heads != "plain"
    h_s, w_s, b_s, h_t, w_t, b_t, weights = _inputs(11, bias=extra)
    student = Head(w_s, b_s, 0.8 if extra else 1.0, 3.0 if extra else None)
    teacher = Head(w_t, b_t, 1.3 if extra else 1.0, 5.0 if extra else None)
    params = [h_s, w_s] + ([b_s] if extra else [])

    def loss(div):
        if incoming == "per_position":
            return (div * weights).sum()
        return div.sum() * (0.25 if incoming == "as_predicted" else 0.5)

    plain = torch.autograd.grad(loss(chunked_divergence(h_s, student, h_t, teacher, beta, 0.7)[0]), params)
    div, _ = chunked_divergence(h_s, student, h_t, teacher, beta, 0.7, grad_scale=0.25)
    predicted = torch.autograd.grad(loss(div), params)
    for a, b in zip(predicted, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert predicted[0].abs().sum() > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_entropy_and_gradient_equal_trls(beta, temperature):
    """TRL's `_chunked_divergence_loss` (its reduction: the masked sum over the valid positions' count)."""
    pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    h_s, w_s, b_s, h_t, w_t, b_t, _ = _inputs(3, bias=True)
    mask = (torch.arange(N) % 4 != 3).long()
    loss, entropy_sum, valid = _chunked_divergence_loss(
        h_s[None], h_t[None], w_s, w_t, mask[None], beta, student_lm_head_bias=b_s, teacher_lm_head_bias=b_t,
        student_logit_scale=0.8, teacher_logit_scale=1.2, student_final_logit_softcapping=4.0,
        teacher_final_logit_softcapping=None, temperature=temperature)
    theirs = torch.autograd.grad(loss, [h_s, w_s, b_s])

    div, entropy = chunked_divergence(h_s, Head(w_s, b_s, 0.8, 4.0), h_t, Head(w_t, b_t, 1.2, None), beta,
                                      temperature)
    ours_loss = (div * mask).sum() / mask.sum()
    ours = torch.autograd.grad(ours_loss, [h_s, w_s, b_s])
    assert int(valid) == int(mask.sum())
    assert float(ours_loss) == pytest.approx(float(loss), rel=1e-5)
    assert float((entropy * mask).sum()) == pytest.approx(float(entropy_sum), rel=1e-5)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_teacher_over_another_vocabulary_and_a_beta_outside_0_1_are_refused():
    h_s, w_s, b_s, h_t, w_t, b_t, _ = _inputs(1, bias=False)
    with pytest.raises(ValueError, match="vocabulary"):
        chunked_divergence(h_s, Head(w_s), h_t, Head(w_t[:-1]), 0.5)
    with pytest.raises(ValueError, match="outside"):
        chunked_divergence(h_s, Head(w_s), h_t, Head(w_t), 1.5)


def test_no_more_than_a_chunk_of_logits_at_once(monkeypatch):
    """Forward and backward project at most CHUNK_ELEMENTS // V positions at a time, for each model."""
    monkeypatch.setattr(divergence, "CHUNK_ELEMENTS", 3 * V)
    widths = []
    original = Head.logits

    def recorded(self, h, products):
        widths.append(h.size(0))
        return original(self, h, products)

    monkeypatch.setattr(Head, "logits", recorded)
    h_s, w_s, b_s, h_t, w_t, b_t, weights = _inputs(5, bias=False)
    div, _ = chunked_divergence(h_s, Head(w_s), h_t, Head(w_t), 0.5)
    (div * weights).sum().backward()
    assert max(widths) == 3 and len(widths) > 2 * (N // 3)  # both models, forward and backward, in chunks of 3


@pytest.mark.parametrize("grad_scale", [None, 0.25])
def test_under_autocast_on_a_gpu_like_device_both_layers_products_take_the_compute_dtype(monkeypatch, grad_scale):
    """On CUDA under a bf16 autocast both output layers' products take bf16 inputs with float32 results (not IEEE
    float32, models/output_products.py); the softmaxes and the divergence stay float32. The CPU stands in for the
    GPU here: the value and the student's gradients equal the formula on bf16-product logits, not on float32 ones."""
    from posttrain.models import output_products

    monkeypatch.setattr(output_products, "LOW_PRECISION_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(divergence, "CHUNK_ELEMENTS", 4 * V)
    h_s, w_s, b_s, h_t, w_t, b_t, weights = _inputs(3, bias=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        div, _ = chunked_divergence(h_s, Head(w_s, b_s), h_t, Head(w_t, b_t), 0.5, grad_scale=grad_scale)
        ours = torch.autograd.grad((div * (weights if grad_scale is None else 0.25)).sum(), (h_s, w_s, b_s))

    def bf16_logits(h, w, b):
        return (h.bfloat16() @ w.bfloat16().t()).float() + b

    expected, _ = _reference(bf16_logits(h_s, w_s, b_s), bf16_logits(h_t, w_t, b_t), 0.5, 1.0)
    theirs = torch.autograd.grad((expected * (weights if grad_scale is None else 0.25)).sum(), (h_s, w_s, b_s))
    in_float32, _ = _reference(_whole(h_s, w_s, b_s, 1.0, None), _whole(h_t, w_t, b_t, 1.0, None), 0.5, 1.0)
    assert div.dtype == torch.float32 and torch.allclose(div, expected.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(div, in_float32.detach(), rtol=1e-4, atol=1e-5)
    for a, b in zip(ours, theirs):
        assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=2e-2, atol=2e-3)
