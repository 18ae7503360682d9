import pytest
from datasets import Dataset, IterableDataset

from posttrain.data import DataError, PromptEncoder, PromptSource
from posttrain.dataset_loading import load_prompt_dataset


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


KINDS = (r"give a dataset on the Hub \(org/name\), a local folder saved with save_to_disk or holding data files, or "
         r"a \.json/\.jsonl/\.csv/\.parquet file\.$")


def test_local_dataset_mistakes_get_one_sentence(tmp_path, monkeypatch):
    """A path that is nothing, a folder without data files, a file of another format, a split or config the data
    lacks: each one sentence naming the cause and the fix (datasets' own errors were tracebacks)."""
    from datasets import Dataset, DatasetDict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text('{"prompt": "a"}\n')
    DatasetDict({"train": Dataset.from_dict({"prompt": ["a"]})}).save_to_disk(str(tmp_path / "saved"))
    expected = {
        ("./data/my_dataset",): r"^\./data/my_dataset is not a folder or a file: " + KINDS,
        (str(tmp_path / "a" / "b" / "c"),): r"c is not a folder or a file: " + KINDS,
        ("empty",): r"^The folder empty holds no data files \(.*\) and no dataset saved with save_to_disk: put the "
                    r"data files in it, or give the folder save_to_disk wrote\.$",
        ("notes.txt",): r"^notes\.txt is a file of a format posttrain does not read as a dataset \(\.txt\): " + KINDS,
        ("folder", None, "validation"): r"^The dataset 'folder' has no 'validation' split \(splits: train\): set "
                                        r"dataset_train_split to one of them\.$",
        ("folder", "nope"): r"^The dataset 'folder' has no config 'nope' \(configs: default\): set dataset_config to "
                            r"one of them\.$",
        ("saved", None, "test", True): r"^The dataset 'saved' has no 'test' split \(splits: train\): set "
                                       r"dataset_test_split to one of them, or set eval_strategy='no'\.$",
    }
    for args, message in expected.items():
        with pytest.raises(DataError, match=message):
            load_prompt_dataset(*args)
    assert load_prompt_dataset("folder")["prompt"] == ["a"]  # the same names, right, load


def test_a_mixture_entry_names_its_own_setting(tmp_path):
    from posttrain.dataset_loading import load_mixture

    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"has no 'test' split \(splits: train\): set the split of its datasets entry "
                                        r"to one of them\.$"):
        load_mixture([{"path": str(tmp_path), "split": "test"}])


def _hub_offline(monkeypatch, offline: bool):
    """HF_HUB_OFFLINE as datasets and huggingface_hub read it (at import, so their constants are set too)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def _hub_answers(monkeypatch, error):
    """The Hub's answer to datasets' first request: `error` raised (nothing goes to the network)."""
    from huggingface_hub import HfApi

    def answer(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(HfApi, "hf_hub_download", answer)
    monkeypatch.setattr(HfApi, "dataset_info", answer)


def test_hub_dataset_mistakes_get_one_sentence(tmp_path, monkeypatch):
    """A hub id offline (HF_HUB_OFFLINE), unreachable, not found or gated: datasets' errors as one sentence."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import httpx  # the HTTP client huggingface_hub and datasets use (httpx2)

    monkeypatch.chdir(tmp_path)
    _hub_offline(monkeypatch, True)
    with pytest.raises(DataError, match=r"^Could not reach the Hub for the dataset 'data/my_dataset' \(HF_HUB_OFFLINE "
                                        r"is set\), it is not in the datasets cache, and there is no local folder or "
                                        r"file of that name: unset HF_HUB_OFFLINE where there is a network, or give a "
                                        r"local folder or a \.json/\.jsonl/\.csv/\.parquet file\.$"):
        load_prompt_dataset("data/my_dataset")
    _hub_offline(monkeypatch, False)
    request = httpx.Request("GET", "https://huggingface.co/datasets/x/y")
    _hub_answers(monkeypatch, httpx.ConnectError("Name or service not known", request=request))
    with pytest.raises(DataError, match=r"'x/y' \(offline\?\), it is not in the datasets cache, .*: connect to the "
                                        r"network, or give a local folder"):
        load_prompt_dataset("x/y")
    _hub_answers(monkeypatch, RepositoryNotFoundError("404", response=httpx.Response(404, request=request)))
    with pytest.raises(DataError, match=r"^The dataset 'x/y' was not found on the Hub \(or is private: log in with hf "
                                        r"auth login\), and there is no local folder or file of that name: check "
                                        r"dataset_name\.$"):
        load_prompt_dataset("x/y")
    _hub_answers(monkeypatch, GatedRepoError("401", response=httpx.Response(401, request=request)))
    with pytest.raises(DataError, match=r"^The dataset 'x/y' is gated on the Hub: ask for access at "
                                        r"https://huggingface\.co/datasets/x/y and log in \(hf auth login\)\.$"):
        load_prompt_dataset("x/y")


def test_local_data_loads_without_progress_bars_and_leaves_them_as_they_were(tmp_path, capfd):
    """A local file or a folder of data files converts in seconds: datasets' "Generating train split" bars are off
    while posttrain loads it, and datasets' own setting is as it was after."""
    import json

    import datasets

    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(5)))
    assert datasets.is_progress_bar_enabled()
    assert len(load_prompt_dataset(str(folder))) == 5
    assert len(load_prompt_dataset(str(folder / "train.jsonl"))) == 5
    captured = capfd.readouterr()
    assert "Generating" not in captured.err + captured.out
    assert datasets.is_progress_bar_enabled()


def test_prompts_with_tools_render_the_tools_schemas_as_the_template_does():
    """A prompt of a run with tools carries the tools' schemas, as the chat template renders them (TRL passes its
    tools to apply_chat_template the same way); a prompt without tools does not."""
    import os

    trl = pytest.importorskip("trl")
    from posttrain.testing import tiny_tokenizer

    def multiply(a: int, b: int) -> int:
        """Multiply two numbers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    tokenizer = tiny_tokenizer()
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as f:
        tokenizer.chat_template = f.read()
    prompt = [{"role": "user", "content": "2*3?"}]
    with_tools, plain = PromptEncoder(tokenizer).encode([prompt, prompt], [0, 1], [[multiply], None])
    expected = tokenizer.apply_chat_template(prompt, tools=[multiply], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(with_tools) == expected and '"name": "multiply"' in expected
    assert tokenizer.decode(plain) == tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
