"""The in-process decoder at fixed shapes (TRL's cache_implementation="static"): the same tokens as the growing decode,
a step that traces as one graph (what a CUDA graph captures), no host sync per token, and a decode in a bf16 run's
dtype (its KV cache too) where the products take it."""

import pytest
import torch

from posttrain.generation import SamplingParams, lean_decoder
from posttrain.generation.transformers_backend import STOP_CHECK_EVERY, TransformersGenerator
from posttrain.models import onednn, output_products
from posttrain.models.forwards import positions_from_mask
from posttrain.testing import tiny_model


def _prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "a much longer prompt here", "x")] * 2


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of a tensor's value on the host (int(), bool(), .item(), .tolist()): each a sync on CUDA."""

    READS = {torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist,
             torch.Tensor.__index__, torch.Tensor.__float__}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["qwen2", "gqa-qwen3"])
def test_the_fixed_shape_decode_samples_what_the_growing_decode_samples_without_a_host_read_per_token(tokenizer,
                                                                                                       kind,
                                                                                                       monkeypatch):
    """Rows that end at different lengths: the same completions, masks, widths and sampler log-probs; the growing
    decode reads the device every token (and drops finished rows), the fixed one every STOP_CHECK_EVERY tokens. Its
    attention reads the filled positions in buckets of 8 here, so that the decode crosses several."""
    monkeypatch.setattr(lean_decoder, "ATTEND_BUCKET", 8)
    if kind == "qwen2":
        model = tiny_model(tokenizer, hidden=32, layers=2)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id))
    assert lean_decoder.supports(model)
    params = SamplingParams(max_new_tokens=40, temperature=1.3)
    runs, reads = [], []
    for fixed in (False, True):
        generator = TransformersGenerator(model, tokenizer, params, seed=5, fixed_shape=fixed)
        with _HostReads() as host:
            runs.append(generator.generate(_prompts(tokenizer)))
        reads.append(host.count)
    growing, fixed = runs
    lengths = growing.completion_mask.sum(1)
    assert lengths.min() < lengths.max() <= 40 and growing.is_eos.any()  # rows end at different steps
    assert torch.equal(fixed.completion_ids, growing.completion_ids)
    assert torch.equal(fixed.completion_mask, growing.completion_mask)
    assert torch.allclose(fixed.sampler_logprobs, growing.sampler_logprobs, atol=1e-5)
    steps = int(lengths.max())
    assert reads[0] >= steps and reads[1] <= steps // STOP_CHECK_EVERY + 6, reads


def test_the_fixed_shape_step_traces_as_one_graph_for_every_token(tokenizer, monkeypatch):
    """torch.compile with fullgraph=True (dynamo's trace, no graph break: no host read, no Python value of the
    device's) traces the fixed-shape step once and runs every later token on that trace with the logits of the
    eager step; the growing step's cache width changes every token, and it is traced again each time. The weights
    as CUDA reads them (no oneDNN packing, a CPU-only path)."""
    import torch._dynamo

    monkeypatch.setattr(onednn, "_OP", False)
    model = tiny_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2)
    n, p, steps = 3, 5, 4
    ids = torch.randint(4, 90, (n, p), generator=torch.Generator().manual_seed(0))
    mask = torch.ones((n, p), dtype=torch.bool)
    mask[1, :2] = False
    tokens = torch.randint(4, 90, (steps, n), generator=torch.Generator().manual_seed(1))
    traces = {}
    with torch.no_grad():
        for fixed in (True, False):
            torch._dynamo.reset()
            frames = []
            decoders = [lean_decoder.LeanDecoder(model, mask, steps, fixed_shape=fixed) for _ in range(2)]
            for decoder in decoders:
                decoder.attend_bucket = None  # the whole cache, as the CUDA graph captures the step
                decoder.prefill(ids, positions_from_mask(mask))

            def count(graph_module, example_inputs):
                frames.append(1)
                return graph_module.forward

            traced = torch.compile(decoders[0].step, fullgraph=True, backend=count, dynamic=False)
            positions = positions_from_mask(mask)[:, -1:] + 1
            for t in range(steps):
                got = traced(tokens[t], positions)
                want = decoders[1].step(tokens[t], positions)
                assert torch.allclose(got, want, atol=1e-5)
                positions = positions + 1
            traces[fixed] = len(frames)
    assert traces[True] == 1 and traces[False] == steps, traces


def test_a_bf16_run_decodes_in_bf16_with_a_bf16_cache_where_the_products_take_it(tokenizer, monkeypatch):
    """A bf16 run over float32 weights, on a device whose products take the compute dtype (the CPU standing in for
    CUDA): the lean decoder's KV cache is bf16 and its logits are the model's own forward under the bf16 autocast
    (what TRL's generate runs under); the model's own decode runs under that autocast too. On the CPU itself the run's dtype does
    not reach the decode (float32, oneDNN's path)."""
    monkeypatch.setattr(output_products, "LOW_PRECISION_DEVICES", {"cpu", "cuda"})
    model = tiny_model(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2).eval()
    n, p = 3, 6
    ids = torch.randint(4, 90, (n, p + 2), generator=torch.Generator().manual_seed(0))
    mask = torch.ones((n, p + 2), dtype=torch.bool)
    mask[2, :3] = False
    positions = positions_from_mask(mask)
    with torch.no_grad():
        for fixed in (False, True):
            decoder = lean_decoder.LeanDecoder(model, mask[:, :p], 2, fixed_shape=fixed, compute_dtype=torch.bfloat16)
            assert decoder.keys.dtype == decoder.values.dtype == torch.bfloat16
            ours = [decoder.prefill(ids[:, :p], positions[:, :p]).clone()]
            ours.append(decoder.step(ids[:, p], positions[:, p:p + 1]).clone())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                theirs = model(input_ids=ids[:, :p + 1], attention_mask=mask[:, :p + 1].long(),
                               position_ids=positions[:, :p + 1]).logits[:, p - 1:p + 1].float()
            in_float32 = model(input_ids=ids[:, :p + 1], attention_mask=mask[:, :p + 1].long(),
                               position_ids=positions[:, :p + 1]).logits[:, p - 1:p + 1]
            ours = torch.stack(ours, 1)
            assert ours.dtype == torch.float32
            # the autocast's logits, nearer to them than to the float32 forward's, and at most a bf16 unit in the
            # last place of the largest logit away: the fixed-shape step's attention over its preallocated cache sums
            # in another order, which can tip a value to its neighbouring bf16 value (seen on an AVX2-only CPU)
            assert (ours - theirs).abs().max() <= 2 ** -7 * theirs.abs().max(), fixed
            assert (ours - theirs).abs().mean() < 0.5 * (ours - in_float32).abs().mean(), fixed
    generator = TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=3), lean=False,
                                      compute_dtype=torch.bfloat16)
    stepper = generator._stepper(mask[:, :p], 3)
    stepper.prefill(ids[:, :p], positions[:, :p])
    # under the autocast, as in TRL's generate: the values come from a bf16 product (some transformers versions keep
    # them in a float32 cache, and the keys, rotated by float32 cos/sin, are float32 there)
    values = stepper.cache.layers[0].values
    assert torch.equal(values, values.bfloat16().to(values.dtype))
    monkeypatch.setattr(output_products, "LOW_PRECISION_DEVICES", {"cuda"})
    assert TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=3),
                                 compute_dtype=torch.bfloat16).compute_dtype is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (the GPU kit runs this)")
def test_on_cuda_the_captured_step_samples_what_the_eager_fixed_step_samples(tokenizer):
    model = tiny_model(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2).cuda()
    params = SamplingParams(max_new_tokens=24, temperature=1.2)
    runs = []
    for graphed in (False, True):
        generator = TransformersGenerator(model, tokenizer, params, seed=2, fixed_shape=True)
        if not graphed:
            generator._stepper = lambda mask, new, g=generator: lean_decoder.LeanDecoder(
                g.model, mask, new, fixed_shape=True)
        runs.append(generator.generate(_prompts(tokenizer)))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.allclose(runs[0].sampler_logprobs, runs[1].sampler_logprobs, atol=1e-5)
