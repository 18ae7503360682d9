"""A packed or padding-free row gives every sequence what it gets alone, on every architecture and attention kernel
(models/packed_layouts.py), or the trainer runs padded rows and says why.

Tiny models of today's architectures (posttrain/testing.py tiny_architecture): pure attention (Qwen2, Llama),
sliding-window attention (Gemma 3), and hybrids whose layers carry state along a row (Qwen3.5 and Qwen3-Next's Gated
DeltaNet, LFM2's short convolutions, GraniteMoeHybrid's Mamba-2), each under sdpa and under flash attention's rules
(posttrain/testing.py use_flash_rules: sequences told apart by cu_seq_lens, or by position ids in a batch of one row,
never across several rows). On this CPU the hybrids' kernels are not installed, and transformers' reference versions
refuse the boundaries: those models run padded rows."""

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset

from packing_cases import CASES, TEXTS, batch_target_logps
from posttrain import SFTConfig, SFTTrainer
from posttrain.models.packed_layouts import Boundaries, Layouts, packed_layouts
from posttrain.sequences.collate import collate
from posttrain.sequences.rows import TokenRows, pack
from posttrain.testing import (ARCHITECTURES, VISION_LANGUAGE, tiny_architecture, tiny_vision_language,
                               use_flash_rules)

HYBRIDS = ("qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid")
NO_CLASSIFIER = ("lfm2", "granitemoehybrid")  # transformers has no sequence classifier for them


def _model(family, tokenizer, kernel, classifier=False):
    model = tiny_architecture(family, tokenizer, classifier=classifier)
    return use_flash_rules(model) if kernel == "flash" else model


@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
@pytest.mark.parametrize("family", ARCHITECTURES)
def test_each_architecture_keeps_the_layouts_it_can(tokenizer, family, kernel):
    """Pure attention packs rows under sdpa, one row with boundaries under flash attention (whose several rows
    attend across sequences); the hybrids pack neither here (their kernels are not installed)."""
    layouts = packed_layouts(_model(family, tokenizer, kernel))
    if family in HYBRIDS:
        assert layouts == Layouts(rows=False, one_row=False)
    else:
        assert layouts == Layouts(rows=kernel == "sdpa", one_row=True)


@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
@pytest.mark.parametrize("family, trainer", [(f, t) for f in ARCHITECTURES for t in CASES
                                             if not (t == "Reward" and f in NO_CLASSIFIER)])
def test_every_trainer_gives_each_sequence_what_it_gets_alone(tokenizer, tmp_path, family, kernel, trainer):
    """Each trainer's own batch (packed where the model keeps the sequences apart, padded otherwise): every
    sequence's per-token log-probs (the reward model's scores) within 1e-5 of the same sequence run alone (the
    reward trainer's on the families transformers has a sequence classifier for)."""
    model = _model(family, tokenizer, kernel, classifier=trainer == "Reward")
    gap, per_row = CASES[trainer](model, tokenizer, tmp_path)
    assert gap < 1e-5
    packs = family not in HYBRIDS and trainer != "KTO"  # KTO's rows are padded, as TRL's
    assert (per_row > 1) == packs


def test_a_hybrid_says_once_why_it_runs_padded_rows(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        for _ in range(2):  # the policy and its reference copy: one warning
            assert packed_layouts(tiny_architecture("qwen3_5", tokenizer)) == Layouts(False, False)
    (message,) = [r.getMessage() for r in caplog.records]  # the rest is transformers' own words, which vary
    assert message.startswith(
        "Qwen3_5ForCausalLM: its packed and padding-free passes run padded rows, one sequence each, because sequences "
        "packed in one row raise ValueError: `causal_conv1d_fn` can't keep packed sequences apart without "
        "`causal_conv1d`"), message


def test_a_model_whose_packed_row_leaks_without_raising_runs_padded_and_says_by_how_much(tokenizer, caplog,
                                                                                         monkeypatch):
    """Boundaries that never reach the model (a forward that drops them): its packed rows differ from its sequences
    alone, which the check measures and says."""
    from posttrain.models import forwards

    monkeypatch.setattr(forwards, "takes_boundaries", lambda model: False)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert packed_layouts(tiny_architecture("lfm2", tokenizer)) == Layouts(False, False)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("Lfm2ForCausalLM: its packed and padding-free passes run padded rows, one sequence "
                              "each, because sequences packed in one row do not get what they get alone (the "
                              "one-time check's hidden states differ by up to ")


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_sft_packing_trains_on_what_each_sequence_gets_alone(tokenizer, tmp_path, family):
    """The same sequences in one micro-batch: SFT with packing=True (packed rows on Qwen2, padded rows on Qwen3.5)
    takes the step-1 loss of packing=False."""
    losses = []
    for packing in (False, True):
        trainer = SFTTrainer(model=tiny_architecture(family, tokenizer), processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": TEXTS}),
                             args=SFTConfig(output_dir=str(tmp_path / str(packing)), max_steps=1, max_length=64,
                                            per_device_train_batch_size=len(TEXTS), packing=packing,
                                            learning_rate=0.0, logging_steps=1, save_strategy="no", report_to="none",
                                            gradient_checkpointing=False, use_cpu=True))
        trainer.train()
        losses.append(next(r["loss"] for r in trainer.state.log_history if "loss" in r))
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def test_the_boundaries_are_trls_for_the_same_rows():
    """SFT's padding-free row of two packed rows (sequences of 3 + 5 and 4 + 2 tokens): position ids, cu_seq_lens,
    max_length and seq_idx as TRL 1.16's own collator gives them."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    lengths = [3, 5, 4, 2]
    ids = [np.arange(10 * (i + 1), 10 * (i + 1) + n, dtype=np.int32) for i, n in enumerate(lengths)]
    rows = pack(TokenRows.from_sequences([(s, np.ones(len(s), bool)) for s in ids]), 8, "bfd")
    ours = collate(rows, 0, True, None)
    examples = [{"input_ids": rows.tokens[rows.row(r)].tolist(),
                 "seq_lengths": np.diff(np.append(np.flatnonzero(rows.starts[rows.row(r)]), rows.lengths[r])).tolist()}
                for r in range(len(rows))]
    trl = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    assert ours.input_ids.tolist() == trl["input_ids"].tolist()
    assert ours.position_ids.tolist() == trl["position_ids"].tolist()
    keywords = ours.boundaries.keywords()
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert keywords[name].dtype == trl[name].dtype and keywords[name].tolist() == trl[name].tolist(), name
    assert keywords["max_length_q"] == keywords["max_length_k"] == trl["max_length_q"] == 5


def test_the_one_row_forward_receives_the_boundaries(tokenizer):
    """Under flash attention's rules the rollouts run as one row, and the forward gets TRL's boundary keywords for
    them (a forward that does not take them is handed none)."""
    model = use_flash_rules(tiny_architecture("qwen2", tokenizer))
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    lengths = [4, 9, 2]
    sequences = [torch.arange(5, 5 + n) for n in lengths]
    batch = collate(TokenRows.from_sequences([(s.numpy().astype(np.int32), np.ones(len(s), bool)) for s in sequences]),
                    0, True, None)
    assert packed_layouts(model).one_row
    with torch.no_grad():
        batch_target_logps(model, batch)
    kwargs = seen[-1]  # the pass's own forward, after the one-time checks'
    assert kwargs["input_ids"].shape == (1, 15) and kwargs["attention_mask"] is None
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 4, 13, 15] and kwargs["max_length_k"] == 9
    assert kwargs["seq_idx"].tolist() == [[0] * 4 + [1] * 9 + [2] * 2]
    assert Boundaries.of_starts(np.array([1, 0, 0, 1, 1, 0], bool)).cu_seq_lens.tolist() == [0, 3, 4, 6]


@pytest.mark.parametrize("trainer", ["SFT", "GRPO"])
@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
@pytest.mark.parametrize("family", VISION_LANGUAGE)
def test_vision_language_models_trained_on_text_too(tokenizer, tmp_path, family, kernel, trainer):
    """Conditional-generation classes (what a vision-language checkpoint loads as) in the layouts their checks allow:
    each sequence's log-probs within 1e-5 of the same sequence alone."""
    model = tiny_vision_language(family, tokenizer)
    gap, _ = CASES[trainer](use_flash_rules(model) if kernel == "flash" else model, tokenizer, tmp_path)
    assert gap < 1e-5
