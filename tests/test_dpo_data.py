"""Preference data -> token pairs (dpo/data.py, dpo/batch.py): TRL's prepared pairs for every format, truncation
and the drop rule, LD-DPO's weights on a hand-computed pair, and a pair's log-probs whatever else is in its batch."""

import numpy as np
import pytest
import torch
from datasets import Dataset

from posttrain.configs import DPOConfig
from posttrain.data import DataError
from posttrain.dpo.batch import collate_pairs
from posttrain.dpo.data import PairEncoder, PairPreparation, extract_prompt, prepare_pairs

STANDARD = {"prompt": ["1+1=", "2+3=", "9+9="], "chosen": ["2", "5", "18"], "rejected": ["3", "6 ", "81"]}
CONVERSATIONAL = {
    "prompt": [[{"role": "user", "content": p}] for p in STANDARD["prompt"]],
    "chosen": [[{"role": "assistant", "content": c}] for c in STANDARD["chosen"]],
    "rejected": [[{"role": "assistant", "content": r}] for r in STANDARD["rejected"]],
}
IMPLICIT = {"chosen": [p + " " + c for p, c in zip(STANDARD["prompt"], STANDARD["chosen"])],
            "rejected": [p + " " + r for p, r in zip(STANDARD["prompt"], STANDARD["rejected"])]}
IMPLICIT_CONVERSATIONAL = {"chosen": [p + c for p, c in zip(CONVERSATIONAL["prompt"], CONVERSATIONAL["chosen"])],
                           "rejected": [p + r for p, r in zip(CONVERSATIONAL["prompt"], CONVERSATIONAL["rejected"])]}


def _pairs(tokenizer, columns, **config):
    args = DPOConfig(output_dir="unused", **config)
    dataset = Dataset.from_dict(columns)
    return prepare_pairs(dataset, PairPreparation(PairEncoder(tokenizer, dataset[0]), args, "train_dataset"))


def _as_lists(pairs):
    out = []
    for p in range(len(pairs)):
        seqs = []
        for r in (2 * p, 2 * p + 1):
            span = pairs.rows.row(r)
            tokens, labels = pairs.rows.tokens[span].tolist(), pairs.rows.labels[span]
            first = int(np.argmax(labels))
            seqs.append((tokens[:first], tokens[first:]))
        assert seqs[0][0] == seqs[1][0]
        out.append((seqs[0][0], seqs[0][1], seqs[1][1]))
    return out


@pytest.mark.parametrize("columns", [STANDARD, CONVERSATIONAL, IMPLICIT, IMPLICIT_CONVERSATIONAL],
                         ids=["standard", "conversational", "implicit", "implicit-conversational"])
def test_prepared_pairs_are_trls(tokenizer, columns):
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl import DPOConfig as TRLDPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer as TRLDPOTrainer

    stub = SimpleNamespace(_tokenizer=tokenizer)
    trl_args = TRLDPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    theirs = TRLDPOTrainer._prepare_dataset(stub, Dataset.from_dict(columns), tokenizer, trl_args, "train")
    ours = _as_lists(_pairs(tokenizer, columns))
    assert ours == [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in theirs]
    if columns is STANDARD:  # the EOS ends every standard completion
        assert all(c[-1] == r[-1] == tokenizer.eos_token_id for _, c, r in ours)


def test_implicit_prompt_is_the_common_start():
    assert extract_prompt("Q: a b", "Q: a c") == ("Q: a", " b", " c")
    m = [{"role": "user", "content": "x"}]
    assert extract_prompt(m + [{"role": "assistant", "content": "1"}], m + [{"role": "assistant", "content": "2"}]) \
        == (m, [{"role": "assistant", "content": "1"}], [{"role": "assistant", "content": "2"}])


def test_truncation_per_sequence_and_the_drop_rule(tokenizer, caplog):
    columns = {"prompt": ["abcdef", "ab"], "chosen": ["xyz", "x"], "rejected": ["q", "qrstuv"]}
    pairs = _pairs(tokenizer, columns, max_length=6)  # the first prompt alone fills max_length: dropped
    assert pairs.index.tolist() == [1] and "1 of 2 pairs were dropped" in caplog.text
    assert pairs.rows.lengths.tolist() == [4, 6]  # ab + x + EOS; ab + qrst (cut at 6, keep_start)
    kept_end = _pairs(tokenizer, columns, max_length=6, truncation_mode="keep_end")
    assert kept_end.index.tolist() == [0, 1] and kept_end.rows.lengths.tolist() == [6, 6, 4, 6]
    with pytest.raises(DataError, match="no pair left: every prompt alone fills max_length=2"):
        _pairs(tokenizer, columns, max_length=2)


@pytest.mark.parametrize("columns,message", [
    ({"prompt": ["a"], "chosen": ["b"]}, "in no preference format: its columns are prompt, chosen; DPO needs .* "
                                         "\\(it has no 'rejected' column\\)"),
    ({"prompt": ["a"], "completion": ["b"]}, "prompt/completion is an SFT dataset"),
    ({"prompt": ["a"], "chosen": [""], "rejected": ["c"]}, "Row 0 of train_dataset has an empty chosen completion"),
    ({"chosen": ["same"], "rejected": ["same"]}, "empty chosen completion once the prompt .* are identical"),
    ({"prompt_ids": [[1]], "chosen_ids": [[2]], "rejected_ids": [[]]}, "empty rejected_ids"),
])
def test_bad_pairs_are_one_sentence(tokenizer, columns, message):
    with pytest.raises(DataError, match=message):
        _pairs(tokenizer, columns)


def test_ld_alpha_weights_a_hand_computed_pair_with_a_prompt_longer_than_both_completions(tokenizer):
    """Prompt of 6 tokens, completions of 4 and 2 (EOS included), alpha 0.5: chosen counts its first 2 tokens fully
    and its last 2 at half weight, rejected counts both; the same for the reference. TRL 0.18's masks gave 0 here."""
    from posttrain.dpo.trainer import DPOTrainer

    columns = {"prompt_ids": [[10, 11, 12, 13, 14, 15]], "chosen_ids": [[20, 21, 22, 23]], "rejected_ids": [[30, 31]]}
    pairs = _pairs(tokenizer, columns)
    batch = collate_pairs(pairs, 0, False, None)
    assert batch.target_seq.tolist() == [0, 0, 0, 0, 1, 1] and batch.target_pos.tolist() == [1, 2, 3, 4, 1, 2]
    logps = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    stub = DPOTrainer.__new__(DPOTrainer)
    stub.args = DPOConfig(output_dir="unused", ld_alpha=0.5)
    assert stub._sequence_logps(logps, batch).tolist() == [-1 - 2 + 0.5 * (-3 - 4), -5 - 6]  # -6.5 and -11.0
    stub.args = DPOConfig(output_dir="unused")
    assert stub._sequence_logps(logps, batch).tolist() == [-10.0, -11.0]
    stub.args = DPOConfig(output_dir="unused", ld_alpha=0.0)
    assert stub._sequence_logps(logps, batch).tolist() == [-3.0, -11.0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_pairs_logps_do_not_depend_on_its_batch_or_padding(tokenizer, attention):
    """The same pair alone, beside a longer pair, padded to a multiple of 64, and padding-free: the same sequence
    log-probs (use_cache=False; padding-free sequences never attend across each other)."""
    from posttrain.models.logprobs import next_token_logprobs
    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, hidden=32, layers=2)
    model.config._attn_implementation = attention
    model.eval()
    columns = {"prompt": ["1+1=", "a much longer prompt here, much longer="],
               "chosen": ["2", "a long chosen answer"], "rejected": ["three", "x"]}
    pairs = _pairs(tokenizer, columns)

    def sequence_logps(selection, padding_free, multiple):
        batch = collate_pairs(pairs.select(selection), tokenizer.pad_token_id, padding_free, multiple)
        s = batch.sequences
        with torch.no_grad():
            logps, _, _ = next_token_logprobs(model, s.input_ids, s.attention_mask, s.position_ids, s.source_mask,
                                              s.targets)
        return torch.zeros(batch.targets.numel()).index_add(0, batch.target_seq, logps)[:2]

    alone = sequence_logps([0], False, None)
    for selection, padding_free, multiple in (([0, 1], False, None), ([0, 1], False, 64), ([0], False, 64),
                                              ([0, 1], True, None), ([0, 1], True, 64), ([0], True, None)):
        torch.testing.assert_close(sequence_logps(selection, padding_free, multiple), alone, rtol=1e-5, atol=1e-5)
