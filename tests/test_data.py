import pytest
from datasets import Dataset, IterableDataset

from posttrain.data import DataError, PromptEncoder, PromptSource, load_prompt_dataset


def _source(rows, tokenizer, per_round=2, **enc):
    ds = rows if not isinstance(rows, dict) else Dataset.from_dict(rows)
    return PromptSource(ds, PromptEncoder(tokenizer, **enc), per_round)


def test_conversational_prompts_use_chat_template(tokenizer):
    src = _source({"prompt": [[{"role": "user", "content": "2+2"}]] * 2, "answer": ["4", "4"]}, tokenizer)
    text = tokenizer.decode(src.prompt_ids[0])
    assert text == "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
    assert src.columns == ["answer"]


def test_rounds_cover_each_epoch_once_and_drop_remainder(tokenizer):
    src = _source({"prompt": [str(i) for i in range(5)]}, tokenizer, per_round=2)
    rounds = src.rounds()
    epoch1 = [r["prompt"] for _ in range(2) for r in next(rounds).rows]
    assert len(set(epoch1)) == 4 and src.rounds_per_epoch == 2


def test_iterable_dataset_and_too_few_prompts(tokenizer):
    it = IterableDataset.from_generator(lambda: ({"prompt": f"p{i}"} for i in range(3)))
    src = _source(it, tokenizer, per_round=2)
    assert [r["prompt"] for r in next(src.rounds()).rows] == ["p0", "p1"]
    with pytest.raises(DataError, match="fewer than the 4 unique prompts"):
        _source({"prompt": ["a", "b"]}, tokenizer, per_round=4)


def test_local_files(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    (tmp_path / "d.csv").write_text("prompt,answer\na,1\n")
    assert load_prompt_dataset(str(tmp_path / "d.jsonl"))["prompt"] == ["a", "b"]
    assert load_prompt_dataset(str(tmp_path / "d.csv"))["answer"] == [1]
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "missing.parquet"))


def test_tiny_tokenizer_round_trips_through_a_saved_model_directory(tmp_path):
    """Saved beside a Qwen2 model and reloaded by path (as the CLI and the demo do), the tiny tokenizer gives the
    same ids and text: spaces, newlines and non-ASCII included."""
    from transformers import AutoTokenizer

    from posttrain.testing import save_tiny, tiny_tokenizer

    original = tiny_tokenizer()
    save_tiny(str(tmp_path), original, hidden=16, layers=1)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["a b\\nc  d", "1+2= 3\\n\\n\\tx", "é€ naïve 日本 ok", ""]:
        ids = original(text, add_special_tokens=False).input_ids
        assert reloaded(text, add_special_tokens=False).input_ids == ids, text
        assert original.decode(ids) == reloaded.decode(ids) == text
    chat = [{"role": "user", "content": "say 1 2\\n3"}]
    assert reloaded.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True)
