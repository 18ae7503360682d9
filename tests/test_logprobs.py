"""token_logprobs against the straightforward reference, across forward signatures."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from posttrain.models.keywords import logits_to_keep_kwarg, transformers_cache_name
from posttrain.models.logprobs import token_logprobs
from posttrain.testing import tiny_model

CACHE = transformers_cache_name()  # the doubles below keep an old signature and pass their cache on by today's name


class OldNameLM(Qwen2ForCausalLM):
    """A model class from before transformers renamed the keyword: only `num_logits_to_keep`."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                num_logits_to_keep=0):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=use_cache, logits_to_keep=num_logits_to_keep)


class NoKeepLM(Qwen2ForCausalLM):
    """A model class whose forward takes neither keyword: full logits come back."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=use_cache)


class IgnoresKeepLM(Qwen2ForCausalLM):
    """Accepts `logits_to_keep` but returns every position (as Qwen2 did on transformers 4.48)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=use_cache, logits_to_keep=0)


class ShortLM(Qwen2ForCausalLM):
    """Returns fewer positions than asked: must be an error, not a silent misalignment."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=1)


def _batch(tokenizer):
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "hello there")]
    width = max(map(len, prompts))
    p_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    p_mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    c_ids = torch.tensor([[5, 6, 7, 8], [9, 10, tokenizer.pad_token_id, tokenizer.pad_token_id]])
    c_mask = torch.tensor([[True] * 4, [True, True, False, False]])
    return p_ids, p_mask, c_ids, c_mask


def _reference(model, p_ids, p_mask, c_ids, c_mask, temperature):
    ids = torch.cat([p_ids, c_ids], 1)
    mask = torch.cat([p_mask, c_mask], 1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = Qwen2ForCausalLM.forward(model, input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, p_ids.size(1) - 1:-1] / temperature
    return logits.log_softmax(-1).gather(-1, c_ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("cls,kwarg", [(Qwen2ForCausalLM, "logits_to_keep"), (OldNameLM, "num_logits_to_keep"),
                                       (NoKeepLM, None), (IgnoresKeepLM, "logits_to_keep")])
def test_logprobs_and_grads_match_reference_for_every_signature(tokenizer, cls, kwarg):
    model = tiny_model(tokenizer, model_class=cls, hidden=32, layers=1)
    assert logits_to_keep_kwarg(model) == kwarg
    batch = _batch(tokenizer)
    logps, entropy = token_logprobs(model, *batch, temperature=0.7, with_entropy=True)
    (logps * batch[3]).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = _reference(model, *batch, temperature=0.7)
    (ref * batch[3]).sum().backward()
    mask = batch[3]
    assert torch.allclose(logps[mask], ref[mask], atol=1e-5)
    for g, r in zip(grads, (p.grad for p in model.parameters())):
        assert torch.allclose(g, r, atol=1e-5)
    assert entropy.shape == logps.shape and bool((entropy[mask] > 0).all())


def test_a_pass_without_gradient_keeps_no_layers_hidden_states_but_the_last(tokenizer):
    """Old and reference log-probs (no gradient) run the model's forward keeping no earlier layer's hidden states while
    later layers run (weak references to each layer's output, counted as each layer starts; before: the forward ran
    with output_hidden_states=True, every layer's [N, L, H] held to the end: gigabytes at 0.5-1.5B and long rows)."""
    import weakref

    from posttrain.models.logprobs import fast_path_available

    model = tiny_model(tokenizer, hidden=32, layers=6)
    assert fast_path_available(model)
    outputs, alive = [], []

    def record(module, args, output):
        outputs.append(weakref.ref(output[0] if isinstance(output, tuple) else output))

    def count(module, args):
        alive.append(sum(ref() is not None for ref in outputs[:-1]))  # every earlier layer's output but the input

    for layer in model.model.layers:
        layer.register_forward_pre_hook(count)
        layer.register_forward_hook(record)
    with torch.no_grad():
        token_logprobs(model, *_batch(tokenizer), packing=False)
    assert len(alive) == 6 and max(alive) == 0, alive


def test_model_returning_too_few_positions_is_an_error(tokenizer):
    model = tiny_model(tokenizer, model_class=ShortLM, hidden=32, layers=1)
    with pytest.raises(RuntimeError, match="does not honour that keyword"):
        token_logprobs(model, *_batch(tokenizer))


def test_the_chunked_path_inside_the_output_layers_forward_gives_the_same_numbers(tokenizer, monkeypatch):
    """Where the output layer's weight is whole only inside its own forward (DeepSpeed ZeRO-3; marked here by the
    attribute DeepSpeed gives a partitioned parameter, on an ordinary model), the chunked log-probs run as that
    forward: log-probs, entropy and gradients equal the ordinary chunked path's bit for bit, for GRPO's completions
    and for SFT/DPO's target tokens, and the layer's own forward is back afterwards."""
    from posttrain.models import logprobs
    from posttrain.models.forwards import output_layer
    from posttrain.models.logprobs import next_token_logprobs

    calls = []
    real = logprobs._computing_in
    monkeypatch.setattr(logprobs, "_computing_in", lambda layer, compute: calls.append(1) or real(layer, compute))

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    prompt, completion = ids[:, :3], ids[:, 3:]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    source = torch.zeros_like(ids, dtype=torch.bool)
    source[:, 1:5] = True
    results = []
    for marked in (False, True):
        model = tiny_model(tokenizer, seed=5)
        layer = output_layer(model)
        if marked:
            layer.weight.ds_tensor = torch.empty(0)
        logps, entropy = token_logprobs(model, prompt, torch.ones_like(prompt), completion, mask, 0.7,
                                        with_entropy=True)
        targets = ids[:, 2:6][source[:, 1:5]]
        seq_logps, seq_entropy, top1 = next_token_logprobs(model, ids, torch.ones_like(ids), None, source, targets,
                                                           with_entropy=True, with_top1=True)
        ((logps * mask).sum() + seq_logps.sum()).backward()
        assert "forward" not in vars(layer)  # the class's forward again
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logps.detach(), entropy, seq_logps.detach(), seq_entropy, top1, grads))
    plain, in_forward = results
    assert len(calls) == 2  # the marked model's two forwards ran inside its output layer
    for a, b in zip(plain[:5], in_forward[:5]):
        assert torch.equal(a * 1, b * 1)
    assert all(torch.equal(plain[5][n], in_forward[5][n]) for n in plain[5])
