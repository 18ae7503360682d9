"""How each family of chat templates writes an assistant turn with tool calls, as transformers' response parsing reads
it (a `response_template`: the turn's start anchor and its fields, each between an open and a close pattern, with a
content parser; transformers >= 5.13, `tokenizer.parse_response`).

    RESPONSE_FORMATS         the families, in the order posttrain tries them (tool_parsing.recognise_format)

A family is never chosen by the template's text: tool_parsing.py renders a probe tool call with the chat template and
takes the first family whose response template reads it back exactly, so a fork of a template (another system prompt,
a fixed bug) is recognised as its family (TRL 1.16 matches templates by their exact text, which forks break: #5724).

Each response template here is posttrain's own, written from what the chat templates render; where TRL 1.16 ships
one for the same family, tests/test_agents_chat.py checks that both parse the same completions alike. Where they
differ by design (a real improvement, see each entry): LFM2 calls are read with transformers' strict Python-call
grammar (`flag=False` is False; TRL's regex reads the string "False"), Nemotron 3 shares Qwen3.5's entry (a turn
whose reasoning never closes is all reasoning, as for Qwen3.5; TRL reads it as content and runs the calls in it),
GPT-OSS also reads the harmony order the model itself writes (`<|channel|>commentary to=functions.NAME
<|constrain|>json`), Llama 3 also reads `"arguments"` and `<|eom_id|>`, GLM-4 closes content at `<|observation|>`,
and a call list cut before its end leaves no "]" in the content (LFM2). Where TRL 1.16 has no response template:
DeepSeek-V3, Muse Glimmer, Diffusion Gemma (Gemma 4's format), and a tokenizer whose template is one of TRL's own
`*_training.jinja` (TRL's add_response_schema does not know their text).
"""

from dataclasses import dataclass

# where a text region ends: Qwen's end of turn, or its base models' EOS
_CHATML_END = r"(?:<\|im_end\|>|<\|endoftext\|>)\s*"
_THINK = {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}
# a call read from its name (a regex capture) and its arguments (the region's content)
_NAMED_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}


@dataclass(frozen=True)
class ResponseFormat:
    """One family's way of writing tool calls.

    Attributes:
        name: what messages call it.
        models: the models (and TRL 1.16 templates) that write it, for messages and docs.
        response_template: transformers' response_template dict for it.
    """

    name: str
    models: str
    response_template: dict

    def missing_parsers(self) -> list[str]:
        """The content parsers its template uses that the installed transformers lacks (its response parsing grew
        them over releases: "python-call-list" came with 5.24)."""
        from transformers.utils.chat_parsing.content_parsers import CONTENT_PARSERS

        used, stack = set(), [self.response_template]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("content"), str):
                    used.add(node["content"])
                stack.extend(node.values())
        return sorted(used - set(CONTENT_PARSERS))


HERMES_JSON = ResponseFormat(
    "Qwen JSON calls", "Qwen2.5, Qwen3, Qwen3-2507, Qwen3-VL",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|im_start|>assistant\n",
     "fields": {
         "reasoning_content": _THINK,
         # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>: the JSON object is the function
         "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                        "content": "json", "transform": {"type": "function", "function": "{content}"}},
         "content": {"close_pattern": _CHATML_END, "content": "text"}}})

QWEN_XML = ResponseFormat(
    "Qwen XML calls", "Qwen3.5, Qwen3.6, Qwen3.8, Nemotron 3",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|im_start|>assistant\n",
     "fields": {
         "reasoning_content": _THINK,
         # <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>; a value is
         # text, typed by the tool's JSON schema when the parser is given the tools (transformers >= 5.15)
         "tool_calls": {"open_pattern": r"<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                        "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "xml-inline",
                        "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                                         "value_parser": {"name": "text"}},
                        "transform": _NAMED_CALL},
         "content": {"close_pattern": _CHATML_END, "content": "text"}}})

GLM = ResponseFormat(
    "GLM calls", "GLM-4.5 / GLM-4.6 (GLM-4-MoE)",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|assistant|>",
     "fields": {
         "reasoning_content": _THINK,
         # <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>
         "tool_calls": {"open_pattern": r"<tool_call>(?P<name>[^\s<]+)\s*", "close_pattern": r"</tool_call>\s*",
                        "repeats": True, "content": "xml-inline",
                        "content_args": {"tag_pattern": r"<arg_key>(?P<key>[^<]+)</arg_key>\s*"
                                                        r"<arg_value>(?P<value>.*?)</arg_value>",
                                         "value_parser": {"name": "text"}},
                        "transform": _NAMED_CALL},
         # GLM ends a turn with <|user|>, with <|observation|> after tool calls, or with its EOS
         "content": {"close_pattern": r"(?:<\|user\|>|<\|observation\|>|<\|endoftext\|>)\s*", "content": "text"}}})

HARMONY = ResponseFormat(
    "GPT-OSS harmony calls", "GPT-OSS",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|start|>assistant",
     "fields": {
         # the analysis channel is the template's `thinking`; text outside every channel is dropped (no implicit
         # field), as the headers between harmony messages are
         "thinking": {"open": "<|channel|>analysis<|message|>", "close_pattern": r"<\|end\|>\s*", "content": "text"},
         "content": {"open": "<|channel|>final<|message|>", "close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*",
                     "content": "text"},
         # the template writes ` to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`; the model
         # also writes `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
         "tool_calls": {"open_pattern": r"(?:to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary"
                                        r"|<\|channel\|>commentary\s+to=functions\.(?P<name>[^\s<]+))"
                                        r"\s*(?:<\|constrain\|>)?\s*json<\|message\|>",
                        "close_pattern": r"<\|call\|>\s*", "repeats": True, "content": "json",
                        "transform": _NAMED_CALL}}})

LLAMA_JSON = ResponseFormat(
    "Llama 3 JSON calls", "Llama 3.1, Llama 3.2",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "fields": {
         # a bare {"name": NAME, "parameters": ARGS} ending the turn; the region holds ARGS (the close takes the
         # object's last brace)
         "tool_calls": {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"(?:parameters|arguments)":\s*',
                        "close_pattern": r"\}\s*(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "repeats": True,
                        "content": "json", "transform": _NAMED_CALL},
         "content": {"close_pattern": r"(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "content": "text"}}})

GEMMA4 = ResponseFormat(
    "Gemma 4 calls", "Gemma 4 (and its diffusion variant)",
    {"defaults": {"role": "assistant"},
     # the model's turn goes on after tool responses, without a new header
     "start_anchor_pattern": r"<\|turn>model\n|<tool_response\|>",
     "fields": {
         "reasoning_content": {"open": "<|channel>thought\n", "close_pattern": r"<channel\|>\s*", "content": "text"},
         # <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>: JSON with bare keys and <|"|> quotes
         "tool_calls": {"open_pattern": r"<\|tool_call>call:(?P<name>[\w.-]+)", "close_pattern": r"<tool_call\|>\s*",
                        "repeats": True, "content": "json",
                        "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
                        "transform": _NAMED_CALL},
         "content": {"close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*", "content": "text"}}})

PYTHONIC = ResponseFormat(
    "LFM2 Python calls", "LFM2 (v2), LFM2.5, LFM2.5-VL",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|im_start|>assistant\n",
     "fields": {
         "thinking": _THINK,  # LFM2.5's template reads the reasoning back from `thinking`
         # <|tool_call_start|>[get_weather(city='Paris', days=3), ping()]<|tool_call_end|>: every call of the turn
         # in one Python list, read with transformers' strict call-list grammar (a list per region: flattened by
         # tool_parsing.py, so calls in several regions all count)
         "tool_calls": {"open": "<|tool_call_start|>", "close_pattern": r"<\|tool_call_end\|>\s*", "repeats": True,
                        "content": "python-call-list", "transform_each": True,
                        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}},
         "content": {"close_pattern": _CHATML_END, "content": "text"}}})

DEEPSEEK = ResponseFormat(
    "DeepSeek-V3 calls", "DeepSeek-V3 (TRL 1.16 has no response template for it)",
    {"defaults": {"role": "assistant"},
     # the model's turn goes on after the tool outputs, without a new header
     "start_anchor_pattern": r"<｜Assistant｜>|<｜tool▁outputs▁end｜>",
     "fields": {
         "reasoning_content": _THINK,
         # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
         # ...<｜tool▁calls▁end｜>: the list's own markers are taken with its first and last call
         "tool_calls": {"open_pattern": r"(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>"
                                        r"(?P<name>[^\n<]+)\s*```(?:json)?\s*",
                        "close_pattern": r"\s*```\s*<｜tool▁call▁end｜>\s*(?:<｜tool▁calls▁end｜>)?\s*",
                        "repeats": True, "content": "json", "transform": _NAMED_CALL},
         "content": {"close_pattern": r"<｜end▁of▁sentence｜>\s*", "content": "text"}}})

ATEM = ResponseFormat(
    "Muse Glimmer ATEM calls", "Muse Glimmer (TRL 1.16 has no response template for it)",
    {"defaults": {"role": "assistant"},
     "start_anchor": "<|start|>assistant",
     "fields": {
         # every part of the turn is a message to a recipient: ` to=self<|message|>REASONING<|eom|>`, one call a
         # message ` to=NAME<|message|><atem:function_calls>...</atem:function_calls>`, ` to=user<|message|>ANSWER
         # <|eot|>`; the headers between them are dropped (no implicit field)
         "reasoning_content": {"open_pattern": r"\s*to=self<\|message\|>", "close_pattern": r"<\|eom\|>\s*",
                               "content": "text"},
         "content": {"open_pattern": r"\s*to=user<\|message\|>", "close_pattern": r"(?:<\|eot\|>|<\|eom\|>)\s*",
                     "content": "text"},
         "tool_calls": {"open_pattern": r"\s*to=(?P<name>[^\s<]+)<\|message\|>\s*<atem:function_calls>",
                        "close_pattern": r"</atem:function_calls>\s*(?:<\|eot\|>|<\|eom\|>)?\s*", "repeats": True,
                        "content": "xml-inline",
                        "content_args": {"tag_pattern": r'<atem:parameter name="(?P<key>[^"]+)">(?P<value>.*?)'
                                                        r"</atem:parameter>",
                                         "value_parser": {"name": "text"}},
                        "transform": _NAMED_CALL}}})

# the order they are tried in; a template's probe call is read back exactly by one family only
RESPONSE_FORMATS = (HERMES_JSON, QWEN_XML, GLM, HARMONY, LLAMA_JSON, GEMMA4, PYTHONIC, DEEPSEEK, ATEM)
