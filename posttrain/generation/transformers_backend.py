"""In-process generation with a transformers model: left-padded batched sampling with a KV cache.

The decode loop is our own rather than `model.generate`, so that it returns each token's sampler
log-prob without keeping [steps, N, V] scores, samples without `torch.multinomial`, and stops as
soon as every row has ended.
"""

import copy
from dataclasses import fields
from typing import Iterable

import torch

from posttrain.errors import UserError
from posttrain.generation import lean_decoder
from posttrain.generation.graphed_step import GraphedSteps
from posttrain.generation.pixel_prompts import sample_with_pixels
from posttrain.generation.protocol import Rollouts, SamplingParams, left_pad
from posttrain.generation.sampling import (apply_repetition_penalty, filter_logits, row_streams, sample,
                                           stream_uniforms)
from posttrain.models.keywords import cache_kwarg, forward_accepts, logits_to_keep_kwarg, returned_cache, unwrap
from posttrain.models.forwards import positions_from_mask
from posttrain.models.loading import fallback_said
from posttrain.models import output_products


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion: the generation config's and the tokenizer's EOS."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def ended_at(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """[N] each row's width up to and including its first EOS ([N, C] tokens; C for a row without one)."""
    is_eos = torch.isin(tokens, eos)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), tokens.size(1) - 1)
    return first + 1


def draw_seed(rng: torch.Generator) -> int:
    """The seed of one generation round, drawn from a generator's own (checkpointed) RNG."""
    return int(torch.randint(0, 2 ** 31 - 1, (1,), generator=rng))


# rows that have finished leave the decode batch once they are at least 1/COMPACT_FRACTION of it: with 16 rows at
# once, with 256 rows in groups of 8 (each removal copies the KV cache)
COMPACT_FRACTION = 32
# at fixed shapes (cache_implementation="static") whether every row has ended is read every this many tokens, not
# every token: the host never waits on the device in between (a finished row decodes on, its tokens discarded)
STOP_CHECK_EVERY = 8


def generation_copy(policy):
    """A plain model of the policy's architecture and dtype for a generator that samples while the policy trains
    (async_generation): weights of its own, loaded from the policy's export at each sync (a LoRA policy's merged),
    so an optimizer step never lands mid-decode. Built from the config: a sharded policy's modules hold shards."""
    from transformers import AutoModelForCausalLM

    base = unwrap(policy)  # DDP's, compile's and peft's wrappers stripped
    first = next(base.parameters())
    model = AutoModelForCausalLM.from_config(base.config)
    model.generation_config = copy.deepcopy(base.generation_config)
    return model.to(dtype=first.dtype, device=first.device).eval().requires_grad_(False)


def can_select_rows(cache) -> bool:
    """Whether `cache` can keep a subset of its rows (batch_select_indices): the cache's method, and for a cache of
    layers every layer's, checked before any layer is changed (a hybrid's Mamba layers may lack it: NemotronH's
    LinearAttentionLayer raises AttributeError after the layers before it dropped their rows)."""
    if not callable(getattr(cache, "batch_select_indices", None)):
        return False
    layers = getattr(cache, "layers", None)
    return layers is None or all(callable(getattr(layer, "batch_select_indices", None)) for layer in layers)


class ModelStepper:
    """Prefill and one-token steps through the model's own forward and a transformers KV cache."""

    def __init__(self, model, prompt_mask: torch.Tensor, compute_dtype: torch.dtype | None = None):
        self.model = model
        self.compute_dtype = compute_dtype
        self.attention = prompt_mask.long()
        self.cache = None
        self.kwargs = {"use_cache": True}
        keep = logits_to_keep_kwarg(model)
        if keep is not None:
            self.kwargs[keep] = 1
        self.pass_positions = forward_accepts(model, "position_ids")
        self.cache_name = cache_kwarg(model)

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, P] ids and positions -> next-token logits [N, V] float32."""
        return self._forward(prompt_ids, positions)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N] ids, [N, 1] positions -> next-token logits [N, V] float32."""
        ones = torch.ones((token_ids.size(0), 1), dtype=self.attention.dtype, device=self.attention.device)
        self.attention = torch.cat([self.attention, ones], dim=1)
        return self._forward(token_ids.unsqueeze(1), positions)

    def keep_rows(self, rows: torch.Tensor) -> bool:
        """Keep only these rows ([n'] indices) of the batch; False when the cache cannot drop rows."""
        if not can_select_rows(self.cache):
            return False
        self.cache.batch_select_indices(rows)
        self.attention = self.attention[rows]
        return True

    def _forward(self, ids, positions):
        kwargs = dict(self.kwargs, **{self.cache_name: self.cache})
        if self.pass_positions:
            kwargs["position_ids"] = positions
        with torch.autocast(ids.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None):
            out = self.model(input_ids=ids, attention_mask=self.attention, **kwargs)
        self.cache = returned_cache(out)
        if self.cache is None:  # the next step would see its one new token only, and sample noise
            raise UserError(f"{type(unwrap(self.model)).__name__} returned no KV cache from a forward with "
                            f"use_cache=True (passed as `{self.cache_name}`), so it cannot be sampled from token by "
                            "token in process: generate with vLLM or posttrain serve (use_vllm: true), or use a model "
                            "whose forward returns its cache.")
        return out.logits[:, -1, :].float()


class TransformersGenerator:
    """Samples with a transformers causal LM in this process.

    Args:
        model: the model to sample from. When it is the policy itself, `sync_weights` has nothing to
            do; when it is a separate copy, `sync_weights` loads the policy's weights into it.
        tokenizer: gives the pad and EOS ids.
        params: sampling parameters.
        seed: seed of the RNG the rounds' seeds are drawn from (independent of the global RNG; the same on every
            process, so that row keys alone tell the processes' rows apart).
        shares_policy: whether `model` is the policy being trained (then there are no weights to copy).
        lean: decode with `LeanDecoder` where it reproduces the model; False always uses the model's forward.
        fixed_shape: decode at fixed shapes (TRL's cache_implementation="static"): the lean decoder's fixed-shape
            step, replayed from a CUDA graph on CUDA (generation/graphed_step.py), whether every row has ended read
            every STOP_CHECK_EVERY tokens, no row removal. The same tokens as the default decode.
        compute_dtype: a bf16 or fp16 run's dtype, for a device where the products take it (CUDA: the decode runs
            under that autocast and its KV cache is in that dtype, as TRL's generate runs under the run's autocast);
            None, or another device: the weights' dtype.
    """

    samples_during_push = pushes_in_background = False  # the policy's own weights: neither (protocol.py)

    def __init__(self, model, tokenizer, params: SamplingParams, *, seed: int = 0, shares_policy: bool = True,
                 lean: bool = True, fixed_shape: bool = False, compute_dtype: torch.dtype | None = None):
        self.model = model
        self.lean, self.fixed_shape = lean, fixed_shape
        self.compute_dtype = compute_dtype if self._device().type in output_products.LOW_PRECISION_DEVICES else None
        self.params = params
        self.shares_policy = shares_policy
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = list(params.eos_token_ids) or eos_token_ids(model, tokenizer)
        self.rng = torch.Generator().manual_seed(seed)  # draws one round seed per generate call
        self._round_seed: int | None = None  # the last round's (generate's new_round)

    def _device(self):
        return next(self.model.parameters()).device

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.shares_policy:
            return
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in state:
                    raise KeyError(f"Weight {name!r} has no counterpart in the generation model.")
                state[name].copy_(tensor)

    def round_done(self) -> None:
        pass  # its memory is the policy's: nothing to release

    def close(self) -> None:
        self.model = None

    def generate(self, prompts: list[list[int]], row_keys: list[int] | None = None,
                 new_round: bool = True, model_inputs=None, images=None) -> Rollouts:
        """Sample a completion for each prompt; see `Rollouts` for the shapes returned. `row_keys`: each row's
        index in the generation round (default 0..N-1), which with the round's seed fixes its random numbers;
        `new_round`, `model_inputs`: see the Generator protocol (`images`, the raw ones, are vLLM's: the pixels in
        model_inputs are what this engine's model takes)."""
        if new_round or self._round_seed is None:
            self._round_seed = draw_seed(self.rng)
        return self.generate_seeded(prompts, self._round_seed, row_keys, model_inputs)

    def generate_seeded(self, prompts: list[list[int]], seed: int, row_keys: list[int] | None = None,
                        model_inputs=None) -> Rollouts:
        """`generate` for the round seeded by `seed`: a row with the same prompt, key and seed samples the same
        completion from the same weights in any process, batch or server request."""
        keys = torch.tensor(row_keys if row_keys is not None else range(len(prompts)), dtype=torch.long)
        if keys.numel() != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {keys.numel()} row keys.")
        self._streams = row_streams(seed, keys).to(self._device())
        was_training = self.model.training
        switch = self._needs_eval_mode(model_inputs)
        if switch:
            self.model.eval()
        try:
            # inference mode skips autograd bookkeeping on every op (about 6% of a small model's decode step);
            # its tensors cannot enter autograd later, so the rollouts leave as ordinary copies
            with torch.inference_mode():
                rollouts = self._decode(prompts, model_inputs)
            return Rollouts(**{f.name: None if getattr(rollouts, f.name) is None else getattr(rollouts, f.name).clone()
                               for f in fields(rollouts)})
        finally:
            if switch:
                self.model.train(was_training)

    def _needs_eval_mode(self, model_inputs) -> bool:
        """Whether the decode must run in eval mode (dropout off): not where the lean decoder runs a model whose parts
        it calls never read `training`. transformers' train() and eval() re-kernelize the model (the `kernels`
        package's mode) at every switch: two switches took 3 ms of a 40 ms step on the demo's model."""
        with_pixels = model_inputs is not None and bool(model_inputs.names)
        return with_pixels or not (self.lean and lean_decoder.supports(self.model)
                                   and lean_decoder.reads_no_training_flag(self.model))

    def _decode(self, prompts: list[list[int]], model_inputs=None) -> Rollouts:
        """The decode loop. Rows that have produced EOS leave the batch (and the stepper's KV cache) once they are
        at least 1/COMPACT_FRACTION of it, so finished rows are not decoded on to the longest row's end; `active`
        maps each row of the shrinking batch to its row in the round. Prompts with pixels (`model_inputs`) are
        sampled by transformers' generate instead (generation/pixel_prompts.py)."""
        p, device = self.params, self._device()
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, device)
        if model_inputs is not None and model_inputs.names:  # prompts with pixels: through transformers' generate
            tokens, logprobs = sample_with_pixels(self.model, prompt_ids, prompt_mask,
                                                  model_inputs.batched(device, prompt_ids), p, self.eos_ids,
                                                  self.pad_id, self._streams)
            return self._rollouts(prompt_ids, prompt_mask, tokens, logprobs, torch.tensor(self.eos_ids, device=device))
        n = len(prompts)
        eos = torch.tensor(self.eos_ids, device=device)
        banned = torch.tensor(p.suppress_tokens, device=device) if p.suppress_tokens else None
        tokens = torch.full((n, p.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((n, p.max_new_tokens), dtype=torch.float32, device=device)
        active = torch.arange(n, device=device)
        streams = self._streams
        done = torch.zeros(n, dtype=torch.bool, device=device)  # of the active rows
        positions = positions_from_mask(prompt_mask)
        stepper = self._stepper(prompt_mask, p.max_new_tokens)
        fixed = getattr(stepper, "fixed_shape", False)
        logits, seen = stepper.prefill(prompt_ids, positions), None  # [n_active, V]
        self.decoded_row_steps = 0  # rows run through the model per token, summed (what compaction saves)
        for t in range(p.max_new_tokens):
            if t > 0:
                logits = stepper.step(tokens[active, t - 1], positions)
            self.decoded_row_steps += active.numel()
            if p.repetition_penalty != 1.0:
                if seen is None:
                    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, prompt_ids, prompt_mask)
                logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
            self._ban(logits, t, eos, banned)
            token, logp = sample(filter_logits(logits, p), stream_uniforms(streams, t),
                                 overwrite=True)  # logits are ours to overwrite
            token = token.masked_fill(done, self.pad_id)
            tokens[active, t] = token
            logprobs[active, t] = logp.masked_fill(done, 0.0)
            if seen is not None:
                seen.scatter_(1, token.unsqueeze(1), True)
            done = done | torch.isin(token, eos)
            positions = positions[:, -1:] + 1
            if fixed and (t + 1) % STOP_CHECK_EVERY:
                continue  # no host sync at fixed shapes but every STOP_CHECK_EVERY tokens
            finished = int(done.sum())
            if finished == done.numel():
                break
            if not fixed and finished >= max(1, done.numel() // COMPACT_FRACTION):  # fixed shapes keep their rows
                keep = (~done).nonzero().squeeze(1)
                if stepper.keep_rows(keep):
                    active, streams, positions, done = active[keep], streams[keep], positions[keep], done[keep]
                    seen = seen[keep] if seen is not None else None
        if fixed:  # decoded up to STOP_CHECK_EVERY - 1 tokens past the last row's end: the width it ended at
            t = int(torch.where(done, ended_at(tokens, eos), p.max_new_tokens).max()) - 1
        return self._rollouts(prompt_ids, prompt_mask, tokens[:, :t + 1], logprobs[:, :t + 1], eos)

    def _ban(self, logits: torch.Tensor, t: int, eos: torch.Tensor, banned: torch.Tensor | None) -> None:
        """-inf, in place in [n, V] logits of completion token t: EOS before min_new_tokens, the banned tokens
        (suppress_tokens, bad_words_ids), begin_suppress_tokens at the first token."""
        if t < self.params.min_new_tokens:
            logits.index_fill_(1, eos, float("-inf"))
        if banned is not None:
            logits.index_fill_(1, banned, float("-inf"))
        if t == 0 and self.params.begin_suppress_tokens:
            logits.index_fill_(1, torch.tensor(self.params.begin_suppress_tokens, device=logits.device), float("-inf"))

    def _stepper(self, prompt_mask: torch.Tensor, max_new_tokens: int):
        """The lean decoder when it reproduces this model (generation/lean_decoder.py), at fixed shapes and replayed
        from a CUDA graph on CUDA with `fixed_shape`; else the model's forward."""
        if self.lean and lean_decoder.supports(self.model):
            decoder = lean_decoder.LeanDecoder(self.model, prompt_mask, max_new_tokens, fixed_shape=self.fixed_shape,
                                               compute_dtype=self.compute_dtype)
            return GraphedSteps(decoder, self.model) if self.fixed_shape and prompt_mask.device.type == "cuda" else decoder
        if self.fixed_shape:
            fallback_said(unwrap(self.model), "cache_implementation='static' decodes through the model's own forward "
                          "at growing shapes, not at fixed ones", "posttrain's lean decoder does not run this model")
        return ModelStepper(self.model, prompt_mask, self.compute_dtype)

    def _rollouts(self, prompt_ids, prompt_mask, tokens, logprobs, eos) -> Rollouts:
        is_eos_token = torch.isin(tokens, eos)
        is_eos = is_eos_token.any(1)
        # mask: True up to and including the first EOS
        after_eos = (is_eos_token.long().cumsum(1) - is_eos_token.long()) > 0
        mask = ~after_eos
        tokens = tokens.masked_fill(~mask, self.pad_id)
        return Rollouts(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens,
                        completion_mask=mask, is_eos=is_eos, sampler_logprobs=logprobs.masked_fill(~mask, 0.0))
