"""Per-token log-probabilities of completions (GRPO) and of sequences' own targets (SFT, DPO) under a causal LM.

Fast path: the model runs its own forward with the output layer's input taken and the layer cut to no position
(`models/forwards.py` output_layer_input), so it computes its body but no logits and keeps no layer's hidden states
but the last. The completion tokens that carry loss then go through the output layer in chunks
(`models/chunked.py`), never as a [N, C, V] tensor. The forward is the (possibly
DDP-wrapped) model's own, so gradient synchronisation is untouched. The path is used where the model passes its
one-time check (`models/chunked_check.py`); otherwise the model's whole logits are reduced a chunk of rows at a time
(`models/logits_path.py`). How the model is called (its keywords, positions, logits) is `models/forwards.py`.

Where the output layer's weight exists whole only inside the layer's own forward and backward (DeepSpeed ZeRO-3
keeps it in shards and gathers it around them), the chunked computation runs as the output layer's forward for that
one model call (`_computing_in`): it sees the whole weight, and its backward is gathered as the layer's own.

On the fast path, GRPO's rollouts may run packed into fewer rows (models/packing.py, in the layout the model keeps
apart: models/packed_layouts.py) and each distinct prompt once (models/prompt_sharing.py), where the model passes
those paths' one-time checks; prompt sharing's is kept here beside the forwards it checks.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Callable

import torch

from posttrain.models import fast_paths
from posttrain.models.chunked import chunked_token_logprobs
from posttrain.models.chunked_check import fast_path_available
from posttrain.models.forwards import (agree_within_rounding, completion_logits, final_hidden, in_eval_mode,
                                       mask_positions, output_layer, output_layer_input,
                                       output_layer_input_and_output, positions_from_mask, sequence_kwargs,
                                       whole_only_in_forward)
from posttrain.models.keywords import cache_kwarg, logits_to_keep_kwarg, missing_from_forward, returned_cache, unwrap
from posttrain.models.loading import CHECK_ERRORS, check_raised, checkpointing, fallback_said, keeps_float32
from posttrain.models.logits_path import completion_logprobs_from_logits, target_logprobs_from_logits
from posttrain.models.onednn import cpu_linears
from posttrain.models.packed_layouts import PADDED_ONLY, packed_layouts
from posttrain.models.packing import PackedRows, pack_rollouts
from posttrain.models.prefix_rows import at_sources, layout, model_mask, prefix_rows, prefix_rows_work, row_width
from posttrain.models.prompt_sharing import (ONE_ROW, UNSHARED, SharedPrompts, body_parameters, distinct_prompts,
                                             every_process_least, saves_enough)

# a prompt is shared only when that saves at least this many of the body's forward FLOPs: the second forward's fixed
# cost (masks, cache objects, hooks: milliseconds on a CPU) outweighs smaller savings, as on tiny models
MIN_SHARED_SAVING_FLOP = 1e9
# what a model loses when a fast path's one-time check fails or its forward cannot take what the path passes
SHARING_OFF = "its log-prob passes run each rollout's prompt, not each distinct prompt once"


@contextlib.contextmanager
def _computing_in(layer: torch.nn.Module, compute: Callable):
    """For one model call, the output layer's forward is `compute(h)` (h: the layer's input, the kept positions'
    final hidden states), a tuple of tensors that the model returns as its `logits`."""
    layer.forward = compute  # an instance attribute shadows the class's forward; hooks on the module still run
    try:
        yield
    finally:
        del layer.forward


def _with_cpu_linears(fn: Callable) -> Callable:
    """`fn(model, ...)` with the model's float32 CPU products through oneDNN (models/onednn.py)."""
    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        with cpu_linears(unwrap(model)) if fast_paths.enabled(model) else contextlib.nullcontext():
            return fn(model, *args, **kwargs)

    return run


@_with_cpu_linears
def token_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                   loss_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None, entropy_grad: bool = False,
                   packing: bool = True, share_prompts: bool = False, model_inputs: dict | None = None):
    """Log-probabilities of each completion token, with the logits divided by `temperature`.

    Args:
        prompt_ids, prompt_mask: [N, P] left-padded prompts and their mask.
        completion_ids, completion_mask: [N, C] right-padded completions and their mask.
        temperature: the sampling temperature; the policy being trained is softmax(logits / temperature).
        with_entropy: also return the per-token entropy (no gradient unless entropy_grad).
        loss_gradient: optional [N, C] log-probs -> [N, C] d loss / d log-probs, for a loss in which each token's
            term depends on its own log-prob only (it is called with other tokens' entries set to 0). On the fast
            path it lets the output layer's gradient be computed in the forward (see models/chunked.py).
        entropy_grad: return the entropy with its gradient (for an entropy bonus); implies with_entropy.
        packing: run the rollouts' real tokens packed into fewer, shorter rows where that saves positions and the
            model allows it (models/packing.py); False keeps the batch's own shape (a fixed pad_to_multiple_of).
        share_prompts: run each distinct prompt once and the completions against its keys and values, where that
            saves positions and the model allows it (models/prompt_sharing.py). Two forwards before one backward:
            for a model whose weights are whole on every process (one process, DDP, DeepSpeed ZeRO-1/2; a model
            wrapped across processes agrees with the others on sharing, a collective on every call), not sharded
            by FSDP or ZeRO-3.
        model_inputs: the rows' extra forward inputs, batched ({name: tensor}: Rollouts.forward_inputs, a
            vision-language model's pixel values). They run through the model's own forward on the padded rows,
            with the positions it derives itself, the chunked output layer after it where the model allows; packing
            and prompt sharing cannot carry them and are not taken (posttrain/model_inputs.py CANNOT_CARRY).
    Returns:
        (logps [N, C] float32, entropy [N, C] float32 or None). Padding positions hold 0 on the fast path
        and finite garbage otherwise; callers mask them.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    with_entropy = with_entropy or entropy_grad
    if model_inputs and fast_path_available(model):
        return _chunked_logprobs(model, input_ids, attention_mask, completion_ids, completion_mask, temperature,
                                 with_entropy, loss_gradient, entropy_grad, model_inputs)
    if model_inputs:
        return _logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature, with_entropy,
                                entropy_grad, model_inputs)
    if fast_path_available(model):
        # packed_layouts runs on every call, so its one-time check (forwards) is reached by every process alike
        layouts = packed_layouts(model) if packing else PADDED_ONLY
        packed = pack_rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, one_row=not layouts.rows) \
            if layouts.rows or layouts.one_row else None
        shared = _shared_prompts(model, prompt_ids, prompt_mask, completion_ids.size(1),
                                 input_ids.numel() if packed is None else packed.input_ids.numel()) \
            if share_prompts else None
        if shared is not None:
            return _at_completions(model, lambda rows: _through_shared(model, shared, completion_ids, completion_mask,
                                                                       rows),
                                   completion_ids, completion_mask, temperature, with_entropy, loss_gradient,
                                   entropy_grad)
        if packed is not None:
            return _packed_logprobs(model, packed, completion_ids.shape, temperature, with_entropy, loss_gradient,
                                    entropy_grad)
        return _chunked_logprobs(model, input_ids, attention_mask, completion_ids, completion_mask, temperature,
                                 with_entropy, loss_gradient, entropy_grad)
    return _logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature, with_entropy, entropy_grad)


def _row_predictor(loss_gradient, shape: torch.Size, positions: torch.Tensor):
    """A chunk-level gradient predictor (models/chunked.py) from a [N, C] -> [N, C] loss gradient: the chunk's
    rows are the [N, C] entries at the flat indices `positions` ([M]), in that order."""
    if loss_gradient is None:
        return None

    def predict(rows: slice, logps: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(shape, dtype=torch.float32, device=logps.device)
        full.view(-1)[positions[rows]] = logps
        grad = loss_gradient(full).reshape(-1)[positions[rows]]
        return torch.where(torch.isfinite(grad), grad, 0.0)  # a non-finite guess becomes 0: recomputed if wrong

    return predict


def _at_positions(values: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[M] values placed at flat indices `positions` of a zero [N, C] float32 tensor (differentiable)."""
    full = torch.zeros(shape.numel(), dtype=torch.float32, device=values.device)
    return full.index_copy(0, positions, values.float()).view(shape)


def through_output_layer(model, input_ids, attention_mask, position_ids, n_keep: int, compute: Callable,
                         boundaries=None, model_inputs: dict | None = None):
    """`compute(h)` on the final hidden states [B, n_keep, H] of the last `n_keep` positions (every position when
    n_keep is 0), from the model's own forward: as the output layer's forward where its weight is whole only there
    (see `_computing_in`), else on the hidden states of a forward that computes one position of logits. A packed
    row's `boundaries` go to the forward (models/packed_layouts.py), and so do the rows' `model_inputs` (a
    vision-language model's pixel values: the output layer sees only the hidden states)."""
    layer, extra = output_layer(model), model_inputs or {}
    if whole_only_in_forward(layer):
        with _computing_in(layer, compute):
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         **sequence_kwargs(model, position_ids, n_keep, boundaries), **extra).logits
    hidden = output_layer_input(model, layer, n_keep, input_ids=input_ids, attention_mask=attention_mask,
                                **sequence_kwargs(model, position_ids, n_keep, boundaries), **extra)
    return compute(hidden[:, -n_keep:])  # n_keep 0: every position (a model without logits_to_keep gives all)


def _chunked_logprobs(model, input_ids, attention_mask, completion_ids, completion_mask, temperature,
                      with_entropy, loss_gradient=None, entropy_grad=False, model_inputs: dict | None = None):
    n = completion_ids.size(1)
    # rows with extra inputs: the model derives its positions (a multimodal rotary embedding's are not 0, 1, 2, ...)
    position_ids = None if model_inputs else mask_positions(model, attention_mask)

    def run(rows):  # the model may keep more positions than asked (>= C + 1): C of them predict the C tokens
        return through_output_layer(model, input_ids, attention_mask, position_ids, n + 1,
                                     lambda hidden: rows(hidden[:, -n - 1:-1]), model_inputs=model_inputs)

    return _at_completions(model, run, completion_ids, completion_mask, temperature, with_entropy, loss_gradient,
                           entropy_grad)


def _at_completions(model, run: Callable, completion_ids, completion_mask, temperature, with_entropy, loss_gradient,
                    entropy_grad):
    """token_logprobs' [N, C] results, given `run(rows)`: `rows` (the chunked output layer at the real completion
    tokens) applied to the [N, C, H] final hidden states that predict the completion tokens."""
    layer = output_layer(model)
    mask = completion_mask.bool()
    positions = mask.reshape(-1).nonzero().squeeze(1)  # flat index of each real completion token, row-major
    predictor = _row_predictor(loss_gradient, completion_ids.shape, positions)

    def rows(hidden):
        return chunked_token_logprobs(hidden[mask], layer.weight, layer.bias, completion_ids[mask], temperature,
                                      with_entropy, predictor, entropy_grad, float32_products=keeps_float32(layer))

    logps, entropy = run(rows)
    full = _at_positions(logps, positions, completion_ids.shape)
    return full, (_at_positions(entropy, positions, completion_ids.shape) if with_entropy else None)


def _packed_logprobs(model, packed: PackedRows, shape: torch.Size, temperature, with_entropy, loss_gradient,
                     entropy_grad):
    """token_logprobs' results [N, C] from the packed rows of the same rollouts (models/packing.py)."""
    layer = output_layer(model)
    predictor = _row_predictor(loss_gradient, shape, packed.positions)

    def rows(hidden):  # [B', W, H]
        return chunked_token_logprobs(hidden[packed.source_mask], layer.weight, layer.bias, packed.targets,
                                      temperature, with_entropy, predictor, entropy_grad,
                                      float32_products=keeps_float32(layer))

    logps, entropy = through_output_layer(model, packed.input_ids, None, packed.position_ids, 0, rows,
                                          packed.boundaries)
    full = _at_positions(logps, packed.positions, shape)
    return full, (_at_positions(entropy, packed.positions, shape) if with_entropy else None)


def _shared_prompts(model, prompt_ids, prompt_mask, completion_width: int, positions_otherwise: int):
    """The rollouts' distinct prompts (models/prompt_sharing.py) with the layout they run in (`prefix_layout`), where
    running them once pays and the model allows it (for a model trained across processes: on every process, in a
    layout every one can run), else None."""
    min_saved = math.ceil(MIN_SHARED_SAVING_FLOP / (2 * max(body_parameters(unwrap(model)), 1)))
    shared = distinct_prompts(prompt_ids, prompt_mask, completion_width, positions_otherwise, min_saved)
    chosen = UNSHARED
    if shared is not None:  # the rows hold every prompt's rollouts in as many slots as the most copies of one
        width = row_width(shared.prompt_ids.size(1), shared.source, completion_width)
        pays = saves_enough(len(shared.prompt_ids) * width, positions_otherwise, min_saved)
        chosen = prefix_layout(model, width if pays else None)
    chosen = every_process_least(model, chosen)
    return None if chosen == UNSHARED else dataclasses.replace(shared, in_rows=chosen == ONE_ROW)


def prefix_layout(model, row_width: int | None) -> int:
    """How `model`'s log-prob passes run prefixes shared by several continuations, where a row per prefix would be
    `row_width` wide (None: rows would not pay): ONE_ROW where the model takes such rows (models/prefix_rows.py) and
    their attention pays (`row_width_limit`), else TWO_FORWARDS, the prefixes with a cache and the continuations
    against it, where the model reproduces its hidden states so (`prompt_sharing_works`; not under activation
    checkpointing, with which transformers turns the cache off in a training forward, nor DDP's static graph,
    recorded for one forward per backward), else UNSHARED. Not on the whole-logits path."""
    if not fast_path_available(model):
        return UNSHARED
    return layout(model, row_width, prefix_rows_work, _two_forwards_work)


def _two_forwards_work(model) -> bool:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.static_graph:
        return False
    return not checkpointing(unwrap(model)) and prompt_sharing_works(model)


def _through_shared(model, shared: SharedPrompts, completion_ids, completion_mask, compute: Callable):
    """`compute` on the [N, C, H] final hidden states that predict each completion token of [N, C] right-padded
    completions after their shared prompts: one forward of a row per prompt (shared.in_rows: models/prefix_rows.py),
    else `_shared_prompt_hidden`'s two."""
    if shared.in_rows:
        rows = prefix_rows(shared.prompt_ids, shared.prompt_mask, completion_ids, completion_mask, shared.source)
        return through_output_layer(model, rows.input_ids, model_mask(model, rows), rows.position_ids, 0,
                                    lambda hidden: compute(at_sources(rows, hidden)))
    return compute(_shared_prompt_hidden(model, shared, completion_ids, completion_mask))


def _shared_prompt_hidden(model, shared: SharedPrompts, completion_ids, completion_mask) -> torch.Tensor:
    """[N, C, H] final hidden states that predict each completion token: the distinct prompts' forward with a cache
    (its last position predicts the first token), the cache's rows selected for the N rollouts, then the completions'
    forward against it (its positions 0 .. C - 2 predict tokens 1 .. C - 1)."""
    layer, c = output_layer(model), completion_ids.size(1)
    prompt_hidden, prompts = output_layer_input_and_output(
        model, layer, 1, input_ids=shared.prompt_ids, attention_mask=shared.prompt_mask, use_cache=True,
        position_ids=positions_from_mask(shared.prompt_mask), **{logits_to_keep_kwarg(model): 1})
    cache = returned_cache(prompts)
    cache.batch_select_indices(shared.source)
    mask = torch.cat([shared.prompt_mask[shared.source], completion_mask.long()], dim=1)  # [N, Lp + C]
    completions = output_layer_input(model, layer, c, input_ids=completion_ids, attention_mask=mask, use_cache=True,
                                     position_ids=positions_from_mask(mask)[:, shared.prompt_ids.size(1):],
                                     **{cache_kwarg(model): cache, logits_to_keep_kwarg(model): c})
    last = prompt_hidden[:, -1][shared.source]  # [N, H]
    return torch.cat([last[:, None], completions[:, -c:][:, :-1]], dim=1)


def prompt_sharing_works(model) -> bool:
    """Whether the model gives the same hidden states to completions run against their prompt's selected cache as to
    the whole rollouts; decided once per model object and cached. The check (a shared and an unshared forward of
    two completions of one prompt) needs an output layer whole outside the model's forward (not ZeRO-3's or
    FSDP1's) and a forward that takes position ids, a cache and logits_to_keep under any of their names; a forward
    that does not is said once, naming what it lacks."""
    return fast_paths.decided(model, "shared_prompts", lambda: _decide_prompt_sharing(unwrap(model)))


def _decide_prompt_sharing(plain) -> bool:
    layer = output_layer(plain)
    if layer is None or whole_only_in_forward(layer):
        return False  # the whole-logits path (said where it is chosen), or sharded by design (docs/grpo.md)
    missing = missing_from_forward(plain, ("position_ids", "cache", "use_cache", "logits_to_keep"))
    return fallback_said(plain, SHARING_OFF, missing) if missing else _check_prompt_sharing(plain)


def _check_prompt_sharing(plain) -> bool:
    """Completions of 3 and 2 tokens of one 4-token prompt: shared against unshared hidden states, within
    agree_within_rounding's tolerance."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    ids = (torch.arange(3, 10, device=device) * 7919) % vocab  # [7]
    prompt, completions = ids[None, :4], torch.stack([ids[4:], ids[4:]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    shared = SharedPrompts(prompt, torch.ones_like(prompt), torch.zeros(2, dtype=torch.long, device=device))
    try:  # in the model's own precision, as the packing check
        with in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = _shared_prompt_hidden(plain, shared, completions, completion_mask)
            mask = torch.cat([torch.ones((2, 4), dtype=torch.long, device=device), completion_mask], dim=1)
            apart = final_hidden(plain, torch.cat([prompt.expand(2, 4), completions], dim=1), mask)[:, 3:-1]
        real = completion_mask.bool()
        return agree_within_rounding(plain, together[real].float(), apart[real].float())
    except CHECK_ERRORS as err:
        return check_raised(plain, SHARING_OFF, err)


def _logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature, with_entropy, entropy_grad=False,
                     model_inputs: dict | None = None):
    """token_logprobs' results [N, C] from the model's whole logits at the completion positions."""
    n = completion_ids.size(1)
    logits = completion_logits(model, input_ids, attention_mask, n + 1, model_inputs)[:, :-1]  # [N, C, V]
    return completion_logprobs_from_logits(logits, completion_ids, temperature, with_entropy, entropy_grad)


# ---------------------------------------------------------------------- sequences with their own targets (SFT, DPO)


@_with_cpu_linears
def next_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, source_mask: torch.Tensor, targets: torch.Tensor,
                        with_entropy: bool = False, with_top1: bool = False, predict_grad=None,
                        with_stats: bool = False, boundaries=None, model_inputs: dict | None = None,
                        prefixes=None):
    """Log-probabilities of the target tokens of right-padded or packed rows, through the output layer only at the
    positions that predict a target (never [B, T, V] logits on the fast path).

    Args:
        input_ids: [B, T] token ids.
        attention_mask: [B, T] (right padding), or None for a padding-free row [1, T], whose sequences are told
            apart by `position_ids` restarting at 0 and their `boundaries` (models/packed_layouts.py; sdpa and eager
            build a block-diagonal mask, flash attention and linear-attention kernels read the boundaries; it needs
            no cache and no mask, which is why both are left out). Only for a model that packs_one_row.
        position_ids: [B, T] or None (0, 1, 2, ... per row).
        source_mask: [B, T] bool, True at position t when token t + 1 is a target (its hidden state predicts it).
        targets: [M] the target token ids, in the row-major order of source_mask's True entries.
        with_entropy, with_top1: also return each target position's entropy / whether the target is the top token.
        predict_grad: (rows, logps) -> d loss / d logps, for the chunked output layer (models/chunked.py).
        with_stats: also return [M, 2] statistics of each target position: its mean logit over the vocabulary and
            log sum_v p(v)^2 (no gradient).
        boundaries: the padding-free row's Boundaries, or None.
        model_inputs: the rows' extra forward inputs, batched (SequenceBatch.model_inputs: a vision-language
            model's pixel values), for right-padded rows (position_ids None: the model derives its own); they go to
            the model's forward, the chunked output layer after it as for any rows.
        prefixes: the same right-padded pairs laid out with each pair's common prefix once (sequences/prefixes.py
            PrefixBatch, until="targets"), or None. Given, the body runs that layout (`_through_prefixes`: a row
            per pair in one forward where prefixes.in_rows, else the prefixes with a cache and the continuations
            against it) and the rows above are not run; only in a layout `prefix_layout` gives for the model (and,
            wrapped across processes, the same on every process).
    Returns:
        (logps [M] float32, entropy [M] or None, is_top1 [M] bool or None), and with `with_stats` the statistics.
    """
    if fast_path_available(model):
        layer = output_layer(model)

        def at_targets(hidden):  # [M, H] the final hidden states predicting the targets
            return chunked_token_logprobs(hidden, layer.weight, layer.bias, targets, 1.0, with_entropy, predict_grad,
                                          with_top1=True, with_stats=with_stats,
                                          float32_products=keeps_float32(layer))

        if prefixes is not None:
            out = _through_prefixes(model, prefixes, at_targets)
        else:
            out = through_output_layer(model, input_ids, attention_mask, position_ids, 0,
                                       lambda hidden: at_targets(hidden[source_mask]), boundaries, model_inputs)
        logps, entropy, top1 = out[:3]
        result = (logps, entropy if with_entropy else None, top1 if with_top1 else None)
        return result + (out[3],) if with_stats else result
    if prefixes is not None:
        raise ValueError("next_token_logprobs(prefixes=...) needs a model on the fast path (prefix_layout)")
    # the model post-processes its logits (or its output layer is wrapped): take them whole, as it computes them
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   **sequence_kwargs(model, position_ids, 0, boundaries), **(model_inputs or {})).logits[
        source_mask].float()  # [M, V]
    return target_logprobs_from_logits(logits, targets, with_entropy, with_top1, with_stats)


def _through_prefixes(model, prefixes, at_targets: Callable):
    """`at_targets` on the [M, H] final hidden states predicting the targets of pairs laid out with their common
    prefix once (sequences/prefixes.py), in the layout `prefixes.in_rows` says (`_through_shared`)."""
    shared = SharedPrompts(prefixes.prefix_ids, prefixes.prefix_mask, prefixes.source, prefixes.in_rows)
    return _through_shared(model, shared, prefixes.suffix_ids, prefixes.suffix_mask,
                           lambda hidden: at_targets(hidden[prefixes.suffix_targets]))
