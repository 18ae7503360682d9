"""models/tied_embedding.py: a tied embedding's rows reach the shared weight's gradient without the dense [V, H]
lookup gradient, and the gradient is autograd's bit for bit (on a CPU) for today's architectures, a vision-language
model, gradient accumulation and several lookups a pass; what it does not know is left to autograd."""

import pytest
import torch

from posttrain.models import tied_embedding
from posttrain.models.tied_embedding import TiedRows, routable, tied_embedding as tied_embedding_of, tied_rows
from posttrain.testing import tiny_architecture, tiny_tokenizer, tiny_vision_processor


def _batches(model, pad: int, passes: int = 2, rows: int = 3, length: int = 9):
    torch.manual_seed(7)
    vocab = model.get_input_embeddings().num_embeddings
    out = []
    for _ in range(passes):
        ids = torch.randint(0, vocab, (rows, length))
        ids[:, :2] = ids[0, :2]  # a token every row looks up
        mask = torch.ones_like(ids)
        ids[0, :3], mask[0, :3] = pad, 0  # left padding: the padding row's lookups
        out.append((ids, mask))
    return out


def _pass(model, ids, mask, heads: int = 1):
    """A pass as posttrain's shared prompts run one: the prompts through the body alone, then the rows through the
    whole model (two lookups, the output layer once); `heads=2`: the prompts through the output layer too."""
    prompts = model.get_decoder()(input_ids=ids[:, :5], attention_mask=mask[:, :5]).last_hidden_state
    prompt_term = prompts.square().mean() if heads == 1 else model.get_output_embeddings()(prompts).logsumexp(-1).mean()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    return loss + 0.3 * prompt_term


def _grads(model, batches, routed: bool, heads: int = 1) -> dict:
    model.zero_grad(set_to_none=True)
    embedding = model.get_input_embeddings()
    for ids, mask in batches:  # gradient accumulation over the passes
        if routed:
            with TiedRows(embedding):
                _pass(model, ids, mask, heads).backward()
        else:
            _pass(model, ids, mask, heads).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen3_5"])
def test_the_gradients_are_autograds_bit_for_bit(family):
    """Qwen2, Gemma 3 (its scaled embedding) and Qwen3.5 (Gated DeltaNet layers), two passes of two forwards each
    (the output layer once a pass, as in every posttrain trainer's pass), left padding included: every parameter's
    gradient equals autograd's exactly."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture(family, tokenizer)
    embedding = tied_embedding_of(model)
    assert embedding is not None and routable(embedding) and tied_embedding.check_route(embedding)
    assert (family == "gemma3") == (tied_embedding._scale(embedding) is not None)
    assert embedding.padding_idx == tokenizer.pad_token_id
    batches = _batches(model, tokenizer.pad_token_id)
    plain, routed = _grads(model, batches, False), _grads(model, batches, True)
    assert plain.keys() == routed.keys()
    assert all(torch.equal(plain[name], routed[name]) for name in plain), [
        (name, float((plain[name] - routed[name]).abs().max())) for name in plain if not torch.equal(plain[name],
                                                                                                     routed[name])]
    pad_row = routed["model.embed_tokens.weight"][tokenizer.pad_token_id]
    assert torch.equal(pad_row, plain["model.embed_tokens.weight"][tokenizer.pad_token_id])


@pytest.mark.parametrize("reentrant", [True, False])
def test_with_gradient_checkpointing_the_gradients_are_autograds(reentrant):
    """Checkpointed layers (transformers' reentrant and non-reentrant kinds) recompute on the routed rows: the same
    gradients, bit for bit."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    batches = _batches(model, tokenizer.pad_token_id)
    plain, routed = _grads(model, batches, False), _grads(model, batches, True)
    assert plain.keys() == routed.keys() and all(torch.equal(plain[n], routed[n]) for n in plain)


def test_with_the_output_layer_twice_a_pass_the_gradients_agree_within_rounding():
    """Two uses of the output layer in one pass: autograd adds each lookup's rows between the output layer's
    contributions, the route after them, so the sums agree within float32 rounding, not bit for bit."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer)
    batches = _batches(model, tokenizer.pad_token_id)
    plain, routed = _grads(model, batches, False, heads=2), _grads(model, batches, True, heads=2)
    for name in plain:
        torch.testing.assert_close(routed[name], plain[name], rtol=1e-6, atol=1e-7)


def test_a_bf16_models_rows_are_summed_in_float32():
    """bf16 weights (a GPU run's): the route's gradient is autograd's within bf16 rounding, and a token looked up in
    every row has its gradient rounded once (summed in float32), as CUDA's lookup backward does."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer).to(torch.bfloat16)
    batches = _batches(model, tokenizer.pad_token_id, passes=1)
    plain, routed = _grads(model, batches, False), _grads(model, batches, True)
    assert routed["model.embed_tokens.weight"].dtype == torch.bfloat16
    for name in plain:
        torch.testing.assert_close(routed[name], plain[name], rtol=2e-2, atol=1e-3)
    embedding = model.get_input_embeddings()
    ids = torch.full((1, 64), 7)
    grad_rows = torch.randn(1, 64, embedding.embedding_dim).to(torch.bfloat16)
    route = TiedRows(embedding)
    route.keep(ids, grad_rows)
    (distinct, sums), = route.pending
    assert distinct.tolist() == [7] and sums.dtype == torch.float32
    torch.testing.assert_close(sums[0], grad_rows[0].float().sum(0), rtol=1e-6, atol=1e-6)


def test_a_vision_language_model_writes_its_image_features_into_the_routed_rows():
    """A tiny LLaVA (tied), whose forward scatters the image features into the looked-up rows: the same gradients."""
    from PIL import Image

    model, processor = tiny_vision_processor("llava")
    embedding = tied_embedding_of(model)
    assert embedding is not None and routable(embedding)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": "Colour?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    images = [Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))]
    inputs = processor(text=[text, text], images=images, return_tensors="pt")

    def grads(routed: bool) -> dict:
        model.zero_grad(set_to_none=True)
        with TiedRows(embedding) if routed else torch.enable_grad():
            model(**inputs, labels=inputs["input_ids"]).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain, routed = grads(False), grads(True)
    assert plain.keys() == routed.keys() and all(torch.equal(plain[n], routed[n]) for n in plain)


def test_the_dense_lookup_gradient_is_not_in_the_graph():
    """Under the route the backward holds no EmbeddingBackward (the node that makes the [V, H] gradient)."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer)
    ids, mask = _batches(model, tokenizer.pad_token_id, passes=1)[0]

    def nodes(loss) -> set:
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        return {type(node).__name__ for node in seen}

    assert "EmbeddingBackward0" in nodes(_pass(model, ids, mask))
    with TiedRows(model.get_input_embeddings()):
        routed = nodes(_pass(model, ids, mask))
    assert "EmbeddingBackward0" not in routed and "_RoutedLookupBackward" in routed


def test_rows_no_other_gradient_reaches_are_added_at_the_end_of_the_pass():
    """A loss that reads the lookup only (the output layer unused): no hook runs on the weight, and the pass's end
    adds the rows, as autograd's lookup gradient would be."""
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer)
    embedding = model.get_input_embeddings()
    ids = torch.tensor([[5, 6, 5, 9]])
    embedding(ids).square().sum().backward()
    plain = embedding.weight.grad.clone()
    embedding.weight.grad = None
    with TiedRows(embedding):
        embedding(ids).square().sum().backward()
    assert torch.equal(embedding.weight.grad, plain)


def test_what_the_route_does_not_know_is_left_to_autograd():
    tokenizer = tiny_tokenizer()
    model = tiny_architecture("qwen2", tokenizer)
    embedding = model.get_input_embeddings()
    for setting in (dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)):
        assert not routable(torch.nn.Embedding(10, 4, **setting))

    class Shifted(torch.nn.Embedding):  # a forward of its own, with no embed_scale
        def forward(self, ids):
            return super().forward(ids) + 1

    class Scaled(torch.nn.Embedding):  # an embed_scale that its forward does not apply as assumed
        embed_scale = 2.0

        def forward(self, ids):
            return super().forward(ids) + self.embed_scale

    assert not routable(Shifted(10, 4))
    assert routable(Scaled(10, 4)) and not tied_embedding.check_route(Scaled(10, 4))
    untied = tiny_architecture("qwen2", tokenizer)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert tied_embedding_of(untied) is None
    embedding.weight.requires_grad_(False)  # frozen (an adapter's base model)
    assert tied_embedding_of(model) is None
    embedding.weight.requires_grad_(True)
    with tied_rows(model, enabled=False):
        assert not embedding._forward_hooks
    with tied_rows(model, enabled=True):
        assert len(embedding._forward_hooks) == 1
    assert not embedding._forward_hooks and not embedding.weight._backward_hooks


@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_a_trainers_update_is_the_same_with_and_without_the_route(trainer, tmp_path, monkeypatch):
    """An SFT run (2 micro-batches a step) and a GRPO run (the chunked output layer, shared prompts) on a tied model
    end with the same weights, bit for bit, whether the route runs or autograd's lookup gradient does."""
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    tokenizer = tiny_tokenizer()
    used = []
    original = TiedRows._add_rows

    def counted(self, grad):
        used.append(bool(self.pending))
        return original(self, grad)

    monkeypatch.setattr(TiedRows, "_add_rows", counted)

    def run(name: str):
        model = tiny_architecture("qwen2", tokenizer, seed=3)
        common = dict(output_dir=str(tmp_path / name), max_steps=2, learning_rate=1e-2, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, plot_on_end=False, log_level="error")
        if trainer == "sft":
            data = Dataset.from_dict({"text": ["abc def ghi", "jkl mno", "pqr stu vwx yz", "a b c d e f"] * 2})
            config = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, **common)
            built = SFTTrainer(model, args=config, train_dataset=data, processing_class=tokenizer)
        else:
            data = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4})
            config = GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=5, beta=0.0,
                                gradient_checkpointing=False, **common)
            built = GRPOTrainer(model, lambda completions, **kw: [len(c) / 5 for c in completions], args=config,
                                train_dataset=data, processing_class=tokenizer)
        built.train()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    routed = run("routed")
    assert used and all(used)
    monkeypatch.setattr(tied_embedding, "routable", lambda embedding: False)
    used.clear()
    plain = run("plain")
    assert not used
    assert routed.keys() == plain.keys() and all(torch.equal(routed[n], plain[n]) for n in routed)
