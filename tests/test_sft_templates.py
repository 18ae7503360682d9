"""Chat templates as TRL 1.16 uses them in SFT: its bundled training template for assistant_only_loss (Qwen3 with
several assistant turns: the same labels as TRL's own SFTTrainer), and chat_template_path from a tokenizer whose
template needs tokens the vocabulary lacks (the same vocabulary and embeddings as TRL's clone_chat_template)."""

import os
import sys

import pytest
import torch
from datasets import Dataset
from test_sft_trainer import sft_config

from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.sequences.templates import EMBEDDING_MULTIPLE
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")
TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
TURNS = [[{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"It is {a + b}."},
          {"role": "user", "content": "Twice that?"}, {"role": "assistant", "content": f"{2 * (a + b)}."}]
         for a in range(3) for b in range(3)]


def _qwen3_tokenizer():
    tokenizer = tiny_tokenizer(all_bytes=False)
    with open(os.path.join(TEMPLATES, "qwen3.jinja"), encoding="utf-8") as f:
        tokenizer.chat_template = f.read()
    return tokenizer


def _ours(tmp_path, tokenizer, **overrides):
    return SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1),
                      args=sft_config(tmp_path, max_length=None, **overrides),
                      train_dataset=Dataset.from_dict({"messages": TURNS}), processing_class=tokenizer)


def test_qwen3_with_several_assistant_turns_masks_as_trls_training_template(tmp_path):
    """Qwen3's own template drops earlier turns' reasoning, so assistant turns cannot be found turn by turn; TRL swaps
    in qwen3_training.jinja, and so does posttrain: the tokens and labels equal TRL's prepared rows, row by row."""
    tokenizer = _qwen3_tokenizer()
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=None,
                         report_to="none", use_cpu=True)
    theirs = trl.SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                            train_dataset=Dataset.from_dict({"messages": TURNS}), processing_class=tokenizer)
    ours = _ours(tmp_path, tokenizer, assistant_only_loss=True)
    assert len(ours.train_dataset) == len(theirs.train_dataset) == len(TURNS)
    for mine, trls in zip(ours.train_dataset, theirs.train_dataset):
        assert mine["input_ids"] == trls["input_ids"] and mine["labels"] == trls["labels"]
        trained = [label != -100 for label in mine["labels"]]
        assert sum(trained) > 0 and not all(trained)
    assert tokenizer.chat_template.startswith(open(os.path.join(TEMPLATES, "qwen3.jinja")).read()[:40])  # untouched


def test_without_trl_a_template_that_rewrites_turns_is_refused_with_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # import fails: TRL not installed
    with pytest.raises(DataError, match=r"rewrites earlier turns.*\{% generation %\} markers.*trl installed"):
        _ours(tmp_path, _qwen3_tokenizer(), assistant_only_loss=True)


def _source_tokenizer(tmp_path) -> str:
    """A tokenizer directory whose template (Qwen3's) uses tokens the tiny vocabulary lacks."""
    source = _qwen3_tokenizer()
    source.add_tokens(["<|im_start|>", "<think>", "</think>"], special_tokens=True)
    path = str(tmp_path / "source")
    source.save_pretrained(path)
    return path


def test_chat_template_path_from_a_tokenizer_adds_its_tokens_as_trls_clone_chat_template(tmp_path):
    from trl import clone_chat_template

    path = _source_tokenizer(tmp_path)
    target = tiny_tokenizer(all_bytes=False)
    model, target, added = clone_chat_template(tiny_model(target, hidden=32, layers=1), target, path)
    ours = _ours(tmp_path, tiny_tokenizer(all_bytes=False), chat_template_path=path, max_steps=1)
    tok = ours.tokenizer
    assert tok.get_vocab() == target.get_vocab() and tok.chat_template == target.chat_template
    assert tok.eos_token == target.eos_token == "<|im_end|>"
    embeddings = ours.policy.get_input_embeddings().num_embeddings
    assert embeddings == model.get_input_embeddings().num_embeddings == len(tok.get_vocab())
    assert embeddings % EMBEDDING_MULTIPLE == 0
    assert ours.policy.generation_config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    before = {n: p.detach().clone() for n, p in ours.policy.named_parameters()}
    ours.train()  # the new tokens train
    assert any(not torch.equal(p, before[n]) for n, p in ours.policy.named_parameters())


def test_a_jinja_file_whose_tokens_are_missing_is_refused(tmp_path):
    template = tmp_path / "llama3.jinja"
    template.write_text(open(os.path.join(TEMPLATES, "llama3.jinja")).read())
    with pytest.raises(ConfigError, match=r"uses <\|end_header_id\|>, <\|eot_id\|>, <\|start_header_id\|>.*give "
                                          r"the tokenizer directory the template "
                                          r"comes from as chat_template_path"):
        _ours(tmp_path, tiny_tokenizer(all_bytes=False), chat_template_path=str(template))


@pytest.mark.peft
@pytest.mark.parametrize("tied", [False, True])
def test_with_adapters_the_added_tokens_train_as_in_trl(tmp_path, tied):
    """TRL puts the tokens chat_template_path added into peft's trainable_token_indices and lm_head into
    modules_to_save; so does posttrain (for tied embeddings the trainable tokens cover the output layer, where TRL's
    lm_head entry makes peft stop), and training moves the new tokens' embeddings."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen2ForCausalLM

    from posttrain.testing import tiny_config

    tokenizer = tiny_tokenizer(all_bytes=False)
    model_config = tiny_config(tokenizer, hidden=32, layers=1)
    model_config.tie_word_embeddings = tied
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = SFTTrainer(Qwen2ForCausalLM(model_config),
                         args=sft_config(tmp_path, max_length=None, chat_template_path=_source_tokenizer(tmp_path),
                                         max_steps=2, learning_rate=1e-2),
                         train_dataset=Dataset.from_dict({"messages": TURNS}), processing_class=tokenizer,
                         peft_config=config)
    added = trainer.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert set(added) <= set(config.trainable_token_indices["embed_tokens"])
    assert ("lm_head" in (config.modules_to_save or [])) is not tied
    embeddings = trainer.policy.get_input_embeddings()
    before = embeddings(torch.tensor(added)).detach().clone()
    trainer.train()
    assert not torch.equal(embeddings(torch.tensor(added)).detach(), before)


# ---------------------------------------------------------------------- TRL's templates and what rows give them

CALL = [{"type": "function", "function": {"name": "mul", "arguments": {"a": 3, "b": 4}}}]
TOOL_TURNS = [[{"role": "user", "content": f"{a}*4?"}, {"role": "assistant", "content": None, "tool_calls": CALL},
               {"role": "tool", "name": "mul", "content": str(4 * a)}, {"role": "assistant", "content": f"{4 * a}."}]
              for a in range(2)]
REASONING = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd</think>\n\nIt is 4."},
             {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "<think>\nagain</think>\n\n6."}]


def _template(name: str) -> str:
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def _tokenizer_with(name: str):
    tokenizer = tiny_tokenizer(all_bytes=True)  # the templates' JSON and names need more than the tiny alphabet
    tokenizer.chat_template = _template(name)
    return tokenizer


@pytest.mark.parametrize("name, assistant_only_loss", [("qwen2_5", False), ("qwen2_5", True), ("qwen3", True)])
def test_an_assistant_tool_call_with_content_none_trains_as_in_trl(tmp_path, name, assistant_only_loss):
    """OpenAI's tool-call message (content None, tool_calls) is valid: the same tokens and labels as TRL 1.16's
    SFTTrainer prepares, with its templates (and its training templates for assistant_only_loss)."""
    tokenizer = _tokenizer_with(name)
    data = Dataset.from_list([{"messages": turns} for turns in TOOL_TURNS])
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=assistant_only_loss, max_length=None,
                         report_to="none", use_cpu=True)
    theirs = trl.SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args, train_dataset=data,
                            processing_class=tokenizer).train_dataset
    ours = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1),
                      args=sft_config(tmp_path, max_length=None, assistant_only_loss=assistant_only_loss),
                      train_dataset=data, processing_class=tokenizer).train_dataset
    for mine, trls in zip(ours, theirs):
        assert mine["input_ids"] == trls["input_ids"] and mine["labels"] == trls["labels"]
        trained = tokenizer.decode([t for t, label in zip(mine["input_ids"], mine["labels"]) if label != -100])
        assert '"name": "mul"' in trained and "None" not in tokenizer.decode(mine["input_ids"])


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3_1", "gemma3"])
def test_an_assistant_message_with_content_none_is_refused_whatever_the_template(tmp_path, name):
    """Content None renders as "None", as nothing, or as a template error, depending on the template (qwen2_5: an
    UndefinedError; qwen3, llama3_1, gemma3: an empty turn, trained on): one sentence, before any template runs."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    data = Dataset.from_dict({"messages": [conversation]})
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has content None in message 1 \(assistant\) of "
                                        r"'messages'.*only an assistant message with tool_calls may leave it out"):
        SFTTrainer(tiny_model(tokenizer := _tokenizer_with(name), hidden=32, layers=1),
                   args=sft_config(tmp_path, max_length=None), train_dataset=data, processing_class=tokenizer)


def test_trls_templates_keep_the_answer_and_reasoning_templates_are_not_blamed():
    """The check that blames a template for dropping the answer, on every template TRL 1.16 ships and a two-turn
    reasoning conversation: it never fires on one that reads string content (the reasoning ones drop earlier
    thoughts, some trim), and fires on each that renders none of it (the vision ones read content parts only)."""
    from posttrain.sft.row_checks import parts_as_python, template_dropped_text

    tokenizer = tiny_tokenizer(all_bytes=True)
    rendered_by = {}
    for path in sorted(os.listdir(TEMPLATES)):
        if path.endswith(".jinja"):
            try:
                rendered_by[path] = tokenizer.apply_chat_template(REASONING, tokenize=False,
                                                                  chat_template=_template(path[:-6]), bos_token="")
            except Exception:  # noqa: BLE001 - templates for other roles or content (vision ones): not this check's
                continue
    assert len(rendered_by) >= 50
    for path, rendered in rendered_by.items():
        reads_strings = "and 3+3?" in rendered
        assert (template_dropped_text(REASONING, rendered) is None) is reads_strings, path
        assert parts_as_python(REASONING, rendered) is None, path
    assert sum("and 3+3?" in rendered for rendered in rendered_by.values()) >= 40
    assert "add" not in rendered_by["qwen3.jinja"] and "It is 4." in rendered_by["qwen3.jinja"]  # thoughts dropped


@pytest.mark.parametrize("name, found", [("qwen3", "left out"), ("llama3_1", "as Python"), ("qwen2_5_vl", None)])
def test_content_parts_a_template_cannot_read_are_found(name, found):
    """A list of typed parts: qwen3 renders nothing of it, llama3_1 renders it as Python text, qwen2_5_vl reads it."""
    from posttrain.sft.row_checks import parts_as_python, template_dropped_text

    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "It is 4."}]}]
    rendered = tiny_tokenizer(all_bytes=True).apply_chat_template(parts, tokenize=False, chat_template=_template(name))
    findings = {"left out": template_dropped_text(parts, rendered), "as Python": parts_as_python(parts, rendered)}
    assert {kind for kind, at in findings.items() if at is not None} == ({found} if found else set())


def test_a_template_that_refuses_the_row_says_so_in_one_sentence(tmp_path):
    tokenizer = _tokenizer_with("gemma")
    data = Dataset.from_dict({"messages": [[{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"},
                                            {"role": "assistant", "content": "ok"}]]})
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset: the chat template raised TemplateError: "
                                        r"Conversation roles must alternate user/assistant/user/assistant/; fix the "
                                        r"row, or use a template that renders it \(chat_template_path\)\.$"):
        SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=sft_config(tmp_path, max_length=None),
                   train_dataset=data, processing_class=tokenizer)
