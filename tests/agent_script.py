"""A scripted "model" for the agent tests: its turns are chosen from the conversation so far and written as the chat
template writes an assistant turn, so TRL 1.16's tool loop and posttrain's see the same model outputs.

    script = Script(tokenizer, chat_template)
    ids = script.next_turn(prompt_and_history_ids)       the next turn's ids, ending with EOS
    engine = ScriptedEngine(script, pad_id, eos_ids)      the Generator protocol over it (posttrain)

A prompt names its case in the user message ("case:<name>"); the turn index is the number of tool-result rounds the
conversation holds (the script's own turns carry a "(turn k)" marker it counts).
"""

import json
import re

from posttrain.agents.chat_templates import calling_turn, render, tool_call
from posttrain.generation import Rollouts

LOGPROB = -0.25  # every scripted token's "sampler log-prob"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"failed because {reason}")


def big() -> str:
    """A result too long for the completion budget."""
    return "x" * 3000


def picture(colour: str) -> list:
    """A multimodal result: an image of the colour and a caption.

    Args:
        colour: The colour.
    """
    from PIL import Image

    return [{"type": "image", "image": Image.new("RGB", (16, 16), colour)}, {"type": "text", "text": f"a {colour} one"}]


TOOLS = [add, mul, fail, big]

# case -> the turns: a list of calls (name, arguments) for a calling turn, or a string for an answer
CASES = {
    "none": ["No tool needed."],
    "one": [[("add", {"a": 2, "b": 3})], "The sum is 5."],
    "parallel": [[("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": 4}), ("fail", {"reason": "test"}),
                  ("nope", {})], [("add", {"a": 4, "b": 5})], "Done."],
    "iterate": [[("add", {"a": k, "b": 1})] for k in range(10)] + ["never"],
    "overflow": [[("big", {})], "unreachable"],
    "malformed": ["MALFORMED"],
    "picture": [[("picture", {"colour": "red"})], [("picture", {"colour": "blue"})], "Red, then blue."],
}


class Script:
    """The scripted model (module docstring)."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.eos = tokenizer.eos_token_id

    def next_turn(self, ids: list[int], variant: int = 0) -> list[int]:
        """The turn after `ids`; `variant` > 0 adds that many "!" to an answer (completions of a group differ)."""
        text = self.tokenizer.decode(ids)
        case = re.search(r"case:(\w+)", text).group(1)
        k = text.count("(turn ")
        turns = CASES[case]
        turn = turns[min(k, len(turns) - 1)]
        if turn == "MALFORMED":
            return self._ids(f"(turn {k}) <tool_call>\n{{\"name\": \"add\", \"arguments\": {{\"a\": 1,}}\n</tool_call>")
        if isinstance(turn, str):
            message = {"role": "assistant", "content": f"(turn {k}) {turn}" + "!" * variant}
        else:
            message = {**calling_turn([tool_call(n, a) for n, a in turn]), "content": f"(turn {k})"}
        return self._turn(message)

    def _turn(self, message: dict) -> list[int]:
        """The ids the template writes for `message` after the generation prompt, cut after its last EOS."""
        user = [{"role": "user", "content": "q"}]
        prompt = render(self.tokenizer, user, self.chat_template, add_generation_prompt=True)
        whole = render(self.tokenizer, user + [message], self.chat_template)
        assert whole.startswith(prompt), "the script's template is not prefix-preserving"
        ids = self.tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]
        stops = [i for i, t in enumerate(ids) if t == self.eos]
        return ids[:stops[-1] + 1]

    def _ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids if ids and ids[-1] == self.eos else ids + [self.eos]


class ScriptedEngine:
    """posttrain's Generator protocol over a Script: each prompt's next turn (cut to max_tokens), LOGPROB per token;
    the calls it got are recorded (prompts, keys, new_round), and the pixels and images of those that had any
    (`pixel_calls`: (prompts, model_inputs, images))."""

    samples_during_push = pushes_in_background = False  # an engine in the trainer's process (the protocol's)

    def __init__(self, script: Script, pad_id: int, eos_ids: list[int], max_tokens: int, vary: bool = False):
        import torch

        self.vary = vary  # answers depend on the row's key (key % 3 "!"), so a group's completions differ
        self.script, self.pad_id, self.eos_ids, self.max_tokens = script, pad_id, list(eos_ids), max_tokens
        self.rng = torch.Generator().manual_seed(0)
        self.calls: list[tuple[list, list, bool]] = []
        self.pixel_calls: list[tuple[list, object, list]] = []

    def generate(self, prompts, row_keys=None, new_round: bool = True, model_inputs=None, images=None) -> Rollouts:
        self.calls.append((prompts, row_keys, new_round))
        if model_inputs is not None:
            self.pixel_calls.append((prompts, model_inputs, images))
        rows = []
        for p, key in zip(prompts, row_keys or range(len(prompts))):
            ids = self.script.next_turn(p, key % (1 << 32) % 3 if self.vary else 0)[:self.max_tokens]
            rows.append((list(p), ids, [LOGPROB] * len(ids)))
        return Rollouts.from_lists(rows, self.pad_id, self.eos_ids, "cpu")

    def sync_weights(self, weights) -> None:
        for _ in weights:
            pass

    def round_done(self) -> None:
        pass

    def close(self) -> None:
        pass


def trl_generate_single_turn(script: Script, max_tokens: int):
    """TRL's `_generate_single_turn` replaced by the script: (completion ids, log-probs) per prompt."""
    def generate(prompt_ids, images=None, multimodal_fields=None, num_generations=1, **kwargs):
        if multimodal_fields:
            generate.pixel_calls.append((prompt_ids, multimodal_fields, images))
        ids = [script.next_turn(list(p))[:max_tokens] for p in prompt_ids]
        return ids, [[LOGPROB] * len(x) for x in ids]

    generate.pixel_calls = []  # (prompt ids, multimodal fields, images) of each turn sampled with pixels
    return generate


def as_json(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)
