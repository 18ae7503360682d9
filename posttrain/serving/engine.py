"""The engine behind `posttrain serve`: a transformers model sampled with posttrain's own decoder (the same sampler
and lean decoder as in-process generation), and weight updates that have an owner and a deadline and end with a
digest of what it holds.

    generate(prompts, n, params, seed, keys, model_inputs)
                                        each prompt repeated n times (prompt-major, as GRPO's groups), one batch;
                                        copy c of prompt i samples with row key keys[i] + c under the round `seed`
                                        (as TransformersGenerator.generate_seeded: the in-process generator gives
                                        those rows the same completions); a prompt's `model_inputs` row (its pixels)
                                        goes with each of its copies; refused (409) while an update is open and
                                        (503) while the weights are partial
    begin_update(version) -> update_id  opens an update owned by whoever holds the id; an open update with no call
                                        for `update_timeout` seconds is abandoned, and a new one may then start
    claim(update_id, version)           checks that a call belongs to the open update (before its body is read)
    touch(update_id)                    the owner is still sending (each received piece of a bucket)
    load(tensors, aliases, version, update_id)
                                        copies one bucket into the model: every name, shape and alias is checked
                                        before anything is copied
    finish_update(version, update_id)   closes it; returns the digest of the named tensors as the engine now holds
                                        them (in the dtype they were sent in)

An abandoned update that copied nothing leaves the previous version served. One that copied some buckets leaves the
model holding two versions mixed: the engine then holds no version (`version` None, `weights` "partial") and
refuses to generate until a complete update has rewritten every tensor the abandoned one wrote.
"""

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from posttrain import wire
from posttrain.generation.protocol import Rollouts, SamplingParams
from posttrain.model_inputs import ModelInputs
from posttrain.models.checkpoint_classes import is_vision_language

logger = logging.getLogger("posttrain.serve")

MAX_INT64 = (1 << 63) - 1


class EngineError(ValueError):
    """A request the engine cannot serve; the message says why (the server answers it with a 4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class OpenUpdate:
    """A weight update in progress: its version, its owner's id, when its owner last called, whether a bucket is
    being copied now, and the names it has written (with the dtype each was sent in)."""

    version: str
    update_id: str
    last_call: float
    loading: bool = False
    written: dict = field(default_factory=dict)  # name -> dtype it was sent in
    buckets: int = 0


class TransformersEngine:
    """Args:
        model: a causal LM (loaded, on its device, in eval mode).
        tokenizer: gives the pad and EOS ids.
        max_model_len: longest prompt + completion served (default: the model's max_position_embeddings).
        name: the model's name in /v1/models.
        update_timeout: seconds an open weight update may go without a call from its owner before it is
            abandoned (`posttrain serve --weight_update_timeout`).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, model, tokenizer, *, max_model_len: int | None = None, name: str = "model",
                 update_timeout: float = 120.0, clock=time.monotonic):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        text = model.config.get_text_config()  # a vision-language model's language model holds them
        limit = getattr(text, "max_position_embeddings", None)
        self.max_model_len = max_model_len or limit or 1 << 30
        self.vocab_size = int(text.vocab_size)
        self.version: str | None = "initial"  # None: no complete version is held (an abandoned update's leftovers)
        self.update: OpenUpdate | None = None
        self.stale: set[str] = set()  # tensors last written by an abandoned update
        self.update_timeout = update_timeout
        self._clock = clock
        self._lock = threading.Lock()  # update state is read on the event loop and changed on the engine thread
        self._state = dict(self.model.state_dict())
        self.fingerprint = wire.fingerprint(self._state.items())
        self.largest_tensor_elements = max((t.numel() for t in self._state.values()), default=0)

    @property
    def updating(self) -> str | None:
        """The version of the open update, or None."""
        return self.update.version if self.update is not None else None

    @property
    def weights(self) -> str:
        """"ready", "updating" (an update is open) or "partial" (an abandoned update left two versions mixed)."""
        with self._lock:
            self._expire()
        if self.update is not None:
            return "updating"
        return "partial" if self.stale else "ready"

    def info(self) -> dict:
        return {"engine": "transformers", "model": self.name, "fingerprint": self.fingerprint,
                "max_model_len": self.max_model_len, "logprobs_mode": "processed_logprobs",
                "weight_version": self.version, "weights": self.weights,
                "dtype": str(next(self.model.parameters()).dtype)}

    # ------------------------------------------------------------------ generation

    def check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Each prompt non-empty, within max_model_len with max_tokens, its ids in the vocabulary (400 otherwise)."""
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} is empty: send at least one token id.", 400)
            if len(prompt) + max_tokens > self.max_model_len:
                raise EngineError(f"prompt {i} has {len(prompt)} tokens, and with max_tokens={max_tokens} that "
                                  f"exceeds this server's max_model_len={self.max_model_len}: shorten it or lower "
                                  "max_tokens.", 400)
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise EngineError(f"prompt {i} holds a token id outside the vocabulary [0, {self.vocab_size}).", 400)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int,
                 keys: list[int] | None = None, model_inputs: ModelInputs | None = None) -> Rollouts:
        """`model_inputs`: one row per prompt (a vision-language model's pixels, as the trainer's processor made
        them), or None."""
        from posttrain.generation.transformers_backend import TransformersGenerator

        self.check_prompts(prompts, params.max_new_tokens)
        if model_inputs is not None:
            self.check_model_inputs(model_inputs, len(prompts))
        self._check_servable()
        generator = TransformersGenerator(self.model, self.tokenizer, params, shares_policy=True)
        keys = keys if keys is not None else [i * n for i in range(len(prompts))]
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        return generator.generate_seeded([prompts[i] for i in rows], seed,
                                         [key + c for key in keys for c in range(n)],
                                         model_inputs.select(rows) if model_inputs is not None else None)

    def check_model_inputs(self, model_inputs: ModelInputs, prompts: int) -> None:
        """One row per prompt, for a model that takes pixels (400 otherwise)."""
        if len(model_inputs) != prompts:
            raise EngineError(f"model_inputs holds {len(model_inputs)} rows for {prompts} prompts: send one per "
                              "prompt ({} for a prompt without any).", 400)
        if model_inputs.names and not is_vision_language(self.model):
            raise EngineError(f"model_inputs carries {', '.join(model_inputs.names)}, but this server's model "
                              f"({type(self.model).__name__}) is a text model: serve the vision-language "
                              "checkpoint being trained.", 400)

    def _check_servable(self) -> None:
        """409 while an update is open, 503 while an abandoned one's leftovers are in the model."""
        with self._lock:
            self._expire()
            if self.update is not None:
                raise EngineError(f"a weight update to version {self.update.version!r} is in progress: retry after it "
                                  f"finishes (an update whose sender stays silent for {self.update_timeout:g} s is "
                                  "abandoned).", 409)
            if self.stale:
                raise EngineError(f"the weights are partial: an abandoned update wrote {len(self.stale)} of the "
                                  "model's tensors and no complete update has replaced them yet: push a complete "
                                  "update (start_weight_update, every bucket, finish_weight_update).", 503)

    # ------------------------------------------------------------------ weight updates

    def _expire(self) -> None:
        """Abandon the open update when its owner has been silent for update_timeout (call with the lock held)."""
        update = self.update
        if update is None or update.loading or self._clock() - update.last_call <= self.update_timeout:
            return
        self._abandon(f"its sender was silent for more than {self.update_timeout:g} s")

    def _abandon(self, why: str) -> None:
        update, self.update = self.update, None
        self.stale |= set(update.written)
        if self.stale:
            self.version = None
            logger.warning("posttrain serve: the weight update to version %r was abandoned (%s) after %d bucket(s): "
                           "%d tensors hold its values, so generation is refused until a complete update arrives.",
                           update.version, why, update.buckets, len(update.written))
        else:
            logger.warning("posttrain serve: the weight update to version %r was abandoned (%s) before any bucket "
                           "was loaded: version %r is served again.", update.version, why, self.version)

    def begin_update(self, version: str) -> str:
        """Open an update to `version`; returns the id its later calls must carry. 409 while another is open."""
        with self._lock:
            self._expire()
            if self.update is not None:
                silent = self._clock() - self.update.last_call
                raise EngineError(f"a weight update to version {self.update.version!r} is already open (its last call "
                                  f"{silent:.0f} s ago): wait until it finishes, or until it has been silent for "
                                  f"{self.update_timeout:g} s (--weight_update_timeout), when a new one may take "
                                  "over.", 409)
            self.update = OpenUpdate(version, secrets.token_hex(16), self._clock())
            return self.update.update_id

    def claim(self, update_id: str | None, version: str) -> None:
        """Check that a call with `update_id` for `version` belongs to the open update (409 otherwise); counts as a
        call of its owner."""
        with self._lock:
            self._expire()
            self._owned(update_id, version)
            self.update.last_call = self._clock()

    def touch(self, update_id: str) -> None:
        """The owner of the open update is still sending: its deadline starts again."""
        with self._lock:
            if self.update is not None and hmac_equal(self.update.update_id, update_id):
                self.update.last_call = self._clock()

    def _owned(self, update_id: str | None, version: str) -> OpenUpdate:
        update = self.update
        if update is None:
            raise EngineError(f"no weight update is open (weights for version {version!r} arrived outside one, or "
                              "after it was abandoned): call start_weight_update first.", 409)
        if not update_id or not hmac_equal(update.update_id, update_id):
            raise EngineError("this call does not carry the id of the open weight update (X-Update-Id header, or "
                              "update_id field): send the update_id start_weight_update returned.", 409)
        if version != update.version:
            raise EngineError(f"weights for version {version!r} arrived in the update to version "
                              f"{update.version!r}: send the version start_weight_update opened.", 409)
        return update

    def load(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str], version: str,
             update_id: str | None = None) -> None:
        """Copy one bucket into the model after checking all of it: nothing is copied when any name, shape or alias
        is wrong."""
        with self._lock:
            self._expire()
            update = self._owned(update_id, version)
            self._check_bucket(tensors, aliases, update)
            update.loading = True
        try:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    self._state[name].copy_(tensor)
                    update.written[name] = tensor.dtype
                for alias, source in aliases.items():
                    if self._state[alias].data_ptr() != self._state[source].data_ptr():
                        self._state[alias].copy_(self._state[source])
                    update.written[alias] = update.written[source]
        finally:
            with self._lock:
                update.loading = False
                update.last_call = self._clock()
                update.buckets += 1

    def _check_bucket(self, tensors: dict[str, torch.Tensor], aliases: dict[str, str], update: OpenUpdate) -> None:
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
            if alias in tensors:
                raise EngineError(f"weight {alias!r} is both sent and listed as an alias of {source!r}: send it "
                                  "once.", 400)
            if source not in tensors and source not in update.written:
                raise EngineError(f"weight {alias!r} is an alias of {source!r}, which this update has not sent: "
                                  "send the source tensor in this bucket or an earlier one.", 400)
            if tuple(self._state[alias].shape) != tuple(self._state[source].shape):
                raise EngineError(f"weight {alias!r} has shape {tuple(self._state[alias].shape)} and its source "
                                  f"{source!r} {tuple(self._state[source].shape)}: they cannot be tied.", 400)

    def finish_update(self, version: str, update_id: str | None = None) -> str:
        """Close the update; the digest of every tensor it named, read back from the model in the sent dtype. 409
        (after closing it) when tensors an abandoned update wrote were not all written again."""
        with self._lock:
            self._expire()
            update = self._owned(update_id, version)
            update.loading = True  # reading back: not abandoned meanwhile
        try:
            digest = self._held_digest(update.written)
        finally:
            update.loading = False
        with self._lock:
            self.update = None
            self.stale -= set(update.written)
            self.version = None if self.stale else version
            left = sorted(self.stale)
        if left:
            raise EngineError(f"the update to version {version!r} did not rewrite {len(left)} tensors an abandoned "
                              f"update had written (e.g. {left[0]!r}), so the weights are still partial: push every "
                              "weight of the model.", 409)
        return digest

    def _held_digest(self, written: dict) -> str:
        """wire.combine over the named tensors as the model holds them, each read in the dtype it was sent in."""
        data: dict[tuple, bytes] = {}  # tied tensors (one memory) are read once
        digests = []
        for name, dtype in written.items():
            held = self._state[name]
            key = (wire.storage_key(held), dtype)
            if key not in data:
                data[key] = wire.data_digest(held.to(dtype))
            digests.append(wire.tensor_digest(name, dtype, held.shape, data[key]))
        return wire.combine(digests)

    def abort_update(self) -> None:
        """Abandon the open update now (as its deadline would)."""
        with self._lock:
            if self.update is not None:
                self._abandon("aborted")


def hmac_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two ids."""
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())
