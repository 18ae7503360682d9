"""Prompt datasets: validation, tokenisation, and the order prompts are drawn in (loading them from where users keep
them: dataset_loading.py).

Formats (as in TRL):
    standard:        {"prompt": "What is 2+2?", ...}
    conversational:  {"prompt": [{"role": "user", "content": "What is 2+2?"}], ...}
Every column other than `prompt` reaches the reward functions as a keyword argument.

Every trainer's tokenized data are checked against the model's vocabulary here (check_within_vocabulary): a token id
past its embedding rows (a tokenizer with tokens added and the embeddings not resized, or rows tokenized by another
model's tokenizer) would fail in the embedding at the first step (torch's IndexError on a CPU, a device-side assert
on a GPU), after the model and data loaded.
"""

import random
from dataclasses import dataclass
from typing import Iterator

from posttrain.errors import UserError

VALID_ROLES = {"system", "user", "assistant", "tool", "developer"}


class DataError(UserError, ValueError):
    """A dataset that cannot be trained on; the message says what to change."""


def vocabulary_rows(model) -> int | None:
    """The token ids a model takes, 0 to this - 1: its input embedding's rows (which may exceed the tokenizer's
    length), no more than its output layer predicts; None for a model that does not say."""
    try:
        sizes = [model.get_input_embeddings().num_embeddings]
    except (AttributeError, NotImplementedError):
        return None
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(getattr(output, "out_features", None), int):
        sizes.append(output.out_features)
    return min(sizes)


def out_of_vocabulary(ids, size: int) -> tuple[int, int] | None:
    """(position, id) of the first token id of `ids` outside [0, size), or None. `ids` may hold Python integers of any
    size (tokenized rows as given), so nothing is cast before the check."""
    if not len(ids) or (0 <= min(ids) and max(ids) < size):
        return None
    return next((p, int(t)) for p, t in enumerate(ids) if not 0 <= t < size)


def check_within_vocabulary(where: str, ids, size: int | None, tokenizer, column: str | None = None) -> None:
    """One sentence when `ids` hold a token id the model has no embedding row for: `where` names the row ("Row 3 of
    train_dataset"), `column` the tokenized column the ids were given in (None: the tokenizer's ids of text). `size`:
    the model's vocabulary_rows (None: unchecked)."""
    found = None if size is None else out_of_vocabulary(ids, size)
    if found is None:
        return
    position, token = found
    if column is not None:
        raise DataError(f"{where} has token id {token} at position {position} of its {column}, outside the model's "
                        f"vocabulary of {size} ids (0 to {size - 1}, its embedding rows): tokenize the rows with this "
                        "model's tokenizer.")
    raise DataError(f"{where} tokenizes to id {token} ({tokenizer.convert_ids_to_tokens(token)!r}), beyond the model's "
                    f"{size} embedding rows, as the tokenizer has {len(tokenizer)} tokens: resize the model's "
                    "embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer))) before training.")


def check_encoded_within_vocabulary(encoded: list, row_indices, name: str, size: int | None, tokenizer,
                                    id_columns: tuple) -> None:
    """check_within_vocabulary for a block of encoded rows: encoded[k]'s first len(id_columns) entries are the token
    ids of dataset row row_indices[k], as given in those tokenized columns (None: the tokenizer's ids of text)."""
    if size is None:
        return
    for parts, index in zip(encoded, row_indices):
        for column, ids in zip(id_columns, parts):
            check_within_vocabulary(f"Row {index} of {name}", ids, size, tokenizer, column)




IMAGE_COLUMNS = ("image", "images")  # TRL's vision datasets: a row's image, or its list of images


def refuse_images(columns, name: str) -> None:
    """One sentence for a dataset with images (an `image` or `images` column, TRL's vision datasets) given to a trainer
    of text (the reward model and ORPO, as TRL's), which would otherwise train on the text and drop the images
    unsaid. The trainers that take images check them against the processor instead (training/vision.py)."""
    found = [c for c in IMAGE_COLUMNS if c in columns]
    if found:
        raise DataError(f"{name} has an {found[0]!r} column, and this trainer trains on text only (as TRL's does): "
                        "remove the column to train on the text alone.")


def check_eval_columns(eval_dataset, required: list[str], images: bool = False) -> None:
    """An eval dataset (or each of a dict of them) needs the columns the training data gives the prompts and
    reward functions; an iterable dataset of unknown features is checked as it is read. `images`: an image column is
    taken (a vision-language processor), else refused."""
    if eval_dataset is None:
        return
    named = eval_dataset if isinstance(eval_dataset, dict) else {"eval_dataset": eval_dataset}
    for name, dataset in named.items():
        columns = getattr(dataset, "column_names", None)
        if not images:
            refuse_images(columns or (), name)
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
        chat_template: the template to render conversations with instead of the tokenizer's (tool calling's
            training template, agents/chat_templates.py), or None.
        vocab_size: the model's vocabulary_rows: every prompt's token ids must lie below it (None: unchecked).
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing) for prompts with images:
            rendered by its template with the images in place, their image tokens expanded, the pixels the rows'
            model_inputs (`encode_rows`); None: text only.
    """

    def __init__(self, tokenizer, *, chat_template_kwargs=None, max_prompt_length=None, max_total_length=None,
                 max_completion_length=0, chat_template: str | None = None, vocab_size: int | None = None,
                 vision=None):
        self.tokenizer, self.vocab_size, self.vision = tokenizer, vocab_size, vision
        self.chat_template = chat_template
        self.chat_template_kwargs = chat_template_kwargs or {}
        _check_template_kwargs(tokenizer, self.chat_template_kwargs)
        if max_total_length and max_completion_length >= max_total_length:
            from posttrain.configs import ConfigError

            raise ConfigError(f"max_completion_length={max_completion_length} leaves no room for a prompt in the "
                              f"model's context of {max_total_length} tokens: set it below {max_total_length}.")
        self.max_prompt_length = max_prompt_length
        self.max_total_length = max_total_length
        self.max_completion_length = max_completion_length

    @classmethod
    def for_run(cls, tokenizer, args, context: int | None, chat_template: str | None, vocab_size: int | None,
                vision=None):
        """The encoder of a GRPO-family run: its config's chat_template_kwargs and lengths, the model's context."""
        return cls(tokenizer, chat_template_kwargs=args.chat_template_kwargs, max_prompt_length=args.max_prompt_length,
                   max_total_length=context, max_completion_length=args.max_completion_length,
                   chat_template=chat_template, vocab_size=vocab_size, vision=vision)

    def text(self, prompt, tools: list | None = None) -> str:
        """The prompt as the model reads it: a conversation through the chat template (with `tools`, the tools'
        schemas rendered as the template renders them: functions or JSON schemas, as apply_chat_template takes
        them), plain text as it is."""
        if not is_conversational(prompt):
            return prompt
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            name = getattr(self.tokenizer, "name_or_path", "")
            whose = f"the tokenizer of {name!r}" if name else "this tokenizer"
            raise DataError(f"Conversational prompts need a chat template, and {whose} has none: use a model with "
                            "one (e.g. an -Instruct model), set tokenizer.chat_template, or use plain-string prompts.")
        options = {"tools": tools} if tools else {}
        if self.chat_template is not None:
            options["chat_template"] = self.chat_template
        return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                  **options, **self.chat_template_kwargs)

    def encode(self, prompts: list, indices: list, tools: list[list] | None = None) -> list[list[int]]:
        """Each prompt's token ids (`tools`: each prompt's tools, for its template; None: none)."""
        tools = tools or [None] * len(prompts)
        ids = self.tokenizer([self.text(p, t) for p, t in zip(prompts, tools)], add_special_tokens=False)["input_ids"]
        return self._checked(ids, indices)

    def encode_rows(self, rows: list[dict], indices: list, tools: list[list] | None = None
                    ) -> tuple[list[list[int]], list[dict] | None]:
        """(each row's prompt ids, each row's model_inputs {name: tensor} or None without a vision processor): a
        row's `image` or `images` placed in its conversation, its image tokens expanded by the processor (`tools`:
        each row's tools, for its template; None: none)."""
        prompts = [r["prompt"] for r in rows]
        if self.vision is None:
            return self.encode(prompts, indices, tools), None
        ids, inputs = [], []
        options = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        for index, row, row_tools in zip(indices, rows, tools or [None] * len(rows)):
            row_ids, row_inputs = self.vision.encode_prompt(row, f"Prompt {index}", {
                **self.chat_template_kwargs, **options, **({"tools": row_tools} if row_tools else {})})
            ids.append(row_ids)
            inputs.append(row_inputs)
        return self._checked(ids, indices, images=True), inputs

    def _checked(self, ids: list[list[int]], indices: list, images: bool = False) -> list[list[int]]:
        """The prompts' ids cut to max_prompt_length (their last tokens) and checked: not empty, within the
        vocabulary, leaving room for the completion; with `images`, a cut must keep every image token."""
        out = []
        for index, row in zip(indices, ids):
            if self.max_prompt_length is not None:
                if images and len(row) > self.max_prompt_length and \
                        set(row[:-self.max_prompt_length]) & set(self.vision.image_token_ids):
                    raise DataError(f"Prompt {index} has image tokens before its last max_prompt_length="
                                    f"{self.max_prompt_length} tokens (it is {len(row)} tokens long), so cutting it "
                                    "would leave its images without their tokens: raise max_prompt_length, or set "
                                    "it to None.")
                row = row[-self.max_prompt_length:]
            if not row:
                raise DataError(f"Prompt {index} is empty after tokenisation.")
            check_within_vocabulary(f"Prompt {index}", row, self.vocab_size, self.tokenizer)
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
    model_inputs: list[dict] | None = None  # each prompt's extra forward inputs (its images' pixels), or None


def prompt_dataset_columns(dataset, images: bool = False) -> list[str]:
    """The columns of a prompt dataset besides 'prompt' (the reward functions' keywords); one sentence when it has no
    'prompt' column or no row, or an image column without a vision-language processor to take it (`images`).
    Needs no model: checked before one loads."""
    names = dataset.column_names
    if names is None:  # an iterable dataset of unknown features: peek at the first row
        first = next(iter(dataset), None)
        if first is None:
            raise DataError("The training dataset is empty: it needs at least one row with a 'prompt'.")
        names = list(first)
    if "prompt" not in names:
        raise DataError(f"The dataset has no 'prompt' column (columns: {', '.join(names)}): rename the column "
                        "that holds the prompts to 'prompt'.")
    if not images:
        refuse_images(names, "The dataset")
    return [c for c in names if c != "prompt"]


class PromptSource:
    """Validated prompts, drawn in generation rounds of `per_round` unique prompts.

    Map-style datasets are validated and tokenised up front, shuffled each epoch with `seed`, and the
    last incomplete round of an epoch is dropped. Iterable datasets are read in order.
    """

    def __init__(self, dataset, encoder: PromptEncoder, per_round: int, *, shuffle: bool = True, seed: int = 42,
                 full_rounds: bool = True):
        import datasets

        self.dataset = dataset
        self.encoder = encoder
        self.per_round = per_round
        self.shuffle = shuffle
        self.seed = seed
        self.iterable = isinstance(dataset, datasets.IterableDataset)
        self.columns = self._columns()
        # with images, prompts are processed round by round (their pixels are not all kept)
        self.by_round = self.iterable or encoder.vision is not None
        self.prompt_ids = None if self.by_round else self._encode_all()
        if self.by_round and not self.iterable:
            for i, prompt in enumerate(dataset["prompt"]):
                check_prompt(prompt, i)
        if full_rounds and not self.iterable and len(dataset) < per_round:
            raise DataError(f"The dataset has {len(dataset)} prompt{'s' if len(dataset) != 1 else ''}, fewer than the "
                            f"{per_round} unique prompts one generation batch needs (generation_batch_size / "
                            "num_generations): add prompts or lower the batch size.")

    def _columns(self) -> list[str]:
        return prompt_dataset_columns(self.dataset, images=self.encoder.vision is not None)

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
                yield self._round([self.dataset[i] for i in idx], idx, epoch + (r + 1) / self.rounds_per_epoch)
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
                    yield self._round(batch, list(range(index - len(batch), index)), 1.0)
                    batch = []
            if batch:
                yield self._round(batch, list(range(index - len(batch), index)), 1.0)
            return
        for start in range(0, len(self.dataset), self.per_round):
            idx = list(range(start, min(start + self.per_round, len(self.dataset))))
            yield self._round([self.dataset[i] for i in idx], idx, 1.0)

    def _round(self, rows: list[dict], indices: list[int], epoch: float) -> PromptRound:
        """The round of `rows` (dataset positions `indices`): their ids encoded now, or as encoded up front."""
        if not self.by_round:
            return PromptRound(rows, [self.prompt_ids[i] for i in indices], epoch, indices)
        ids, inputs = self.encoder.encode_rows(rows, indices)
        return PromptRound(rows, ids, epoch, indices, inputs)

    def _iterable_rounds(self) -> Iterator[PromptRound]:
        epoch, index = 0, 0
        while True:
            batch = []
            for row in self.dataset:
                check_prompt(row["prompt"], index)
                batch.append(row)
                index += 1
                if len(batch) == self.per_round:
                    yield self._round(batch, list(range(index - len(batch), index)), float(epoch))
                    batch = []
            if index == 0:
                raise DataError("The training dataset is empty: it needs at least one row with a 'prompt'.")
            epoch += 1
