"""The reward model's pairs with their common prefix run once (sequences/prefixes.py; models/scores.py
`prefix_row_scores`, a row per pair, and `prefix_shared_scores`, two forwards through a cache): the layout, the scores
against the model's own unshared forward, TRL's numbers through both layouts, and where sharing is not taken."""

import contextlib
import copy

import numpy as np
import pytest
import torch
from conftest import assert_same_run
from datasets import Dataset
from test_reward import METRICS, PAIRS, _conversational, _records, _train, _trl_trainer

from posttrain.models import prefix_rows as prefix_rows_module
from posttrain.models.scores import prefix_row_scores, prefix_shared_scores, prefix_sharing_works, row_scores_work
from posttrain.reward import trainer as reward_trainer
from posttrain.sequences.collate import collate
from posttrain.sequences.prefixes import prefix_batch, shared_prefix_lengths
from posttrain.sequences.rows import TokenRows
from posttrain.testing import tiny_reward_model

PAD = 0


@pytest.fixture(autouse=True)
def rows_on_tiny_models(monkeypatch):
    """The tests' models are tiny: a row's attention weighs more against their products than MAX_ATTENTION_SHARE
    allows at most widths, so the share is lifted here (tests/test_pair_prefixes.py test_wide_rows_run_two_forwards
    checks the limit itself)."""
    monkeypatch.setattr(prefix_rows_module, "MAX_ATTENTION_SHARE", 1e6)


def _rows(*sequences) -> TokenRows:
    return TokenRows.from_sequences([(np.asarray(s, dtype=np.int64), np.ones(len(s), dtype=bool))
                                     for s in sequences])


def test_each_pair_shares_its_common_prefix_up_to_its_score_positions():
    """The longest common prefix, cut before either sequence's last token that is not padding (the pad id 0 here
    stands for an EOS that is also the pad token, read past as transformers pools)."""
    rows = _rows([5, 6, 7, 8, 9], [5, 6, 7, 3],       # prompt 5 6 7: shared 3
                 [5, 6, 7], [5, 6, 7, 8, 9],          # chosen a prefix of rejected: cut before its last token
                 [5, 6, 7, 0], [5, 6, 7, 8, 0],       # pad = EOS: chosen is scored at 7, so 2 are shared
                 [4, 6], [5, 6])                      # nothing in common
    assert shared_prefix_lengths(rows, PAD).tolist() == [3, 2, 2, 0]


def test_the_layout_holds_every_sequence_and_saves_positions():
    rows = _rows([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 3], [4, 6, 1], [4, 6, 9, 9])
    batch = prefix_batch(rows, PAD, padded_width=6, min_saved=0)
    assert batch.prefix_ids.tolist() == [[5, 6, 7, 8], [PAD, PAD, 4, 6]]  # left-padded, ending at the last column
    assert batch.prefix_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert batch.suffix_ids.tolist() == [[9, 10], [3, PAD], [1, PAD], [9, 9]]
    assert batch.suffix_mask.tolist() == [[1, 1], [1, 0], [1, 0], [1, 1]]
    # 2 x 4 + 4 x 2 = 16 positions (both prefixes cut to 2 would run 2 x 2 + 4 x 4 = 20) against the padded batch's
    # 4 x 6 = 24: too few for a floor of 9, and a pair without a common token is never laid out so
    assert prefix_batch(rows, PAD, padded_width=6, min_saved=9) is None
    assert prefix_batch(_rows([5, 6, 7], [5, 6, 8], [4, 6], [5, 6]), PAD, padded_width=3, min_saved=0) is None


def test_prefixes_are_cut_to_one_length_where_that_runs_fewer_positions():
    """Prompts of one length, one pair's answers beginning alike: cut to the shortest prefix, 2 x 3 + 4 x 3
    positions against 2 x 4 + 4 x 3 for each pair's own (padded) prefix, and no padding in the prefix rows."""
    rows = _rows([5, 6, 7, 8, 9], [5, 6, 7, 8, 3], [4, 6, 2, 1, 1, 1], [4, 6, 2, 9, 9, 9])
    batch = prefix_batch(rows, PAD, padded_width=6, min_saved=0)
    assert batch.prefix_ids.tolist() == [[5, 6, 7], [4, 6, 2]] and bool(batch.prefix_mask.all())
    assert batch.suffix_ids.tolist() == [[8, 9, PAD], [8, 3, PAD], [1, 1, 1], [9, 9, 9]]


def test_shared_scores_equal_the_models_own(tokenizer):
    """Pairs whose prompts differ in length (left-padded prefixes) and answers of different lengths (right-padded
    continuations), pad = EOS: the same scores as the model's forward over the whole padded sequences, with the
    same gradient."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    model = tiny_reward_model(tokenizer, hidden=32, layers=2)
    model.config.pad_token_id = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    texts = [("12+3=", "15", "16"), ("1+1=", "2", "3"), ("100+200=", "300", "30")]
    sequences = [tokenizer(p + a)["input_ids"] + [eos] for p, c, r in texts for a in (c, r)]
    rows = _rows(*sequences)
    padded = collate(rows, eos, padding_free=False, pad_to_multiple_of=None)
    batch = prefix_batch(rows, eos, padded.input_ids.size(1), min_saved=0)
    # one token a character: each prompt, and the answers' common first digit where they have one
    assert batch is not None and batch.prefix_mask.sum(1).tolist() == [len("12+3=1"), len("1+1="), len("100+200=3")]
    assert prefix_sharing_works(model) and row_scores_work(model)
    whole = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, 0]
    grads_whole = torch.autograd.grad(whole.square().sum(), list(model.parameters()))
    for scores in (prefix_shared_scores, prefix_row_scores):  # two forwards through a cache; a row per pair
        shared = scores(model, batch.prefix_ids, batch.prefix_mask, batch.suffix_ids, batch.suffix_mask)
        grads_shared = torch.autograd.grad(shared.square().sum(), list(model.parameters()))
        assert torch.allclose(shared, whole, atol=1e-5), scores.__name__
        for a, b in zip(grads_shared, grads_whole, strict=True):
            assert torch.allclose(a, b, atol=1e-5), scores.__name__


def _counting_shared_passes(monkeypatch) -> list:
    """Shared prefixes on the tiny test model (no FLOP floor); the list gets the layout of each shared pass ("rows"
    or "two forwards")."""
    monkeypatch.setattr(reward_trainer, "MIN_PREFIX_SAVING_FLOP", 0)
    passes = []
    for name, layout in (("prefix_row_scores", "rows"), ("prefix_shared_scores", "two forwards")):
        original = getattr(reward_trainer, name)
        monkeypatch.setattr(reward_trainer, name, lambda *args, original=original, layout=layout:
                            passes.append(layout) or original(*args))
    return passes


@pytest.mark.parametrize("case", ["plain", "margin_pad_is_eos", "conversational", "checkpointing", "two_forwards",
                                  "two_forwards_checkpointing"])
def test_shared_prefixes_give_trls_numbers(tokenizer, tmp_path, monkeypatch, case):
    """TRL 1.16's RewardTrainer against ours with every step's pairs run through their shared prompts, as a row per
    pair: the same loss and metrics at steps 1 and 2 (step 2 tests the update). margin_pad_is_eos: a margin column,
    and the EOS as the pad token (each reward read before the final EOS); checkpointing: activation checkpointing on
    (one row per pair needs no cache); two_forwards: rows off, the prefixes' forward with a cache, which
    transformers turns off under checkpointing (two_forwards_checkpointing: the pairs run whole)."""
    columns = _conversational() if case == "conversational" else dict(PAIRS)
    if case == "margin_pad_is_eos":
        columns["margin"] = [0.1 * (i % 5) - 0.2 for i in range(16)]
    options = {"gradient_checkpointing": True} if case.endswith("checkpointing") else {}
    if case == "margin_pad_is_eos":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.pad_token = tokenizer.eos_token
    theirs = _trl_trainer(tokenizer, tmp_path, Dataset.from_dict(columns), **options)
    theirs.train()
    passes = _counting_shared_passes(monkeypatch)
    if case.startswith("two_forwards"):
        monkeypatch.setattr(reward_trainer, "row_scores_work", lambda model: False)
    ours, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(columns), train_sampling_strategy="sequential",
                        **options)
    assert passes == {"two_forwards": ["two forwards"] * 2, "two_forwards_checkpointing": []}.get(case, ["rows"] * 2)
    for a, b in zip(_records(ours), _records(theirs), strict=True):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_evaluation_through_shared_prefixes_gives_the_unshared_metrics(tokenizer, tmp_path, monkeypatch):
    """Prompts of different lengths and implicit prompts (the common prefix found in the tokens): training and
    evaluation with the prefixes shared give the metrics and weights of the same run without."""
    columns = {"chosen": [f"{a * 37}+{b}={a * 37 + b}" for a in range(4) for b in range(4)],
               "rejected": [f"{a * 37}+{b}={a * 37 + b + 1}x" for a in range(4) for b in range(4)]}
    runs = {}
    for shared in (False, True):
        passes = _counting_shared_passes(monkeypatch) if shared else []
        trainer, params, _ = _train(tokenizer, tmp_path / str(shared), data=Dataset.from_dict(columns),
                                    train_sampling_strategy="sequential", eval_dataset=Dataset.from_dict(columns),
                                    per_device_eval_batch_size=4)
        runs[shared] = (_records(trainer), trainer.evaluate(), params, list(passes))
    (records, evaluated, params, _), (records_shared, evaluated_shared, params_shared, passes) = runs[False], runs[True]
    assert passes == ["rows"] * (2 + 4)  # the two steps, then the evaluation's 4 batches
    assert_same_run(records, records_shared, METRICS, params, params_shared, evaluated, evaluated_shared)


def test_the_floor_keeps_small_savings_unshared(tokenizer, tmp_path, monkeypatch):
    """At the shipped floor the tiny model's pairs save far too few FLOPs to pay for a second forward; padding-free
    rows keep their own layout whatever the floor."""
    trainer, _, _ = _train(tokenizer, tmp_path / "floor", train=False)
    pairs = trainer.batches.rows.select(np.arange(8))
    batch = trainer._collate(pairs)
    assert trainer._min_shared > batch.sequences.input_ids.numel() and batch.prefixes is None
    monkeypatch.setattr(reward_trainer, "MIN_PREFIX_SAVING_FLOP", 0)
    trainer, _, _ = _train(tokenizer, tmp_path / "packed", train=False, padding_free=True)
    assert trainer._min_shared is None and trainer._collate(pairs).prefixes is None


def test_masked_grouped_query_attention_whole_gives_the_same_scores(tokenizer):
    """Within masked_gqa_on_cpu (the reward passes' attention: key and value heads not repeated), a padded batch
    scores as transformers' default path scores it, with the same gradient; the switch is unset again after, and
    never set for a model that checkpoints activations (its recomputation runs outside the block)."""
    import os

    from posttrain.models.forwards import SDPA_FORCE_GQA, masked_gqa_on_cpu

    model = tiny_reward_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2)
    model.config.pad_token_id = 0
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    mask = (ids != 0).long()
    results = []
    for whole in (False, True):
        with masked_gqa_on_cpu(model) if whole else contextlib.nullcontext():
            assert (os.environ.get(SDPA_FORCE_GQA) == "1") == whole
            scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        results.append((scores, torch.autograd.grad(scores.sum(), model.score.weight)[0]))
    assert SDPA_FORCE_GQA not in os.environ
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    model.gradient_checkpointing_enable()
    model.train()
    with masked_gqa_on_cpu(model):
        assert SDPA_FORCE_GQA not in os.environ
