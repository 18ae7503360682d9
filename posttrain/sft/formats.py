"""SFT dataset rows -> token sequences and the tokens they train on, in TRL's dataset formats.

    text                              {"text": "The sky is blue."}                  (the column is dataset_text_field)
    prompt-completion                 {"prompt": "The sky is", "completion": " blue."}
    conversational                    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
                                      ({"conversations": [{"from": "human", "value": ...}]} is converted)
    conversational prompt-completion  {"prompt": [messages], "completion": [messages]}
    tokenized                         {"input_ids": [...], "labels" | "completion_mask" | "assistant_masks": [...]}

With a vision-language model's processor (`vision`, sequences/images.py), a row's `image` or `images` go with it:
into its conversation (the prompt's, for prompt-completion) as TRL places them, rendered by the processor's chat
template, the image tokens expanded by the processor, and the pixels kept as the row's model_inputs (`encode_rows`).
A text row's text holds its image tokens itself. Rows without images train as text.

A `formatting_func(row)` is called on one row at a time (a dict of the dataset's columns), as TRL 1.16 calls it, and may
return a string (the row becomes text) or {"prompt", "completion"} (the row becomes prompt-completion, keeping
completion-only loss). Its signature is checked when the trainer is built; a function that raises, or returns anything
else, stops with one sentence naming it and the row (its own traceback kept). Per-row `tools` and
`chat_template_kwargs` columns reach the chat template.

What stops with one sentence naming the row, where training would go on wrong or crash later: a row in another format
than the first, or null where its format needs a value (row_formats.py); a message without content (but a tool call)
(sequences/chat.py); a template that raises, drops the last answer, or renders content parts as Python text; a token
id outside the model's vocabulary (row_checks.py). Why a sequence has nothing to train on is `why_untrained`'s.

What trains (the label mask): every token, or with completion-only loss the completion's tokens (the completion
starts where the tokenized prompt and prompt+completion first differ), and with assistant-only loss the assistant
turns' tokens. The EOS token ends every text and completion (appended when missing), and every conversation must train
on it, so the model learns to stop.
"""

import logging
import re

import numpy as np

from posttrain.configs import ConfigError
from posttrain.data import DataError, check_encoded_within_vocabulary
from posttrain.errors import UserFunctionError, described, detail_of, function_name, signature_mismatch
from posttrain.sequences.chat import check_messages, common_prefix_length, template_kwargs, trl_training_template
from posttrain.sequences.images import images_of, with_images
from posttrain.sequences.rows import TokenRows
from posttrain.sft.row_formats import (ACCEPTED, TEXT, check_vision_options, detect_format, format_columns,
                                       format_of, from_sharegpt, has_value)
from posttrain.sft.row_checks import parts_as_python, template_dropped_text, tokenized_rows, untrained_reason

logger = logging.getLogger("posttrain")

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template) -> bool:
    """Whether a chat template marks assistant turns with {% generation %} (transformers' assistant masks)."""
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any(_GENERATION_TAG.search(t) for t in templates)


def check_formatting_func(fn) -> None:
    """Stop, when the trainer is built, a formatting_func that cannot be called as TRL calls it: with one row."""
    if not callable(fn):
        raise ConfigError(f"formatting_func is a {type(fn).__name__}, not a function: pass a function that takes one "
                          "row (a dict of the dataset's columns) and returns its text.")
    problem = signature_mismatch(fn, {})
    if problem is not None:
        raise ConfigError(f"formatting_func {described(fn)} cannot be called with one row, as TRL and posttrain "
                          f"call it ({problem}): make it take the row alone (a dict of the dataset's columns) and "
                          "return its text, or a {'prompt', 'completion'} dict.")


class RowEncoder:
    """Tokenizes rows of one dataset in its format, with the label mask of each.

    Args:
        tokenizer: the policy's tokenizer (chat template, EOS and padding already set by the trainer).
        args: the SFTConfig.
        formatting_func: optional row -> str | {"prompt", "completion"}.
        first_row: the dataset's first row, which decides the format (as in TRL).
        name: the dataset's name in messages (train_dataset, eval_dataset).
        vocab_size: the model's vocabulary (its embedding rows): every token id must lie below it. None: unchecked.
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing), for a dataset with
            images; None: text only.
        source: the map-style dataset the rows come from, whose rows' images are read again when a batch takes
            them (sequences/images.py RowPixels); None (a stream): the pixels are kept with the rows.
    """

    def __init__(self, tokenizer, args, formatting_func, first_row: dict, *, name: str = "train_dataset",
                 vocab_size: int | None = None, vision=None, source=None):
        self.tokenizer = tokenizer
        self.vision, self.source = vision, source
        self._images, self._inputs = [], []  # the rows being encoded: each one's images, its model_inputs
        self.args = args
        self.formatting_func = formatting_func
        self.name = name
        self.vocab_size = vocab_size
        self.stop_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        if formatting_func is not None:
            check_formatting_func(formatting_func)
        formatted = self._formatted(first_row, 0)
        self._check_null_columns(formatted, 0, format_of(formatted, args.dataset_text_field) is None)
        self.format = detect_format(formatted, args.dataset_text_field, images=vision is not None)
        if vision is not None:
            check_vision_options(self.format, args, name)
        self.first_columns = self._columns_of(self.format, formatted)
        self.completion_only = self._completion_only(first_row)
        self.mask_columns = [c for c in ("labels", "completion_mask", "assistant_masks") if has_value(first_row, c)
                             and (c != "completion_mask" or self.completion_only)]
        self.assistant_only = args.assistant_only_loss
        if self.assistant_only and not self.format.startswith("conversational"):
            raise ConfigError(f"assistant_only_loss=True needs conversational data (messages), and {name} is "
                              f"{self.format}: set assistant_only_loss=False, or use completion_only_loss for "
                              "prompt-completion data.")
        if self.format.startswith("conversational"):
            self._check_chat_template()
        # without {% generation %} markers, TRL's training version of the template where it has one (sequences/templates.py)
        self.template = None
        if self.assistant_only and not has_generation_markers(tokenizer.chat_template):
            self.template = trl_training_template(tokenizer)
        self.template_masks = self.assistant_only and (self.template is not None
                                                       or has_generation_markers(tokenizer.chat_template))
        self._warned_prefix = False

    # ------------------------------------------------------------------ format and options

    def _formatted(self, row: dict, index: int) -> dict:
        """The row as the encoder reads it: through formatting_func, conversations converted to messages."""
        if self.formatting_func is not None:
            if "input_ids" in row:
                raise ConfigError(f"formatting_func is given, but {self.name} is already tokenized (input_ids), so "
                                  "there is nothing to format: remove formatting_func, or pass the untokenized rows.")
            out = self._call_formatting_func(row, index)
            if isinstance(out, str):
                row = {TEXT: out, **{k: row[k] for k in ("tools", "chat_template_kwargs") if k in row}}
            else:
                row = {**{k: v for k, v in row.items() if k not in ("text", "messages", "conversations")},
                       "prompt": out["prompt"], "completion": out["completion"]}
        if has_value(row, "conversations") and not has_value(row, "messages"):
            row = {**row, "messages": row["conversations"]}
        for key in ("messages", "prompt", "completion"):
            if isinstance(row.get(key), list):
                row[key] = from_sharegpt(row[key])
        return row

    def _call_formatting_func(self, row: dict, index: int):
        """formatting_func(row): a string, or a dict with "prompt" and "completion"; a UserFunctionError (with the
        function's own exception as its cause) when it raises, a DataError when it returns anything else."""
        fn = self.formatting_func
        try:
            out = fn(row)
        except Exception as err:  # noqa: BLE001 - the user's own exception: its traceback is kept as the cause
            raise UserFunctionError(
                f"formatting_func {function_name(fn)!r} raised {type(err).__name__} on row {index} of {self.name} "
                f"(columns: {', '.join(map(str, row)) or 'none'}){detail_of(err)}; fix the function.") from err
        if isinstance(out, str) or (isinstance(out, dict) and "prompt" in out and "completion" in out):
            return out
        name = repr(function_name(fn))
        if isinstance(out, (list, tuple)):
            raise DataError(f"formatting_func returned a {type(out).__name__} for row {index} of {self.name}: it is "
                            f"called on one row at a time (as in TRL >= 0.13), so {name} must return one string, or "
                            "a {'prompt', 'completion'} dict.")
        what = ("None" if out is None else f"a dict with keys {', '.join(map(repr, out))}" if isinstance(out, dict)
                else type(out).__name__)
        raise DataError(f"formatting_func returned {what} for row {index} of {self.name}: make {name} return a string "
                        "(trained on whole) or a {'prompt': ..., 'completion': ...} dict (trained on the "
                        "completion).")

    def _completion_only(self, first_row: dict) -> bool:
        """completion_only_loss resolved for this dataset: None means "where the data says where completions are"."""
        wanted = self.args.completion_only_loss
        has_boundary = self.format.endswith("prompt-completion") or (
            self.format == "tokenized" and has_value(first_row, "completion_mask"))
        if self.formatting_func is not None and self.format == "text" and wanted:
            raise ConfigError("completion_only_loss=True, but formatting_func returns a string, which has no completion "
                              "to train on alone: return {'prompt': ..., 'completion': ...} from it, or set "
                              "completion_only_loss=False to train on the whole text.")
        if wanted and not has_boundary:
            raise ConfigError(f"completion_only_loss=True, but {self.name} is {self.format} data, which does not say "
                              "where completions start: use prompt/completion columns (or a completion_mask column, "
                              "or a formatting_func returning {'prompt', 'completion'}), or set "
                              "completion_only_loss=False.")
        return has_boundary if wanted is None else bool(wanted)

    def _check_chat_template(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            name = getattr(self.tokenizer, "name_or_path", "")
            whose = f"the tokenizer of {name!r}" if name else "this tokenizer"
            raise DataError(f"{self.name} is conversational, and {whose} has no chat template: use a model with one, "
                            "set chat_template_path (a .jinja file or a tokenizer that has one), or give text data.")

    # ------------------------------------------------------------------ encoding

    def encode(self, rows: list[dict], first_index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(token ids int32 [L], label mask bool [L])] for `rows`, the first of which is row `first_index`."""
        rows = [self._formatted(r, first_index + i) for i, r in enumerate(rows)]
        for i, row in enumerate(rows):
            self._check_same_format(row, first_index + i)
        encode = {"text": self._text, "prompt-completion": self._prompt_completion,
                  "conversational": self._conversations, "conversational prompt-completion": self._conversations,
                  "tokenized": lambda rows, first: tokenized_rows(rows, first, self.name, self.completion_only)
                  }[self.format]
        if self.vision is not None:
            self._images, self._inputs = [images_of(r) for r in rows], [{} for _ in rows]
        out = encode(rows, first_index)
        if self.format != "tokenized":
            self._check_stop_token(out, first_index)
        check_encoded_within_vocabulary(out, range(first_index, first_index + len(out)), self.name, self.vocab_size,
                                        self.tokenizer, ("input_ids" if self.format == "tokenized" else None,))
        return [(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)) for ids, mask in out]

    def encode_rows(self, rows: list[dict], first_index: int) -> TokenRows:
        """`encode`'s sequences as token rows, each with its model_inputs where the rows have images."""
        sequences = self.encode(rows, first_index)
        inputs = None if self.vision is None else self.vision.model_inputs(self._inputs)
        return TokenRows.from_sequences(sequences, inputs)

    def _vision_ids(self, text: str, i: int, index: int, keep: bool = True) -> list[int]:
        """Row i's `text` through the processor with the row's images (its image tokens expanded); `keep`: the
        processed pixels are the row's model_inputs (the whole sequence's, not a prompt's; from a map-style dataset,
        made again when a batch takes the row)."""
        where = f"Row {index} of {self.name}"
        if not keep:
            return self.vision.encode(text, self._images[i], where)[0]
        ids, self._inputs[i] = self.vision.row_inputs(text, self._images[i], where, self.source, index)
        return ids

    def why_untrained(self, length: int) -> tuple[str, str]:
        """(why a sequence of `length` tokens that `encode` gave no target has nothing to train on, the fix)."""
        return untrained_reason(self.format, length, self.formatting_func is not None, self.args.dataset_text_field,
                                self.mask_columns, self.assistant_only)

    def _columns_of(self, data_format: str, row: dict) -> str:
        columns = [c for c in format_columns(data_format, row, self.args.dataset_text_field) if has_value(row, c)]
        return ", ".join("formatting_func's string" if c == TEXT else c for c in columns)

    def _check_null_columns(self, row: dict, index: int, in_no_format: bool) -> None:
        """A row in no format because of null values: one sentence naming them (a missing value, not a format)."""
        null = [c for c in ("text", self.args.dataset_text_field, "prompt", "completion", "messages", "conversations",
                            "input_ids") if c in row and row[c] is None]
        if in_no_format and null:
            raise DataError(f"Row {index} of {self.name} has null in {', '.join(map(repr, dict.fromkeys(null)))}, so "
                            f"it is in no SFT format: fill the value in, or filter such rows out first (SFT needs "
                            f"{ACCEPTED}).")

    def _check_same_format(self, row: dict, index: int) -> None:
        """Every row in the dataset's format (its first row's): a row in another one, or with null where the format
        needs a value, stops with one sentence saying which."""
        found = format_of(row, self.args.dataset_text_field)
        if found == self.format:
            return
        if found is not None:
            raise DataError(f"Row {index} of {self.name} is {found} data ({self._columns_of(found, row)}), and its "
                            f"first row is {self.format} ({self.first_columns}): one dataset holds one format (a file "
                            "mixing them gives each row the others' columns as null); convert the rows to one format, "
                            "or train on each separately.")
        null = [c for c in format_columns(self.format, row, self.args.dataset_text_field) if row[c] is None]
        if null:
            raise DataError(f"Row {index} of {self.name} has null in {', '.join(map(repr, null))}, which "
                            f"{self.format} data needs in every row: fill the value in, or filter such rows out "
                            "first.")
        raise DataError(f"Row {index} of {self.name} is in no SFT format (its columns: {', '.join(row) or 'none'}), "
                        f"and its first row is {self.format}: give every row the same columns.")

    def _strings(self, rows, column: str, first_index: int) -> list[str]:
        values = [r[column] for r in rows]
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise DataError(f"Row {first_index + i} of {self.name} has a {type(v).__name__} in {column!r}: it "
                                "must be a string.")
        return values

    def _with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.stop_id else ids + [self.stop_id]

    def _text(self, rows, first_index):
        column = TEXT if TEXT in rows[0] else self.args.dataset_text_field
        texts = self._strings(rows, column, first_index)
        if self.vision is not None:
            tokenized = [self._vision_ids(t, i, first_index + i) for i, t in enumerate(texts)]
        else:
            tokenized = self.tokenizer(texts)["input_ids"]
        return [(ids, [True] * len(ids)) for ids in map(self._with_eos, tokenized)]

    def _prompt_completion(self, rows, first_index):
        prompts = self._strings(rows, "prompt", first_index)
        completions = self._strings(rows, "completion", first_index)
        if self.vision is not None:
            prompt_ids = [self._vision_ids(p, i, first_index + i, keep=False) for i, p in enumerate(prompts)]
            full_ids = [self._vision_ids(p + c, i, first_index + i) for i, (p, c) in enumerate(zip(prompts,
                                                                                                   completions))]
        else:
            prompt_ids = self.tokenizer(prompts)["input_ids"]
            full_ids = self.tokenizer([p + c for p, c in zip(prompts, completions)])["input_ids"]
        out = []
        for i, (p, full) in enumerate(zip(prompt_ids, full_ids)):
            full = self._with_eos(full)
            out.append((full, self._completion_mask(p, full, first_index + i)))
        return out

    def _completion_mask(self, prompt_ids: list, full_ids: list, index: int) -> list[bool]:
        """Label mask of a prompt + completion: the completion starts where the two tokenizations first differ."""
        start = common_prefix_length(prompt_ids, full_ids)
        if start < len(prompt_ids) and not self._warned_prefix:
            self._warned_prefix = True
            logger.warning("Row %d of %s: the tokenized prompt is not a prefix of the tokenized prompt + completion "
                           "(the tokens merge across the boundary, or the chat template renders the prompt alone "
                           "differently), so the completion is taken to start where they first differ, %d tokens in. "
                           "Shown once.", index, self.name, start)
        if not self.completion_only:
            return [True] * len(full_ids)
        return [False] * start + [True] * (len(full_ids) - start)

    # ------------------------------------------------------------------ conversations

    def _render(self, messages: list, kwargs: dict, index: int, generation_prompt: bool = False, **options):
        """The chat template applied to row `index`'s messages (text, or with `options` what transformers returns);
        an error the template raises (a role order it refuses, a value it cannot read) as one sentence naming the
        row."""
        try:
            if self.vision is not None:
                return self.vision.render(messages, generation_prompt=generation_prompt, **options, **kwargs)
            return self.tokenizer.apply_chat_template(messages, tokenize=options.pop("tokenize", False),
                                                      add_generation_prompt=generation_prompt,
                                                      **options, **self._with_template(kwargs))
        except Exception as err:  # noqa: BLE001 - the template's own error (jinja, or Python inside it)
            raise DataError(f"Row {index} of {self.name}: the chat template raised {type(err).__name__}"
                            f"{detail_of(err)}; fix the row, or use a template that renders it (chat_template_path)."
                            ) from err

    def _check_rendering(self, messages: list, rendered: str, index: int) -> None:
        """The rendered conversation holds every assistant message's text, and no content list written as Python:
        otherwise the template, not the row, lost what the row says, and training would go on without it."""
        dropped = template_dropped_text(messages, rendered)
        if dropped is not None:
            raise DataError(f"Row {index} of {self.name}: the chat template leaves out message {dropped}, the last "
                            "assistant message (its text is not in the rendered conversation), so the row would train "
                            "without its answer; the template is at fault, not the row: use one that renders assistant "
                            "turns (chat_template_path).")
        as_python = parts_as_python(messages, rendered)
        if as_python is not None:
            raise DataError(f"Row {index} of {self.name}: the chat template renders the content of message "
                            f"{as_python}, a list of parts, as Python text (\"[{{'type': ...\"), as it expects "
                            "strings: write each message's content as a string.")

    def _with_template(self, kwargs: dict) -> dict:
        """A row's chat template keyword arguments, with the training template when one replaces the tokenizer's."""
        return kwargs if self.template is None else {**kwargs, "chat_template": self.template}

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _conversations(self, rows, first_index):
        out = []
        for i, row in enumerate(rows):
            index = first_index + i
            kwargs = template_kwargs(row)
            if self.format == "conversational":
                check_messages(row["messages"], f"Row {index} of {self.name}", "messages")
                messages, prompt = row["messages"], None
            else:
                check_messages(row["prompt"], f"Row {index} of {self.name}", "prompt")
                check_messages(row["completion"], f"Row {index} of {self.name}", "completion")
                messages, prompt = row["prompt"] + row["completion"], row["prompt"]
            messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # null: absent, as in
            # transformers (a dataset gives a missing key null)
            shown = messages if self.vision is None else self._with_row_images(messages, prompt, i, index)
            rendered = self._render(shown, kwargs, index)
            ids, mask = self._conversation(shown, kwargs, index, rendered, i)
            self._check_rendering(messages, rendered, index)
            if self.assistant_only and not any(mask):
                self._no_assistant_tokens(messages, index)
            if prompt is not None:
                prompt_text = self._render(shown[:len(prompt)], kwargs, index, generation_prompt=True)
                prompt_ids = self._ids(prompt_text) if self.vision is None else \
                    self._vision_ids(prompt_text, i, index, keep=False)
                completion = self._completion_mask(prompt_ids, ids, index)
                mask = [a and b for a, b in zip(mask, completion)]
            out.append((ids, mask))
        return out

    def _with_row_images(self, messages: list, prompt: list | None, i: int, index: int) -> list:
        """Row i's messages with its images in place: in the prompt's messages for prompt-completion rows."""
        where = f"Row {index} of {self.name}"
        if prompt is None:
            return with_images(messages, self._images[i], where)
        return with_images(messages[:len(prompt)], self._images[i], where) + \
            with_images(messages[len(prompt):], [], where)

    def _conversation(self, messages: list, kwargs: dict, index: int, rendered: str, i: int) -> tuple[list, list]:
        """Token ids of a conversation (`rendered`: its text; row i of those being encoded) and its label mask (all
        tokens, or the assistant turns')."""
        if self.vision is not None:
            ids = self._vision_ids(rendered, i, index)
            return ids, [True] * len(ids)
        if self.assistant_only and self.template_masks:
            marked = self._render(messages, kwargs, index, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
            ids, mask = list(marked["input_ids"]), [bool(b) for b in marked["assistant_masks"]]
        else:
            ids = self._ids(rendered)
            mask = self._assistant_turns(messages, kwargs, ids, index) if self.assistant_only else [True] * len(ids)
        return ids, mask

    def _no_assistant_tokens(self, messages: list, index: int) -> None:
        """assistant_only_loss found no assistant token in a conversation the template rendered whole: the row has no
        assistant turn, or the template's {% generation %} markers enclose none."""
        if self.template_masks and any(m["role"] == "assistant" for m in messages):
            raise DataError(f"Row {index} of {self.name} has assistant turns, but the chat template's "
                            "{% generation %} markers enclose none of their tokens: put the markers around each "
                            "assistant message and its end-of-turn token (as TRL's *_training.jinja templates do), or "
                            "remove them, and posttrain finds the turns by rendering.")
        raise DataError(f"Row {index} of {self.name} has no assistant tokens to train on with "
                        "assistant_only_loss=True: give every conversation an assistant turn, or set "
                        "assistant_only_loss=False.")

    def _assistant_turns(self, messages: list, kwargs: dict, ids: list, index: int) -> list[bool]:
        """Assistant-turn mask for a template without {% generation %} markers: each assistant message's tokens are
        those the conversation gains from the generation prompt before it to the end of that message."""
        mask = [False] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._ids(self._render(messages[:i], kwargs, index, generation_prompt=True)) if i else []
            through = self._ids(self._render(messages[:i + 1], kwargs, index))
            if through != ids[:len(through)]:
                raise DataError(
                    f"Row {index} of {self.name}: the chat template renders the conversation up to message {i} "
                    "differently from the start of the whole conversation (it rewrites earlier turns), so the "
                    "assistant's tokens cannot be found: use a template with {% generation %} markers "
                    "(chat_template_path; with trl installed, TRL's training version of a template it knows is used "
                    "by itself), or set assistant_only_loss=False.")
            for t in range(common_prefix_length(before, through), len(through)):
                mask[t] = True
        return mask

    # ------------------------------------------------------------------ checks

    def _check_stop_token(self, encoded: list, first_index: int) -> None:
        """Every sequence trains on the EOS (stop) token, so the model learns to stop."""
        for i, (ids, mask) in enumerate(encoded):
            if any(m and t == self.stop_id for t, m in zip(ids, mask)) or not any(mask[1:]):
                continue  # (a sequence with nothing to train on is left out, with its reason: sft/data.py)
            token = self.tokenizer.eos_token
            raise DataError(
                f"Row {first_index + i} of {self.name} never trains on the EOS token {token!r}, so the model would not "
                "learn to stop: the chat template ends turns with another token; set eos_token to that token (e.g. "
                "eos_token='<|im_end|>'), or use a template that emits the EOS.")
