"""Each distinct prompt once in the log-prob passes (models/prompt_sharing.py): which prompts are shared, and
log-probs, entropies and every parameter's gradient equal to the unshared pass's."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from posttrain.models import logprobs
from posttrain.models.keywords import transformers_cache_name
from posttrain.models.logprobs import prompt_sharing_works, token_logprobs
from posttrain.models.packed_layouts import packed_layouts
from posttrain.models.prompt_sharing import distinct_prompts
from posttrain.testing import tiny_model

CACHE = transformers_cache_name()  # CachelessLM keeps an old signature and passes its cache on by today's name


def _group_rollouts(prompts: list[list[int]], copies: list[int], completion_lengths: list[int], completion_width: int,
                    vocab: int, seed: int = 0):
    """Row i holds prompt copies[i] (left-padded to the longest) and a random right-padded completion."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(copies), max(len(p) for p in prompts)
    prompt_ids = torch.zeros((n, width), dtype=torch.long)
    prompt_mask = torch.zeros((n, width), dtype=torch.long)
    completion_ids = torch.zeros((n, completion_width), dtype=torch.long)
    completion_mask = torch.zeros((n, completion_width), dtype=torch.long)
    for i, (which, c) in enumerate(zip(copies, completion_lengths)):
        prompt = prompts[which]
        prompt_ids[i, width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width - len(prompt):] = 1
        completion_ids[i, :c] = torch.randint(1, vocab, (c,), generator=g)
        completion_mask[i, :c] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture(autouse=True)
def share_on_tiny_models(monkeypatch):
    """The tests' models are tiny: sharing would save fewer FLOPs than MIN_SHARED_SAVING_FLOP, so the floor is 0
    here (test_tiny_savings_do_not_pay_for_a_second_forward checks the floor itself)."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)


def test_distinct_prompts_and_what_is_not_shared():
    p_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    p_mask = (p_ids > 0).long()
    p_ids[2, 0] = 3  # a different id under the padding: still the same prompt
    shared = distinct_prompts(p_ids, p_mask, completion_width=4, positions_otherwise=5 * 7)
    assert len(shared.prompt_ids) == 2
    assert torch.equal(shared.prompt_ids[shared.source] * p_mask, p_ids * p_mask)
    assert torch.equal(shared.prompt_mask[shared.source], p_mask)
    # 2 * 3 + 5 * 4 = 26 positions against 35: shared; against 27 (what packing might leave): not worth it
    assert distinct_prompts(p_ids, p_mask, 4, 27) is None
    assert distinct_prompts(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.long), 4, 12) is None
    assert distinct_prompts(p_ids, p_mask, 4, 35, min_saved_positions=10) is None  # 9 saved
    right_padded = torch.flip(p_mask, [1])
    assert distinct_prompts(p_ids, right_padded, 4, 35) is None  # a prompt's last column is not real
    empty = p_mask.clone()
    empty[1] = 0
    assert distinct_prompts(p_ids, empty, 4, 35) is None


def _passes(tokenizer, batch, shared: bool, temperature=0.7, model_class=None, with_gradient=True):
    """(log-probs, entropies, gradients, the widths the embedding saw) of one token_logprobs pass."""
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2, model_class=model_class)
    assert logprobs.fast_path_available(model)
    packed_layouts(model)  # the one-time checks before the hook below, which sees the log-prob pass only
    prompt_sharing_works(model)
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    logps, entropy = token_logprobs(model, *batch, temperature=temperature, with_entropy=True,
                                    loss_gradient=(lambda lp: weights) if with_gradient else None,
                                    packing=False, share_prompts=shared)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, {n: p.grad for n, p in model.named_parameters()}, widths


@pytest.mark.parametrize("with_gradient", [True, False], ids=["gradient in the forward", "recomputing backward"])
def test_shared_prompts_give_the_unshared_logprobs_entropy_and_gradients(tokenizer, with_gradient):
    """Three prompts of 2, 5 and 3 tokens, 9 rows interleaved, completions of 1 to 6 tokens: the shared pass runs the
    3 prompts once and the 9 completions against them, with the unshared pass's log-probs, entropies and gradients
    (the gradient of each shared prompt summed over its copies)."""
    vocab = len(tokenizer)
    prompts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    batch = _group_rollouts(prompts, [0, 1, 2, 0, 1, 2, 0, 1, 2], [6, 1, 4, 6, 3, 2, 5, 6, 1], 6, vocab, seed=3)
    unshared = _passes(tokenizer, batch, False, with_gradient=with_gradient)
    shared = _passes(tokenizer, batch, True, with_gradient=with_gradient)
    assert unshared[3] == [(9, 11)]
    assert shared[3] == [(3, 5), (9, 6)]  # the distinct prompts, then the completions against their cache
    mask = batch[3].bool()
    assert torch.allclose(shared[0][mask], unshared[0][mask], atol=1e-5)
    assert torch.equal(shared[0][~mask], torch.zeros_like(shared[0][~mask]))
    assert torch.allclose(shared[1][mask], unshared[1][mask], atol=1e-5)
    for name, grad in unshared[2].items():
        assert torch.allclose(shared[2][name], grad, atol=1e-5), name


def test_too_little_to_share_runs_the_rollouts_as_they_are(tokenizer):
    """Long completions of two 2-token prompts: sharing would run 2 * 2 + 4 * 20 = 84 of the 88 positions, saving
    less than 1/16."""
    batch = _group_rollouts([[11, 12], [21, 22]], [0, 1, 0, 1], [20] * 4, 20, len(tokenizer))
    *_, widths = _passes(tokenizer, batch, True)
    assert widths == [(4, 22)]


def test_tiny_savings_do_not_pay_for_a_second_forward(tokenizer, monkeypatch):
    """With the shipped floor, the tests' 32-wide model (18,720 body parameters) would need about 27,000 positions
    saved; the example saves 30 of 99 and runs whole. A floor it clears (a thousandth: 27 positions) shares."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 1e9)
    prompts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    batch = _group_rollouts(prompts, [0, 1, 2, 0, 1, 2, 0, 1, 2], [6, 1, 4, 6, 3, 2, 5, 6, 1], 6, len(tokenizer))
    assert _passes(tokenizer, batch, True)[3] == [(9, 11)]
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 1e6)
    assert _passes(tokenizer, batch, True)[3] == [(3, 5), (9, 6)]


class CachelessLM(Qwen2ForCausalLM):
    """Returns no cache however asked: its completions cannot run against their prompt's keys and values."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=False, logits_to_keep=logits_to_keep,
                               **kwargs)


def test_a_model_without_a_usable_cache_runs_the_rollouts_unshared(tokenizer, caplog):
    model = tiny_model(tokenizer, model_class=CachelessLM, seed=2, hidden=32, layers=2)
    assert logprobs.fast_path_available(model)
    with caplog.at_level("WARNING", logger="posttrain"):
        assert not prompt_sharing_works(model)
    # the check's selected cache is None: said once, with what it raised
    assert [r.getMessage() for r in caplog.records] == [
        "CachelessLM: its log-prob passes run each rollout's prompt, not each distinct prompt once, because its "
        "one-time check raised AttributeError: 'NoneType' object has no attribute 'batch_select_indices'."]
    batch = _group_rollouts([[11, 12, 13], [21, 22]], [0, 1, 0, 1], [2, 1, 2, 2], 2, len(tokenizer))
    unshared = _passes(tokenizer, batch, False)
    shared = _passes(tokenizer, batch, True, model_class=CachelessLM)
    assert shared[3] == [(4, 5)]
    mask = batch[3].bool()
    assert torch.allclose(shared[0][mask], unshared[0][mask], atol=1e-6)


def test_the_sharing_check_passes_in_16_bit_and_is_skipped_under_gradient_checkpointing(tokenizer):
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2).to(torch.bfloat16)
    assert prompt_sharing_works(model)
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    packed_layouts(model)
    batch = _group_rollouts([[11, 12, 13], [21, 22]], [0, 1, 0, 1], [2, 1, 2, 2], 2, len(tokenizer))
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    token_logprobs(model, *batch, packing=False, share_prompts=True)
    assert widths[-1] == (4, 5)  # transformers turns the cache off under checkpointing: the rollouts run whole


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no reference", "with the reference pass"])
def test_a_grpo_step_with_shared_prompts_equals_the_unshared_step(tokenizer, addition_dataset, tmp_path, monkeypatch,
                                                                  beta):
    """One process, no sharding: the trainer shares prompts in its policy (and reference) passes, with the gradients
    of the unshared step."""
    from conftest import capture_gradients, length_reward, tiny_config, variable_length_fast_model

    from posttrain.grpo.trainer import GRPOTrainer

    shared_calls = []
    hidden = logprobs._shared_prompt_hidden
    monkeypatch.setattr(logprobs, "_shared_prompt_hidden",
                        lambda model, shared, *a: shared_calls.append((len(shared.source), torch.is_grad_enabled()))
                        or hidden(model, shared, *a))
    results = []
    for share in (False, True):
        config = tiny_config(tmp_path / str(share), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                             max_completion_length=6, beta=beta, generation_kwargs={"min_new_tokens": 6})
        trainer = GRPOTrainer(variable_length_fast_model(tokenizer), length_reward, config,
                              train_dataset=addition_dataset, processing_class=tokenizer)
        assert trainer.share_prompts
        trainer.share_prompts = share
        grads = capture_gradients(trainer)
        trainer.train()
        results.append(grads[0])
    # the one-time checks (2 rows, no gradient), the reference pass over the 8 rollouts (with beta), the policy pass
    # (with gradient; without beta, over the rows whose advantage is not 0)
    assert (8, False) in shared_calls if beta else all(n == 2 for n, grad in shared_calls if not grad), shared_calls
    assert any(grad for n, grad in shared_calls), shared_calls
    for name, grad in results[0].items():
        assert torch.allclose(results[1][name], grad, rtol=1e-4, atol=1e-7), name
    assert any(g.abs().sum() > 0 for g in results[0].values())


@pytest.mark.multiproc
@pytest.mark.parametrize("find_unused", ["false", "true"])
def test_under_ddp_every_process_shares_or_none_does(find_unused, tmp_path):
    """2 gloo processes, a DDP-wrapped model (buffers broadcast at every forward): where both processes' rollouts
    repeat their prompts, both share them, in the pass without gradient and in the one with; where one process has
    nothing to share, neither does (a process sharing alone would run two forwards, and two buffer broadcasts, to the
    other's one). Log-probs and DDP's averaged gradients equal an unwrapped copy's without sharing."""
    import json

    from conftest import two_gloo_processes

    two_gloo_processes("multiproc_prompt_sharing.py", find_unused, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for result in ranks:
        assert (result["both"]["shared_without_gradient"], result["both"]["shared_with_gradient"]) == (1, 1)
        assert (result["one"]["shared_without_gradient"], result["one"]["shared_with_gradient"]) == (0, 0)
        for case in result.values():
            assert case["logps_max_diff"] <= 1e-5 and case["no_grad_logps_max_diff"] <= 1e-5, case
            assert case["grad_max"] > 0 and case["grad_max_diff"] <= 1e-5 * case["grad_max"], case
