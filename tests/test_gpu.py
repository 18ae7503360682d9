"""The CUDA paths: the chunked output layer (values, gradients, memory), bf16 numerics of the output layer and of GRPO,
SFT and DPO steps, shared prompts in rows (a custom attention mask to sdpa), the sampler's draws and a whole decode on
the device, and checkpoint resume there.

Marked `gpu`; bench/gpu/run.sh runs them on the GPU machine (`pytest -m gpu tests/test_gpu.py`). Without a CUDA
device they skip at once, unless POSTTRAIN_GPU_TESTS_ON_CPU=1 (the kit's --dry-run sets it): then they run on the CPU,
so that the dry run exercises them for real. There, comparisons of the device with the CPU compare the CPU with
itself, and the one check that needs CUDA's allocator (peak memory) skips.
"""

import math
import os

import pytest

pytestmark = pytest.mark.gpu
ON_CPU = "POSTTRAIN_GPU_TESTS_ON_CPU"


@pytest.fixture(scope="session")
def device():
    """CUDA when there is one; the CPU with POSTTRAIN_GPU_TESTS_ON_CPU=1; else the test skips. Session-scoped and
    first in each test's arguments, so that a skip costs no other fixture."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get(ON_CPU) == "1":
        return torch.device("cpu")
    pytest.skip(f"needs a CUDA device (or {ON_CPU}=1 to run on the CPU, as bench/gpu/run.sh --dry-run does)")


def _output_layer(device, rows: int, hidden: int, vocab: int, seed: int = 0, with_bias: bool = False):
    """Random output-layer inputs on `device`: h [rows, hidden], W [vocab, hidden], b [vocab] or None, ids [rows],
    each float32 and requiring grad."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.05).to(device).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).to(device).requires_grad_() if with_bias else None
    ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    return h, w, b, ids


def _sizes(device, monkeypatch) -> tuple[int, int, int]:
    """(rows, hidden, vocab) spanning several chunks with a ragged last one: on CUDA Qwen's vocabulary with the
    shipped chunk size (220 rows a chunk), on the CPU a small one with chunks of 40 rows."""
    from posttrain.models import chunked

    if device.type == "cuda":
        return 1024, 256, 151936
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 40 * 4096)
    return 96, 32, 4096


@pytest.mark.parametrize("prediction", ["none", "right", "partly wrong"])
def test_chunked_output_layer_on_the_device_equals_whole_logits(device, monkeypatch, prediction):
    """Log-probs, entropy and the gradients of h, W and b through the chunked layer equal autograd through the whole
    float32 logits, on the device, with the loss gradient predicted in the forward or not (a wrong prediction is
    corrected in the backward)."""
    import torch

    from posttrain.models.chunked import chunked_token_logprobs

    rows, hidden, vocab = _sizes(device, monkeypatch)
    h, w, b, ids = _output_layer(device, rows, hidden, vocab, with_bias=True)
    g = torch.randn(rows, generator=torch.Generator().manual_seed(1)).to(device)
    guess = {"none": None, "right": g,
             "partly wrong": torch.where(torch.arange(rows, device=device) % 3 == 0, g + 1.0, g)}[prediction]
    predict = None if guess is None else (lambda rows_, logps: guess[rows_])
    logps, entropy = chunked_token_logprobs(h, w, b, ids, 0.7, predict_grad=predict)
    ours = torch.autograd.grad((logps * g).sum(), (h, w, b))
    log_p = ((h @ w.T + b) / 0.7).log_softmax(-1)
    ref_logps = log_p.gather(-1, ids[:, None]).squeeze(-1)
    theirs = torch.autograd.grad((ref_logps * g).sum(), (h, w, b))
    assert logps.device.type == device.type and logps.dtype == torch.float32
    torch.testing.assert_close(logps, ref_logps.detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1).detach(), atol=1e-4, rtol=0)
    for name, a, c in zip("hwb", ours, theirs):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4, msg=f"gradient of {name}")


def test_chunked_output_layer_on_cuda_never_holds_the_whole_logits(device):
    """The point of the chunks, measured by CUDA's allocator: forward + backward over 4,096 positions x 151,936
    vocabulary takes under a quarter of the [M, V] float32 logits beyond its inputs."""
    import torch

    if device.type != "cuda":
        pytest.skip("peak device memory is read from CUDA's allocator")
    from posttrain.models.chunked import chunked_token_logprobs

    h, w, _, ids = _output_layer(device, 4096, 128, 151936)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logps, _ = chunked_token_logprobs(h, w, None, ids, with_entropy=True)
    logps.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    whole_logits = 4096 * 151936 * 4
    assert extra < whole_logits / 4, f"{extra / 2**20:.0f} MiB beyond the inputs, whole logits: {whole_logits >> 20}"
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()


def test_chunked_logprobs_under_bf16_autocast_keep_float32_accuracy(device, monkeypatch):
    """What bf16=True does to the output layer: hidden states in bf16 (the body's output), the layer's float32 master
    weight, bf16 autocast around it. The chunked path computes in float32 and stays within 1e-4 of a float64
    computation on the same values; the whole logits under autocast (a bf16 product) are off by far more."""
    import torch

    from posttrain.models.chunked import chunked_token_logprobs

    rows, hidden, vocab = _sizes(device, monkeypatch)
    h, w, _, ids = _output_layer(device, rows, hidden, vocab)
    h_bf16 = h.detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        logps, _ = chunked_token_logprobs(h_bf16, w, None, ids, with_entropy=False)
        naive = (h_bf16 @ w.T).float().log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    logps.sum().backward()
    exact_log_p = (h_bf16.detach().double() @ w.detach().double().T).log_softmax(-1)
    exact = exact_log_p.gather(-1, ids[:, None]).squeeze(-1)
    chunked_error = float((logps.detach().double() - exact).abs().max())
    naive_error = float((naive.detach().double() - exact).abs().max())
    assert logps.dtype == torch.float32 and chunked_error < 1e-4, chunked_error
    assert naive_error > 10 * chunked_error, (naive_error, chunked_error)
    assert h_bf16.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32  # each input's own dtype
    d_logits = torch.nn.functional.one_hot(ids, vocab).double() - exact_log_p.exp()
    exact_grad_w = d_logits.T @ h_bf16.detach().double()
    torch.testing.assert_close(w.grad.double(), exact_grad_w, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- sampling


def test_counter_based_streams_on_the_device_are_the_cpus(device):
    """The uniform numbers a row samples with are integer hashing (splitmix64 on int64): the device gives the CPU's
    bits exactly, which is what lets a row sample the same completion on any device or process."""
    import torch

    from posttrain.generation.sampling import row_streams, stream_uniforms

    keys = torch.arange(-5, 4000)
    on_cpu = row_streams(1234, keys)
    on_device = row_streams(1234, keys.to(device))
    assert torch.equal(on_device.cpu(), on_cpu)
    for step in (0, 1, 77, 10**6):
        assert torch.equal(stream_uniforms(on_device, step).cpu(), stream_uniforms(on_cpu, step))


@pytest.mark.parametrize("vocab", [3000, 50000])  # the one-level draw, and the two-level one (blocks of 2,048)
def test_the_device_draws_what_the_cpu_draws(device, vocab):
    """Same logits, same filters (temperature, top-k, top-p, min-p), same uniform numbers: the same tokens and
    log-probs on the device as on the CPU, and every draw inside its row's filter."""
    import torch

    from posttrain.generation import SamplingParams
    from posttrain.generation.sampling import filter_logits, row_streams, sample, stream_uniforms

    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(3)) * 3
    uniforms = stream_uniforms(row_streams(9, torch.arange(64)), 5)
    for params in (SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=1, temperature=0.7, top_k=50),
                   SamplingParams(max_new_tokens=1, top_p=0.9), SamplingParams(max_new_tokens=1, min_p=0.05)):
        cpu_filtered = filter_logits(logits, params)
        device_filtered = filter_logits(logits.to(device), params)
        assert torch.equal(device_filtered.isfinite().cpu(), cpu_filtered.isfinite()), params
        cpu_tokens, cpu_logps = sample(cpu_filtered, uniforms)
        tokens, logps = sample(device_filtered.clone(), uniforms.to(device), overwrite=True)
        assert tokens.device.type == device.type
        assert torch.equal(tokens.cpu(), cpu_tokens), params
        torch.testing.assert_close(logps.cpu(), cpu_logps, atol=1e-5, rtol=0)
        assert cpu_filtered.gather(-1, cpu_tokens[:, None]).isfinite().all()


@pytest.mark.parametrize("vocab", [3, 4500])
@pytest.mark.parametrize("numbers", ["counter-based", "device RNG"])
def test_draws_on_the_device_follow_the_distribution(device, vocab, numbers):
    """20,000 draws on the device from one distribution (heavy tokens in the first, a middle and the ragged last
    block), with the decoder's counter-based numbers or the device's own generator: each heavy token's frequency
    within 5 standard deviations of its probability."""
    import torch

    from posttrain.generation.sampling import row_streams, sample, stream_uniforms

    probs = torch.full((vocab,), 0.05 / max(vocab - 3, 1))
    heavy = torch.tensor([0, vocab // 2, vocab - 1])
    probs[heavy] = torch.tensor([0.55, 0.3, 0.1]) + (0.05 if vocab == 3 else 0.0) * torch.tensor([1.0, 0, 0])
    rows = 20000
    torch.manual_seed(0)
    uniforms = (stream_uniforms(row_streams(0, torch.arange(rows)), 0).to(device) if numbers == "counter-based"
                else None)
    tokens, logps = sample(probs.log().to(device).expand(rows, vocab), uniforms)
    freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / rows
    sigma = (probs[heavy].double() * (1 - probs[heavy].double()) / rows).sqrt()
    assert ((freq[heavy] - probs[heavy].double()).abs() < 5 * sigma).all(), (freq[heavy], probs[heavy])
    torch.testing.assert_close(logps.cpu(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)


def _prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "a much longer prompt here", "x")]


@pytest.mark.parametrize("lean", [True, False])
def test_a_decode_on_the_device_samples_what_the_cpu_samples(device, tokenizer, lean):
    """A whole decode (posttrain's LeanDecoder, or the model's own forward and cache) with the model on the device:
    the same completions as on the CPU for the same seed, the sampler's log-probs those of a training forward there,
    and a row's completion the same alone as in its batch."""
    import torch

    from posttrain.generation import SamplingParams
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.models.logprobs import token_logprobs
    from posttrain.testing import tiny_model

    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    prompts = _prompts(tokenizer) * 2
    on_cpu = TransformersGenerator(tiny_model(tokenizer, hidden=32, layers=2), tokenizer, params, seed=3,
                                   lean=lean).generate_seeded(prompts, 3)
    model = tiny_model(tokenizer, hidden=32, layers=2).to(device)
    generator = TransformersGenerator(model, tokenizer, params, seed=3, lean=lean)
    rollouts = generator.generate_seeded(prompts, 3)
    assert rollouts.completion_ids.device.type == device.type
    assert torch.equal(rollouts.completion_ids.cpu(), on_cpu.completion_ids)
    torch.testing.assert_close(rollouts.sampler_logprobs.cpu(), on_cpu.sampler_logprobs, atol=1e-4, rtol=0)
    logps, _ = token_logprobs(model, rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids,
                              rollouts.completion_mask, 0.9)
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(logps[mask], rollouts.sampler_logprobs[mask], atol=1e-4, rtol=0)
    alone = generator.generate_seeded(prompts[4:5], 3, row_keys=[4])
    n = int(rollouts.completion_mask[4].sum())
    assert alone.completion_ids[0, :n].tolist() == rollouts.completion_ids[4, :n].tolist()


# ---------------------------------------------------------------- bf16 steps


def _on(device) -> dict:
    """The config fields that put a run on `device`."""
    return {"use_cpu": device.type == "cpu"}


def _steps(trainer) -> list[dict]:
    return [r for r in trainer.state.log_history if "loss" in r]


def _assert_trained_on(trainer, device, before: dict) -> None:
    """The policy is on `device`, still float32 (bf16 autocast keeps float32 master weights), and every weight
    matrix moved."""
    import torch

    params = dict(trainer.policy.named_parameters())
    assert {p.device.type for p in params.values()} == {device.type}
    assert {p.dtype for p in params.values()} == {torch.float32}
    moved = [n for n, p in params.items() if p.dim() == 2 and not torch.equal(p.detach().cpu(), before[n])]
    assert len(moved) == len([p for p in params.values() if p.dim() == 2]), moved


def _weights(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def test_grpo_steps_in_bf16_on_the_device(device, tokenizer, addition_dataset, tmp_path):
    """Two GRPO steps with bf16=True: finite losses, every weight updated, and at step 1 (policy = reference) a KL
    that is the rounding of two bf16 passes over the same weights, not more."""
    from conftest import length_reward, tiny_config

    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=1)
    before = _weights(model)
    trainer = GRPOTrainer(model, length_reward, tiny_config(tmp_path, bf16=True, beta=0.04, **_on(device)),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    steps = _steps(trainer)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in steps)
    assert abs(steps[0]["kl"]) < 1e-3, steps[0]["kl"]
    _assert_trained_on(trainer, device, before)


def test_sft_loss_in_bf16_is_the_float32_loss_to_bf16_rounding(device, tokenizer, tmp_path):
    """SFT's step-1 loss (before any update) with bf16=True is the float32 run's within 1%, and the bf16 run trains."""
    from datasets import Dataset
    from test_sft_trainer import TEXTS, sft_config

    from posttrain.sft.trainer import SFTTrainer
    from posttrain.testing import tiny_model

    losses = {}
    for bf16 in (False, True):
        model = tiny_model(tokenizer, hidden=32, layers=1)
        before = _weights(model)
        trainer = SFTTrainer(model, args=sft_config(tmp_path / str(bf16), bf16=bf16, **_on(device)),
                             train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer)
        trainer.train()
        losses[bf16] = [r["loss"] for r in _steps(trainer)]
    assert all(math.isfinite(loss) for loss in losses[True])
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-2)
    _assert_trained_on(trainer, device, before)


def test_dpo_first_step_in_bf16_is_log_2_and_its_logps_the_float32_ones(device, tokenizer, tmp_path):
    """DPO's step 1 with bf16=True: the policy is the reference, so the loss is log 2 up to bf16 rounding, and the
    sequence log-probs are the float32 run's within 1%."""
    from datasets import Dataset
    from test_dpo_trainer import PAIRS, dpo_config

    from posttrain.dpo.trainer import DPOTrainer
    from posttrain.testing import tiny_model

    first = {}
    for bf16 in (False, True):
        model = tiny_model(tokenizer, hidden=32, layers=1)
        before = _weights(model)
        trainer = DPOTrainer(model, args=dpo_config(tmp_path / str(bf16), bf16=bf16, **_on(device)),
                             train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
        trainer.train()
        first[bf16] = _steps(trainer)[0]
    assert first[True]["loss"] == pytest.approx(math.log(2), abs=5e-3)
    for key in ("logps/chosen", "logps/rejected"):
        assert first[True][key] == pytest.approx(first[False][key], rel=1e-2), key
    _assert_trained_on(trainer, device, before)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_prompts_in_rows_on_the_device_give_the_unshared_logprobs_and_gradients(device, tokenizer, monkeypatch,
                                                                                      precision):
    """GRPO's shared prompts as a row per prompt (models/prefix_rows.py: a boolean [P, 1, T, T] mask to sdpa, which
    on CUDA takes the memory-efficient kernel, not flash) on the device, in float32 or under bf16 autocast as
    bf16=True trains: 2 prompts of 6 and 9 tokens with 4 completions each, of 3 to 8 tokens, give the log-probs and
    gradients of the rollouts run whole (to float32 rounding, or to bf16's)."""
    import torch

    from posttrain.models import logprobs
    from posttrain.models import prefix_rows as prefix_rows_module
    from posttrain.testing import tiny_architecture

    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)  # the tiny model saves too little otherwise
    monkeypatch.setattr(prefix_rows_module, "MAX_ATTENTION_SHARE", 1e6)
    layouts, through = [], logprobs._through_shared
    monkeypatch.setattr(logprobs, "_through_shared",
                        lambda model, shared, *a: layouts.append(shared.in_rows) or through(model, shared, *a))
    model = tiny_architecture("qwen2", tokenizer).to(device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=gen) for n in (6, 9)]
    prompt_ids, prompt_mask = torch.zeros((8, 9), dtype=torch.long), torch.zeros((8, 9), dtype=torch.long)
    completion_ids = torch.randint(3, 90, (8, 8), generator=gen)
    completion_mask = (torch.arange(8)[None] < torch.tensor([8, 3, 5, 8, 6, 8, 4, 7])[:, None]).long()
    for row in range(8):
        prompt = prompts[row % 2]
        prompt_ids[row, 9 - len(prompt):], prompt_mask[row, 9 - len(prompt):] = prompt, 1
    batch = [t.to(device) for t in (prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask)]
    weights = torch.randn((8, 8), generator=gen).to(device) * batch[3]
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logps, _ = logprobs.token_logprobs(model, *batch, packing=False, share_prompts=share)
        (logps * weights).sum().backward()
        results.append((logps.detach().float(), [p.grad.float() for p in model.parameters()]))
    assert layouts == [True]  # one pass through the rows, the whole rollouts' not
    tolerance = 2e-2 if precision == "bf16" else 1e-5
    real = batch[3].bool()
    torch.testing.assert_close(results[1][0][real], results[0][0][real], rtol=tolerance, atol=tolerance)
    for shared, whole in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(shared, whole, rtol=tolerance, atol=tolerance * float(whole.abs().max()))


# ---------------------------------------------------------------- checkpoint resume


@pytest.fixture
def deterministic_kernels():
    """torch's deterministic implementations where it has them (index_put, scatter_add, index_add on CUDA add
    atomically otherwise), a warning where it has none, for one test."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _resumable(tokenizer, dataset, out, device, bf16: bool, callbacks=None, **overrides):
    """A 4-step GRPO run on `device` saving every 2 steps. The tiny model uses eager attention: the backward of
    SDPA's float32 kernel on CUDA adds into its gradients atomically, in an order that varies from run to run, and
    this test is about what the checkpoint restores, not about kernels' atomics (deterministic_kernels, for the
    same reason)."""
    from conftest import length_reward, tiny_config

    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=1)
    model.set_attn_implementation("eager")
    values = dict(max_steps=4, save_strategy="steps", save_steps=2, beta=0.04, num_iterations=1, bf16=bf16,
                  **_on(device))
    values.update(overrides)
    return GRPOTrainer(model, length_reward, tiny_config(out, **values), train_dataset=dataset,
                       processing_class=tokenizer, callbacks=callbacks)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.filterwarnings("ignore:.*does not have a deterministic implementation")
def test_resume_on_the_device_is_bit_exact(device, deterministic_kernels, tokenizer, addition_dataset, tmp_path, bf16):
    """Train 4 steps straight; train 2 (checkpoint at 2), then resume in a new trainer: the weights, every step's
    logged figures and the token count equal the straight run's, and the checkpoint carries the device's RNG."""
    import torch
    from conftest import StopAt

    straight = _resumable(tokenizer, addition_dataset, tmp_path / "a", device, bf16, save_strategy="no")
    straight.train()
    first = _resumable(tokenizer, addition_dataset, tmp_path / "b", device, bf16, callbacks=[StopAt(2)])
    first.train()
    assert first.state.global_step == 2
    rng = torch.load(tmp_path / "b" / "out" / "checkpoint-2" / "rng_state_0.pt", weights_only=True)
    assert ("cuda" in rng) == (device.type == "cuda")
    resumed = _resumable(tokenizer, addition_dataset, tmp_path / "b", device, bf16)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == straight.state.global_step == 4
    assert {p.device.type for p in resumed.policy.parameters()} == {device.type}
    a, b = _weights(straight.policy), _weights(resumed.policy)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    keys = ("step", "loss", "kl", "reward", "num_tokens")
    assert all(key in r for r in _steps(straight) for key in keys)
    for key in keys:
        assert [r[key] for r in _steps(resumed)] == [r[key] for r in _steps(straight)], key
    assert resumed.state.num_input_tokens_seen == straight.state.num_input_tokens_seen > 0
