"""The model's tool calls: a turn's token ids read as the assistant message they write, with every call of the turn.

    parser = ToolCallParser(tokenizer)                  the family recognised from the chat template (or an override)
    turn = parser.parse(turn_ids, prefix_ids, tools)    ParsedTurn: the message, and whether it was malformed

The ids are decoded for reading only: the rollout keeps them as sampled. Reading is transformers' response parsing
(`tokenizer.parse_response` with a response_template, the prompt before the turn as its prefix, and the tools' schemas
to type the arguments), with the response template of the turn's family (agents/response_formats.py).

Which response template, in this order:
1. the `response_template` given (a transformers response_template dict, or a function (turn text, prefix text) ->
   assistant message) for a forked or unknown template;
2. the tokenizer's own `response_template` attribute, as TRL 1.16 uses it when set;
3. the family whose response template reads back what the chat template renders for a probe turn holding a tool
   call (and two, where the template renders two): recognised by what the template writes, not by its text, so a
   fork is recognised (TRL matches the exact text). None reads it back: ConfigError naming the template and the
   override.

A malformed turn, as TRL 1.16's parse_response handles it (`trl.chat_template_utils.parse_response`): when reading
raises ValueError or TypeError (a call whose JSON does not parse, a call without a string name, a parser that
returns nothing), the turn becomes {"role": "assistant", "content": the turn decoded without special tokens} with no
tool_calls, so none of its calls run (a well-formed call beside a malformed one included) and the rollout ends with
that turn; posttrain marks it (ParsedTurn.malformed) so it is counted, not silent. Otherwise, as TRL: an EOS token at
the end of the content is removed, content is always a string, and a call without arguments gets {}.
"""

import logging
from dataclasses import dataclass
from typing import Callable

from posttrain.agents.chat_templates import (PROBE_ARGUMENTS, PROBE_TOOL, PROBE_USER, calling_turn, capitalised,
                                             render, template_name, tool_call)
from posttrain.agents.response_formats import RESPONSE_FORMATS, ResponseFormat
from posttrain.configs import ConfigError
from posttrain.errors import UserFunctionError, function_name

logger = logging.getLogger("posttrain")

# the prefix is decoded from its last this many tokens when the turn's start anchor is among them (it is: the
# generation prompt ends the prefix), else whole
PREFIX_TAIL_TOKENS = 256
# the probe's tool schema, so that formats writing arguments as text (Qwen3.5's XML) read them back typed
PROBE_SCHEMAS = [{"type": "function", "function": {
    "name": PROBE_TOOL, "description": "A probe.",
    "parameters": {"type": "object", "required": ["probe_text", "probe_count"],
                   "properties": {"probe_text": {"type": "string"}, "probe_count": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "probe_other", "description": "Another probe.",
                                      "parameters": {"type": "object", "properties": {}}}}]
PROBE_CALLS = [tool_call(PROBE_TOOL, PROBE_ARGUMENTS), tool_call("probe_other", {})]


@dataclass(frozen=True)
class ParsedTurn:
    """One model turn, read.

    Attributes:
        message: {"role": "assistant", "content": str, ["reasoning_content" / "thinking"], ["tool_calls": [{"type":
            "function", "function": {"name": str, "arguments": dict}}, ...]]}: every call of the turn, in order.
        malformed: reading failed: the message is the turn's text without special tokens and no calls (module doc).
    """

    message: dict
    malformed: bool = False


# ------------------------------------------------------------------ reading one turn


def _flat_calls(calls) -> list:
    """A format that reads a list of calls per region (LFM2's) gives a list of lists: the calls in order."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list.")
    return [call for item in calls for call in (item if isinstance(item, list) else [item])]


def _checked_call(call, index: int) -> dict:
    """`call` as the tool runner takes it; ValueError when it has no string name (a call without arguments gets {},
    as TRL's _validate_tool_calls does, in either the nested or the flat shape)."""
    if not isinstance(call, dict):
        raise ValueError(f"tool_calls[{index}] is not a mapping.")
    function = call["function"] if "function" in call else call
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool_calls[{index}] has no name.")
    if function.get("arguments") is None:
        function["arguments"] = {}
    return call


def as_assistant_message(parsed, eos_token: str | None) -> dict:
    """What the response parser returned, as the assistant message (TRL 1.16's rules, module doc); ValueError when
    it is not one."""
    if not isinstance(parsed, dict):
        raise ValueError("the response parser returned no message.")
    content = parsed.get("content")
    if isinstance(content, str) and eos_token:
        content = content.removesuffix(eos_token)
    parsed["content"] = content or ""
    if parsed.get("tool_calls") is not None:
        parsed["tool_calls"] = [_checked_call(c, i) for i, c in enumerate(_flat_calls(parsed["tool_calls"]))]
    return parsed


# ------------------------------------------------------------------ the parser


class ToolCallParser:
    """Reads a model's turns (module doc).

    Args:
        tokenizer: the policy's tokenizer (its chat template, or `chat_template`, is what is recognised).
        response_template: an override: a transformers response_template dict, or a function (turn text, prefix
            text) -> assistant message (a dict with "content" and, when it calls tools, "tool_calls").
        chat_template: the template the prompts are rendered with, when not the tokenizer's.

    Attributes:
        format: the ResponseFormat turns are read with (None when a function reads them).
    """

    def __init__(self, tokenizer, response_template: dict | Callable | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self._function = response_template if callable(response_template) else None
        self.format = None if self._function else _chosen_format(tokenizer, response_template, chat_template)
        self._loaded = None if self._function else _loaded(self.format.response_template, self.format.name)

    def parse(self, ids: list[int], prefix_ids: list[int], tools: list | None = None) -> ParsedTurn:
        """The turn `ids` ([T] as sampled, its stop token included) read after `prefix_ids` ([P] the ids before it:
        the prompt, and in later turns the earlier turns and tool results); `tools`: the row's tools (JSON schemas,
        or functions) so that the arguments are typed as the tools declare them."""
        try:
            parsed = self._read(ids, prefix_ids, tools)
            return ParsedTurn(as_assistant_message(parsed, self.tokenizer.eos_token))
        except ConfigError:  # the response template's fault, not the turn's
            raise
        except (ValueError, TypeError):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            return ParsedTurn({"role": "assistant", "content": text}, malformed=True)

    def _read(self, ids: list[int], prefix_ids: list[int], tools: list | None):
        text = self.tokenizer.decode(ids)
        if self._function is not None:
            return self._call_function(text, self.tokenizer.decode(prefix_ids))
        try:
            return self.tokenizer.parse_response(text, self._loaded, prefix=self._prefix_text(prefix_ids), tools=tools)
        except KeyError as err:  # a transform naming a capture its patterns do not have (a given response_template)
            cause = err.args[0] if err.args else err
            raise ConfigError(f"{capitalised(self.format.name)} cannot read a turn ({cause}): let its transforms name "
                              f"only 'content' and the captures of its patterns.") from None

    def _prefix_text(self, prefix_ids: list[int]) -> str:
        """The prefix's text from its last start anchor on is all the parser reads: decoded from the prefix's tail
        when the anchor is there."""
        tail = self.tokenizer.decode(prefix_ids[-PREFIX_TAIL_TOKENS:])
        if len(prefix_ids) <= PREFIX_TAIL_TOKENS or self._loaded.start_anchor_re.search(tail):
            return tail
        return self.tokenizer.decode(prefix_ids)

    def _call_function(self, text: str, prefix: str):
        try:
            return self._function(text, prefix)
        except (ValueError, TypeError):
            raise
        except Exception as err:
            raise UserFunctionError(f"The response_template function {function_name(self._function)} raised "
                                    f"{type(err).__name__} reading a turn: fix it, or raise ValueError for a turn it "
                                    f"cannot read (the turn then counts as malformed, as TRL's parse_response "
                                    f"falls back).") from err


# ------------------------------------------------------------------ choosing the response template


def _loaded(response_template: dict, name: str):
    """transformers' compiled form of `response_template`; ConfigError when transformers refuses it."""
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        return load_response_template(response_template)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{capitalised(name)} cannot be used: {str(err).splitlines()[0]}; see transformers' "
                          f"response parsing docs for its format.") from None


def _chosen_format(tokenizer, given: dict | None, chat_template: str | None) -> ResponseFormat:
    """The response template to read turns with (module doc, 1-3)."""
    own = getattr(tokenizer, "response_template", None)
    for fmt, whose in ((given, "the given"), (own, "the tokenizer's")):
        if fmt is not None:
            chosen = ResponseFormat(f"{whose} response_template", "given", fmt)
            _loaded(fmt, chosen.name)
            if not reads_back(tokenizer, chosen, chat_template):
                logger.warning("%s does not read back the tool call %s writes; turns are read with it as given.",
                               capitalised(chosen.name), template_name(tokenizer))
            return chosen
    return recognise_format(tokenizer, chat_template)


def recognise_format(tokenizer, chat_template: str | None = None) -> ResponseFormat:
    """The family (response_formats.RESPONSE_FORMATS) whose response template reads back the chat template's probe
    turn; ConfigError naming the template and the override when none does."""
    unreadable = []  # families this transformers cannot parse (a content parser it lacks)
    for fmt in RESPONSE_FORMATS:
        if fmt.missing_parsers():
            unreadable.append(fmt)
        elif reads_back(tokenizer, fmt, chat_template):
            return fmt
    rendered = probe_turn(tokenizer, PROBE_CALLS[:1], chat_template)
    shown = repr(rendered[1][:80]) if rendered else "it cannot render one"
    newer = "".join(f" (the {fmt.name} of {fmt.models} need transformers' {', '.join(fmt.missing_parsers())} "
                    "parser: upgrade transformers)" for fmt in unreadable
                    if rendered and _opening(fmt) and _opening(fmt) in rendered[1])  # the template writes that family's
    raise ConfigError(f"posttrain does not recognise how {template_name(tokenizer)} writes a tool call "
                      f"({shown}){newer}: give the trainer a response_template (a transformers response_template dict "
                      "for it, or a function (turn text, prefix text) -> message), or set tokenizer.response_template.")


def _opening(fmt: ResponseFormat) -> str | None:
    """The marker a family's tool calls open with, where its response template names one."""
    calls = fmt.response_template.get("fields", {}).get("tool_calls", {})
    return calls.get("open") if isinstance(calls, dict) else None


def probe_turn(tokenizer, calls: list[dict], chat_template: str | None = None) -> tuple[str, str] | None:
    """(prefix, turn): the conversation [user, assistant holding `calls`] as the template renders it, split where it
    leaves the generation prompt of [user] (the prefix the model's turn follows); None when it cannot render it."""
    from jinja2 import TemplateError

    user = [{"role": "user", "content": PROBE_USER}]
    try:
        prompt = render(tokenizer, user, chat_template, add_generation_prompt=True)
        whole = render(tokenizer, user + [calling_turn(calls)], chat_template)
    except (TemplateError, TypeError):
        return None
    split = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), min(len(prompt), len(whole)))
    return whole[:split], whole[split:]


def reads_back(tokenizer, fmt: ResponseFormat, chat_template: str | None = None) -> bool:
    """Whether `fmt` reads back, exactly, the call (and the two parallel calls, where the template writes both) that
    the chat template writes, its start anchor found in the generation prompt."""
    try:
        loaded = _loaded(fmt.response_template, fmt.name)
    except ConfigError:
        return False
    results = []
    for calls in (PROBE_CALLS[:1], PROBE_CALLS):
        rendered = probe_turn(tokenizer, calls, chat_template)
        if rendered is None or not all(c["function"]["name"] in rendered[1] for c in calls):
            continue  # a template that writes one call a turn (Llama 3 raises, GPT-OSS drops the second)
        prefix, turn = rendered
        if not loaded.start_anchor_re.search(prefix):
            return False
        try:
            parsed = as_assistant_message(tokenizer.parse_response(turn, loaded, prefix=prefix, tools=PROBE_SCHEMAS),
                                          tokenizer.eos_token)
        except (ValueError, TypeError, KeyError):
            return False
        results.append(parsed.get("tool_calls") == calls)
    return bool(results) and all(results)
