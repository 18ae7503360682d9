"""Prompt datasets: loading, validation, tokenisation, and the order prompts are drawn in.

Formats (as in TRL):
    standard:        {"prompt": "What is 2+2?", ...}
    conversational:  {"prompt": [{"role": "user", "content": "What is 2+2?"}], ...}
Every column other than `prompt` reaches the reward functions as a keyword argument.
"""

import contextlib
import os
import random
import re
from dataclasses import dataclass
from typing import Iterator

from posttrain.errors import UserError

VALID_ROLES = {"system", "user", "assistant", "tool", "developer"}
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(UserError, ValueError):
    """A dataset that cannot be trained on; the message says what to change."""


DATASET_KINDS = ("a dataset on the Hub (org/name), a local folder saved with save_to_disk or holding data files, or a "
                 ".json/.jsonl/.csv/.parquet file")
QUOTED = r"'([^']*)'"  # the names in datasets' lists of splits and configs


def load_prompt_dataset(name: str, config: str | None = None, split: str = "train", for_eval: bool = False,
                        streaming: bool = False, data_dir: str | None = None, data_files=None,
                        field: str = "dataset_name"):
    """Load a dataset split from a local file (.json/.jsonl/.csv/.parquet), a `save_to_disk` directory, a folder of
    data files, or the hub; every way of naming none of these is a DataError naming the cause and the fix.

    A single local file is one split: it serves training, and evaluation (for_eval) needs a dataset with splits.
    With `streaming`, an IterableDataset. `field`: where the name was given ("dataset_name", or "datasets" for an
    entry of a mixture), for the fix the messages name.
    """
    import datasets

    given, name = name, os.path.expanduser(name)
    ext = os.path.splitext(name)[1].lower()
    if ext in LOCAL_FORMATS:
        return _load_file(name, ext, split, for_eval, streaming)
    if os.path.isfile(name):
        raise DataError(f"{name} is a file of a format posttrain does not read as a dataset ({ext or 'no extension'}): "
                        f"give {DATASET_KINDS}.")
    if not os.path.exists(name) and (given.startswith((".", "/", "~")) or name.count("/") > 1):  # a path, no hub id
        raise DataError(f"{name} is not a folder or a file: give {DATASET_KINDS}.")
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")) or os.path.exists(
            os.path.join(name, "dataset_dict.json")):
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise _no_split(name, split, list(loaded), for_eval, field)
            loaded = loaded[split]
        return loaded.to_iterable_dataset() if streaming else loaded
    try:
        with _quiet_if(os.path.isdir(name)):  # a local folder converts in seconds; a download shows its bars
            return datasets.load_dataset(name, config, split=split, streaming=streaming, data_dir=data_dir,
                                         data_files=data_files)
    except Exception as err:  # noqa: BLE001 - sorted below: what the user can fix, or raised as it is
        problem = _not_loaded(name, config, split, for_eval, field, err)
        if problem is None:
            raise
        raise problem from None  # datasets' traceback is not the user's to read (it stays the error's __context__)


def _load_file(name: str, ext: str, split: str, for_eval: bool, streaming: bool):
    """One local .json/.jsonl/.csv/.parquet file as the split `split`."""
    import datasets

    if not os.path.exists(name):
        raise DataError(f"Dataset file {name!r} does not exist: check dataset_name.")
    if for_eval:
        raise DataError(f"Evaluation needs a {split!r} split, and the single file {name!r} is one split: save the "
                        "dataset with its splits (DatasetDict.save_to_disk) and give that directory, or set "
                        "eval_strategy='no'.")
    try:
        with _quiet_if(True):  # a local file converts in seconds: no "Generating train split" bars
            return datasets.load_dataset(LOCAL_FORMATS[ext], data_files={split: name}, split=split,
                                         streaming=streaming)
    except Exception as err:  # noqa: BLE001 - datasets and pyarrow raise many types for a bad file
        raise _unreadable(name, ext, err) from None  # the message names the line or the cause: no datasets traceback


@contextlib.contextmanager
def _quiet_if(quiet: bool):
    """datasets' progress bars off inside (when `quiet`), and back as they were after."""
    import datasets

    was_shown = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and was_shown:
            datasets.enable_progress_bars()


def _no_split(name: str, split: str, splits: list[str], for_eval: bool, field: str) -> DataError:
    setting = f"dataset_{'test' if for_eval else 'train'}_split" if field == "dataset_name" else (
        f"the split of its {field} entry")
    also = ", or set eval_strategy='no'" if for_eval else ""
    return DataError(f"The dataset {name!r} has no {split!r} split (splits: {', '.join(splits)}): set {setting} to "
                     f"one of them{also}.")


def _not_loaded(name: str, config, split: str, for_eval: bool, field: str, err: Exception) -> Exception | None:
    """One sentence for what the user can fix when datasets cannot load `name` (a folder without data files, a hub id
    it cannot find or reach, a config or split the dataset lacks); None for anything else."""
    import datasets
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError, DatasetsError

    from posttrain.errors import is_storage_failure, storage_error

    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    nowhere = "and there is no local folder or file of that name"
    if isinstance(err, (EmptyDatasetError, DataFilesNotFoundError)):
        if os.path.isdir(name):
            return DataError(f"The folder {name} holds no data files (.json/.jsonl/.csv/.parquet/.arrow/.txt) and no "
                             "dataset saved with save_to_disk: put the data files in it, or give the folder "
                             "save_to_disk wrote.")
        return DataError(f"The Hub dataset {name!r} has no data files datasets can read ({text}): check {field}.")
    if isinstance(err, DatasetNotFoundError):
        if "gated" in text:
            return DataError(f"The dataset {name!r} is gated on the Hub: ask for access at "
                             f"https://huggingface.co/datasets/{name} and log in (hf auth login).")
        return DataError(f"The dataset {name!r} was not found on the Hub (or is private: log in with hf auth login), "
                         f"{nowhere}: check {field}.")
    if isinstance(err, ConnectionError):
        why, fix = ("HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE where there is a network") if (
            datasets.config.HF_HUB_OFFLINE) else ("offline?", "connect to the network")
        return DataError(f"Could not reach the Hub for the dataset {name!r} ({why}), it is not in the datasets cache, "
                         f"{nowhere}: {fix}, or give a local folder or a .json/.jsonl/.csv/.parquet file.")
    listed = re.match(r"""Unknown split "(.*)"\. Should be one of \[(.*)\]""", text)
    if isinstance(err, ValueError) and listed:
        return _no_split(name, split, re.findall(QUOTED, listed.group(2)), for_eval, field)
    listed = re.match(r"BuilderConfig '(.*)' not found\. Available: \[(.*)\]", text)
    if isinstance(err, ValueError) and listed:
        setting = "dataset_config" if field == "dataset_name" else f"the name of its {field} entry"
        configs = listed.group(2)
        return DataError(f"The dataset {name!r} has no config {config!r} (configs: "
                         f"{', '.join(re.findall(QUOTED, configs))}): set {setting} to one of them.")
    if isinstance(err, FileNotFoundError):
        return DataError(f"{name} is not a folder or a file, nor a dataset on the Hub ({text}): give {DATASET_KINDS}.")
    if is_storage_failure(err):
        return storage_error(err, "write the datasets cache at", getattr(err, "filename", None) or "HF_DATASETS_CACHE",
                             fix="set HF_DATASETS_CACHE to a writable directory")
    if isinstance(err, DatasetsError) or "Dataset scripts are no longer supported" in text:
        return DataError(f"The dataset {name!r} could not be loaded ({text}): check {field} and the dataset's files.")
    return None


def load_mixture(entries: list[dict], streaming: bool = False, test_split_size: float | None = None, seed: int = 42,
                 wants_eval: bool = False):
    """(train, test or None) from a `datasets:` mixture (configs/script.py checks the entries).

    With `fraction` on every entry, the fractions (normalised) are each dataset's share of the mixture, and the mixture
    is the largest that takes no dataset's rows twice: each dataset gives its first round(share * size) rows, as in
    TRL. With test_split_size, a seeded train/test split of the mixture.
    """
    import datasets

    parts = []
    for entry in entries:
        part = load_prompt_dataset(entry["path"], entry.get("name"), entry.get("split", "train"), streaming=streaming,
                                   data_dir=entry.get("data_dir"), data_files=entry.get("data_files"),
                                   field="datasets")
        if entry.get("columns") is not None:
            missing = [c for c in entry["columns"] if c not in (part.column_names or entry["columns"])]
            if missing:
                raise DataError(f"datasets entry {entry['path']!r} has no column(s) {', '.join(missing)} (its columns: "
                                f"{', '.join(part.column_names)}): fix columns.")
            part = part.select_columns(entry["columns"])
        parts.append(part)
    fractions = [entry.get("fraction") for entry in entries]
    if fractions[0] is not None:
        shares = [f / sum(fractions) for f in fractions]
        size = min(len(part) / share for part, share in zip(parts, shares))
        parts = [part.select(range(round(share * size))) for part, share in zip(parts, shares)]
    mixture = datasets.concatenate_datasets(parts)
    if test_split_size is None:
        if wants_eval:
            raise DataError("Evaluation needs a test split, and the datasets mixture has none: set test_split_size "
                            "(e.g. 0.05), or eval_strategy='no'.")
        return mixture, None
    if streaming:
        raise DataError("test_split_size needs the mixture's length, which streaming does not give: drop one of them.")
    size = int(test_split_size) if test_split_size >= 1 else test_split_size
    split = mixture.train_test_split(test_size=size, seed=seed)
    return split["train"], split["test"]


def _unreadable(name: str, ext: str, err: Exception) -> Exception:
    """One sentence for a local dataset file that datasets could not read: the bad JSON line when there is one, the
    cache directory it could not write, or what datasets said."""
    from posttrain.errors import is_storage_failure, storage_error

    if is_storage_failure(err):
        return storage_error(err, "write the datasets cache at", getattr(err, "filename", None) or "HF_DATASETS_CACHE",
                             fix="set HF_DATASETS_CACHE to a writable directory")
    if ext == ".jsonl" or ext == ".json":
        import json

        with open(name, encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            json.loads(text)
            return DataError(f"{name} is one JSON document, not one record per line: write a JSON list of records, or "
                             "one JSON object per line (.jsonl).")
        except ValueError:
            pass
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as bad:
                    return DataError(f"Line {number} of {name} is not valid JSON ({bad.msg} at column {bad.colno}): "
                                     "fix or remove that line.")
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return DataError(f"{name} could not be read as {ext[1:]} ({cause}): check the file.")


def check_eval_columns(eval_dataset, required: list[str]) -> None:
    """An eval dataset (or each of a dict of them) needs the columns the training data gives the prompts and
    reward functions; an iterable dataset of unknown features is checked as it is read."""
    if eval_dataset is None:
        return
    named = eval_dataset if isinstance(eval_dataset, dict) else {"eval_dataset": eval_dataset}
    for name, dataset in named.items():
        columns = getattr(dataset, "column_names", None)
        missing = [c for c in required if c not in (columns or required)]
        if missing:
            raise DataError(f"{name} lacks the column(s) {', '.join(missing)} that the training data has and the "
                            f"prompts or reward functions need (its columns: {', '.join(columns)}).")


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list)


def check_prompt(prompt, index) -> None:
    """Raise DataError for a prompt that is neither a string nor a list of {role, content} messages."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"Prompt {index} is {type(prompt).__name__}: prompts must be strings or non-empty "
                        "lists of {'role', 'content'} messages.")
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"Prompt {index} has a message without 'role' and 'content' ({message!r}): write each "
                            "message as {'role': ..., 'content': ...}.")
        if message["role"] not in VALID_ROLES:
            raise DataError(f"Prompt {index} has a message with role {message['role']!r}: use one of "
                            f"{', '.join(sorted(VALID_ROLES))}.")


def _check_template_kwargs(tokenizer, kwargs: dict) -> None:
    """chat_template_kwargs keys must be variables the chat template reads: jinja ignores any other one, so a typo
    (enable_thinkng) would silently do nothing."""
    template = getattr(tokenizer, "chat_template", None)
    if not kwargs or template is None:
        return
    import jinja2
    from jinja2 import meta

    from posttrain.configs import ConfigError, suggest

    templates = template.values() if isinstance(template, dict) else [template]
    used = set()
    for text in templates:
        used |= meta.find_undeclared_variables(jinja2.Environment().parse(text))
    for key in kwargs:
        if key not in used:
            raise ConfigError(f"chat_template_kwargs has {key!r}, which the tokenizer's chat template never reads (it "
                              f"reads: {', '.join(sorted(used))}), so it would change nothing.{suggest(key, used)}")


class PromptEncoder:
    """Turns prompts into token ids: chat template for conversational ones, plain text otherwise.

    Args:
        tokenizer: the policy's tokenizer.
        chat_template_kwargs: passed to `apply_chat_template` (e.g. enable_thinking).
        max_prompt_length: if set, keep only the last this many tokens.
        max_total_length: the model's context; a prompt that leaves no room for the completion is an error.
        max_completion_length: tokens reserved for the completion.
    """

    def __init__(self, tokenizer, chat_template_kwargs=None, max_prompt_length=None, max_total_length=None,
                 max_completion_length=0):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        _check_template_kwargs(tokenizer, self.chat_template_kwargs)
        if max_total_length and max_completion_length >= max_total_length:
            from posttrain.configs import ConfigError

            raise ConfigError(f"max_completion_length={max_completion_length} leaves no room for a prompt in the "
                              f"model's context of {max_total_length} tokens: set it below {max_total_length}.")
        self.max_prompt_length = max_prompt_length
        self.max_total_length = max_total_length
        self.max_completion_length = max_completion_length

    def text(self, prompt) -> str:
        if not is_conversational(prompt):
            return prompt
        if getattr(self.tokenizer, "chat_template", None) is None:
            name = getattr(self.tokenizer, "name_or_path", "")
            whose = f"the tokenizer of {name!r}" if name else "this tokenizer"
            raise DataError(f"Conversational prompts need a chat template, and {whose} has none: use a model with "
                            "one (e.g. an -Instruct model), set tokenizer.chat_template, or use plain-string prompts.")
        return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                  **self.chat_template_kwargs)

    def encode(self, prompts: list, indices: list) -> list[list[int]]:
        ids = self.tokenizer([self.text(p) for p in prompts], add_special_tokens=False)["input_ids"]
        out = []
        for index, row in zip(indices, ids):
            if self.max_prompt_length is not None:
                row = row[-self.max_prompt_length:]
            if not row:
                raise DataError(f"Prompt {index} is empty after tokenisation.")
            if self.max_total_length and len(row) + self.max_completion_length > self.max_total_length:
                raise DataError(
                    f"Prompt {index} has {len(row)} tokens, which with max_completion_length="
                    f"{self.max_completion_length} exceeds the model's context of {self.max_total_length}: "
                    "shorten it, set max_prompt_length, or lower max_completion_length.")
            out.append(row)
        return out


@dataclass
class PromptRound:
    """The unique prompts of one generation batch (identical on every process)."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    epoch: float
    indices: list[int]  # each row's position in the dataset (in reading order for an iterable dataset)


class PromptSource:
    """Validated prompts, drawn in generation rounds of `per_round` unique prompts.

    Map-style datasets are validated and tokenised up front, shuffled each epoch with `seed`, and the
    last incomplete round of an epoch is dropped. Iterable datasets are read in order.
    """

    def __init__(self, dataset, encoder: PromptEncoder, per_round: int, shuffle: bool = True, seed: int = 42,
                 full_rounds: bool = True):
        import datasets

        self.dataset = dataset
        self.encoder = encoder
        self.per_round = per_round
        self.shuffle = shuffle
        self.seed = seed
        self.iterable = isinstance(dataset, datasets.IterableDataset)
        self.columns = self._columns()
        self.prompt_ids = None if self.iterable else self._encode_all()
        if full_rounds and not self.iterable and len(dataset) < per_round:
            raise DataError(f"The dataset has {len(dataset)} prompts, fewer than the {per_round} unique prompts one "
                            "generation batch needs (generation_batch_size / num_generations): add prompts or "
                            "lower the batch size.")

    def _columns(self) -> list[str]:
        names = self.dataset.column_names
        if names is None:  # an iterable dataset of unknown features: peek at the first row
            first = next(iter(self.dataset), None)
            if first is None:
                raise DataError("The training dataset is empty: it needs at least one row with a 'prompt'.")
            names = list(first)
        if "prompt" not in names:
            raise DataError(f"The dataset has no 'prompt' column (columns: {', '.join(names)}): rename the column "
                            "that holds the prompts to 'prompt'.")
        return [c for c in names if c != "prompt"]

    def _encode_all(self) -> list[list[int]]:
        if len(self.dataset) == 0:
            raise DataError("The training dataset is empty: it needs at least one row with a 'prompt'.")
        prompts = self.dataset["prompt"]
        for i, prompt in enumerate(prompts):
            check_prompt(prompt, i)
        return self.encoder.encode(list(prompts), list(range(len(prompts))))

    @property
    def rounds_per_epoch(self) -> int | None:
        return None if self.iterable else len(self.dataset) // self.per_round

    def rounds(self) -> Iterator[PromptRound]:
        """Endless generation rounds (epoch after epoch)."""
        return self._iterable_rounds() if self.iterable else self._map_rounds()

    def _map_rounds(self) -> Iterator[PromptRound]:
        epoch = 0
        while True:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            for r in range(self.rounds_per_epoch):
                idx = order[r * self.per_round:(r + 1) * self.per_round]
                rows = [self.dataset[i] for i in idx]
                yield PromptRound(rows, [self.prompt_ids[i] for i in idx], epoch + (r + 1) / self.rounds_per_epoch,
                                  idx)
            epoch += 1

    def one_pass(self) -> Iterator[PromptRound]:
        """Every prompt once, in dataset order, in rounds of `per_round` (the last one may be shorter)."""
        if self.iterable:
            batch, index = [], 0
            for row in self.dataset:
                check_prompt(row["prompt"], index)
                batch.append(row)
                index += 1
                if len(batch) == self.per_round:
                    yield self._round(batch, index)
                    batch = []
            if batch:
                yield self._round(batch, index)
            return
        for start in range(0, len(self.dataset), self.per_round):
            idx = list(range(start, min(start + self.per_round, len(self.dataset))))
            yield PromptRound([self.dataset[i] for i in idx], [self.prompt_ids[i] for i in idx], 1.0, idx)

    def _round(self, batch: list[dict], end: int) -> PromptRound:
        indices = list(range(end - len(batch), end))
        return PromptRound(batch, self.encoder.encode([r["prompt"] for r in batch], indices), 1.0, indices)

    def _iterable_rounds(self) -> Iterator[PromptRound]:
        epoch, index = 0, 0
        while True:
            batch = []
            for row in self.dataset:
                check_prompt(row["prompt"], index)
                batch.append(row)
                index += 1
                if len(batch) == self.per_round:
                    indices = list(range(index - len(batch), index))
                    ids = self.encoder.encode([r["prompt"] for r in batch], indices)
                    yield PromptRound(batch, ids, float(epoch), indices)
                    batch = []
            if index == 0:
                raise DataError("The training dataset is empty: it needs at least one row with a 'prompt'.")
            epoch += 1
