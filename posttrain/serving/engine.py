"""The engine behind `posttrain serve`: a transformers model sampled with posttrain's own decoder (the same sampler
and lean decoder as in-process generation), and weight updates that end with a digest of what it holds.

    generate(prompts, n, params, seed, keys)
                                        each prompt repeated n times (prompt-major, as GRPO's groups), one batch;
                                        copy c of prompt i samples with row key keys[i] + c under the round `seed`
                                        (as TransformersGenerator.generate_seeded: the in-process generator gives
                                        those rows the same completions)
    begin_update(version)               opens an update; generation waits until it is finished
    load(tensors, aliases)              copies one bucket into the model (names checked, shapes and dtypes too)
    finish_update(version, names)       closes it; returns the digest of the named tensors as the engine now holds
                                        them (in the dtype they were sent in)
"""

import torch

from posttrain import wire
from posttrain.generation.protocol import Rollouts, SamplingParams


class EngineError(ValueError):
    """A request the engine cannot serve; the message says why (the server answers it with a 4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class TransformersEngine:
    """Args:
        model: a causal LM (loaded, on its device, in eval mode).
        tokenizer: gives the pad and EOS ids.
        max_model_len: longest prompt + completion served (default: the model's max_position_embeddings).
        name: the model's name in /v1/models.
    """

    def __init__(self, model, tokenizer, max_model_len: int | None = None, name: str = "model"):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = max_model_len or limit or 1 << 30
        self.version = "initial"  # calls arrive one at a time (app.py runs them on one thread)
        self.updating: str | None = None  # the version of an open update
        self._state = dict(self.model.state_dict())
        self.fingerprint = wire.fingerprint(self._state.items())

    def info(self) -> dict:
        return {"engine": "transformers", "model": self.name, "fingerprint": self.fingerprint,
                "max_model_len": self.max_model_len, "logprobs_mode": "processed_logprobs",
                "weight_version": self.version, "dtype": str(next(self.model.parameters()).dtype)}

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int,
                 keys: list[int] | None = None) -> Rollouts:
        from posttrain.generation.transformers_backend import TransformersGenerator

        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} is empty: send at least one token id.", 400)
            if len(prompt) + params.max_new_tokens > self.max_model_len:
                raise EngineError(f"prompt {i} has {len(prompt)} tokens, and with max_tokens="
                                  f"{params.max_new_tokens} that exceeds this server's max_model_len="
                                  f"{self.max_model_len}: shorten it or lower max_tokens.", 400)
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise EngineError(f"prompt {i} holds a token id outside the vocabulary [0, {vocab}).", 400)
        if self.updating is not None:
            raise EngineError(f"a weight update to version {self.updating!r} is in progress: retry after it "
                              "finishes.", 409)
        generator = TransformersGenerator(self.model, self.tokenizer, params, shares_policy=True)
        keys = keys if keys is not None else [i * n for i in range(len(prompts))]
        return generator.generate_seeded([p for p in prompts for _ in range(n)], seed,
                                         [key + c for key in keys for c in range(n)])

    # ------------------------------------------------------------------ weight updates

    def begin_update(self, version: str) -> None:
        self.updating = version
        self._sent_dtypes: dict[str, str] = {}

    def load(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str], version: str) -> None:
        if self.updating is None or version != self.updating:
            raise EngineError(f"weights for version {version!r} arrived outside an update to it: call "
                              "start_weight_update first.", 409)
        for name, tensor in tensors.items():
            target = self._state.get(name)
            if target is None:
                raise EngineError(f"weight {name!r} is not a tensor of the served model: the trainer's model "
                                  "differs from the one this server loaded.", 400)
            if tuple(target.shape) != tuple(tensor.shape):
                raise EngineError(f"weight {name!r} has shape {tuple(tensor.shape)}, the served model's "
                                  f"{tuple(target.shape)}: the trainer's model differs from the served one.", 400)
        for alias, source in aliases.items():
            if alias not in self._state:
                raise EngineError(f"weight {alias!r} (tied to {source!r}) is not in the served model.", 400)
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._state[name].copy_(tensor)
                self._sent_dtypes[name] = tensor.dtype
            for alias, source in aliases.items():
                if self._state[alias].data_ptr() != self._state[source].data_ptr():
                    self._state[alias].copy_(self._state[source])
                self._sent_dtypes[alias] = tensors[source].dtype if source in tensors else self._sent_dtypes.get(source)

    def finish_update(self, version: str) -> str:
        """Close the update; the digest of every tensor it named, read back from the model in the sent dtype."""
        if self.updating != version:
            raise EngineError(f"no update to version {version!r} is open.", 409)
        data: dict[tuple, bytes] = {}  # tied tensors (one memory) are read once
        digests = []
        for name, dtype in self._sent_dtypes.items():
            held = self._state[name]
            key = (wire.storage_key(held), dtype)
            if key not in data:
                data[key] = wire.data_digest(held.to(dtype))
            digests.append(wire.tensor_digest(name, dtype, held.shape, data[key]))
        digest = wire.combine(digests)
        self.version, self.updating = version, None
        return digest

    def abort_update(self) -> None:
        self.updating = None
