"""Each distinct prompt once in the log-prob passes (models/prompt_sharing.py), as a row per prompt or two forwards:
which prompts are shared and how, log-probs, entropies and every parameter's gradient equal to the unshared pass's,
and log-probs and entropies equal to TRL's own pass."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from posttrain.models import logprobs
from posttrain.models import prefix_rows as prefix_rows_module
from posttrain.models.keywords import transformers_cache_name
from posttrain.models.logprobs import prompt_sharing_works, token_logprobs
from posttrain.models.packed_layouts import packed_layouts
from posttrain.models.prefix_rows import prefix_rows
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
    """The tests' models are tiny: sharing would save fewer FLOPs than MIN_SHARED_SAVING_FLOP, and a row's attention
    weighs more against their products than MAX_ATTENTION_SHARE allows, so the floor is 0 and the share lifted here
    (test_tiny_savings_do_not_pay_for_a_second_forward checks the floor itself, tests/test_pair_prefixes.py
    test_wide_rows_run_two_forwards the share)."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)
    monkeypatch.setattr(prefix_rows_module, "MAX_ATTENTION_SHARE", 1e6)


def _two_forwards(monkeypatch):
    """Rows turned off: shared prompts run as the prompts' forward with a cache and the completions' against it."""
    monkeypatch.setattr(logprobs, "prefix_rows_work", lambda model: False)


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


def test_a_row_per_prompt_holds_its_rollouts_in_slots():
    """Two prompts with 3 rollouts and 1 (interleaved): rows of 3 slots, the second prompt's last two all padding;
    every slot continues its prompt's positions and sees the prompt and itself only; each completion token is read
    from the column before it (the prompt's last for the first token)."""
    rows = prefix_rows(torch.tensor([[5, 6], [0, 7]]), torch.tensor([[1, 1], [0, 1]]),
                       torch.tensor([[8, 9], [3, 0], [4, 4], [2, 2]]), torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]),
                       torch.tensor([0, 1, 0, 0]))
    assert rows.input_ids.tolist() == [[5, 6, 8, 9, 4, 4, 2, 2], [0, 7, 3, 0, 0, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 2, 3], [0, 0, 1, 2, 1, 2, 1, 2]]
    assert rows.allowed[0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],
                                              [1, 1, 0, 0, 0, 0, 0, 0],
                                              [1, 1, 1, 0, 0, 0, 0, 0],
                                              [1, 1, 1, 1, 0, 0, 0, 0],
                                              [1, 1, 0, 0, 1, 0, 0, 0],
                                              [1, 1, 0, 0, 1, 1, 0, 0],
                                              [1, 1, 0, 0, 0, 0, 1, 0],
                                              [1, 1, 0, 0, 0, 0, 1, 1]]
    assert torch.equal(rows.allowed[1], torch.eye(8, dtype=torch.bool) | torch.tensor(
        [[0] * 8, [0, 1] + [0] * 6, [0, 1, 1] + [0] * 5] + [[0] * 8] * 5, dtype=torch.bool))
    assert rows.source.tolist() == [[1, 2], [9, 10], [1, 4], [1, 6]]


def _passes(tokenizer, batch, shared: bool, temperature=0.7, model_class=None, with_gradient=True):
    """(log-probs, entropies, gradients, the widths the embedding saw) of one token_logprobs pass."""
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2, model_class=model_class)
    assert logprobs.fast_path_available(model)
    packed_layouts(model)  # the one-time checks before the hook below, which sees the log-prob pass only
    prompt_sharing_works(model)
    logprobs.prefix_rows_work(model)
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    logps, entropy = token_logprobs(model, *batch, temperature=temperature, with_entropy=True,
                                    loss_gradient=(lambda lp: weights) if with_gradient else None,
                                    packing=False, share_prompts=shared)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, {n: p.grad for n, p in model.named_parameters()}, widths


@pytest.mark.parametrize("layout", ["rows", "two forwards"])
@pytest.mark.parametrize("with_gradient", [True, False], ids=["gradient in the forward", "recomputing backward"])
def test_shared_prompts_give_the_unshared_logprobs_entropy_and_gradients(tokenizer, monkeypatch, with_gradient,
                                                                         layout):
    """Three prompts of 2, 5 and 3 tokens, 9 rows interleaved, completions of 1 to 6 tokens: the shared pass runs the
    3 prompts once, as a row per prompt with its 3 completions or as the prompts' forward and the 9 completions'
    against it, with the unshared pass's log-probs, entropies and gradients (the gradient of each shared prompt
    summed over its copies)."""
    if layout == "two forwards":
        _two_forwards(monkeypatch)
    vocab = len(tokenizer)
    prompts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    batch = _group_rollouts(prompts, [0, 1, 2, 0, 1, 2, 0, 1, 2], [6, 1, 4, 6, 3, 2, 5, 6, 1], 6, vocab, seed=3)
    unshared = _passes(tokenizer, batch, False, with_gradient=with_gradient)
    shared = _passes(tokenizer, batch, True, with_gradient=with_gradient)
    assert unshared[3] == [(9, 11)]
    # a row per prompt (5 + 3 x 6 columns: 69 positions), or the prompts, then the completions against their cache
    assert shared[3] == ([(3, 23)] if layout == "rows" else [(3, 5), (9, 6)])
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


def test_rows_padded_to_the_most_copies_run_two_forwards_where_they_would_not_pay(tokenizer):
    """A prompt with 5 rollouts and one with 1: rows of 5 slots would run 2 x (4 + 5 x 6) = 68 positions against the
    unshared 60, so the two forwards run (2 x 4 + 6 x 6 = 44); with 3 and 3, rows run (2 x 22 = 44)."""
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24]]
    batch = _group_rollouts(prompts, [0, 0, 0, 0, 0, 1], [6] * 6, 6, len(tokenizer))
    assert _passes(tokenizer, batch, True)[3] == [(2, 4), (6, 6)]
    batch = _group_rollouts(prompts, [0, 0, 0, 1, 1, 1], [6] * 6, 6, len(tokenizer))
    assert _passes(tokenizer, batch, True)[3] == [(2, 22)]


def test_tiny_savings_do_not_pay_for_a_second_forward(tokenizer, monkeypatch):
    """With the shipped floor, the tests' 32-wide model (18,720 body parameters) would need about 27,000 positions
    saved; the example saves 30 of 99 and runs whole. A floor it clears (a thousandth: 27 positions) shares."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 1e9)
    prompts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    batch = _group_rollouts(prompts, [0, 1, 2, 0, 1, 2, 0, 1, 2], [6, 1, 4, 6, 3, 2, 5, 6, 1], 6, len(tokenizer))
    assert _passes(tokenizer, batch, True)[3] == [(9, 11)]
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 1e6)
    assert _passes(tokenizer, batch, True)[3] == [(3, 23)]


class CachelessLM(Qwen2ForCausalLM):
    """Returns no cache however asked: its completions cannot run against their prompt's keys and values."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=False, logits_to_keep=logits_to_keep,
                               **kwargs)


def test_a_model_without_a_usable_cache_runs_the_rollouts_unshared(tokenizer, caplog, monkeypatch):
    """Without rows (which need no cache) a model whose cache cannot select rows runs its rollouts whole; with them,
    in rows."""
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
    in_rows = _passes(tokenizer, batch, True, model_class=CachelessLM)
    _two_forwards(monkeypatch)
    shared = _passes(tokenizer, batch, True, model_class=CachelessLM)
    assert shared[3] == [(4, 5)] and in_rows[3] == [(2, 7)]
    mask = batch[3].bool()
    assert torch.allclose(shared[0][mask], unshared[0][mask], atol=1e-6)
    assert torch.allclose(in_rows[0][mask], unshared[0][mask], atol=1e-5)


def test_the_sharing_check_passes_in_16_bit_and_under_gradient_checkpointing_rows_run(tokenizer, monkeypatch):
    """Under activation checkpointing transformers turns the cache off: the prompts are shared in rows (one forward,
    no cache), and without rows the rollouts run whole."""
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2).to(torch.bfloat16)
    assert prompt_sharing_works(model)
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    packed_layouts(model)
    batch = _group_rollouts([[11, 12, 13], [21, 22]], [0, 1, 0, 1], [2, 1, 2, 2], 2, len(tokenizer))
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    in_rows, _ = token_logprobs(model, *batch, packing=False, share_prompts=True)
    assert widths[-1] == (2, 7)  # a row per prompt: 3 + 2 x 2 columns
    _two_forwards(monkeypatch)
    whole, _ = token_logprobs(model, *batch, packing=False, share_prompts=True)
    assert widths[-1] == (4, 5)
    assert torch.allclose(in_rows, whole, atol=1e-5)


@pytest.mark.parametrize("beta,layout", [(0.0, "rows"), (0.04, "rows"), (0.04, "two forwards")],
                         ids=["no reference", "with the reference pass", "two forwards"])
def test_a_grpo_step_with_shared_prompts_equals_the_unshared_step(tokenizer, addition_dataset, tmp_path, monkeypatch,
                                                                  beta, layout):
    """One process, no sharding: the trainer shares prompts in its policy (and reference) passes, in rows or two
    forwards, with the gradients of the unshared step."""
    from conftest import capture_gradients, length_reward, tiny_config, variable_length_fast_model

    from posttrain.grpo.trainer import GRPOTrainer

    if layout == "two forwards":
        _two_forwards(monkeypatch)
    shared_calls = []
    through = logprobs._through_shared
    monkeypatch.setattr(logprobs, "_through_shared", lambda model, shared, *a: shared_calls.append(
        (len(shared.source), torch.is_grad_enabled(), shared.in_rows)) or through(model, shared, *a))
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
    # the reference pass over the 8 rollouts (with beta), the policy pass (with gradient; without beta, over the rows
    # whose advantage is not 0); the two forwards' one-time check (2 rows, no gradient)
    assert (8, False, layout == "rows") in shared_calls if beta else not any(not grad for _, grad, _ in shared_calls)
    assert any(grad for _, grad, _ in shared_calls), shared_calls
    assert all(in_rows == (layout == "rows") for _, _, in_rows in shared_calls), shared_calls
    for name, grad in results[0].items():
        assert torch.allclose(results[1][name], grad, rtol=1e-4, atol=1e-7), name
    assert any(g.abs().sum() > 0 for g in results[0].values())


@pytest.mark.multiproc
@pytest.mark.parametrize("find_unused", ["false", "true"])
def test_under_ddp_every_process_shares_or_none_does(find_unused, tmp_path):
    """2 gloo processes, a DDP-wrapped model (buffers broadcast at every forward): where both processes' rollouts
    repeat their prompts, both share them in rows, in the pass without gradient and in the one with; where one
    process has nothing to share, neither does; where one would run a row and the other two forwards, both run two
    forwards (a process running two forwards alone would broadcast the buffers twice to the other's once). Log-probs
    and DDP's averaged gradients equal an unwrapped copy's without sharing."""
    import json

    from conftest import two_gloo_processes

    two_gloo_processes("multiproc_prompt_sharing.py", find_unused, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for result in ranks:
        assert result["both"]["shared"] == ["no_grad rows", "grad rows"]
        assert result["one"]["shared"] == []
        assert result["mixed"]["shared"] == ["no_grad two", "grad two"]
        for case in result.values():
            assert case["logps_max_diff"] <= 1e-5 and case["no_grad_logps_max_diff"] <= 1e-5, case
            assert case["grad_max"] > 0 and case["grad_max_diff"] <= 1e-5 * case["grad_max"], case


def test_rows_give_trls_log_probs_and_entropies(tokenizer, addition_dataset, tmp_path, monkeypatch):
    """TRL 1.16's own log-prob pass (GRPOTrainer._get_per_token_logps_and_entropies, each rollout whole, through the
    fused output layer TRL puts on the model) against ours with the prompts shared as a row per prompt: the same
    log-probs and entropies of every completion token."""
    import copy

    trl = pytest.importorskip("trl")
    from conftest import length_reward

    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2)
    theirs = trl.GRPOTrainer(copy.deepcopy(model), length_reward, train_dataset=addition_dataset,
                             processing_class=tokenizer,
                             args=trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                 num_generations=2, max_completion_length=6, report_to="none",
                                                 use_cpu=True, bf16=False))
    prompts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    batch = _group_rollouts(prompts, [0, 1, 2, 0, 1, 2, 0, 1, 2], [6, 1, 4, 6, 3, 2, 5, 6, 1], 6, len(tokenizer),
                            seed=3)
    ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
    with torch.no_grad():
        trl_logps, trl_entropy, _ = theirs._get_per_token_logps_and_entropies(theirs.model, ids, mask, 6,
                                                                              compute_entropy=True)
    layouts, through = [], logprobs._through_shared
    monkeypatch.setattr(logprobs, "_through_shared",
                        lambda m, shared, *a: layouts.append(shared.in_rows) or through(m, shared, *a))
    with torch.no_grad():
        logps, entropy = token_logprobs(model, *batch, with_entropy=True, packing=False, share_prompts=True)
    assert layouts == [True]
    real = batch[3].bool()
    torch.testing.assert_close(logps[real], trl_logps[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[real], trl_entropy[real], atol=1e-5, rtol=1e-5)
