"""Datasets from where users keep them (as TRL's scripts load them): a Hub id, a local folder (saved with save_to_disk
or holding data files), a .json/.jsonl/.csv/.parquet file, or a `datasets:` mixture. What the user can fix (a missing
file or folder, an unreachable or unknown Hub id, a split or config the dataset lacks, a malformed line, a cache that
cannot be written) is one DataError or StorageError sentence, with no datasets traceback or error line above it.

    load_prompt_dataset(name, config, split, ...)    one split (or a streamed one)
    load_mixture(entries, ...)                       (train, test or None) of a `datasets:` mixture
"""

import contextlib
import os
import re

from posttrain.data import DataError

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
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
    try:  # a local file converts in seconds: no "Generating train split" bars
        with _quiet_if(True), _without_datasets_error_lines():
            return datasets.load_dataset(LOCAL_FORMATS[ext], data_files={split: name}, split=split,
                                         streaming=streaming)
    except Exception as err:  # noqa: BLE001 - datasets and pyarrow raise many types for a bad file
        raise _unreadable(name, ext, err) from None  # the message names the line or the cause: no datasets traceback


@contextlib.contextmanager
def _without_datasets_error_lines():
    """datasets' error lines (its json builder logs "Failed to load JSON from file ..." before it raises) are dropped
    inside: the DataError raised in their place says which line is bad and what to do. Warnings still show."""
    import logging

    datasets_logger = logging.getLogger("datasets")

    def below_error(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR

    handlers = list(datasets_logger.handlers)  # datasets' own handler: the filter must sit where records are emitted
    for handler in handlers:
        handler.addFilter(below_error)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(below_error)


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
                    return DataError(f"Line {number} of {name} is not valid JSON ({bad.msg.removesuffix(' at')}, column "
                                     f"{bad.colno}): fix or remove that line.")
    from datasets.exceptions import DatasetGenerationError

    if isinstance(err, DatasetGenerationError) and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__  # "An error occurred while generating the dataset": what did
    cause = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
    return DataError(f"{name} could not be read as {ext[1:]} ({cause}): check the file.")
