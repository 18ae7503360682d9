"""The chat template's side of tool calling, token-in/token-out: whether a template can carry a tool exchange, the
template the tool results are rendered with, and the token ids of a turn's tool results.

    chat_template = tool_chat_template(tokenizer, chat_template_kwargs)   at initialisation (None: the tokenizer's)
    suffix = ToolSuffix(tokenizer, chat_template, chat_template_kwargs)
    ids = suffix(tool_messages)     what the template puts after the model's turn, the next turn's header included

The model's own tokens are never rendered again: a rollout is prompt + turn + suffix + turn + ..., each turn as the
model sampled it. That is exact only if the template renders an assistant turn the same whether or not tool messages
follow it ("prefix-preserving"); of TRL 1.16's templates, Qwen3's is not (it writes an empty `<think>\n\n</think>`
block into the last assistant turn, and drops it once anything follows), and TRL swaps in its training version of
it, as posttrain does when TRL is installed; any other such template is refused in one sentence.
"""

import json
import logging
import re

from posttrain.configs import ConfigError
from posttrain.sequences.chat import trl_training_template

logger = logging.getLogger("posttrain")

# the probe conversation: a call with a string and an integer argument, and its result (values no template writes)
PROBE_TOOL = "probe_tool"
PROBE_ARGUMENTS = {"probe_text": "probe value", "probe_count": 7}
PROBE_RESULT = "probe result 31"
PROBE_USER = "probe question"


def template_name(tokenizer) -> str:
    """How messages name the tokenizer's chat template: after its model when it has a name."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the chat template of {name!r}" if name else "the tokenizer's chat template"


def capitalised(text: str) -> str:
    """`text` as the start of a sentence."""
    return text[:1].upper() + text[1:]


def tool_call(name: str, arguments: dict | str) -> dict:
    """A tool call as chat templates read it: {"type": "function", "function": {"name", "arguments"}}."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def calling_turn(calls: list[dict]) -> dict:
    """An assistant message holding `calls` and no text ("content" is set: some processors need it)."""
    return {"role": "assistant", "content": "", "tool_calls": calls}


def with_string_arguments(messages: list[dict]) -> list[dict]:
    """`messages` with every tool call's arguments as a JSON string: templates that concatenate the arguments
    (DeepSeek-V3's) cannot take them as a mapping (transformers#45419)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [tool_call(c["function"]["name"], json.dumps(c["function"]["arguments"]))
                     if isinstance(c["function"]["arguments"], dict) else c for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def render(tokenizer, messages: list[dict], chat_template: str | None = None, tokenize: bool = False,
           add_generation_prompt: bool = False, **kwargs):
    """apply_chat_template of `messages` (text, or token ids with tokenize); tool calls whose mapping arguments the
    template cannot take (TypeError) are rendered with JSON-string arguments, as TRL 1.16 falls back."""
    options = dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                   **kwargs)
    if tokenize:
        options["return_dict"] = False
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except TypeError:
        return tokenizer.apply_chat_template(with_string_arguments(messages), **options)


# ------------------------------------------------------------------ can the template carry tools?


def tool_exchange_gap(tokenizer, chat_template: str | None = None) -> str | None:
    """None when the template renders a whole tool exchange (user -> assistant with a tool call -> tool message) with
    the call's name, its argument and the tool's result all in the text; else what it drops or the error it raises
    (TRL 1.16's supports_tool_calling gives the same verdict)."""
    from jinja2 import TemplateError

    messages = [{"role": "user", "content": PROBE_USER}, calling_turn([tool_call(PROBE_TOOL, PROBE_ARGUMENTS)]),
                {"role": "tool", "name": PROBE_TOOL, "content": PROBE_RESULT}]
    try:
        text = render(tokenizer, messages, chat_template)
    except (TemplateError, TypeError) as err:
        return f"it raises {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
    parts = {"the call's name": [PROBE_TOOL], "its arguments": ["probe_text", PROBE_ARGUMENTS["probe_text"]],
             "the tool message": [PROBE_RESULT]}
    dropped = [what for what, probes in parts.items() if not all(probe in text for probe in probes)]
    return f"it drops {' and '.join(dropped)}" if dropped else None


# ------------------------------------------------------------------ prefix preservation


def _probe_conversations() -> tuple[list[dict], list[dict]]:
    """[user, assistant with a call] and the same with the call's tool message after it."""
    calling = [{"role": "user", "content": PROBE_USER}, calling_turn([tool_call(PROBE_TOOL, {})])]
    return calling, calling + [{"role": "tool", "name": PROBE_TOOL, "content": PROBE_RESULT}]


def is_prefix_preserving(tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the template renders [user, assistant with a tool call] as the start of the same conversation with a
    tool message after it (and the generation prompt): the property ToolSuffix relies on (TRL 1.16's
    is_chat_template_prefix_preserving, with the chat_template_kwargs the rollout renders with)."""
    calling, answered = _probe_conversations()
    kwargs = chat_template_kwargs or {}
    alone = render(tokenizer, calling, chat_template, tokenize=True, **kwargs)
    followed = render(tokenizer, answered, chat_template, tokenize=True, add_generation_prompt=True, **kwargs)
    return followed[:len(alone)] == alone


def _where_it_changes(tokenizer, chat_template: str | None, chat_template_kwargs: dict | None) -> str:
    """The assistant turn as the template renders it alone and once a tool message follows, from where they part."""
    calling, answered = _probe_conversations()
    kwargs = chat_template_kwargs or {}
    alone = render(tokenizer, calling, chat_template, **kwargs)
    followed = render(tokenizer, answered, chat_template, add_generation_prompt=True, **kwargs)
    start = next((i for i, (a, b) in enumerate(zip(alone, followed)) if a != b), min(len(alone), len(followed)))
    start = max(0, start - 12)  # from a little before, so the excerpts start at a readable place
    return f"{alone[start:start + 40]!r} alone, {followed[start:start + 40]!r} once a tool message follows"


def tool_chat_template(tokenizer, chat_template_kwargs: dict | None = None) -> str | None:
    """The chat template tool results are rendered with, checked once before training: None for the tokenizer's own
    when it carries tool exchanges and is prefix-preserving; TRL's training version of it when it is not (as TRL 1.16
    swaps it in); else ConfigError, one sentence naming the template and the fix."""
    name = capitalised(template_name(tokenizer))
    gap = tool_exchange_gap(tokenizer)
    if gap is not None:
        raise ConfigError(f"{name} cannot show the model a tool exchange ({gap}): give a chat template that renders an "
                          f"assistant's tool_calls and the tool messages after it (chat_template_path), as TRL "
                          f"requires for tools.")
    if is_prefix_preserving(tokenizer, None, chat_template_kwargs):
        return None
    training = trl_training_template(tokenizer)
    if training is not None and is_prefix_preserving(tokenizer, training, chat_template_kwargs):
        logger.info("%s renders an assistant turn differently once a tool message follows: tool results are rendered "
                    "with TRL's training version of it, which does not.", name)
        return training
    raise ConfigError(f"{name} renders an assistant turn differently once a tool message follows "
                      f"({_where_it_changes(tokenizer, None, chat_template_kwargs)}), so tool results cannot be "
                      f"appended to the model's tokens: give a template that renders earlier turns unchanged with "
                      f"chat_template_path (TRL ships training versions of the templates it knows, used here when "
                      f"trl is installed).")


# ------------------------------------------------------------------ the tool results' ids


class ToolSuffix:
    """The token ids a chat template puts between the model's turn and its next one for that turn's tool messages.

    As TRL 1.16's `_get_tool_suffix_ids`: render [user, assistant calling the first message's tool] with and without
    the tool messages after it (the second with the generation prompt), cut the first after its last stop token
    (the model's turn ends there, not at the newline templates write after it), check that it starts the second, and
    take the rest. Where posttrain goes further: the first rendering is kept per tool name (one rendering a call
    instead of two), `stop_token_ids` may name every token the model stops at (TRL: the tokenizer's EOS), a template
    that cannot take mapping arguments (DeepSeek-V3's) gets JSON strings (TRL raises TypeError), and a mismatch is
    one sentence naming the template.

    Args:
        tokenizer: the policy's tokenizer.
        chat_template: the template to render with (tool_chat_template's; None: the tokenizer's).
        chat_template_kwargs: as the prompts are rendered with (e.g. enable_thinking).
        stop_token_ids: the tokens a model turn ends with; None: the tokenizer's EOS.
        results_as_text: a tool result that holds the text of one of the tokenizer's special tokens (`<|im_end|>` in
            a fetched page) is tokenized as its characters, the template's own markers around it as the template
            writes them, so that a result cannot forge a turn boundary (TRL's, and False: the special tokens); a
            result without such text gives TRL's ids either way.
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing), for results that hold
            images (`with_images`); None: a result with an image is refused.
    """

    _said_unsplit = False  # a template that rewrites results: said once a process

    def __init__(self, tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                 *, stop_token_ids: list[int] | None = None, results_as_text: bool = True, vision=None):
        self.tokenizer, self.vision = tokenizer, vision
        self.results_as_text = results_as_text
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        eos = tokenizer.eos_token_id
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else {eos} - {None}
        self._calling_ids: dict[str, list[int]] = {}  # tool name -> [user, calling assistant] ids, cut after the stop

    def __call__(self, tool_messages: list[dict]) -> list[int]:
        """[S] the ids of `tool_messages` (one turn's, at least one, in order, each {"role": "tool", "name",
        "content"}) as the template renders them after the model's turn, the next turn's generation prompt
        included."""
        calling = self._calling(tool_messages[0]["name"])
        messages = self._conversation(tool_messages[0]["name"]) + list(tool_messages)
        forged = self.results_as_text and any(_holds_special_text(self.tokenizer, m["content"]) for m in tool_messages)
        full = self._render_as_text(messages, len(tool_messages)) if forged else self._render(
            messages, add_generation_prompt=True)
        return self._after(calling, full, tool_messages)

    def with_images(self, tool_messages: list[dict]) -> tuple[list[int], dict, list]:
        """(`__call__`'s ids, the results' images' model_inputs, those images) for results that may hold image
        blocks ({"type": "image", "image": ...}): the template renders each image's placeholder, the processor
        expands it to the image's tokens and makes its pixels, as TRL renders a multimodal tool response through the
        processor. Results without images give `__call__`'s ids, {} and []."""
        images = [part["image"] for m in tool_messages if isinstance(m["content"], list) for part in m["content"]
                  if isinstance(part, dict) and part.get("type") == "image"]
        if not images:
            return self(tool_messages), {}, []
        name = tool_messages[0]["name"]
        if self.vision is None:
            raise ConfigError(f"Tool {name!r} returned an image, but this run has no image processor to show it to "
                              "the model (a text model, or a tokenizer as processing_class): train a vision-language "
                              "checkpoint with its processor, or return the image as text.")
        calling = self._calling(name)
        text = render(self.vision.processor, self._conversation(name) + list(tool_messages), self.chat_template,
                      add_generation_prompt=True, **self.chat_template_kwargs)
        full, pixels = self.vision.encode(text, images, f"The result of tool {name!r}")
        return self._after(calling, full, tool_messages), pixels, images

    def _after(self, calling: list[int], full: list[int], tool_messages: list[dict]) -> list[int]:
        """`full`'s ids after the `calling` turn's, which must start it."""
        if full[:len(calling)] != calling:
            name = capitalised(template_name(self.tokenizer))
            raise ConfigError(f"{name} renders the turn before the tool messages "
                              f"{[m['name'] for m in tool_messages]} differently once they follow it, so their token "
                              f"ids cannot be appended to the model's: give a prefix-preserving template with "
                              f"chat_template_path.")
        return full[len(calling):]

    def _conversation(self, name: str) -> list[dict]:
        """TRL's dummy: [user, assistant calling `name` with no arguments]."""
        return [{"role": "user", "content": "dummy"}, calling_turn([tool_call(name, {})])]

    def _calling(self, name: str) -> list[int]:
        """[P] the ids of [user, assistant calling `name`], cut after their last stop token."""
        if name not in self._calling_ids:
            ids = self._render(self._conversation(name), add_generation_prompt=False)
            stops = [i for i, token in enumerate(ids) if token in self.stop_token_ids]
            self._calling_ids[name] = ids[:stops[-1] + 1] if stops else ids
        return self._calling_ids[name]

    def _render_as_text(self, messages: list[dict], results: int) -> list[int]:
        """The ids of `messages` (the last `results` of them tool messages) with each result's text tokenized as
        characters (special tokens' texts included) and the template's own text around them as usual. A template
        that changes a result's text otherwise than trimming or quoting it gets TRL's ids (said once)."""
        marks = [f"\ue000{i}\ue001" for i in range(results)]  # private-use characters: no template or tool writes them
        marked = messages[:-results] + [dict(m, content=mark) for m, mark in zip(messages[-results:], marks)]
        pieces = re.split("(\ue000\\d+\ue001)", render(self.tokenizer, marked, self.chat_template,
                                                       add_generation_prompt=True, **self.chat_template_kwargs))
        rendered = render(self.tokenizer, messages, self.chat_template, add_generation_prompt=True,
                          **self.chat_template_kwargs)
        # the result as the template writes it: as given, trimmed, or escaped in a JSON string (Llama 3.1, gpt-oss:
        # the mark is quoted the same way)
        for shown in (lambda text: text, str.strip, lambda text: json.dumps(text, ensure_ascii=False)[1:-1]):
            parts = [(shown(messages[len(messages) - results + int(m.group(1))]["content"]), True)
                     if (m := re.fullmatch("\ue000(\\d+)\ue001", piece)) else (piece, False) for piece in pieces]
            if "".join(text for text, _ in parts) == rendered:
                return [i for text, result in parts if text for i in self.tokenizer(
                    text, add_special_tokens=False, split_special_tokens=result)["input_ids"]]
        if not ToolSuffix._said_unsplit:
            ToolSuffix._said_unsplit = True
            logger.warning(f"{capitalised(template_name(self.tokenizer))} changes a tool result's text as it renders "
                           "it, so a result holding a special token's text is tokenized as TRL tokenizes it (the "
                           "special token itself): tool_results_as_text cannot apply.")
        return self._render(messages, add_generation_prompt=True)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The ids of `messages` as the rollout's template renders them."""
        return render(self.tokenizer, messages, self.chat_template, tokenize=True,
                      add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs)


def _holds_special_text(tokenizer, content) -> bool:
    """Whether a tool message's text content holds the text of one of the tokenizer's special tokens (content blocks,
    a multimodal result, are rendered as the template writes them)."""
    return isinstance(content, str) and any(token in content for token in tokenizer.all_special_tokens)
