"""The chunked output-layer log-prob path equals full logits + log_softmax + gather, values and gradients."""

import pytest
import torch
import transformers

from posttrain.models import chunked, onednn, output_products
from posttrain.models.chunked import chunked_token_logprobs
from posttrain.models.chunked_check import fast_path_available


@pytest.fixture(params=["mkl", "onednn"])
def logits_library(request, monkeypatch):
    """Each chunk's logits through torch's GEMM into a workspace buffer, or through oneDNN into a tensor of its own
    (from any hidden size here; in use from ONEDNN_LOGITS_MIN_HIDDEN). Yields the list of oneDNN products made."""
    calls = []
    if request.param == "mkl":
        monkeypatch.setattr(onednn, "_OP", False)
    else:
        if onednn.linear_op() is None:
            pytest.skip("this torch has no oneDNN linear")
        monkeypatch.setattr(output_products, "ONEDNN_LOGITS_MIN_HIDDEN", 0)
        original = onednn.linear
        monkeypatch.setattr(onednn, "linear", lambda *args: calls.append(args[0].shape) or original(*args))
    yield request.param, calls
    assert bool(calls) == (request.param == "onednn")


def _prediction(kind: str, g: torch.Tensor):
    """predict_grad for the test's upstream gradient g: none, right, wrong in some rows, or wrong everywhere."""
    if kind == "none":
        return None
    guess = {"right": g, "partly": torch.where(torch.arange(len(g)) % 3 == 0, g + 1.0, g), "wrong": -2 * g}[kind]
    return lambda rows, logps: guess[rows]


@pytest.mark.parametrize("prediction", ["none", "right", "partly", "wrong"])
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_matches_reference_across_chunks(monkeypatch, temperature, with_bias, prediction, logits_library):
    """Values and gradients equal the reference with or without a predicted gradient, right or wrong."""
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 3 * 50)  # 3 rows per chunk: several chunks, a ragged last one
    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if with_bias else None
    ids = torch.randint(0, 50, (10,))
    g = torch.randn(10)
    logps, entropy = chunked_token_logprobs(h, w, b, ids, temperature, predict_grad=_prediction(prediction, g))
    (logps * g).sum().backward()
    got = [h.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    for t in [h, w] + ([b] if with_bias else []):
        t.grad = None
    logits = (h @ w.T + (b if with_bias else 0)) / temperature
    ref = logits.log_softmax(-1)
    ref_logps = ref.gather(-1, ids[:, None]).squeeze(-1)
    (ref_logps * g).sum().backward()
    want = [h.grad, w.grad] + ([b.grad] if with_bias else [])
    assert torch.allclose(logps, ref_logps, atol=1e-5)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1).detach(), atol=1e-5)
    for a, c in zip(got, want):
        assert torch.allclose(a, c, atol=1e-5)


def test_fast_path_is_used_for_qwen2_and_refused_for_softcapped_logits(tokenizer, caplog):
    from transformers import Qwen2ForCausalLM

    from posttrain.testing import tiny_model

    class SoftCapped(Qwen2ForCausalLM):
        """Post-processes logits after the output layer: the chunked path would be wrong, so it must not be used."""

        def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, attention_mask, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = 5 * torch.tanh(out.logits / 5)
            return out

    class LastPositionOnly(Qwen2ForCausalLM):
        """Reads its logits' last position after the output layer: with the layer cut to no position (the fast path's
        forward) the one-time check raises, and the model runs on whole logits, said once."""

        def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, attention_mask, logits_to_keep=logits_to_keep, **kwargs)
            self.last_logits = out.logits[:, -1]  # as a model that post-processes its last position would
            return out

    class NoKeyword(Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with caplog.at_level("WARNING", logger="posttrain"):
        assert fast_path_available(tiny_model(tokenizer, hidden=32, layers=1))
        assert not caplog.records
        for model_class in (SoftCapped, NoKeyword):
            model = tiny_model(tokenizer, hidden=32, layers=1, model_class=model_class)
            assert not fast_path_available(model) and not fast_path_available(model)
        raising = tiny_model(tokenizer, hidden=32, layers=1, model_class=LastPositionOnly)
        assert not fast_path_available(raising)
        custom_head = tiny_model(tokenizer, hidden=32, layers=1)
        custom_head.lm_head.__class__ = type("ScaledHead", (torch.nn.Linear,), {})  # a subclass may compute anything
        assert not fast_path_available(custom_head)
    # said once per model, with the reason
    start = "log-probs come from the model's whole logits ([tokens, vocabulary] at once, as in TRL), not from its " \
            "output layer in chunks, because"
    assert [r.getMessage() for r in caplog.records] == [
        f"SoftCapped: {start} its logits are not its output layer's output (it changes them, as soft-capping does).",
        f"NoKeyword: {start} its forward (NoKeyword, transformers {transformers.__version__}) takes neither "
        "`logits_to_keep` nor `num_logits_to_keep`.",
        f"LastPositionOnly: {start} its one-time check raised IndexError: index -1 is out of bounds for dimension 1 "
        "with size 0.",
        f"Qwen2ForCausalLM: {start} its output layer is ScaledHead, not a plain Linear (a LoRA adapter on it, or a "
        "custom head)."]


def test_right_prediction_recomputes_nothing(monkeypatch):
    """With the gradient predicted right the backward recomputes no logits; a row predicted wrong is recomputed."""
    recomputed = []
    original = chunked._recompute_into
    monkeypatch.setattr(chunked, "_recompute_into",
                        lambda grads, products, h, ids, lse, g, rows, *rest: recomputed.append(rows.numel()) or
                        original(grads, products, h, ids, lse, g, rows, *rest))
    torch.manual_seed(0)
    h = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    ids = torch.randint(0, 40, (8,))
    g = torch.randn(8)
    logps, _ = chunked_token_logprobs(h, w, None, ids, predict_grad=lambda rows, lp: g[rows])
    (logps * g).sum().backward()
    g_wrong = g.clone()
    g_wrong[5] += 1.0
    logps, _ = chunked_token_logprobs(h, w, None, ids, predict_grad=lambda rows, lp: g_wrong[rows])
    (logps * g).sum().backward()
    assert recomputed == [0, 1]


def test_float32_inside_bf16_autocast():
    """Under bf16 autocast (what bf16=True turns on) the output layer still computes in float32."""
    torch.manual_seed(0)
    h = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    ids = torch.randint(0, 40, (6,))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logps, _ = chunked_token_logprobs(h, w, None, ids)
    logps.sum().backward()
    ref = (h @ w.T).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    assert logps.dtype == torch.float32 and torch.allclose(logps, ref, atol=1e-5)
    assert w.grad.dtype == torch.float32


@pytest.fixture
def low_precision_cpu(monkeypatch):
    """The CPU taken as a device whose output-layer products run in the compute dtype, as CUDA is: the products are
    then computed in bf16 and widened afterwards (the CPU has no out_dtype product)."""
    monkeypatch.setattr(output_products, "LOW_PRECISION_DEVICES", {"cpu", "cuda"})


def _bf16_reference(h, w, ids, temperature=1.0):
    """log-probs from bf16 products widened to float32, the log-softmax in float32: what the compute dtype gives."""
    log_p = ((h.bfloat16() @ w.bfloat16().T).float() / temperature).log_softmax(-1)
    return log_p.gather(-1, ids[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("predicted", [False, True])
def test_under_autocast_on_a_gpu_like_device_the_products_take_the_compute_dtype(low_precision_cpu, monkeypatch,
                                                                                 predicted):
    """On CUDA under a bf16 autocast (bf16=True) the output layer's products take bf16 inputs with float32 results,
    not IEEE float32 (several times the body's time there); the log-sum-exp and log-probs stay float32. Values and
    gradients equal the bf16-product formula, not the float32 one, through the forward's predicted gradient and the
    recomputing backward alike, across chunks."""
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 3 * 300)
    torch.manual_seed(0)
    h = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(300, 64, requires_grad=True)
    ids = torch.randint(0, 300, (8,))
    g = torch.randn(8)
    seen = []
    with _product_dtypes(seen, 300), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logps, entropy = chunked_token_logprobs(h, w, None, ids, 0.7, predict_grad=(lambda rows, lp: g[rows])
                                                if predicted else None)
        ours = torch.autograd.grad((logps * g).sum(), (h, w))
    assert seen and set(seen) == {torch.bfloat16}  # every product over the vocabulary, forward and backward
    assert logps.dtype == entropy.dtype == torch.float32
    ref_logps, ref_entropy = _bf16_reference(h, w, ids, 0.7)
    theirs = torch.autograd.grad((ref_logps * g).sum(), (h, w))
    f32 = ((h @ w.T) / 0.7).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(logps, ref_logps, atol=1e-5) and not torch.allclose(logps, f32, atol=1e-3)
    assert torch.allclose(entropy, ref_entropy, atol=1e-5)
    for a, c in zip(ours, theirs):
        assert a.dtype == torch.float32 and torch.allclose(a, c, rtol=2e-2, atol=2e-2)


def test_the_compute_dtype_is_the_autocasts_then_the_weights_and_float32_on_a_cpu(low_precision_cpu, monkeypatch):
    """bf16 weights without autocast take bf16 products on the GPU-like device; a float32 run takes float32 (TF32
    there when tf32=True); the CPU itself keeps float32 under any autocast (oneDNN's fast path)."""
    cpu = torch.device("cpu")
    assert output_products.compute_dtype(cpu, torch.bfloat16) == torch.bfloat16
    assert output_products.compute_dtype(cpu, torch.float32) == torch.float32
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        assert output_products.compute_dtype(cpu, torch.float32) == torch.float16
    monkeypatch.setattr(output_products, "LOW_PRECISION_DEVICES", {"cuda"})
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert output_products.compute_dtype(cpu, torch.bfloat16) == torch.float32


class _product_dtypes(torch.overrides.TorchFunctionMode):
    """Records the input dtype of every torch.mm / addmm with a `vocab`-wide operand (the output layer's)."""

    def __init__(self, seen: list, vocab: int):
        super().__init__()
        self.seen, self.vocab = seen, vocab

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.mm, torch.addmm, torch.Tensor.addmm_) and self.vocab in args[-1].shape + args[-2].shape:
            self.seen.append(args[-1].dtype)
        return out


@pytest.mark.parametrize("predicted", [False, True])
def test_entropy_gradient_equals_autograd_of_full_logits(predicted, logits_library):
    """With entropy_grad the entropy carries its gradient (for an entropy bonus), through the recomputing backward
    and beside a predicted log-prob gradient alike."""
    torch.manual_seed(0)
    h = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(11, 5, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    ids = torch.randint(0, 11, (7,))
    g_logp, g_entropy, temperature = torch.randn(7), torch.randn(7), 0.7
    predict = (lambda rows, lp: g_logp[rows]) if predicted else None
    logps, entropy = chunked_token_logprobs(h, w, b, ids, temperature, True, predict, entropy_grad=True)
    ours = torch.autograd.grad((logps * g_logp).sum() + (entropy * g_entropy).sum(), (h, w, b))
    log_p = ((h @ w.T + b) / temperature).log_softmax(-1)
    full_entropy = -(log_p.exp() * log_p).sum(-1)
    theirs = torch.autograd.grad((log_p.gather(-1, ids[:, None]).squeeze(-1) * g_logp).sum()
                                 + (full_entropy * g_entropy).sum(), (h, w, b))
    assert torch.allclose(entropy, full_entropy, atol=1e-5)
    for a, c in zip(ours, theirs):
        assert torch.allclose(a, c, atol=1e-5)


@pytest.mark.parametrize("cast_lm_head_to_fp32", [False, True])
def test_a_models_log_prob_pass_takes_the_compute_dtype_unless_its_head_is_cast_to_float32(
        low_precision_cpu, tokenizer, cast_lm_head_to_fp32):
    """Through the model's log-prob pass (models/logprobs.py) under a bf16 autocast on the GPU-like device: the
    products over the vocabulary take bf16, except with TRL's cast_lm_head_to_fp32, whose layer keeps them float32."""
    from posttrain.models.loading import cast_output_layer_to_fp32
    from posttrain.models.logprobs import token_logprobs
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=1)
    if cast_lm_head_to_fp32:
        cast_output_layer_to_fp32(model)
    vocab = model.lm_head.weight.size(0)
    prompt = torch.randint(3, vocab, (2, 4))
    completion = torch.randint(3, vocab, (2, 5))
    seen = []
    with _product_dtypes(seen, vocab), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logps, _ = token_logprobs(model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))
        logps.sum().backward()
    assert logps.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.float32
    assert seen and set(seen) == {torch.float32 if cast_lm_head_to_fp32 else torch.bfloat16}
