"""GRPO's rollouts with tools, environments or a rollout_func: a round's rows in, multi-turn Rollouts and what the
reward functions receive out. grpo/rollout.py calls it in place of a single generate() when the trainer has agents.

    agents = AgentRollouts(tokenizer, encoder, Agents(tools, environment_factory, rollout_func, ...), ...)
    sampled = agents.sample(rows, indices, row_keys, generator)      AgentSample (below)

One round, as TRL 1.16's GRPOTrainer runs it (`_generate_and_score_completions`, `_generate`, `_tool_call_loop`):
  1. environments: an instance per row, reset with the row; reset's text appended to the row's prompt
     (agents/environments.py); the row's tools are the standalone tools and its instance's methods;
  2. the prompts rendered with their rows' tools' schemas, through the template tool results are rendered with
     (agents/chat_templates.py tool_chat_template), or rollout_func(prompts, trainer) called instead, its output
     checked (agents/rollout_func.py);
  3. the first turns sampled (one per row, each with its key), then the tool loop (agents/loop.py): each turn read
     for calls (agents/tool_parsing.py), the calls run (agents/tools.py), their results' ids from the template
     (ToolSuffix), the next turn sampled within the round from prompt + completion + results;
  4. the rows as Rollouts with their tool mask; the completions as messages (each assistant turn parsed, each tool
     message), the environments and rollout_func's extra columns for the reward functions; the calls and failures.
Token-in/token-out: every later turn's engine answer is checked to have been sampled from exactly the ids sent (the
prompt and every earlier turn and result, in order); a difference stops the run instead of being patched.
"""

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrain.agents.chat_templates import ToolSuffix
from posttrain.agents.environments import EnvironmentPool
from posttrain.agents.loop import Budget, Suffix, Turns, tool_loop
from posttrain.agents.rollout_func import check_rollout_output
from posttrain.agents.sampling import first_turns, later_turns, multi_turn_rollouts
from posttrain.agents.tool_parsing import ToolCallParser
from posttrain.agents.tools import ToolRunner, ToolSet
from posttrain.data import DataError, check_within_vocabulary, is_conversational
from posttrain.errors import UserFunctionError, detail_of, function_name, program_stop_message, stops_the_program
from posttrain.generation import Rollouts
from posttrain.model_inputs import ModelInputs
from posttrain.sequences.images import images_of

logger = logging.getLogger("posttrain")


@dataclass
class Agents:
    """What a GRPOTrainer was given to act with (TRL 1.16's arguments).

    Attributes:
        tools: the standalone tools (functions, sync or async).
        environment_factory: a factory, {name: factory}, or None.
        rollout_func: (prompts, trainer) -> dict, or None.
        response_template: posttrain's override of how turns are read (agents/tool_parsing.py), or None.
    """

    tools: list = field(default_factory=list)
    environment_factory: Any = None
    rollout_func: Callable | None = None
    response_template: Any = None

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None

    def __bool__(self) -> bool:
        return self.calls_tools or self.rollout_func is not None


@dataclass
class AgentSample:
    """One round's rows on this process, sampled.

    Attributes:
        rollouts: [N] the rows, a multi-turn row's tool results marked in tool_mask.
        prompts: [N] the prompts as the reward functions receive them (reset's text appended).
        completions: [N] what the reward functions receive: with tools, each row's messages (every assistant turn
            parsed, every tool message); else the decoded completion (as messages for conversational prompts).
        texts: [N] each completion decoded without special tokens (the completion log's).
        columns: {name: [N] values}: `environments`, and rollout_func's extra columns.
        counts: [3] this process's rows, tool calls and failed calls.
        images: [N] each row's images, the prompt's then its tools' (the completions log's, with log_multimodal);
            None where no row has any.
    """

    rollouts: Rollouts
    prompts: list
    completions: list
    texts: list[str]
    columns: dict[str, list]
    counts: torch.Tensor
    images: list | None = None


class AgentRollouts:
    """A round's rows through tools, environments or a rollout_func (module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        encoder: the trainer's PromptEncoder (rendering with the tool template).
        agents: the trainer's tools, environments and rollout_func.
        chat_template: the template tool results are rendered with (None: the tokenizer's).
        chat_template_kwargs: as prompts are rendered with.
        budget: the tool loop's budget (max_completion_length, the context, max_tool_calling_iterations).
        tool_timeout: seconds a tool call may take (None: no limit).
        trainer: what rollout_func receives as its second argument (never read here).
        vocab_size: the model's vocabulary_rows, which rollout_func's ids and the tool results' must stay within.
        reserved: names rollout_func's extra columns may not take (what reward functions already receive).
        placeholder_prompts: the rows' prompts are TRL's placeholder, not the dataset's (an environment writes the
            prompt): reset is not given them.
        results_as_text: tool results' special-token texts are tokenized as text (ToolSuffix).
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing): the prompts' images (the
            encoder's, for a dataset with images) and the tools' images go with the rows; None: text only.
    """

    def __init__(self, tokenizer, encoder, agents: Agents, *, chat_template: str | None, chat_template_kwargs: dict,
                 budget: Budget, tool_timeout: float | None = None, trainer: Any = None, vocab_size: int | None = None,
                 reserved=(), placeholder_prompts: bool = False, results_as_text: bool = True, vision=None):
        self.tokenizer, self.encoder, self.agents, self.budget = tokenizer, encoder, agents, budget
        self.token_types = vision.token_types if vision is not None else None
        self.trainer, self.vocab_size, self.reserved = trainer, vocab_size, set(reserved)
        self.placeholder_prompts = placeholder_prompts
        self._noted: set[str] = set()  # rollout_func's rows already said (_note_untrainable)
        self.runner = ToolRunner(tool_timeout)
        self.tools = ToolSet(agents.tools)
        self.pool = (EnvironmentPool(agents.environment_factory, self.tools, self.runner)
                     if agents.environment_factory is not None else None)
        self.parser = ToolCallParser(tokenizer, agents.response_template, chat_template) if agents.calls_tools else None
        self.suffix = (ToolSuffix(tokenizer, chat_template, chat_template_kwargs, results_as_text=results_as_text,
                                  vision=vision) if agents.calls_tools else None)

    def reward_sources(self) -> list[tuple[str, Callable]]:
        """(class name, function) for each environment class with get_reward: reward sources of weight 1."""
        return self.pool.reward_sources() if self.pool is not None else []

    @property
    def column_names(self) -> list[str]:
        """The keywords reward functions get besides the dataset's columns (rollout_func's extras are known only
        once it ran)."""
        return ["environments"] if self.pool is not None else []

    def sample(self, rows: list[dict], indices: list[int], row_keys: list[int], generator, device) -> AgentSample:
        """The round's rows on this process (one per completion), sampled to the end of their rollouts (Rollouts on
        `device`)."""
        prompts, tool_sets, columns = [row.get("prompt") for row in rows], [self.tools] * len(rows), {}
        if self.pool is not None:
            drawn = self.pool.draw([{k: v for k, v in row.items() if k != "prompt"} for row in rows]
                                   if self.placeholder_prompts else rows)
            prompts, tool_sets, columns = drawn.prompts, drawn.tools, {"environments": drawn.environments}
        if self.agents.calls_tools:
            check_conversational(prompts, indices)
        if self.agents.rollout_func is not None:
            prompt_ids, first, extra = self._from_rollout_func(prompts)
            columns.update(extra.pop("columns"))
        else:
            schemas = [t.schemas for t in tool_sets] if self.agents.calls_tools else None
            prompt_ids, pixels, images = self._encode(rows, prompts, indices, schemas)
            inputs = None if pixels is None else ModelInputs.from_rows(pixels, self.token_types)
            first = first_turns(generator.generate(prompt_ids, row_keys) if inputs is None else
                                generator.generate(prompt_ids, row_keys, model_inputs=inputs, images=images))
            extra = {}
        pad_id = self.tokenizer.pad_token_id
        if not self.agents.calls_tools:  # rollout_func alone: its rows as it returned them
            rollouts = Rollouts.from_lists([(p, ids, logps) for p, (ids, logps) in zip(prompt_ids, first)], pad_id,
                                           generator.eos_ids, device, extra.get("env_mask"))
            completion_ids = [ids for ids, _ in first]
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            conversational = is_conversational(prompts[0])
            completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
            return AgentSample(rollouts, prompts, completions, texts, columns, torch.tensor([len(rows), 0, 0]))
        turns = Turns(generate=later_turns(generator, self.token_types),
                      parse=lambda r, ids, before: self.parser.parse(ids, before, tool_sets[r].schemas).message,
                      run_calls=lambda r, calls: _ran(self.runner.run(calls, tool_sets[r])),
                      suffix_ids=lambda r, messages: self._suffix_ids(messages))
        finished = tool_loop(prompt_ids, first, row_keys, turns, self.budget, pixels, images)
        rollouts = multi_turn_rollouts(finished, pad_id, generator.eos_ids, device, self.token_types)
        texts = self.tokenizer.batch_decode([row.completion_ids for row in finished], skip_special_tokens=True)
        completions = [[m for m in row.messages if m] for row in finished]
        counts = torch.tensor([len(rows), sum(row.tool_calls for row in finished), sum(row.tool_failures for row in finished)])
        images = [row.images for row in finished] if any(row.images for row in finished) else None
        return AgentSample(rollouts, prompts, completions, texts, columns, counts, images)

    def _encode(self, rows: list[dict], prompts: list, indices: list[int], schemas: list | None) -> tuple:
        """(each prompt's ids, each prompt's pixels or None, each prompt's images or None): with a dataset with
        images (the encoder has the processor), each row's images placed in its prompt (reset's text appended),
        rendered with its tools."""
        if self.encoder.vision is None:
            return self.encoder.encode(prompts, indices, schemas), None, None
        shown = [{"prompt": prompt, "images": images_of(row)} for prompt, row in zip(prompts, rows)]
        ids, pixels = self.encoder.encode_rows(shown, indices, schemas)
        return ids, pixels, [row["images"] for row in shown]

    def _suffix_ids(self, messages: list[dict]) -> Suffix:
        """The tool messages' ids (ToolSuffix; with the images they return, their pixels), within the model's
        vocabulary: a result's text may hold a token the tokenizer has and the model's embedding lacks."""
        ids, pixels, images = self.suffix.with_images(messages)
        where = f"The result of tool {messages[0]['name']!r}" if len(messages) == 1 else "A turn's tool results"
        check_within_vocabulary(where, ids, self.vocab_size, self.tokenizer)
        return Suffix(ids, pixels, images)

    def _note_untrainable(self, fn, completion_ids: list, env_mask: list | None) -> None:
        """Say once a run what of rollout_func's rows cannot train as it may expect: rows whose env_mask is all 0
        (no token of the model's: no gradient), completions past max_completion_length (trained whole, as TRL)."""
        longest, limit = max((len(ids) for ids in completion_ids), default=0), self.budget.max_completion_length
        unmasked = 0 if env_mask is None else sum(1 for row in env_mask if row and not any(row))
        for key, count, text in (
                ("no model tokens", unmasked, f"{unmasked} of {len(completion_ids)} rows whose env_mask is all 0, so "
                                              "they hold no token of the model's and give no gradient"),
                ("too long", longest > limit, f"completions of up to {longest} tokens, past max_completion_length="
                                              f"{limit}; they are trained whole, as TRL trains them")):
            if count and key not in self._noted:
                self._noted.add(key)
                logger.warning(f"rollout_func {function_name(fn)!r} returned {text} (said once a run).")

    def _from_rollout_func(self, prompts: list) -> tuple[list, list, dict]:
        """rollout_func's rows: (prompt ids, [(completion ids, log-probs)], {"columns": extra, "env_mask": ...})."""
        fn = self.agents.rollout_func
        try:
            output = fn(copy.deepcopy(prompts), self.trainer)
        except BaseException as err:  # an Exception, or SystemExit and the like (errors.stops_the_program)
            if stops_the_program(err):
                raise UserFunctionError(program_stop_message(f"rollout_func {function_name(fn)!r}", err)) from err
            if not isinstance(err, Exception):
                raise  # the run's own interrupt
            raise UserFunctionError(f"rollout_func {function_name(fn)!r} raised {type(err).__name__}"
                                    f"{detail_of(err)}; fix the function.") from err
        out = check_rollout_output(output, len(prompts), self.vocab_size, self.reserved)
        if out.env_mask is not None and self.agents.calls_tools:
            raise UserFunctionError("rollout_func returned env_mask while the trainer also has tools, whose loop makes "
                                    "its own tool mask: return no env_mask, or run the tools inside rollout_func "
                                    "and pass no tools to the trainer.")
        logprobs = out.logprobs or [[float("nan")] * len(ids) for ids in out.completion_ids]
        env_mask = None if out.env_mask is None else [[bool(x) for x in row] for row in out.env_mask]
        self._note_untrainable(fn, out.completion_ids, env_mask)
        return out.prompt_ids, list(zip(out.completion_ids, logprobs)), {"columns": out.extra, "env_mask": env_mask}

    def close(self) -> None:
        self.runner.close()


def _ran(results) -> tuple[list[dict], int]:
    return results.messages, results.failures


def check_conversational(prompts: list, indices: list[int]) -> None:
    """DataError for the first plain-text prompt: tools need messages (`indices`: the prompts' dataset rows)."""
    for prompt, index in zip(prompts, indices):
        if not is_conversational(prompt):
            raise DataError(f"Prompt {index} is plain text, but tool calling needs conversational prompts (a list of "
                            f"messages) so the chat template can show the tools and their results: give the dataset "
                            f"conversational prompts, e.g. [{{'role': 'user', 'content': ...}}].")
