"""Generation: the `Generator` protocol, its outputs, and the backends behind it.

A backend turns tokenised prompts into sampled completions. The trainer sees only this protocol;
which engine runs underneath (transformers in-process here; vLLM and a server later) is chosen at
setup by `make_generator`.
"""

from dataclasses import dataclass, fields, replace
from typing import Iterable, Protocol

import torch

from posttrain.configs import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature, filters, lengths. `extra` holds validated `generation_kwargs`."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0

    # generation_kwargs keys that map onto these fields; anything else is rejected.
    KWARG_ALIASES = {"max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens", "temperature": "temperature",
                     "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_new_tokens",
                     "min_tokens": "min_new_tokens"}

    @classmethod
    def from_config(cls, config) -> "SamplingParams":
        """Build from a GRPOConfig; `generation_kwargs` override the named fields, unknown keys raise."""
        params = cls(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                     top_p=config.top_p, top_k=config.top_k or 0, min_p=config.min_p,
                     repetition_penalty=config.repetition_penalty)
        overrides = {}
        for key, value in (config.generation_kwargs or {}).items():
            if key == "do_sample" and value:
                continue  # we always sample
            if key not in cls.KWARG_ALIASES:
                raise ConfigError(
                    f"generation_kwargs key {key!r} is not supported by the transformers generator: use one of "
                    f"{', '.join(sorted(cls.KWARG_ALIASES))} (or the matching config field).")
            overrides[cls.KWARG_ALIASES[key]] = value
        params = replace(params, **overrides)
        if params.min_new_tokens > params.max_new_tokens:
            raise ConfigError(f"min_new_tokens={params.min_new_tokens} exceeds max_completion_length="
                             f"{params.max_new_tokens}: lower it or raise max_completion_length.")
        return params


@dataclass(frozen=True)
class Rollouts:
    """Sampled completions for a batch of prompts. N rows, P prompt tokens, C completion tokens.

    Attributes:
        prompt_ids: [N, P] left-padded with the pad token.
        prompt_mask: [N, P] bool, True on real prompt tokens.
        completion_ids: [N, C] right-padded; includes the EOS token when one was sampled.
        completion_mask: [N, C] bool, True up to and including EOS.
        is_eos: [N] bool, whether the completion ended with EOS (False: cut at max length).
        sampler_logprobs: [N, C] float32, log-prob of each sampled token under the distribution it was
            drawn from (temperature and filters applied); 0 on padding.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_eos: torch.Tensor
    sampler_logprobs: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    def select(self, index: torch.Tensor) -> "Rollouts":
        """Rows `index`, with columns that are padding in every selected row trimmed away."""
        parts = {f.name: getattr(self, f.name)[index] for f in fields(self)}
        keep_p = parts["prompt_mask"].any(0)
        first = int(keep_p.float().argmax()) if keep_p.any() else parts["prompt_mask"].size(1)
        last = int(parts["completion_mask"].any(0).nonzero().max()) + 1 if parts["completion_mask"].any() else 1
        for name in ("prompt_ids", "prompt_mask"):
            parts[name] = parts[name][:, first:]
        for name in ("completion_ids", "completion_mask", "sampler_logprobs"):
            parts[name] = parts[name][:, :last]
        return Rollouts(**parts)

    def padded(self, multiple: int | None) -> "Rollouts":
        """The same rows with the prompt width (on the left) and the completion width (on the right) padded to a
        multiple of `multiple`; padding is masked out. None or 1 returns self."""
        if not multiple or multiple == 1:
            return self
        left = -self.prompt_ids.size(1) % multiple
        right = -self.completion_ids.size(1) % multiple
        if not left and not right:
            return self
        pad = torch.nn.functional.pad
        return Rollouts(prompt_ids=pad(self.prompt_ids, (left, 0)), prompt_mask=pad(self.prompt_mask, (left, 0)),
                        completion_ids=pad(self.completion_ids, (0, right)),
                        completion_mask=pad(self.completion_mask, (0, right)), is_eos=self.is_eos,
                        sampler_logprobs=pad(self.sampler_logprobs, (0, right)))


class Generator(Protocol):
    """What the trainer needs from a generation engine."""

    def generate(self, prompts: list[list[int]]) -> Rollouts:
        """Sample one completion per prompt (prompts arrive already repeated G times)."""

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights (plain parameter names) before the next `generate`."""

    def close(self) -> None:
        """Release the engine's resources."""


def make_generator(config, policy, tokenizer, seed: int = 0) -> Generator:
    """The generation backend for `config`: the in-process transformers one, sampling from `policy` itself."""
    from posttrain.generation.transformers_backend import TransformersGenerator

    return TransformersGenerator(policy, tokenizer, SamplingParams.from_config(config), seed=seed)
