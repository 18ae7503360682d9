import pytest
import torch

from posttrain.configs import GRPOConfig
from posttrain.generation import SamplingParams
from posttrain.generation.sampling import filter_logits, mix64, mix64_int, row_streams, sample, stream_uniforms
from posttrain.generation.transformers_backend import ModelStepper, TransformersGenerator
from posttrain.models.logprobs import token_logprobs


def _prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "a much longer prompt here", "x")]


def test_rollouts_shapes_masks_and_sampler_logprobs(tokenizer, model):
    gen = TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=12, temperature=0.8), seed=1)
    r = gen.generate(_prompts(tokenizer) * 2)
    n, c = r.completion_ids.shape
    assert n == 6 and c <= 12 and r.prompt_ids.shape == r.prompt_mask.shape
    assert not r.prompt_mask[:, 0].all()  # left padding
    for row in range(n):
        length = int(r.completion_mask[row].sum())
        if r.is_eos[row]:
            assert r.completion_ids[row, length - 1] == tokenizer.eos_token_id
        else:
            assert length == 12
        assert (r.completion_ids[row, length:] == tokenizer.pad_token_id).all()
    # the sampler's log-probs are the training forward's (temperature applied to both)
    logps, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.8)
    assert torch.allclose(logps[r.completion_mask], r.sampler_logprobs[r.completion_mask], atol=1e-4)


def test_min_new_tokens_and_early_stop(tokenizer):
    from transformers import Qwen2ForCausalLM

    from posttrain.testing import tiny_model

    class EagerToEnd(Qwen2ForCausalLM):
        """EOS is (all but) certain at every position."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits[..., tokenizer.eos_token_id] += 100.0
            return out

    model = tiny_model(tokenizer, hidden=32, layers=1, model_class=EagerToEnd)
    gen = TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=10, min_new_tokens=3), seed=0)
    r = gen.generate(_prompts(tokenizer))
    assert r.completion_mask.sum(1).tolist() == [4, 4, 4]  # 3 forced tokens, then EOS; loop stopped there
    assert r.completion_ids.size(1) == 4 and r.is_eos.all()


def test_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    tokens, logp = sample(filter_logits(logits, SamplingParams(max_new_tokens=1, top_k=1)))
    assert tokens.tolist() == [1, 0] and torch.allclose(logp, torch.zeros(2))


def test_top_p_and_min_p_filters():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), SamplingParams(max_new_tokens=1, top_p=0.75)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.75, 0.8 covers it
    kept = filter_logits(probs.log(), SamplingParams(max_new_tokens=1, min_p=0.5)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # >= 0.25


@pytest.mark.parametrize("vocab", [3, 4500])  # one-level draw, and the two-level one (blocks of 2,048)
def test_sampling_frequencies_follow_the_distribution(vocab):
    probs = torch.full((vocab,), 0.05 / max(vocab - 3, 1))
    heavy = torch.tensor([0, vocab // 2, vocab - 1])  # in the first, a middle and the ragged last block
    probs[heavy] = torch.tensor([0.55, 0.3, 0.1]) + (0.05 if vocab == 3 else 0.0) * torch.tensor([1.0, 0, 0])
    rows = 8000
    uniforms = stream_uniforms(row_streams(0, torch.arange(rows)), 0)  # the decoder's counter-based numbers
    tokens, logp = sample(probs.log().expand(rows, vocab), uniforms)
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    assert torch.allclose(freq[heavy], probs[heavy], atol=0.02)
    assert torch.allclose(logp, probs.log()[tokens], atol=1e-5)  # each draw's log-prob is its token's


def test_generation_kwargs_are_used_or_rejected():
    cfg = GRPOConfig(generation_kwargs={"min_new_tokens": 4, "top_k": 7})
    params = SamplingParams.from_config(cfg)
    assert params.min_new_tokens == 4 and params.top_k == 7
    with pytest.raises(ValueError, match="num_beams=4 asks for beam search.*raise num_generations"):
        SamplingParams.from_config(GRPOConfig(generation_kwargs={"num_beams": 4}))
    # TRL's test_train_with_generation_kwargs: beams with a length penalty are refused for the same reason
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams.from_config(GRPOConfig(generation_kwargs={"do_sample": True, "num_beams": 2,
                                                                 "length_penalty": -0.1}))
    # at one beam these keys rank nothing, as in generate: accepted and the samples unchanged
    one_beam = SamplingParams.from_config(GRPOConfig(generation_kwargs={"num_beams": 1, "length_penalty": -0.1,
                                                                        "early_stopping": True}))
    assert one_beam == SamplingParams.from_config(GRPOConfig())
    for kwargs, message in (({"do_sample": False}, "do_sample=False"), ({"temperature": -1}, "temperature=-1"),
                            ({"bad_words_ids": [[3, 4]]}, "several tokens"), ({"eos_token_id": "x"}, "token id")):
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_config(GRPOConfig(generation_kwargs=kwargs))
    # generate's names and vLLM's both map onto the sampler; caching keys change nothing
    params = SamplingParams.from_config(GRPOConfig(generation_kwargs={
        "stop_token_ids": [5], "suppress_tokens": [7], "bad_words_ids": [[8]], "begin_suppress_tokens": [9],
        "max_tokens": 6, "use_cache": True, "do_sample": True}))
    assert (params.eos_token_ids, params.suppress_tokens, params.begin_suppress_tokens) == ((5,), (8,), (9,))
    assert params.max_new_tokens == 6


def test_suppressed_begin_suppressed_and_stop_tokens_are_honoured(tokenizer):
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=1)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    stop = tokenizer.convert_tokens_to_ids("a")
    params = SamplingParams(max_new_tokens=12, temperature=3.0, suppress_tokens=tuple(digits[1:]),
                            begin_suppress_tokens=(digits[0],), eos_token_ids=(stop,))
    prompt = tokenizer("1+2=", add_special_tokens=False).input_ids
    out = TransformersGenerator(model, tokenizer, params, seed=0).generate([prompt] * 64)
    sampled = out.completion_ids[out.completion_mask]
    assert not torch.isin(sampled, torch.tensor(digits[1:])).any()  # never sampled
    assert (out.completion_ids[:, 0] != digits[0]).all()  # never first
    assert (sampled == digits[0]).any()  # but allowed later (the temperature spreads the draws)
    ended = out.is_eos.nonzero().squeeze(1)
    lengths = out.completion_mask.sum(1)
    assert len(ended) and (out.completion_ids[ended, lengths[ended] - 1] == stop).all()  # "a" ends a completion


def _llama_family(tokenizer, kind: str):
    """A tiny Llama-family model: "llama", "llama-dynamic-rope" (cos/sin recomputed per call rather than
    tabled) or "qwen3" (per-head q/k norms)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **sizes))
    config = LlamaConfig(**sizes)
    if kind == "llama-dynamic-rope":
        config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = LlamaForCausalLM(config)
    assert model.model.rotary_emb.rope_type == ("dynamic" if kind == "llama-dynamic-rope" else "default")
    return model


@pytest.mark.parametrize("make", ["qwen2", "qwen2-unfused", "llama", "llama-dynamic-rope", "qwen3", "qwen2-lora"])
def test_lean_decoder_samples_what_the_model_forward_samples(tokenizer, make, monkeypatch):
    """Same seed, same tokens and sampler log-probs, whether decoding runs through LeanDecoder or the model.
    The prompts come twice, so the shared prefill is used."""
    from posttrain.generation import lean_decoder
    from posttrain.testing import tiny_model

    if make in ("llama", "llama-dynamic-rope", "qwen3"):
        model = _llama_family(tokenizer, make)
    else:
        model = tiny_model(tokenizer, hidden=32, layers=2)
    if make == "qwen2-unfused":
        monkeypatch.setattr(lean_decoder, "FUSED_COPY_BUDGET", 0)
    if make == "qwen2-lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert lean_decoder.supports(model)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, min_new_tokens=10)
    runs = [TransformersGenerator(model, tokenizer, params, seed=3, lean=lean).generate(_prompts(tokenizer) * 2)
            for lean in (True, False)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.allclose(runs[0].sampler_logprobs, runs[1].sampler_logprobs, atol=1e-5)


@pytest.mark.parametrize("lora_dropout", [None, 0.5])
def test_a_training_model_decodes_as_in_eval_mode_switching_only_where_a_part_reads_the_mode(tokenizer,
                                                                                              lora_dropout):
    """A plain model's lean decode calls only parts that never read `training` (Linear, Embedding, RMSNorm, SiLU),
    so it decodes in train mode without a switch (transformers' train()/eval() re-kernelize at each one); LoRA's
    dropout reads it, so that decode switches to eval mode and back. Either way the tokens are eval mode's."""
    from posttrain.generation import lean_decoder
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=2)
    if lora_dropout is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=lora_dropout,
                                                           init_lora_weights=False))
    assert lean_decoder.reads_no_training_flag(model) == (lora_dropout is None)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, min_new_tokens=8)
    model.eval()
    in_eval = TransformersGenerator(model, tokenizer, params, seed=5).generate(_prompts(tokenizer))
    model.train()
    switches = []
    train = model.train
    model.train = lambda mode=True: switches.append(mode) or train(mode)
    in_train = TransformersGenerator(model, tokenizer, params, seed=5).generate(_prompts(tokenizer))
    assert switches == ([] if lora_dropout is None else [False, True]) and model.training
    assert torch.equal(in_train.completion_ids, in_eval.completion_ids)
    assert torch.equal(in_train.sampler_logprobs, in_eval.sampler_logprobs)


def test_lean_decoder_builds_what_its_model_has():
    """The parts the shared prefill, the cos/sin table and the fused products rely on are in place."""
    from posttrain.generation import lean_decoder
    from posttrain.models.forwards import positions_from_mask
    from posttrain.testing import tiny_model

    model = tiny_model(hidden=32, layers=2)
    mask = torch.tensor([[False, True, True], [True, True, True], [False, True, True]])
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6]])
    with torch.no_grad():
        decoder = lean_decoder.LeanDecoder(model, mask, 4)
        logits = decoder.prefill(ids, positions_from_mask(mask))
    assert decoder.rope_table is not None and decoder.rope_table[0].shape == (3 + 4, 8)  # [S, D]
    assert torch.equal(logits[0], logits[2])  # rows 0 and 2 share one prefill
    assert torch.equal(decoder.keys[:, 0, :, :3], decoder.keys[:, 2, :, :3])  # the prompt's 3 cache positions
    assert torch.equal(decoder.values[:, 0, :, :3], decoder.values[:, 2, :, :3])
    assert not torch.equal(decoder.keys[:, 0, :, :3], decoder.keys[:, 1, :, :3])
    x = torch.randn(2, 3, 4, 8)
    rotated = x @ decoder.rotate_half
    assert torch.equal(rotated, torch.cat((-x[..., 4:], x[..., :4]), dim=-1))


@pytest.mark.parametrize("gathered", [False, True])
def test_dropping_finished_rows_moves_them_within_the_one_cache(tokenizer, gathered, monkeypatch):
    """keep_rows compacts the KV cache in place: a row at a time it allocates less than one row's cache (the
    profiler's CPU memory record; before: a second cache of the kept rows beside the first, and the gather's
    temporary); gathered at once (a cache this small), the kept rows' filled keys and values once; and the kept rows
    decode the next tokens exactly as they would have in the uncompacted cache."""
    from torch.profiler import ProfilerActivity, profile

    from posttrain.generation import lean_decoder
    from posttrain.models.forwards import positions_from_mask
    from posttrain.testing import tiny_model

    if not gathered:
        monkeypatch.setattr(lean_decoder, "GATHER_BUDGET", 0)
    model = tiny_model(tokenizer, hidden=64, layers=2)
    n, p, steps = 12, 6, 8
    ids = torch.randint(4, 90, (n, p), generator=torch.Generator().manual_seed(0))
    mask = torch.ones((n, p), dtype=torch.bool)
    token = torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([1, 2, 5, 6, 9, 11])
    with torch.no_grad():
        whole = lean_decoder.LeanDecoder(model, mask, steps)
        whole.prefill(ids, positions_from_mask(mask))
        compacted = lean_decoder.LeanDecoder(model, mask, steps)
        compacted.prefill(ids, positions_from_mask(mask))
        for _ in range(2):
            positions = torch.full((n, 1), whole.length)
            whole.step(token, positions)
            compacted.step(token, positions)
        one_row = compacted.keys[:, 0].numel() * compacted.keys.element_size() * 2  # keys and values
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            compacted.keep_rows(keep)
        allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
        # the cache is a view of the kept rows now; their filled keys and values, and the key mask, once each
        kept = 2 * compacted.keys[:, :, :, :compacted.length].nbytes + compacted.key_mask.nbytes
        assert allocated <= kept if gathered else allocated < one_row, (allocated, kept, one_row)
        positions = torch.full((keep.numel(), 1), whole.length)
        after = compacted.step(token[keep], positions).clone()
        expected = whole.step(token, torch.full((n, 1), whole.length))[keep]
    assert torch.allclose(after, expected, atol=1e-5)


def test_grouped_query_attention_never_repeats_the_keys_and_values(tokenizer, monkeypatch):
    """A decode step of a grouped-query model (4 query heads over 2 kv heads) allocates less than its layers' keys and
    values repeated per query head (the profiler's CPU memory record; before: SDPA's enable_gqa with a mask took the
    math kernel, which repeats them on every layer and token), and samples the same logits as the model's forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from posttrain.generation import lean_decoder
    from posttrain.models.forwards import positions_from_mask
    from posttrain.testing import tiny_model

    monkeypatch.setattr(lean_decoder, "GROUPED_QUERY_DEVICES", {"cpu"})  # as on CUDA
    model = tiny_model(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2)
    n, p = 4, 192
    ids = torch.randint(4, 90, (n, p), generator=torch.Generator().manual_seed(0))
    mask = torch.ones((n, p), dtype=torch.bool)
    mask[1, :10] = False  # a left-padded row: the mask matters
    token = torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        decoder = lean_decoder.LeanDecoder(model, mask, 4)
        decoder.prefill(ids, positions_from_mask(mask))
        positions = positions_from_mask(mask)[:, -1:] + 1
        # SDPA's math kernel, which CUDA takes for enable_gqa with a mask (the CPU's own kernel reads the heads grouped)
        with sdpa_kernel(SDPBackend.MATH), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logits = decoder.step(token, positions).clone()
        allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
        layers = decoder.keys.size(0)  # keys and values repeated per query head, one layer's times the layers
        repeated = layers * n * decoder.q_heads * (p + 1) * decoder.head_dim * decoder.keys.element_size() * 2
        assert allocated < repeated, (allocated, repeated)
        full = torch.cat([ids, token[:, None]], 1)
        attention = torch.cat([mask, torch.ones((n, 1), dtype=torch.bool)], 1)
        expected = model(input_ids=full, attention_mask=attention.long(),
                         position_ids=positions_from_mask(attention)).logits[:, -1]
    assert torch.allclose(logits, expected.float(), atol=1e-4)


def test_lean_decoder_refuses_models_it_does_not_reproduce(tokenizer):
    """A Qwen2 subclass that changes its logits, and a sliding-window config, decode through the model's forward."""
    from transformers import Qwen2ForCausalLM

    from posttrain.generation import lean_decoder
    from posttrain.testing import tiny_model

    class Shifted(Qwen2ForCausalLM):
        def forward(self, *args, **kw):
            out = super().forward(*args, **kw)
            out.logits[..., 5] += 1.0
            return out

    assert not lean_decoder.supports(tiny_model(tokenizer, hidden=32, layers=1, model_class=Shifted))
    windowed = tiny_model(tokenizer, hidden=32, layers=1)
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 4
    assert not lean_decoder.supports(windowed)
    gen = TransformersGenerator(windowed, tokenizer, SamplingParams(max_new_tokens=4), seed=0)
    assert isinstance(gen._stepper(torch.ones(2, 3, dtype=torch.bool), 4), ModelStepper)


def test_a_lean_decoder_check_that_raises_is_said_once(tokenizer, monkeypatch, caplog):
    """A model the decoder seems to know but cannot run: its decodes go through its forward, with one warning."""
    from posttrain.generation import lean_decoder
    from posttrain.testing import tiny_model

    def fails(self, prompt_ids, positions):
        raise IndexError("index 7 is out of bounds\nmore")

    monkeypatch.setattr(lean_decoder.LeanDecoder, "prefill", fails)
    model = tiny_model(tokenizer, hidden=32, layers=1)
    with caplog.at_level("WARNING", logger="posttrain"):
        assert not lean_decoder.supports(model) and not lean_decoder.supports(model)
    assert [r.getMessage() for r in caplog.records] == [
        "Qwen2ForCausalLM: its decodes run through its own forward, not the lean decoder, because its one-time check "
        "raised IndexError: index 7 is out of bounds."]


def test_counter_based_streams_are_splitmix64_and_uniform():
    import random

    values = [random.Random(0).getrandbits(64) - (1 << 63) for _ in range(2000)] + [0, -1, (1 << 63) - 1, -(1 << 63)]
    assert mix64(torch.tensor(values)).tolist() == [mix64_int(v) for v in values]  # int64 wraps as uint64 would
    assert mix64_int(0) & ((1 << 64) - 1) == 0xE220A8397B1DCDAF  # splitmix64's first output for seed 0
    u = stream_uniforms(row_streams(11, torch.arange(50_000)), 7).squeeze(1)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    # a row's numbers depend on its key and the step, not on its neighbours
    some = stream_uniforms(row_streams(11, torch.tensor([49_999, 3])), 7).squeeze(1)
    assert some.tolist() == [float(u[49_999]), float(u[3])]
    assert not torch.equal(stream_uniforms(row_streams(11, torch.arange(4)), 8),
                           stream_uniforms(row_streams(11, torch.arange(4)), 7))


def test_a_row_samples_the_same_completion_in_any_batch(tokenizer):
    """What makes completions independent of the number of processes: a row's completion depends on its prompt,
    its key and the round's seed only, not on the rows beside it."""
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer)
    gen = TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=8))
    prompts = [[5, 76, 5, 84]] * 3 + [[7, 76, 9, 84, 11]] * 3
    whole = gen.generate_seeded(prompts, 21)
    first = gen.generate_seeded(prompts[:2], 21, row_keys=[0, 1])
    rest = gen.generate_seeded(prompts[2:], 21, row_keys=[2, 3, 4, 5])
    for rows, part in ((slice(0, 2), first), (slice(2, 6), rest)):
        for r, row in zip(range(6)[rows], range(len(part))):
            n = int(whole.completion_mask[r].sum())
            assert n == int(part.completion_mask[row].sum())
            assert whole.completion_ids[r, :n].tolist() == part.completion_ids[row, :n].tolist()
            assert torch.allclose(whole.sampler_logprobs[r, :n], part.sampler_logprobs[row, :n], atol=1e-5)
    # copies of one prompt differ (their keys do)
    assert len({tuple(whole.completion_ids[r].tolist()) for r in range(3)}) > 1


@pytest.mark.parametrize("lean", [True, False])
def test_finished_rows_leave_the_batch_and_the_rest_sample_what_they_would_have(tokenizer, lean, monkeypatch):
    """Decode compaction: rows that produced EOS leave the decode batch; every row's tokens and sampler log-probs
    equal those of a decode that keeps every row to the end (LeanDecoder and the model's own cache alike), with a
    repetition penalty (its per-row seen tokens shrink with the batch)."""
    from posttrain.generation import lean_decoder
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=2)
    with torch.no_grad():  # a likely EOS whose chance depends on the context: completions end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[tokenizer.eos_token_id] * 60.0
    assert lean_decoder.supports(model)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, repetition_penalty=1.2)
    prompts = _prompts(tokenizer) * 6  # 18 rows

    def run():
        gen = TransformersGenerator(model, tokenizer, params, seed=5, lean=lean)
        return gen.generate(prompts), gen.decoded_row_steps

    compacted, steps = run()
    lengths = compacted.completion_mask.sum(1)
    assert len(set(lengths.tolist())) >= 4 and compacted.is_eos.sum() >= 6  # the test needs spread lengths
    assert steps == int(lengths.sum())  # one model row per token each row generated, none after its EOS
    stepper = lean_decoder.LeanDecoder if lean else ModelStepper
    monkeypatch.setattr(stepper, "keep_rows", lambda self, rows: False)
    every_row, steps_uncompacted = run()
    assert steps_uncompacted == len(prompts) * compacted.completion_ids.size(1)
    assert torch.equal(compacted.completion_ids, every_row.completion_ids)
    assert torch.equal(compacted.completion_mask, every_row.completion_mask)
    assert torch.allclose(compacted.sampler_logprobs, every_row.sampler_logprobs, atol=1e-5)


def test_a_cache_whose_layers_cannot_drop_rows_keeps_them_and_samples_the_same(tokenizer):
    """NemotronH's cache has batch_select_indices, and its Mamba layer (LinearAttentionLayer) has none: dropping the
    finished rows raised AttributeError mid-run (after the layers before it had dropped theirs) whenever a row ended
    early. The decode keeps every row instead, and samples what it samples with the rows kept."""
    from posttrain.generation.transformers_backend import can_select_rows
    from posttrain.testing import tiny_architecture

    model = tiny_architecture("nemotron_h", tokenizer)
    with torch.no_grad():  # a likely EOS: rows end at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[tokenizer.eos_token_id] * 60.0
    cache = model(input_ids=torch.tensor([[5, 6]]), use_cache=True).past_key_values
    assert callable(getattr(cache, "batch_select_indices", None)) and not can_select_rows(cache)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    out = TransformersGenerator(model, tokenizer, params, seed=5, lean=False).generate(_prompts(tokenizer) * 3)
    lengths = out.completion_mask.sum(1)
    assert len(set(lengths.tolist())) >= 2 and out.is_eos.any()  # some rows ended before others
    again = TransformersGenerator(model, tokenizer, params, seed=5, lean=False).generate(_prompts(tokenizer) * 3)
    assert torch.equal(out.completion_ids, again.completion_ids)


def test_lean_decoder_with_onednn_samples_what_it_samples_with_torch_gemm(tokenizer, monkeypatch):
    """On CPU the decoder's products go through oneDNN's linear on packed weights (2-3x faster for a decode step's
    rows); the tokens and log-probs are those of torch's GEMM, and a weight budget of 0 (weights read in place)
    changes nothing either. A decode of fewer than PACK_MIN_NEW_TOKENS tokens packs nothing."""
    from posttrain.generation import lean_decoder
    from posttrain.models import onednn
    from posttrain.testing import tiny_model

    if onednn.linear_op() is None:
        pytest.skip("this torch has no oneDNN linear")
    model = tiny_model(tokenizer, hidden=32, layers=2)
    assert lean_decoder.supports(model)  # its check (a decode of its own) done before counting
    params = SamplingParams(max_new_tokens=lean_decoder.PACK_MIN_NEW_TOKENS, temperature=0.9,
                            min_new_tokens=lean_decoder.PACK_MIN_NEW_TOKENS)  # long enough a decode to pack

    def run():
        return TransformersGenerator(model, tokenizer, params, seed=4).generate(_prompts(tokenizer) * 3)

    calls, packer = [], lean_decoder.Packer
    monkeypatch.setattr(lean_decoder, "Packer", type("Counting", (packer,), {
        "__call__": lambda self, w: calls.append(w.shape) or packer.__call__(self, w)}))
    reorder, packed = torch.ops.mkldnn._reorder_linear_weight, []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, rows: packed.append(w) or reorder(w, rows))
    through_onednn = run()
    assert len(calls) == 2 * 4 + 1  # per layer q/k/v (fused), o, gate/up (fused), down; and the output layer
    assert len(packed) == len(calls)  # all of them packed
    packed.clear()
    short = SamplingParams(max_new_tokens=lean_decoder.PACK_MIN_NEW_TOKENS - 1)
    TransformersGenerator(model, tokenizer, short, seed=4).generate(_prompts(tokenizer))
    assert not packed  # a short decode reads the weights in place
    monkeypatch.setattr(lean_decoder, "PACKED_COPY_BUDGET", 0)
    in_place = run()
    monkeypatch.setattr(onednn, "_OP", False)
    gemm = run()
    for other in (in_place, gemm):
        assert torch.equal(through_onednn.completion_ids, other.completion_ids)
        assert torch.allclose(through_onednn.sampler_logprobs, other.sampler_logprobs, atol=1e-5)


def test_left_pad_and_completion_lists_read_each_row_as_it_is():
    """left_pad takes lists, tuples and tensors, empty prompts too; completion_lists gives the masked tokens of each
    row, whether the mask is a prefix of the row (up to EOS) or has holes."""
    from posttrain.generation import Rollouts
    from posttrain.generation.protocol import left_pad

    ids, mask = left_pad([[5, 6, 7], (8,), torch.tensor([9, 10]), []], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10], [0, 0, 0]] and ids.dtype == torch.long
    assert mask.tolist() == [[True] * 3, [False, False, True], [False, True, True], [False] * 3]
    completion_ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for completion_mask, expected in (([[True, True, False], [True, True, True]], [[1, 2], [4, 5, 6]]),
                                      ([[True, False, True], [False, False, False]], [[1, 3], []])):
        completion_mask = torch.tensor(completion_mask)
        rollouts = Rollouts(ids[:2], mask[:2], completion_ids, completion_mask, completion_mask[:, -1],
                            torch.zeros(2, 3))
        assert rollouts.completion_lists() == expected
        assert expected == [row[keep].tolist() for row, keep in zip(completion_ids, completion_mask)]
