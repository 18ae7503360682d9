"""SFT data: formats (against TRL 1.16's prepared rows), label masks, EOS, truncation, packing, batches, order."""

import numpy as np
import pytest
import torch
from datasets import Dataset

from posttrain.configs import ConfigError, SFTConfig
from posttrain.data import DataError
from posttrain.sequences.collate import collate
from posttrain.sft.formats import RowEncoder
from posttrain.sequences.rows import EpochPlan, TokenRows, best_fit_bins, pack, prepare, split_long, truncate

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


def _encode(tokenizer, data: dict, formatting_func=None, **config):
    rows = [dict(zip(data, values)) for values in zip(*data.values())]
    args = SFTConfig(output_dir="/tmp/unused", **config)
    encoder = RowEncoder(tokenizer, args, formatting_func, rows[0])
    return encoder, encoder.encode(rows, 0)


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
    random = EpochPlan(np.arange(10), 2, 1, 1, "random", seed=3)
    assert sorted(random.order(0).tolist()) == list(range(10)) and random.order(0).tolist() != random.order(1).tolist()
    assert random.order(1).tolist() == EpochPlan(np.arange(10), 2, 1, 1, "random", seed=3).order(1).tolist()
    assert EpochPlan(np.arange(10), 4, 1, 1, drop_last=True).micro_batches == 2
    grouped = EpochPlan(np.arange(100), 1, 1, 1, "group_by_length").order(0)
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
