"""SFT data: formats (against TRL 1.16's prepared rows), label masks, EOS, truncation, packing, batches, order."""

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset

from posttrain.configs import ConfigError, SFTConfig
from posttrain.data import DataError
from posttrain.sequences.collate import collate
from posttrain.sft.data import Preparation, prepare_map_dataset
from posttrain.sft.formats import RowEncoder
from posttrain.sequences.rows import (EpochPlan, TokenRows, best_fit_bins, pack, prepare, split_long, truncate,
                                      truncates, truncation_cut)

GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CHAT = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
         {"role": "assistant", "content": "6"}]]

DATASETS = {
    "text": {"text": ["The sky is blue.", "Grass is green"]},
    "prompt-completion": {"prompt": ["The sky is", "2+2="], "completion": [" blue.", "4"]},
    "conversational": {"messages": CHAT},
    "conversational prompt-completion": {"prompt": [c[:-1] for c in CHAT], "completion": [c[-1:] for c in CHAT]},
}


def _encode(tokenizer, data: dict, formatting_func=None, vocab_size=None, **config):
    rows = [dict(zip(data, values)) for values in zip(*data.values())]
    args = SFTConfig(output_dir="/tmp/unused", **config)
    encoder = RowEncoder(tokenizer, args, formatting_func, rows[0], vocab_size=vocab_size)
    return encoder, encoder.encode(rows, 0)


def _prepared(tokenizer, dataset, formatting_func=None, main_process=True, **config):
    """(training rows, the Preparation) of a whole map-style dataset, as the trainer prepares it."""
    args = SFTConfig(output_dir="/tmp/unused", **config)
    encoder = RowEncoder(tokenizer, args, formatting_func, dataset[0])
    preparation = Preparation(encoder, args, packing=args.packing, name="train_dataset", main_process=main_process)
    return prepare_map_dataset(dataset, preparation, seed=0), preparation


def _trl_rows(tokenizer, data: dict, formatting_func=None, **config):
    trl = pytest.importorskip("trl")
    from posttrain.testing import tiny_model

    args = trl.SFTConfig(output_dir="/tmp/unused-trl", use_cpu=True, bf16=False, report_to="none", **config)
    trainer = trl.SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args, train_dataset=Dataset.from_dict(data),
                             processing_class=tokenizer, formatting_func=formatting_func)
    prepared = trainer.train_dataset
    labels = prepared["labels"] if "labels" in prepared.column_names else prepared["input_ids"]
    return [(ids, [lab != -100 for lab in row]) for ids, row in zip(prepared["input_ids"], labels)]


@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_every_format_gives_trls_tokens_and_labels(tokenizer, name, completion_only_loss):
    _, ours = _encode(tokenizer, DATASETS[name], completion_only_loss=completion_only_loss)
    theirs = _trl_rows(tokenizer, DATASETS[name], completion_only_loss=completion_only_loss)
    assert [(ids.tolist(), mask.tolist()) for ids, mask in ours] == theirs
    for ids, mask in ours:  # the EOS is a label of every sequence
        assert (ids == tokenizer.eos_token_id)[mask].any()


def test_assistant_only_loss_matches_trl_with_generation_markers(tokenizer):
    tokenizer = _with_template(tokenizer, GENERATION_TEMPLATE)
    _, ours = _encode(tokenizer, DATASETS["conversational"], assistant_only_loss=True)
    theirs = _trl_rows(tokenizer, DATASETS["conversational"], assistant_only_loss=True)
    assert [(ids.tolist(), mask.tolist()) for ids, mask in ours] == theirs
    trained = tokenizer.decode(ours[1][0][ours[1][1]])
    assert trained == "4<|im_end|>\n6<|im_end|>\n"


def _with_template(tokenizer, template):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_assistant_turns_without_markers_are_found_by_rendering_prefixes(tokenizer):
    """A template without {% generation %} (the tiny ChatML one): the same mask as the marked template gives."""
    _, plain = _encode(tokenizer, DATASETS["conversational"], assistant_only_loss=True)
    _, marked = _encode(_with_template(tokenizer, GENERATION_TEMPLATE), DATASETS["conversational"],
                        assistant_only_loss=True)
    assert [(i.tolist(), m.tolist()) for i, m in plain] == [(i.tolist(), m.tolist()) for i, m in marked]


def test_a_template_that_rewrites_earlier_turns_stops_assistant_only_loss(tokenizer):
    # drops every assistant turn but the last, as reasoning templates drop earlier thoughts
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match=r"renders the conversation up to message 2 differently .* \{% generation %\}"):
        _encode(_with_template(tokenizer, rewriting), DATASETS["conversational"], assistant_only_loss=True)


def test_assistant_only_loss_needs_conversations(tokenizer):
    with pytest.raises(ConfigError, match="assistant_only_loss=True needs conversational data"):
        _encode(tokenizer, DATASETS["text"], assistant_only_loss=True)


def test_sharegpt_conversations_become_messages(tokenizer):
    sharegpt = {"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]]}
    _, ours = _encode(tokenizer, sharegpt, assistant_only_loss=True)
    _, messages = _encode(tokenizer, {"messages": CHAT[:1]}, assistant_only_loss=True)
    assert ours[0][0].tolist() == messages[0][0].tolist() and ours[0][1].tolist() == messages[0][1].tolist()


def test_eos_is_appended_once(tokenizer):
    _, out = _encode(tokenizer, {"text": ["ab", "ab<|im_end|>"]})
    assert out[0][0].tolist() == out[1][0].tolist() and out[0][0][-1] == tokenizer.eos_token_id
    assert (out[0][0] == tokenizer.eos_token_id).sum() == 1


def test_formatting_func_string_or_prompt_completion(tokenizer):
    data = {"question": ["2+2"], "answer": ["4"]}
    _, text = _encode(tokenizer, data, lambda r: f"Q: {r['question']} A: {r['answer']}")
    assert tokenizer.decode(text[0][0]) == "Q: 2+2 A: 4<|im_end|>" and text[0][1].all()
    encoder, pc = _encode(tokenizer, data, lambda r: {"prompt": f"Q: {r['question']} A:", "completion": f" {r['answer']}"})
    assert encoder.completion_only
    assert tokenizer.decode(pc[0][0][pc[0][1]]) == " 4<|im_end|>"


def test_formatting_func_is_never_ignored(tokenizer):
    """TRL 1.16 ignores a formatting function on prompt-completion data with completion_only_loss=False, and drops
    the EOS; here the formatted text is trained on, EOS included."""
    _, out = _encode(tokenizer, DATASETS["prompt-completion"], lambda r: "Q: " + r["prompt"] + " A:" + r["completion"],
                     completion_only_loss=False)
    assert tokenizer.decode(out[0][0]) == "Q: The sky is A: blue.<|im_end|>" and out[0][1].all()


def test_formatting_func_errors(tokenizer):
    with pytest.raises(ConfigError, match=r"completion_only_loss=True, but formatting_func returns a string"):
        _encode(tokenizer, DATASETS["prompt-completion"], lambda r: r["prompt"], completion_only_loss=True)
    with pytest.raises(DataError, match=r"formatting_func returned a list for row 0 .* one row at a time"):
        _encode(tokenizer, DATASETS["text"], lambda r: [r["text"]])
    with pytest.raises(ConfigError, match="already tokenized"):
        _encode(tokenizer, {"input_ids": [[5, 6]]}, lambda r: "x")


def test_tokenized_rows_and_their_masks(tokenizer):
    eos = tokenizer.eos_token_id
    _, out = _encode(tokenizer, {"input_ids": [[5, 6, 7, eos]], "completion_mask": [[0, 0, 1, 1]],
                                 "assistant_masks": [[1, 1, 1, 0]]})
    assert out[0][1].tolist() == [False, False, True, False]  # both masks, completion-only by default
    _, out = _encode(tokenizer, {"input_ids": [[5, 6, 7]], "completion_mask": [[0, 0, 1]]}, completion_only_loss=False)
    assert out[0][1].all()
    _, out = _encode(tokenizer, {"input_ids": [[5, 6, 7]], "labels": [[-100, 6, 7]]})
    assert out[0][1].tolist() == [False, True, True]
    with pytest.raises(DataError, match="labels that differ from its input_ids"):
        _encode(tokenizer, {"input_ids": [[5, 6, 7]], "labels": [[-100, 9, 7]]})
    with pytest.raises(DataError, match="has 2 completion_mask for 3 input_ids"):
        _encode(tokenizer, {"input_ids": [[5, 6, 7]], "completion_mask": [[0, 1]]})


def test_completion_only_loss_true_needs_completions(tokenizer):
    with pytest.raises(ConfigError, match="completion_only_loss=True, but train_dataset is text data"):
        _encode(tokenizer, DATASETS["text"], completion_only_loss=True)


def test_unknown_format_names_columns_and_formats(tokenizer):
    with pytest.raises(DataError, match=r"no SFT format: its columns are question, answer; SFT needs a text column"):
        _encode(tokenizer, {"question": ["a"], "answer": ["b"]})
    with pytest.raises(DataError, match="a prompt alone is GRPO's format"):
        _encode(tokenizer, {"prompt": ["a"]})


def test_conversations_need_a_chat_template(tokenizer):
    with pytest.raises(DataError, match="is conversational, and .* has no chat template: .*chat_template_path"):
        _encode(_with_template(tokenizer, None), DATASETS["conversational"])


def test_conversations_must_train_on_the_eos(tokenizer):
    tok = _with_template(tokenizer, tokenizer.chat_template)
    tok.eos_token = "<|endoftext|>"  # a base tokenizer whose EOS the ChatML template never emits
    with pytest.raises(DataError, match=r"never trains on the EOS token '<\|endoftext\|>'.*eos_token="):
        _encode(tok, DATASETS["conversational"])


def test_per_row_tools_and_template_kwargs_reach_the_template(tokenizer):
    template = ("{% if tools %}[tools:{{ tools | length }}]{% endif %}{% if terse %}[terse]{% endif %}"
                + tokenizer.chat_template)
    data = {"messages": CHAT[:1], "tools": ['[{"name": "f"}, {"name": "g"}]'], "chat_template_kwargs": [{"terse": True}]}
    _, out = _encode(_with_template(tokenizer, template), data)
    assert tokenizer.decode(out[0][0]).startswith("[tools:2][terse]<|im_start|>user")


# ---------------------------------------------------------------------- rows: truncation and packing


def _rows(lengths, labelled=None):
    seqs, start = [], 0
    for i, n in enumerate(lengths):
        ids = np.arange(start, start + n, dtype=np.int32)
        mask = np.ones(n, bool) if labelled is None else np.asarray(labelled[i], bool)
        seqs.append((ids, mask))
        start += n
    return TokenRows.from_sequences(seqs)


def _as_lists(rows):
    return [rows.tokens[rows.row(r)].tolist() for r in range(len(rows))]


def test_truncation_keeps_the_start_or_the_end():
    rows = _rows([5, 2])
    assert _as_lists(truncate(rows, 3)) == [[0, 1, 2], [5, 6]]
    kept = truncate(rows, 3, "keep_end")
    assert _as_lists(kept) == [[2, 3, 4], [5, 6]] and kept.starts[kept.offsets[:-1]].all()


def test_sequences_left_without_targets_are_dropped_and_counted():
    rows = _rows([4, 4], labelled=[[0, 0, 0, 1], [0, 1, 1, 1]])
    kept, dropped = prepare(rows, 3, "keep_start", False, "bfd")
    assert dropped == 1 and _as_lists(kept) == [[4, 5, 6]]


def test_best_fit_decreasing_and_split():
    """Lengths 5, 2, 3, 2 into rows of 4, as TRL's pack_dataset bins them. bfd truncates the 5 to 4; bfd_split cuts it
    into 4 + 1, and the 1-token piece, which starts a sequence and so has no target, is dropped."""
    rows = _rows([5, 2, 3, 2])
    packed, _ = prepare(rows, 4, "keep_start", True, "bfd")
    assert _as_lists(packed) == [[0, 1, 2, 3], [7, 8, 9], [5, 6, 10, 11]]
    split, dropped = prepare(rows, 4, "keep_start", True, "bfd_split")
    assert dropped == 1 and _as_lists(split) == [[0, 1, 2, 3], [7, 8, 9], [5, 6, 10, 11]]
    starts = [split.starts[split.row(r)].tolist() for r in range(len(split))]
    assert starts == [[True, False, False, False], [True, False, False], [True, False, True, False]]
    long_split, _ = prepare(_rows([6, 2]), 4, "keep_start", True, "bfd_split")
    assert _as_lists(long_split) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the 6 as 4 + 2, the 2-piece shares a row


def test_best_fit_bins_never_overflow_and_place_every_item():
    lengths = np.random.default_rng(0).integers(1, 100, size=500)
    bins = best_fit_bins(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert max(lengths[b].sum() for b in bins) <= 100
    assert len(bins) <= int(np.ceil(lengths.sum() / 100 * 1.25))  # within 25% of the lower bound


def test_wrapped_packing_keeps_sequence_boundaries():
    rows = pack(_rows([3, 4, 2]), 4, "wrapped")
    assert _as_lists(rows) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert rows.starts.tolist() == [True, False, False, True, True, False, False, True, True]


def test_split_long_cuts_pieces_of_max_length():
    rows = split_long(_rows([7, 2]), 3)
    assert _as_lists(rows) == [[0, 1, 2], [3, 4, 5], [6], [7, 8]] and rows.starts[rows.offsets[:-1]].all()


# ---------------------------------------------------------------------- batches


def test_padded_and_padding_free_batches():
    rows = _rows([3, 2], labelled=[[0, 1, 1], [1, 1]])
    padded = collate(rows, pad_id=99, padding_free=False, pad_to_multiple_of=4)
    assert padded.input_ids.tolist() == [[0, 1, 2, 99], [3, 4, 99, 99]]
    assert padded.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]] and padded.position_ids is None
    assert padded.targets.tolist() == [1, 2, 4] and padded.tokens == 5
    flat = collate(rows, pad_id=99, padding_free=True, pad_to_multiple_of=4)
    assert flat.input_ids.tolist() == [[0, 1, 2, 3, 4, 99, 99, 99]] and flat.attention_mask is None
    assert flat.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    # token 3 starts a sequence: never a target, although labelled
    assert flat.targets.tolist() == [1, 2, 4] and flat.source_mask.sum() == 3


def test_epoch_plan_orders_and_shares():
    plan = EpochPlan(np.arange(10), micro_batch_size=2, num_processes=2, accumulation=2, strategy="sequential")
    order = plan.order(0)
    assert plan.micro_batches == 3 and plan.steps == 2 and list(plan.step_micro_batches(1)) == [2]
    assert plan.share(order, 0, 1).tolist() == [2, 3] and [plan.share(order, 2, r).tolist() for r in (0, 1)] == [[8],
                                                                                                                 [9]]
    random = EpochPlan(np.arange(10), 2, num_processes=1, accumulation=1, strategy="random", seed=3)
    assert sorted(random.order(0).tolist()) == list(range(10)) and random.order(0).tolist() != random.order(1).tolist()
    again = EpochPlan(np.arange(10), 2, num_processes=1, accumulation=1, strategy="random", seed=3)
    assert random.order(1).tolist() == again.order(1).tolist()
    assert EpochPlan(np.arange(10), 4, num_processes=1, accumulation=1, drop_last=True).micro_batches == 2
    grouped = EpochPlan(np.arange(100), 1, num_processes=1, accumulation=1, strategy="group_by_length").order(0)
    assert grouped.tolist()[:50] == sorted(grouped.tolist()[:50], reverse=True)


def test_padding_free_and_packed_forwards_equal_separate_ones(tokenizer):
    """The same documents give the same target log-probs padded, padding-free and packed, with sdpa and eager: the
    position ids alone keep packed sequences apart (no cache, no mask)."""
    from posttrain.models.logprobs import next_token_logprobs
    from posttrain.testing import tiny_model

    rows = _rows([5, 7, 3])
    rows.tokens = rows.tokens % 90 + 4
    for attention in ("sdpa", "eager"):
        model = tiny_model(tokenizer, hidden=32, layers=2)
        model.config._attn_implementation = attention
        model.eval()
        results = []
        for padding_free in (False, True):
            batch = collate(rows, tokenizer.pad_token_id, padding_free, None)
            with torch.no_grad():
                logps, _, _ = next_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                                  batch.source_mask, batch.targets)
            results.append(logps)
        packed, _ = prepare(rows, 16, "keep_start", True, "bfd")
        assert len(packed) == 1
        batch = collate(packed, tokenizer.pad_token_id, True, None)
        with torch.no_grad():
            logps, _, _ = next_token_logprobs(model, batch.input_ids, None, batch.position_ids, batch.source_mask,
                                              batch.targets)
        # packing reorders the documents (longest first): compare per document
        separate = _per_document(results[0], [5, 7, 3])
        assert torch.allclose(results[1], results[0], atol=1e-5), attention
        assert sorted(_per_document(logps, [7, 5, 3])) == pytest.approx(sorted(separate), abs=1e-4), attention


def _per_document(logps, lengths):
    out, at = [], 0
    for n in lengths:
        out.append(float(logps[at:at + n - 1].sum()))
        at += n - 1
    return out


# ---------------------------------------------------------------------- what preparation cuts, why a row has nothing


TEXTS = ["ab" * n for n in (1, 2, 3, 4, 5)]  # 3, 5, 7, 9 and 11 tokens with the EOS: 35


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "posttrain"]


def test_truncation_is_counted_where_it_cuts():
    rows = _rows([7, 2, 5])
    assert truncation_cut(rows.lengths, 4) == (2, 4) and truncation_cut(rows.lengths, None) == (0, 0)
    assert len(rows.tokens) - len(truncate(rows, 4).tokens) == 4  # what it counts is what truncate removes
    assert truncates(False, "bfd_split") and truncates(True, "bfd")  # unpacked rows are cut whatever the strategy
    assert not truncates(True, "bfd_split") and not truncates(True, "wrapped")


def test_wrapped_packing_counts_the_rows_it_drops():
    """Cut every 4 tokens, the last row holds one token, which the cut makes a sequence start: no target, dropped and
    counted (it was dropped without a count before)."""
    packed, dropped = prepare(_rows([3, 4, 2]), 4, "keep_start", True, "wrapped")
    assert dropped == 1 and _as_lists(packed) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("packing, keeps", [
    (True, "; packing_strategy='bfd_split' keeps them, splitting long rows into pieces of max_length."),
    (False, "; raise max_length to keep them, or pack with packing_strategy='bfd_split', which splits long rows "),
])
def test_what_max_length_cuts_is_said_once_with_counts_and_shares(tokenizer, caplog, packing, keeps):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        rows, _ = _prepared(tokenizer, Dataset.from_dict({"text": TEXTS}), packing=packing, max_length=6)
    assert len(rows.tokens) == 35 - (1 + 3 + 5)
    [warning] = _warnings(caplog)
    assert warning.startswith("train_dataset: 3 of 5 rows (60.0%) were longer than max_length=6 and cut to their first "
                              "6 tokens, losing 9 of 35 tokens (25.7%)") and keeps in warning


def test_bfd_split_cuts_nothing_and_counts_the_pieces_it_drops(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        rows, _ = _prepared(tokenizer, Dataset.from_dict({"text": TEXTS}), packing=True, max_length=6,
                            packing_strategy="bfd_split")
    assert len(rows.tokens) == 35 - 1  # 7 = 6 + a one-token piece, which has no target
    assert _warnings(caplog) == ["train_dataset: 1 pieces of rows split at max_length=6 held no trained token and were "
                                 "dropped."]


def test_a_stream_says_what_max_length_cuts_once(tokenizer, caplog, monkeypatch):
    from posttrain.sequences import batches

    monkeypatch.setattr(batches, "BLOCK", 2)  # 3 blocks: none cut, then 2 rows cut, then 1
    dataset = Dataset.from_dict({"text": TEXTS}).to_iterable_dataset()
    args = SFTConfig(output_dir="/tmp/unused", packing=True, max_length=6)
    preparation = Preparation(RowEncoder(tokenizer, args, None, batches.first_row(dataset)), args, packing=True,
                              name="train_dataset", stream=True)
    stream = batches.StreamBatches(dataset, preparation, micro_batch_size=1, num_processes=1, accumulation=1, rank=0)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        for _ in range(6):
            stream.next_step()
    [warning] = _warnings(caplog)
    assert warning.startswith("train_dataset: 2 of 4 rows (50.0%) were longer than max_length=6") and warning.endswith(
        "(over the stream's rows read so far; later blocks are not reported).")
    assert preparation.losses.truncated == 3  # still counted


def test_only_the_main_process_warns(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        _prepared(tokenizer, Dataset.from_dict({"text": TEXTS}), main_process=False, max_length=6)
    assert _warnings(caplog) == []


def test_rows_with_nothing_to_train_on_are_left_out_with_their_cause(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        rows, _ = _prepared(tokenizer, Dataset.from_dict({"text": ["a", "bcd", "ef"]}),
                            lambda r: "" if r["text"] == "a" else r["text"])
    assert _as_lists(rows) == [tokenizer("bcd<|im_end|>")["input_ids"], tokenizer("ef<|im_end|>")["input_ids"]]
    assert _warnings(caplog) == [
        "train_dataset: 1 of 3 rows had nothing to train on and were left out (row 0: formatting_func returned an "
        "empty string for it; make the function return the row's text, or filter such rows out first)."]


_USER_COMPLETION = {"prompt": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]] * 2,
                    "completion": [[{"role": "user", "content": "c"}]] * 2}


@pytest.mark.parametrize("data, formatting_func, config, cause", [
    ({"text": ["a", "b"]}, lambda r: "", {}, r"row 0: formatting_func returned an empty string for it\); make the "),
    ({"text": ["", ""]}, None, {}, r"row 0: its 'text' is empty\); fill it in"),
    ({"prompt": ["", ""], "completion": ["", ""]}, None, {}, r"row 0: its prompt and completion are both empty\)"),
    ({"input_ids": [[5, 6, 7]] * 2, "labels": [[-100] * 3] * 2}, None, {},
     r"row 0: its labels leave no token after the first to train on\); mark the tokens"),
    ({"input_ids": [[5, 6, 7]] * 2, "completion_mask": [[1, 0, 0]] * 2}, None, {},
     r"row 0: its completion_mask leave no token after the first"),
    ({"input_ids": [[5]] * 2}, None, {}, r"row 0: its input_ids hold 1 token\(s\), and the first token of a sequence"),
    (_USER_COMPLETION, None, {"assistant_only_loss": True},
     r"row 0: its completion holds no assistant message, and assistant_only_loss=True trains on assistant turns only"),
])
def test_a_dataset_with_nothing_to_train_on_says_why_not_max_length(tokenizer, data, formatting_func, config, cause):
    with pytest.raises(DataError, match=r"^train_dataset has nothing to train on: no row has a token to train on \("
                                        + cause) as info:
        _prepared(tokenizer, Dataset.from_dict(data), formatting_func, **config)
    assert "max_length" not in str(info.value)


def test_rows_empty_for_both_causes_name_both(tokenizer):
    data = Dataset.from_dict({"text": ["a", "b", "c"]})
    with pytest.raises(DataError, match=r"1 rows had nothing to train on \(row 0: formatting_func returned an empty "
                                        r"string for it\) and the other 2 lost every trained token to truncation to "
                                        r"max_length=1; make the function return .*, and raise max_length"):
        _prepared(tokenizer, data, lambda r: "" if r["text"] == "a" else r["text"], max_length=1)


@pytest.mark.parametrize("message, found", [
    ({"role": "assistant", "content": None}, r"has content None in message 1 \(assistant\) of 'messages', which a "
                                             r"chat template renders as the text 'None', as nothing or as an error"),
    ({"role": "assistant"}, r"has no 'content' in message 1 \(assistant\) of 'messages'"),
    ({"role": "assistant", "content": None, "tool_calls": []}, r"has content None in message 1"),
    ({"role": "assistant", "content": 4}, r"has content of type int in message 1 \(assistant\) of 'messages': write "
                                          r"it as a string"),
    ({"role": "assistant", "content": {"text": "4"}}, r"has content of type dict in message 1"),
    ({"role": "assistant", "content": ["4"]}, r"has content of type list in message 1"),
    ({"from": "gpt", "value": None}, r"has content None in message 1 \(assistant\)"),
])
def test_a_message_without_text_is_refused_naming_the_row_and_message(tokenizer, message, found):
    conversation = [{"role": "user", "content": "hi"}, message]
    with pytest.raises(DataError, match=r"^Row 1 of train_dataset " + found):
        _encode(tokenizer, {"messages": [CHAT[0], conversation]})
    with pytest.raises(DataError, match=r"content None in message 0 \(user\)"):
        _encode(tokenizer, {"messages": [[{"role": "user", "content": None}, CHAT[0][1]]]})


def test_an_assistant_tool_call_without_text_trains(tokenizer):
    """OpenAI's and TRL's format: an assistant message with tool_calls may have content None (or none); a dataset's
    null keys (every message gets every key) are absent to the template. With TRL's templates:
    tests/test_sft_templates.py."""
    call = [{"type": "function", "function": {"name": "mul", "arguments": '{"a": 3}'}}]
    conversation = [{"role": "user", "content": "3*4?", "tool_calls": None},
                    {"role": "assistant", "content": None, "tool_calls": call},
                    {"role": "tool", "content": "12", "tool_calls": None},
                    {"role": "assistant", "content": "It is 12.", "tool_calls": None}]
    _, out = _encode(tokenizer, {"messages": [conversation]}, assistant_only_loss=True)
    assert tokenizer.decode(out[0][0][out[0][1]]).endswith("It is 12.<|im_end|>\n")
    assert "None" not in tokenizer.decode(out[0][0])


@pytest.mark.parametrize("bad", [100 + 5, -1, 2 ** 40])
def test_token_ids_outside_the_model_vocabulary_are_refused(tokenizer, bad):
    with pytest.raises(DataError, match=rf"^Row 1 of train_dataset has token id {bad} at position 1 of its input_ids, "
                                        r"outside the model's vocabulary of 100 ids \(0 to 99, its embedding rows\): "
                                        r"tokenize the rows with this model's tokenizer\.$"):
        _encode(tokenizer, {"input_ids": [[5, 6, 7], [5, bad, 7]]}, vocab_size=100)


def test_the_vocabulary_is_the_models_embedding_rows(tokenizer):
    """An embedding padded past the tokenizer (as Qwen's are) takes ids up to its rows; a tokenizer with more tokens
    than the model's rows is refused before its ids reach the embedding."""
    import copy

    rows = len(tokenizer) + 28
    _, out = _encode(tokenizer, {"input_ids": [[5, rows - 1, 7]]}, vocab_size=rows)
    assert out[0][0].tolist() == [5, rows - 1, 7]
    with pytest.raises(DataError, match=rf"token id {rows} at position 1"):
        _encode(tokenizer, {"input_ids": [[5, rows, 7]]}, vocab_size=rows)
    grown = copy.deepcopy(tokenizer)
    grown.add_tokens(["<|new|>"])
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset tokenizes to id 100 \('<\|new\|>'\), beyond the "
                                        r"model's 100 embedding rows, as the tokenizer has 101 tokens: resize the "
                                        r"model's embeddings"):
        _encode(grown, {"text": ["a<|new|>"]}, vocab_size=len(tokenizer))


def test_mask_values_are_0_or_1(tokenizer):
    _, out = _encode(tokenizer, {"input_ids": [[5, 6, 7]], "completion_mask": [[False, True, True]]})
    assert out[0][1].tolist() == [False, True, True]
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has 2 at position 1 of its completion_mask: give 1 "):
        _encode(tokenizer, {"input_ids": [[5, 6, 7]], "completion_mask": [[0, 2, 1]]})


def test_a_dataset_mixing_formats_names_both(tokenizer):
    """A file mixing formats gives each row the others' columns as null (as load_dataset("json") does)."""
    mixed = Dataset.from_dict({"messages": [CHAT[0], None], "prompt": [None, "2+2="], "completion": [None, "4"]})
    with pytest.raises(DataError, match=r"^Row 1 of train_dataset is prompt-completion data \(prompt, completion\), "
                                        r"and its first row is conversational \(messages\): one dataset holds one "
                                        r"format"):
        _prepared(tokenizer, mixed)
    with pytest.raises(DataError, match=r"^Row 1 of train_dataset is conversational data \(messages\), and its first "
                                        r"row is prompt-completion \(prompt, completion\)"):
        _prepared(tokenizer, mixed.select([1, 0]))


def test_a_null_value_is_named_as_such(tokenizer):
    with pytest.raises(DataError, match=r"^Row 1 of train_dataset has null in 'completion', which prompt-completion "
                                        r"data needs in every row: fill the value in, or filter such rows out"):
        _prepared(tokenizer, Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", None]}))
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has null in 'completion', so it is in no SFT "
                                        r"format"):
        _prepared(tokenizer, Dataset.from_dict({"prompt": ["a", "b"], "completion": [None, "d"]}))
    with pytest.raises(DataError, match=r"^Row 1 of train_dataset has null in 'text', which text data needs"):
        _prepared(tokenizer, Dataset.from_dict({"text": ["a", None]}))


SKIPS_ASSISTANT = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                   "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAST_USER_ONLY = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 == messages | length - 2 %}"
                  "<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [SKIPS_ASSISTANT, LAST_USER_ONLY], ids=["skips-assistant", "last-user-only"])
@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_a_template_that_drops_the_answer_is_blamed_not_the_row(tokenizer, template, assistant_only_loss):
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset: the chat template leaves out message 1, the last "
                                        r"assistant message \(its text is not in the rendered conversation\), so the "
                                        r"row would train without its answer; the template is at fault, not the row"):
        _encode(_with_template(tokenizer, template), {"messages": CHAT[:1]}, assistant_only_loss=assistant_only_loss)


def test_generation_markers_that_enclose_nothing_are_blamed_not_the_row(tokenizer):
    empty_markers = GENERATION_TEMPLATE.replace("{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}",
                                                "{{ m['content'] }}<|im_end|>\n{% generation %}{% endgeneration %}")
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has assistant turns, but the chat template's "
                                        r"\{% generation %\} markers enclose none of their tokens"):
        _encode(_with_template(tokenizer, empty_markers), {"messages": CHAT[:1]}, assistant_only_loss=True)
    with pytest.raises(DataError, match=r"has no assistant tokens to train on with assistant_only_loss=True: give "
                                        r"every conversation an assistant turn"):  # the row's own fault
        _encode(_with_template(tokenizer, GENERATION_TEMPLATE), {"messages": [CHAT[0][:1]]}, assistant_only_loss=True)


def test_content_parts_rendered_as_python_are_refused(tokenizer):
    parts = [[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]]
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset: the chat template renders the content of message "
                                        r"0, a list of parts, as Python text"):
        _encode(tokenizer, {"messages": parts})
    reading_parts = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}{{ p['text'] }}"
                     "{% endfor %}<|im_end|>\n{% endfor %}")
    _, out = _encode(_with_template(tokenizer, reading_parts), {"messages": parts})
    assert tokenizer.decode(out[0][0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"


def test_a_template_error_names_the_row(tokenizer):
    strict = "{% for m in messages %}{{ raise_exception('roles must alternate') if loop.index0 > 0 }}{% endfor %}"
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset: the chat template raised TemplateError: roles must "
                                        r"alternate; fix the row, or use a template that renders it"):
        _encode(_with_template(tokenizer, strict), {"messages": CHAT[:1]})
