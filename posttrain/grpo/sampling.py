"""A round's completions sampled from the policy: the half of a round that GRPO's (grpo/rollout.py) and
distillation's (distillation/rollout.py) share.

    share   = sampler.share(round, G)        this process's rows of the round, each prompt G times
    sample  = sampler.generate(share)        the policy's weights pushed, this process's rows sampled (through the
                                             agents' loop with tools, environments or a rollout_func)
"""

from dataclasses import dataclass, replace

import torch

from posttrain.agents.rollouts import AgentSample
from posttrain.data import PromptRound
from posttrain.model_inputs import ModelInputs
from posttrain.rewards import reward_inputs
from posttrain.sequences.images import images_of
from posttrain.weights import export_weights


@dataclass(frozen=True)
class RoundShare:
    """This process's rows of a round, each prompt repeated G times.

    Attributes:
        rows: the dataset rows, one per completion.
        prompt_ids: their token ids.
        indices: each row's position in the dataset.
        row_keys: each row's index in the (padded) round: what its completion's randomness depends on.
        real: False for the repeats that fill the last processes' shares when the prompts do not split evenly.
        model_inputs: each row's extra forward inputs (its prompt's images' pixels), or None for text prompts.
    """

    rows: list[dict]
    prompt_ids: list[list[int]]
    indices: list[int]
    row_keys: list[int]
    real: list[bool]
    model_inputs: ModelInputs | None = None


class RoundSampler:
    """Samples this process's share of a round from the policy.

    Args:
        accelerator, sharding: the run's (training/).
        model: the policy as prepared (its weights go to the generator).
        generator: the generation backend (posttrain/generation).
        tokenizer: decodes completions (what reward functions receive).
        agents: tools, environments or a rollout_func (posttrain/agents/rollouts.py), or None: one generate() call.
        token_types: the vision-language model's per-token input derived from the ids (model_inputs.TokenTypes), for
            prompts with images; None.
    """

    def __init__(self, *, accelerator, sharding, model, generator, tokenizer, agents=None, token_types=None):
        self.accelerator, self.sharding, self.model = accelerator, sharding, model
        self.generator, self.tokenizer, self.agents = generator, tokenizer, agents
        self.token_types = token_types  # the per-token input a vision-language model derives from the ids

    @property
    def calls_tools(self) -> bool:
        return self.agents is not None and self.agents.agents.calls_tools

    def share(self, prompt_round: PromptRound, G: int, pad_prompts: bool = False) -> RoundShare:
        """This process's contiguous share of the round's B*G rows (B*G splits evenly over the processes in
        training). With `pad_prompts` (evaluation, whose last round may hold any number of prompts), the first prompts
        are repeated until B splits over the processes, the repeats marked not real."""
        acc = self.accelerator
        real = len(prompt_round.rows)
        padded = real + (-real % acc.num_processes) if pad_prompts else real
        order = [i % real for i in range(padded)]
        n = padded * G // acc.num_processes
        mine = slice(acc.process_index * n, (acc.process_index + 1) * n)

        def spread(values: list) -> list:
            return [values[i] for i in order for _ in range(G)][mine]

        inputs = None if prompt_round.model_inputs is None else \
            ModelInputs.from_rows(spread(prompt_round.model_inputs), self.token_types)
        return RoundShare(spread(prompt_round.rows), spread(prompt_round.prompt_ids), spread(prompt_round.indices),
                          list(range(padded * G))[mine], [k < real * G for k in range(padded * G)][mine], inputs)

    def push_weights(self) -> None:
        """The policy's weights to the generator (a collective under sharding: every process calls it)."""
        with self.sharding.whole_weights(self.model):
            self.generator.sync_weights(export_weights(self.model))

    def weights_snapshot(self) -> list:
        """The policy's weights as the generator takes them, copied to the CPU, for a push that runs while training
        goes on (a collective under sharding: every process calls it)."""
        with self.sharding.whole_weights(self.model):
            return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in export_weights(self.model)]

    def generate(self, share: RoundShare) -> AgentSample:
        """`generate_with_held_weights` after pushing the policy's weights to the generator, within the whole weights
        (sharded training: for the export and the whole decode)."""
        with self.sharding.whole_weights(self.model):
            self.generator.sync_weights(export_weights(self.model))
            return self.generate_with_held_weights(share)

    def generate_with_held_weights(self, share: RoundShare) -> AgentSample:
        """This process's rows sampled with the weights the generator holds (through the agents' loop when the
        trainer has tools, environments or a rollout_func), with what the reward functions receive."""
        try:
            if self.agents is not None:
                return self.agents.sample(share.rows, share.indices, share.row_keys, self.generator,
                                          self.accelerator.device)
            if share.model_inputs is None:
                rollouts = self.generator.generate(share.prompt_ids, share.row_keys)
            else:  # the prompts' pixels (vLLM: their images) go to the prefill, and ride with the rows to every
                # later forward
                rollouts = replace(self.generator.generate(share.prompt_ids, share.row_keys,
                                                           model_inputs=share.model_inputs,
                                                           images=[images_of(row) for row in share.rows]),
                                   model_inputs=share.model_inputs)
        finally:
            self.generator.round_done()  # after the last turn: an engine may free its memory for training
        prompts = [row["prompt"] for row in share.rows]
        completion_ids, texts, completions = reward_inputs(self.tokenizer, rollouts, isinstance(prompts[0], list))
        return AgentSample(rollouts, prompts, completions, texts, {}, torch.zeros(3, dtype=torch.long))
