"""Preference data -> token pairs (dpo/data.py, dpo/batch.py): TRL's prepared pairs for every format, truncation
and the drop rule, LD-DPO's weights on a hand-computed pair, and a pair's log-probs whatever else is in its batch."""

import numpy as np
import pytest
import torch
from datasets import Dataset

from posttrain.configs import DPOConfig
from posttrain.data import DataError
from posttrain.sequences.pair_batch import collate_pairs
from posttrain.sequences.pair_data import PairEncoder, PairPreparation, prepare_pairs
from posttrain.sequences.chat import extract_prompt

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
    ({"chosen": ["a b"], "rejected": ["a b c"]}, "empty chosen completion once the prompt .* one of chosen and "
                                                 "rejected extends the other"),
    ({"chosen": ["same"], "rejected": ["same"]}, "train_dataset has no pair left that can teach: of its 1 pairs, 1 "
                                                 "have the same chosen and rejected tokens"),
    ({"prompt_ids": [[1]], "chosen_ids": [[2]], "rejected_ids": [[]]}, "empty rejected_ids"),
])
def test_bad_pairs_are_one_sentence(tokenizer, columns, message):
    with pytest.raises(DataError, match=message):
        _pairs(tokenizer, columns)


def _chat(role, texts):
    return [[{"role": role, "content": t}] for t in texts]


# one pair of each that gives the same answer twice (the index given), as given or once truncated
SAME_ANSWER_TWICE = {
    "standard": ({"prompt": ["1+1=", "2+2=", "3+3="], "chosen": ["2", "4", "6"], "rejected": ["3", "4", "7"]}, {}, 1),
    "conversational": ({"prompt": _chat("user", ["a", "b"]), "chosen": _chat("assistant", ["x", "y"]),
                        "rejected": _chat("assistant", ["x", "z"])}, {}, 0),
    "implicit": ({"chosen": ["Q: a b", "Q: same"], "rejected": ["Q: a c", "Q: same"]}, {}, 1),
    "implicit-conversational": ({"chosen": _chat("user", ["a"]) * 2, "rejected": [
        _chat("user", ["a"])[0], _chat("user", ["b"])[0]]}, {}, 0),
    "tokenized": ({"prompt_ids": [[1, 2], [1]], "chosen_ids": [[3], [4]], "rejected_ids": [[3], [5]]}, {}, 0),
    "keep_start": ({"prompt": ["ab", "cd"], "chosen": ["xyz1", "q"], "rejected": ["xyz2", "r"]},
                   {"max_length": 5}, 0),
    "keep_end": ({"prompt": ["ab", "cd"], "chosen": ["1xyz", "q"], "rejected": ["2xyz", "r"]},
                 {"max_length": 4, "truncation_mode": "keep_end"}, 0),
}


@pytest.mark.parametrize("form", list(SAME_ANSWER_TWICE))
def test_a_pair_with_the_same_answer_twice_is_dropped_with_one_warning(tokenizer, caplog, form):
    """Every model gives such a pair's two sequences the same log-prob: sigmoid's loss log 2, no gradient. Dropped
    in every format and after truncation, counted in one warning naming the cause and the fix."""
    columns, config, same = SAME_ANSWER_TWICE[form]
    rows = len(next(iter(columns.values())))
    pairs = _pairs(tokenizer, columns, **config)
    assert pairs.index.tolist() == [i for i in range(rows) if i != same]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    truncated = f" (once truncated to max_length={config['max_length']})" if config else ""
    assert warnings == [f"train_dataset: dropped 1 pairs of {rows} whose chosen and rejected are the same tokens"
                        f"{truncated}, which teach nothing (every model gives both the same log-prob); remove them "
                        f"from the dataset{' (raise max_length for those that differ beyond it)' if config else ''}."]
    for p in range(len(pairs)):  # what is left differs within max_length
        chosen, rejected = (pairs.rows.tokens[pairs.rows.row(r)] for r in (2 * p, 2 * p + 1))
        assert not np.array_equal(chosen, rejected)


def test_no_pair_left_that_can_teach_is_one_sentence(tokenizer):
    same = {"prompt": ["abcdef", "ab", "cd"], "chosen": ["x", "x", "yzw1"], "rejected": ["y", "x", "yzw2"]}
    with pytest.raises(DataError, match=r"^train_dataset has no pair left that can teach: of its 3 pairs, 1 prompts "
                                        r"alone fill max_length=5 and 1 have the same chosen and rejected tokens and 1 "
                                        r"have the same chosen and rejected tokens once truncated to max_length=5; "
                                        r"give pairs whose chosen and rejected answers differ within max_length\.$"):
        _pairs(tokenizer, same, max_length=5)


def test_trl_trains_on_a_pair_with_the_same_answer_twice(tokenizer):
    """The difference from TRL 1.16 (docs/dpo.md): its prepared dataset keeps the pair, which it then trains on at
    loss log 2 with no gradient."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl import DPOConfig as TRLDPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer as TRLDPOTrainer

    columns = SAME_ANSWER_TWICE["standard"][0]
    trl_args = TRLDPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    theirs = TRLDPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), Dataset.from_dict(columns),
                                            tokenizer, trl_args, "train")
    assert len(theirs) == 3 and theirs[1]["chosen_ids"] == theirs[1]["rejected_ids"]
    assert len(_pairs(tokenizer, columns)) == 2


def test_every_process_drops_the_same_pairs_and_the_main_one_says_so(tokenizer, caplog):
    """Map-style: each process prepares every pair, so the drop is the same everywhere; a stream's blocks too, before
    a micro-batch is shared out. Only the announcing (main) process warns."""
    from posttrain.sequences.batches import StreamBatches

    columns = {"prompt": [f"{i}+{i}=" for i in range(6)], "chosen": ["a", "b", "c", "d", "e", "f"],
               "rejected": ["a", "x", "c", "y", "z", "w"]}
    dataset = Dataset.from_dict(columns)
    args = DPOConfig(output_dir="unused")

    def preparation(rank):
        return PairPreparation(PairEncoder(tokenizer, dataset[0]), args, "train_dataset", announce=rank == 0)

    kept = [prepare_pairs(dataset, preparation(rank)).index.tolist() for rank in (1, 0)]
    assert kept == [[1, 3, 4, 5]] * 2
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    caplog.clear()
    shared = []
    for rank in (1, 0):
        stream = StreamBatches(dataset.to_iterable_dataset(), preparation(rank), micro_batch_size=1, num_processes=2,
                               accumulation=1, rank=rank)
        shared.append([stream.next_step()[0].index.tolist() for _ in range(2)])
    assert shared == [[[3], [5]], [[1], [4]]]  # the 4 pairs left, alternately to each process
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "train_dataset: dropped 2 pairs at rows 0-5 whose chosen and rejected are the same tokens, which teach nothing "
        "(every model gives both the same log-prob); remove them from the dataset."]


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
