"""DPO's and ORPO's pairs with their common prefix run once (sequences/prefixes.py until="targets", models/logprobs.py
`next_token_logprobs(prefixes=...)`): the layout, the log-probs and gradients against the unshared forward, TRL's
numbers through the shared path, and where the path is not taken."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import assert_same_run
from datasets import Dataset
from test_dpo_trainer import PAIRS, _records, _train, dpo_config

from posttrain.configs.orpo import ORPOConfig
from posttrain.dpo.trainer import DPOTrainer
from posttrain.models import logprobs
from posttrain.models import prefix_rows as prefix_rows_module
from posttrain.models.logprobs import next_token_logprobs, prefix_layout
from posttrain.models.prompt_sharing import ONE_ROW, TWO_FORWARDS, UNSHARED
from posttrain.models.prefix_rows import prefix_rows
from posttrain.orpo import ORPOTrainer
from posttrain.sequences.pair_batch import collate_pairs
from posttrain.sequences.pairs import PairRows
from posttrain.sequences.prefixes import prefix_batch, shared_prefix_lengths
from posttrain.sequences.rows import TokenRows
from posttrain.testing import tiny_architecture, tiny_model
from posttrain.training import pairs as pair_trainers

PAD = 0
EVAL_PAIRS = {k: v[:12] for k, v in PAIRS.items()}  # not the train pairs: their reference is not read from the cache
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")


@pytest.fixture(autouse=True)
def rows_on_tiny_models(monkeypatch):
    """The tests' models are tiny: a row's attention weighs more against their products than MAX_ATTENTION_SHARE
    allows at any width, so the share is lifted here (test_wide_rows_run_two_forwards checks the limit itself)."""
    monkeypatch.setattr(prefix_rows_module, "MAX_ATTENTION_SHARE", 1e6)


def _rows(*sequences) -> TokenRows:
    """(prompt, completion) token lists -> rows whose completions are labelled."""
    return TokenRows.from_sequences([(np.asarray(p + c, dtype=np.int64), np.arange(len(p + c)) >= len(p))
                                     for p, c in sequences])


def test_each_pair_shares_its_prompt_up_to_its_first_target():
    """The longest common prefix, cut at either sequence's first target (a labelled token): answers that begin alike
    keep their first tokens in the continuations, since the prompt's last position predicts them."""
    rows = _rows(([5, 6, 7], [8, 9]), ([5, 6, 7], [3]),        # the prompt: 3
                 ([5, 6, 7], [8, 9]), ([5, 6, 7], [8, 4]),     # answers beginning alike: still 3
                 ([5, 6], [7, 8]), ([5, 6, 7], [9]),           # prompts of 2 and 3 tokens: the shorter one
                 ([4], [6]), ([5], [6]))                       # nothing in common
    assert shared_prefix_lengths(rows, PAD, until="targets").tolist() == [3, 3, 2, 0]


def test_the_layout_keeps_every_target_in_order():
    rows = _rows(([5, 6, 7, 8], [9, 10]), ([5, 6, 7, 8], [3]), ([4, 6], [1, 2, 3]), ([4, 6], [9]))
    batch = collate_pairs(PairRows(rows, np.arange(len(rows) // 2)), PAD, padding_free=False, pad_to_multiple_of=None, min_shared=0)
    shared = batch.prefixes
    assert shared.prefix_ids.tolist() == [[5, 6, 7, 8], [PAD, PAD, 4, 6]]
    assert shared.suffix_ids.tolist() == [[9, 10, PAD], [3, PAD, PAD], [1, 2, 3], [9, PAD, PAD]]
    assert shared.suffix_targets.tolist() == [[True, True, False], [True, False, False], [True, True, True],
                                              [True, False, False]]
    assert torch.equal(shared.suffix_ids[shared.suffix_targets], batch.sequences.targets)
    # 2 x 4 + 4 x 3 = 20 positions against the padded 4 x 6 = 24: not enough for a floor of 5; padding-free keeps
    # its own layout
    assert collate_pairs(PairRows(rows, np.arange(len(rows) // 2)), PAD, False, None, min_shared=5).prefixes is None
    assert collate_pairs(PairRows(rows, np.arange(len(rows) // 2)), PAD, True, None, min_shared=0).prefixes is None
    assert prefix_batch(_rows(([4], [6]), ([5], [6])), PAD, 2, 0, until="targets") is None


@pytest.mark.parametrize("case", ["qwen2", "qwen2-eager", "qwen2-bf16", "qwen2-two-forwards", "llama", "gemma3"])
def test_shared_logprobs_entropy_statistics_and_gradients_equal_the_unshared(tokenizer, monkeypatch, case):
    """Three pairs of prompts 7, 4 and 9 tokens long, answers of 5 and 3: the log-probs, entropies, top-1 flags,
    statistics and gradients through the shared prefixes against the whole sequences'. Full-attention models run a
    row per pair (sdpa or eager); a sliding window (Gemma 3) runs the two forwards, as does qwen2-two-forwards (the
    rows turned off)."""
    family = case.split("-")[0]
    model = tiny_architecture(family, tokenizer)
    if case.endswith("eager"):
        model.set_attn_implementation("eager")
    if case.endswith("bf16"):
        model = model.to(torch.bfloat16)
    if case.endswith("two-forwards"):
        monkeypatch.setattr(logprobs, "prefix_rows_work", lambda model: False)
    assert logprobs.prefix_rows_work(model) == (family in ("qwen2", "llama") and not case.endswith("two-forwards"))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (7, 4, 9)]
    rows = _rows(*[(p, torch.randint(3, 90, (k,), generator=generator).tolist()) for p in prompts for k in (5, 3)])
    batch = collate_pairs(PairRows(rows, np.arange(3)), PAD, False, None, min_shared=0)
    layout = prefix_layout(model, batch.prefixes.row_width)
    assert layout == (ONE_ROW if logprobs.prefix_rows_work(model) else TWO_FORWARDS)
    results = []
    for prefixes in (None, replace(batch.prefixes, in_rows=layout == ONE_ROW)):
        model.zero_grad()
        s = batch.sequences
        logps, entropy, top1, stats = next_token_logprobs(model, s.input_ids, s.attention_mask, s.position_ids,
                                                          s.source_mask, s.targets, with_entropy=True,
                                                          with_top1=True, with_stats=True, prefixes=prefixes)
        (logps * torch.linspace(-1, 1, len(logps))).sum().backward()
        results.append((logps.detach(), entropy, top1, stats, [p.grad.clone() for p in model.parameters()]))
    (logps, entropy, top1, stats, grads), shared = results[0], results[1]
    low = case.endswith("bf16")
    tolerance = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[0], logps, **tolerance)
    torch.testing.assert_close(shared[1], entropy, **tolerance)
    torch.testing.assert_close(shared[3], stats, **tolerance)
    if not low:
        assert torch.equal(shared[2], top1)
    for a, b in zip(shared[4], grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance["rtol"], atol=tolerance["atol"] * 5)


def test_recurrent_layers_run_whole_sequences(tokenizer):
    """Qwen3.5's Gated DeltaNet layers read no attention mask (a row per pair would mix its parts) and their cache
    cannot select rows (two forwards cannot run): its pairs run whole."""
    model = tiny_architecture("qwen3_5", tokenizer)
    assert not logprobs.prefix_rows_work(model) and prefix_layout(model, 20) == UNSHARED


def test_a_row_per_pair_keeps_the_continuations_apart():
    """The rows' layout: positions continue each prefix's real tokens, the rejected continuation never sees the chosen
    one, padding sees itself only, and each target is predicted from the column before it (the prefix's last for a
    continuation's first token)."""
    rows = prefix_rows(torch.tensor([[PAD, 5, 6]]), torch.tensor([[0, 1, 1]]), torch.tensor([[7, 8], [9, PAD]]),
                       torch.tensor([[1, 1], [1, 0]]), torch.tensor([0, 0]))
    assert rows.input_ids.tolist() == [[PAD, 5, 6, 7, 8, 9, PAD]]
    assert rows.position_ids.tolist() == [[0, 0, 1, 2, 3, 2, 3]]
    assert rows.allowed[0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                              [0, 1, 0, 0, 0, 0, 0],
                                              [0, 1, 1, 0, 0, 0, 0],
                                              [0, 1, 1, 1, 0, 0, 0],
                                              [0, 1, 1, 1, 1, 0, 0],
                                              [0, 1, 1, 0, 0, 1, 0],
                                              [0, 0, 0, 0, 0, 0, 1]]
    assert rows.source.tolist() == [[2, 3], [2, 5]]  # the padding's (5) is read by no target
    assert rows.source[torch.tensor([[True, True], [True, False]])].tolist() == [2, 3, 2]


def test_wide_rows_run_two_forwards(tokenizer, monkeypatch):
    """A row's attention computes every (query, key) pair: at Qwen2.5-0.5B's shape rows are taken up to about 1,040
    columns (attention an eighth of the products), which holds DPO's and GRPO's benchmark rows (160 and 267); a
    wider row runs the two forwards, or whole sequences where those cannot run (activation checkpointing), as does
    a model whose config does not give its attention's size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    monkeypatch.setattr(prefix_rows_module, "MAX_ATTENTION_SHARE", 1 / 8)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        assert 1000 < prefix_rows_module.row_width_limit(Qwen2ForCausalLM(config)) < 1100
    model = tiny_architecture("qwen2", tokenizer)
    limit = prefix_rows_module.row_width_limit(model)
    assert prefix_layout(model, limit) == ONE_ROW and prefix_layout(model, None) == TWO_FORWARDS
    assert prefix_layout(model, limit + 1) == TWO_FORWARDS
    model.gradient_checkpointing_enable()
    model.train()
    assert prefix_layout(model, limit) == ONE_ROW and prefix_layout(model, limit + 1) == UNSHARED
    # a (text) config that does not say its attention's size
    monkeypatch.setattr(prefix_rows_module, "_text_config", lambda plain: SimpleNamespace(hidden_size=32))
    assert prefix_rows_module.row_width_limit(model) == 0 and prefix_layout(model, 1) == UNSHARED


def _counting_shared_passes(monkeypatch) -> list:
    """Every shared pass from here on, counted (with gradient or not); the floor lowered so the tiny model's pairs
    share."""
    monkeypatch.setattr(pair_trainers, "MIN_SHARED_SAVING_FLOP", 0)
    passes, through = [], logprobs._through_prefixes

    def counted(*args, **kwargs):
        passes.append(torch.is_grad_enabled())
        return through(*args, **kwargs)

    monkeypatch.setattr(logprobs, "_through_prefixes", counted)
    return passes


@pytest.mark.parametrize("options", [{}, {"ld_alpha": 0.5}, {"loss_type": ["sigmoid", "bco_pair", "sft"],
                                                              "loss_weights": [0.8, 0.2, 1.0]},
                                     {"gradient_checkpointing": True}])
def test_shared_prefixes_give_trls_numbers(tokenizer, tmp_path, monkeypatch, options):
    """TRL 1.16's DPOTrainer against ours with every step's policy and reference passes run through their shared
    prompts (a row per pair, activation checkpointing or not): the same loss, rewards and log-probs at steps 1 and 2
    (step 2 tests the update)."""
    trl = pytest.importorskip("trl")
    trl_options = {k: v for k, v in options.items() if k != "gradient_checkpointing"}
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", max_steps=2,
                         per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                         gradient_checkpointing=False, train_sampling_strategy="sequential", **trl_options)
    theirs = trl.DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                            ref_model=tiny_model(tokenizer, hidden=32, layers=1),
                            train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    theirs.train()
    passes = _counting_shared_passes(monkeypatch)
    ours, _, _ = _train(tokenizer, tmp_path, train_sampling_strategy="sequential", **options)
    # each of the 2 steps: the policy's pass with gradient and the reference's without (checkpointed too: one row
    # per pair needs no cache)
    assert passes == [True, False, True, False]
    for a, b in zip(_records(ours), _records(theirs), strict=True):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_training_and_evaluation_through_shared_prefixes_give_the_unshared_run(tokenizer, tmp_path, monkeypatch):
    """The reference precomputed, prompts of different lengths, evaluation: the metrics and weights of the same run
    without sharing."""
    runs = {}
    for shared in (False, True):
        passes = _counting_shared_passes(monkeypatch) if shared else []
        monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / f"cache-{shared}"))  # each run computes its reference
        args = dpo_config(tmp_path / str(shared), train_sampling_strategy="sequential", per_device_train_batch_size=4,
                          precompute_ref_log_probs=True, per_device_eval_batch_size=8)
        trainer = DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                             train_dataset=Dataset.from_dict(PAIRS), eval_dataset=Dataset.from_dict(EVAL_PAIRS),
                             processing_class=tokenizer)
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        runs[shared] = (_records(trainer), trainer.evaluate(), params, list(passes))
    (records, evaluated, params, _), (records_shared, evaluated_shared, params_shared, passes) = runs[False], runs[True]
    # the train and eval pairs' reference (4 + 2 batches: 4 and 8 + 4 pairs), the 2 steps' policy passes, the
    # evaluation's 2
    assert passes == [False] * 6 + [True] * 2 + [False] * 2
    assert_same_run(records, records_shared, METRICS, params, params_shared, evaluated, evaluated_shared)


def test_orpo_through_shared_prefixes_gives_the_unshared_run(tokenizer, tmp_path, monkeypatch):
    runs = {}
    for shared in (False, True):
        passes = _counting_shared_passes(monkeypatch) if shared else []
        args = ORPOConfig(output_dir=str(tmp_path / str(shared)), max_steps=2, per_device_train_batch_size=8,
                          learning_rate=1e-2, logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
                          report_to="none", train_sampling_strategy="sequential",
                          gradient_checkpointing=False)
        trainer = ORPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                              train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
        trainer.train()
        runs[shared] = ([h for h in trainer.state.log_history if "loss" in h], list(passes),
                        {n: p.detach().clone() for n, p in trainer.policy.named_parameters()})
    (records, _, params), (records_shared, passes, params_shared) = runs[False], runs[True]
    assert passes == [True, True]
    assert_same_run(records, records_shared, ("loss", "nll_loss", "log_odds_ratio", "rewards/margins",
                                              "logps/chosen", "logits/rejected"), params, params_shared)


def test_the_floor_keeps_small_savings_unshared(tokenizer, tmp_path, monkeypatch):
    """At the shipped floor the tiny model's pairs save far too few FLOPs to pay for a second forward; padding-free
    rows and a fixed padded width keep the pairs whole whatever the floor."""
    trainer, _, _ = _train(tokenizer, tmp_path / "floor", train=False)
    pairs = trainer.batches.rows.select(np.arange(8))
    assert trainer._shared_prefix_floor > trainer._collate(pairs).sequences.input_ids.numel()
    assert trainer._collate(pairs).prefixes is None
    monkeypatch.setattr(pair_trainers, "MIN_SHARED_SAVING_FLOP", 0)
    assert trainer._collate(pairs).prefixes is not None
    for name, option in (("packed", {"padding_free": True}), ("fixed", {"pad_to_multiple_of": 8})):
        trainer, _, _ = _train(tokenizer, tmp_path / name, train=False, **option)
        assert trainer._shared_prefix_floor is None and trainer._collate(pairs).prefixes is None, name


def test_flash_attention_takes_no_rows(tokenizer):
    """Flash attention takes no [P, 1, T, T] mask: under its rules (posttrain.testing.use_flash_rules) shared
    prefixes run as the two forwards, never as rows."""
    from posttrain.testing import use_flash_rules

    model = use_flash_rules(tiny_architecture("qwen2", tokenizer))
    assert prefix_rows_module.takes_row_masks(model) is None
    assert prefix_layout(model, 10) == TWO_FORWARDS
