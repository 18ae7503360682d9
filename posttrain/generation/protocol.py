"""The generation protocol: what the trainer and a backend agree on, with no backend in it.

    SamplingParams     how to sample (from a config's fields and generation_kwargs)
    Rollouts           sampled completions for a batch of prompts, and the engine answers they are built from
    Generator          what the trainer needs from a generation engine
    GenerationError    a generation server failed or could not be reached (generation/server.py raises it, and
                       vllm_transfer.py / vllm_colocate.py)
    left_pad           token lists to left-padded ids and mask

The backends (transformers_backend.py, server.py, vllm_colocate.py) import this module; it imports none of them.
`make_generator` (generation/factory.py) chooses the backend; the package re-exports both.
"""

from dataclasses import dataclass, fields, replace
from typing import Iterable, Protocol

import torch

from posttrain.configs import ConfigError
from posttrain.errors import UserError
from posttrain.model_inputs import ModelInputs


def _token_ids(key: str, value) -> tuple:
    ids = [value] if isinstance(value, int) else list(value or [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"generation_kwargs {key}={value!r} must be a token id or a list of token ids.")
    return tuple(ids)


def _bad_words(value) -> tuple:
    """transformers' bad_words_ids ([[id], ...]); only single-token entries can be honoured token by token."""
    entries = [list(e) for e in (value or [])]
    if any(len(e) != 1 for e in entries):
        raise ConfigError(f"generation_kwargs bad_words_ids={value!r} holds a sequence of several tokens, which the "
                          "sampler cannot ban token by token: list single tokens ([[id], ...]) or use "
                          "suppress_tokens.")
    return _token_ids("bad_words_ids", [e[0] for e in entries])


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature, filters, lengths, and the token lists of `generation_kwargs`.

    Attributes:
        eos_token_ids: tokens that end a completion, replacing the model's and tokenizer's EOS (generate's
            eos_token_id); empty: theirs.
        suppress_tokens: never sampled (generate's suppress_tokens, and single-token bad_words_ids).
        begin_suppress_tokens: never sampled as a completion's first token.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    eos_token_ids: tuple = ()
    suppress_tokens: tuple = ()
    begin_suppress_tokens: tuple = ()

    # generation_kwargs keys (transformers' generate and vLLM's SamplingParams names) the sampler honours, and how
    KWARGS = {"max_new_tokens": ("max_new_tokens", int), "max_tokens": ("max_new_tokens", int),
              "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
              "min_p": ("min_p", float), "repetition_penalty": ("repetition_penalty", float),
              "min_new_tokens": ("min_new_tokens", int), "min_tokens": ("min_new_tokens", int),
              "eos_token_id": ("eos_token_ids", lambda v: _token_ids("eos_token_id", v)),
              "stop_token_ids": ("eos_token_ids", lambda v: _token_ids("stop_token_ids", v)),
              "suppress_tokens": ("suppress_tokens", lambda v: _token_ids("suppress_tokens", v)),
              "bad_words_ids": ("suppress_tokens", _bad_words),
              "begin_suppress_tokens": ("begin_suppress_tokens",
                                        lambda v: _token_ids("begin_suppress_tokens", v))}
    # keys accepted because they cannot change what is sampled (caching, ids the trainer sets anyway)
    NO_EFFECT = ("use_cache", "cache_implementation", "renormalize_logits", "pad_token_id", "bos_token_id",
                 "disable_compile")

    # beam search's keys: accepted at their no-beam values (length_penalty only scores beams), else refused
    BEAM_KEYS = ("num_beams", "length_penalty", "early_stopping", "num_beam_groups")

    @staticmethod
    def _check_beam_key(key: str, value, kwargs: dict) -> None:
        beams = kwargs.get("num_beams", 1)
        if key == "num_beams" and value in (None, 1):
            return
        if key in ("length_penalty", "early_stopping") and beams in (None, 1):
            return  # as in transformers' generate: these only rank beams, and there is one
        raise ConfigError(
            f"generation_kwargs {key}={value!r} asks for beam search, which posttrain does not run: GRPO's gradient "
            "and its importance weights treat each completion as a sample of the policy, and a beam is the "
            "highest-scoring of several, not a sample (vLLM's SamplingParams has no beams either); remove "
            f"{'num_beams' if key == 'num_beams' else 'num_beams and ' + key} and raise num_generations for more "
            "completions per prompt.")

    def banning(self, tokens) -> "SamplingParams":
        """These params with `tokens` suppressed too (a vision-language model's image tokens)."""
        return replace(self, suppress_tokens=tuple(sorted({*self.suppress_tokens, *tokens}))) if tokens else self

    def check_no_bans(self, engine: str) -> None:
        """A ConfigError where generation_kwargs ban tokens (suppress_tokens, bad_words_ids, begin_suppress_tokens),
        which `engine`'s sampler has no parameter for: they would be dropped, and the samples would hold them."""
        if self.suppress_tokens or self.begin_suppress_tokens:
            raise ConfigError(f"generation_kwargs ban tokens (suppress_tokens, bad_words_ids or "
                              f"begin_suppress_tokens), which {engine}'s sampler has no parameter for: sample in "
                              "process or with posttrain serve (use_vllm=False, or vllm_mode='server' at posttrain "
                              "serve's URL), or remove them.")

    @classmethod
    def from_config(cls, config) -> "SamplingParams":
        """Build from a GRPOConfig; `generation_kwargs` override the named fields, other keys raise."""
        params = cls(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                     top_p=config.top_p, top_k=config.top_k or 0, min_p=config.min_p,
                     repetition_penalty=config.repetition_penalty)
        overrides = {}
        for key, value in (config.generation_kwargs or {}).items():
            if key == "do_sample":
                if not value:
                    raise ConfigError("generation_kwargs do_sample=False would make every completion of a group the "
                                      "same (greedy), leaving GRPO no advantage to learn from: remove it.")
                continue
            if key in cls.NO_EFFECT:
                continue
            if key in cls.BEAM_KEYS:
                cls._check_beam_key(key, value, config.generation_kwargs)
                continue
            if key not in cls.KWARGS:
                raise ConfigError(
                    f"generation_kwargs key {key!r} is not one the in-process sampler can honour: use "
                    f"{', '.join(sorted(cls.KWARGS))} (or {', '.join(cls.NO_EFFECT)}, which do not change the "
                    "samples).")
            name, convert = cls.KWARGS[key]
            try:
                overrides[name] = convert(value)
            except ConfigError:
                raise
            except (TypeError, ValueError):
                raise ConfigError(f"generation_kwargs {key}={value!r} is not a valid value.") from None
        params = replace(params, **overrides)
        for name, ok, bound in (("max_new_tokens", params.max_new_tokens > 0, "> 0"),
                                ("temperature", params.temperature > 0, "> 0"),
                                ("top_p", 0 < params.top_p <= 1, "in (0, 1]"), ("top_k", params.top_k >= 0, ">= 0"),
                                ("min_p", params.min_p is None or 0 <= params.min_p <= 1, "in [0, 1]"),
                                ("repetition_penalty", params.repetition_penalty > 0, "> 0"),
                                ("min_new_tokens", params.min_new_tokens >= 0, ">= 0")):
            if not ok:
                raise ConfigError(f"generation_kwargs gives {name}={getattr(params, name)!r}, which must be {bound}.")
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
            drawn from (temperature and filters applied); 0 on padding (and on a tool result's tokens).
        tool_mask: [N, C] bool, True on the tokens the model produced, False on the tokens a multi-turn rollout
            put between its turns (tool results, an environment's observations: TRL's tool_mask / env_mask); True
            on padding. None for single-turn rollouts, where every completion token is the model's.
        model_inputs: each row's extra forward inputs (posttrain/model_inputs.py: a vision-language model's pixel
            values), selected and checkpointed with the row; None for text-only rows.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_eos: torch.Tensor
    sampler_logprobs: torch.Tensor
    tool_mask: torch.Tensor | None = None
    model_inputs: ModelInputs | None = None

    @property
    def model_tokens(self) -> torch.Tensor:
        """[N, C] bool: the completion tokens the model produced (completion_mask less a tool result's tokens), the
        ones that carry loss and count in the completion lengths."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask & self.tool_mask

    def completion_lists(self) -> list[list[int]]:
        """[N] each row's completion tokens (where completion_mask is True) as a list, read from the host once (a
        boolean index and a read a row cost 9 us a row)."""
        mask, lengths = self.completion_mask, self.completion_mask.sum(1)
        if torch.equal(mask, torch.arange(mask.size(1), device=mask.device) < lengths.unsqueeze(1)):  # prefixes
            return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths.tolist())]
        return [[t for t, kept in zip(row, keep) if kept] for row, keep in zip(self.completion_ids.tolist(),
                                                                                 mask.tolist())]

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    @classmethod
    def from_lists(cls, rows: list[tuple[list[int], list[int], list[float]]], pad_id: int, eos_ids: list[int],
                   device, tool_masks: list[list[bool] | None] | None = None,
                   model_inputs: ModelInputs | None = None) -> "Rollouts":
        """Rollouts from an engine's answers: one (prompt ids, completion ids, sampler log-probs) per row; with
        `tool_masks`, each row's tool mask over its completion (None: every token the model's); `model_inputs`, the
        rows' extra forward inputs."""
        prompt_ids, prompt_mask = left_pad([p for p, _, _ in rows], pad_id, "cpu")
        width = max(1, max(len(c) for _, c, _ in rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        logps = torch.zeros((len(rows), width), dtype=torch.float32)
        for r, (_, tokens, token_logps) in enumerate(rows):
            ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[r, :len(tokens)] = True
            logps[r, :len(tokens)] = torch.tensor(token_logps, dtype=torch.float32)
        eos = set(eos_ids)
        is_eos = torch.tensor([bool(c) and c[-1] in eos for _, c, _ in rows], dtype=torch.bool)
        tool_mask = None
        if tool_masks is not None:
            tool_mask = torch.ones((len(rows), width), dtype=torch.bool)
            for r, row_mask in enumerate(tool_masks):
                if row_mask is not None:
                    tool_mask[r, :len(row_mask)] = torch.tensor(row_mask, dtype=torch.bool)
            tool_mask = tool_mask.to(device)
        return cls(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                   completion_ids=ids.to(device), completion_mask=mask.to(device), is_eos=is_eos.to(device),
                   sampler_logprobs=logps.to(device), tool_mask=tool_mask, model_inputs=model_inputs)

    def select(self, index: torch.Tensor) -> "Rollouts":
        """Rows `index`, with columns that are padding in every selected row trimmed away."""
        parts = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index] for f in fields(self)}
        keep_p = parts["prompt_mask"].any(0)
        first = int(keep_p.float().argmax()) if keep_p.any() else parts["prompt_mask"].size(1)
        last = int(parts["completion_mask"].any(0).nonzero().max()) + 1 if parts["completion_mask"].any() else 1
        for name in ("prompt_ids", "prompt_mask"):
            parts[name] = parts[name][:, first:]
        for name in ("completion_ids", "completion_mask", "sampler_logprobs", "tool_mask"):
            parts[name] = None if parts[name] is None else parts[name][:, :last]
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
                        sampler_logprobs=pad(self.sampler_logprobs, (0, right)),
                        tool_mask=None if self.tool_mask is None else pad(self.tool_mask, (0, right), value=True),
                        model_inputs=self.model_inputs)

    def forward_inputs(self) -> dict:
        """The rows' extra forward inputs batched for one forward on the rows' device ({} for text-only rows)."""
        if self.model_inputs is None:
            return {}
        return self.model_inputs.batched(self.prompt_ids.device, torch.cat([self.prompt_ids, self.completion_ids], 1))


class Generator(Protocol):
    """What the trainer needs from a generation engine, and what asynchronous generation asks of it:

        samples_during_push     whether it may sample while new weights are being pushed (a server does; an engine
                                in this process shares the weights and does not)
        pushes_in_background    whether a push may be sent from a copy of the weights while the trainer steps on
    """

    samples_during_push: bool
    pushes_in_background: bool

    def generate(self, prompts: list[list[int]], row_keys: list[int] | None = None,
                 new_round: bool = True, model_inputs: ModelInputs | None = None,
                 images: list[list] | None = None) -> Rollouts:
        """Sample one completion per prompt (prompts arrive already repeated G times). For a vision-language model's
        prompts (their ids hold the expanded image tokens): `model_inputs`, each row's pixels as the trainer's
        processor made them (what the in-process engine's model takes), and `images`, each row's images as given
        (what vLLM processes itself); the rollouts do not carry them back (the caller attaches them). Engines that
        take neither are refused images when the trainer is built. `row_keys`: each row's index
        in the generation round across processes (default 0..N-1); a row's completion depends on its prompt, its
        key, the round and the weights only, not on which process or request samples it. A round's seed is drawn
        (the same on every process) when `new_round`; False samples within the last round (a multi-turn rollout's
        later turns, whose keys tell them apart: posttrain/agents/loop.py), drawing nothing, so that processes
        whose rows take different numbers of turns keep drawing the same seeds."""

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights (plain parameter names) before the next `generate`."""

    def round_done(self) -> None:
        """The round's sampling is over, every turn of its multi-turn rollouts included: an engine that frees its
        memory for training (vLLM colocate's sleep mode) does it here, never between a round's turns."""

    def close(self) -> None:
        """Release the engine's resources."""


class GenerationError(UserError, RuntimeError):
    """The generation server failed or could not be reached; the message says which call and what to do."""


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ([N, P] ids, [N, P] bool mask)."""
    prompts = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    width = max(len(p) for p in prompts)
    # built as lists and made tensors once: a row at a time cost 1 ms a round of 64 rows (a tenth of a tiny model's
    # decode)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long).view(len(prompts), width)
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts],
                        dtype=torch.bool).view(len(prompts), width)
    return ids.to(device), mask.to(device)
