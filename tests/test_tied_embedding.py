"""models/tied_embedding.py: a tied embedding's lookup gives autograd a sparse gradient in the training passes, so the
backward makes no [V, H] temporary for it, and the weight's gradient is the dense path's."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.models import fast_paths, logprobs, tied_embedding
from posttrain.models.logprobs import next_token_logprobs, token_logprobs
from posttrain.testing import tiny_model


class _FullSizeOutputs(TorchDispatchMode):
    """Counts the dense ops whose output has the embedding weight's shape [V, H]; notes the ops run and whether one
    made a sparse tensor of that shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count, self.ops, self.sparse = tuple(shape), 0, set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__.split(".")[0])
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.sparse |= out.is_sparse
            self.count += not out.is_sparse
        return out


def _rollouts(vocab: int, rows: int = 4, prompt: int = 5, completion: int = 6):
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (rows // 2, prompt), generator=g).repeat_interleave(2, dim=0)  # 2 each
    completion_ids = torch.randint(3, vocab, (rows, completion), generator=g)
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[1, 4:] = 0
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask


def _policy_pass_grad(model, sparse: bool, **kwargs):
    """The tied weight's gradient after token_logprobs' backward, with the lookup's gradient sparse or (the module's
    context made a no-op) nn.Embedding's own dense backward; and what the backward did."""
    model.zero_grad(set_to_none=True)
    inputs = _rollouts(model.config.vocab_size)
    if sparse:
        logps, _ = token_logprobs(model, *inputs, **kwargs)
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tied_embedding, "_tied_embedding", lambda plain: None)
            logps, _ = token_logprobs(model, *inputs, **kwargs)
    weight = model.get_input_embeddings().weight
    watch = _FullSizeOutputs(weight.shape)
    with watch:
        (logps * inputs[3]).sum().backward()
    return weight.grad.clone(), watch


@pytest.mark.parametrize("share_prompts", [False, True])
def test_tied_gradient_is_the_dense_paths_without_its_temporary(share_prompts, monkeypatch):
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)  # shared wherever positions are saved, tiny or not
    model = tiny_model(vocab_size=2048)  # tied, as the test models are
    model.train()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    dense, dense_watch = _policy_pass_grad(model, sparse=False, share_prompts=share_prompts)
    sparse, sparse_watch = _policy_pass_grad(model, sparse=True, share_prompts=share_prompts)
    assert not sparse.is_sparse
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-7)
    assert "embedding_dense_backward" in dense_watch.ops and "embedding_dense_backward" not in sparse_watch.ops
    assert sparse_watch.sparse and not dense_watch.sparse
    # the dense backward makes one [V, H] tensor more per lookup (one, or two with shared prompts) than the sparse one
    assert dense_watch.count - sparse_watch.count >= 1 + int(share_prompts)
    assert not model.get_input_embeddings().sparse  # the module is left as it was
    if share_prompts:
        assert fast_paths.decided(model, "shared_prompts", lambda: None) is True


def test_sequences_pass_too():
    """SFT's and DPO's pass (next_token_logprobs) gets the same treatment."""
    model = tiny_model(vocab_size=2048)
    model.train()
    ids = torch.randint(3, 2048, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    source = torch.ones_like(ids, dtype=torch.bool)
    source[:, -1] = False  # each position predicts the next token; the last predicts none
    weight = model.get_input_embeddings().weight
    grads = []
    for make_dense in (True, False):
        model.zero_grad(set_to_none=True)
        with pytest.MonkeyPatch.context() as patch:
            if make_dense:
                patch.setattr(tied_embedding, "_tied_embedding", lambda plain: None)
            logps, _, _ = next_token_logprobs(model, ids, mask, None, source, ids[:, 1:].reshape(-1))
        watch = _FullSizeOutputs(weight.shape)
        with watch:
            logps.sum().backward()
        assert watch.sparse is not make_dense
        grads.append(weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_untied_frozen_and_no_grad_embeddings_are_left_alone():
    untied = tiny_model(vocab_size=2048)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    frozen = tiny_model(vocab_size=2048)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    for model in (untied, frozen):
        assert tied_embedding._tied_embedding(model) is None
    tied = tiny_model(vocab_size=2048)
    assert tied_embedding._tied_embedding(tied) is tied.get_input_embeddings()
    with torch.no_grad(), tied_embedding.sparse_tied_embedding_grad(tied):
        assert not tied.get_input_embeddings().sparse


def test_a_lone_sparse_gradient_becomes_dense():
    """Should a backward reach the tied weight through the lookup alone, its `.grad` is still dense."""
    model = tiny_model(vocab_size=2048)
    embedding = model.get_input_embeddings()
    with tied_embedding.sparse_tied_embedding_grad(model):
        assert embedding.sparse
        looked_up = embedding(torch.tensor([[5, 7, 5]]))
    assert not embedding.sparse
    looked_up.sum().backward()
    grad = embedding.weight.grad
    assert not grad.is_sparse
    expected = torch.zeros_like(embedding.weight)
    expected[5], expected[7] = 2.0, 1.0
    torch.testing.assert_close(grad, expected)
