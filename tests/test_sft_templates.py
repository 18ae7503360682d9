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
from posttrain.sft.templates import EMBEDDING_MULTIPLE
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
