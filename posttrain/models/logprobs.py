"""Per-token log-probabilities of completions under a causal LM.

Fast path: the model runs with `output_hidden_states=True` and `logits_to_keep=1`, so it computes its
body but (almost) no logits. The completion tokens that carry loss then go through the output layer
in chunks (`models/chunked.py`), never as a [N, C, V] tensor. The forward is the (possibly
DDP-wrapped) model's own, so gradient synchronisation is untouched. The path is used when the output
layer is a plain `nn.Linear` and, checked once per model, when its output equals the model's own logits
(which rules out models that post-process logits, e.g. soft-capping). Otherwise the logits path below
is used.

Where the output layer's weight exists whole only inside the layer's own forward and backward (DeepSpeed ZeRO-3
keeps it in shards and gathers it around them), the chunked computation runs as the output layer's forward for that
one model call (`_computing_in`): it sees the whole weight, and its backward is gathered as the layer's own.

The model is asked for logits at the completion positions only. Whether it can be asked depends
on the transformers version and the model class: recent ones take `logits_to_keep`, older ones
`num_logits_to_keep`, some neither. The keyword is chosen from the forward signature, and the
returned logits are checked against what was asked (some models accept the keyword and ignore
it, as Qwen2 did on transformers 4.48), slicing when more came back.
"""

import contextlib
import functools
import math
from typing import Callable

import torch

from posttrain.models import fast_paths
from posttrain.models.chunked import chunked_token_logprobs
from posttrain.models.keywords import (cache_kwarg, forward_accepts, logits_to_keep_kwarg, missing_from_forward,
                                       returned_cache, unwrap)
from posttrain.models.loading import (CHECK_ERRORS, check_raised, checkpointing, fallback_said, is_fully_shard_unit,
                                      is_plain_linear, raised)
from posttrain.models.onednn import cpu_linears
from posttrain.models.packing import PackedRows, pack_rollouts
from posttrain.models.prompt_sharing import SharedPrompts, distinct_prompts

CHUNK_ELEMENTS = 1 << 25  # logits turned into log-probs at a time (128 MiB of float32), bounding temporaries
# a prompt is shared only when that saves at least this many of the body's forward FLOPs: the second forward's fixed
# cost (masks, cache objects, hooks: milliseconds on a CPU) outweighs smaller savings, as on tiny models
MIN_SHARED_SAVING_FLOP = 1e9
# what a model loses when a fast path's one-time check fails or its forward cannot take what the path passes
PACKING_OFF = "its log-prob passes run padded rows, not packed ones"
SHARING_OFF = "its log-prob passes run each rollout's prompt, not each distinct prompt once"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token. [N, L] -> [N, L]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _sequence_kwargs(model, position_ids, n_keep: int) -> dict:
    """Keyword arguments for a no-cache forward that returns the last `n_keep` positions' logits (0: every
    position), with these position ids (None: the model's own)."""
    kwargs = {}
    keep = logits_to_keep_kwarg(model)
    if keep is not None:
        kwargs[keep] = n_keep
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if forward_accepts(model, "use_cache"):
        kwargs["use_cache"] = False  # a cache would also hide packed sequences' boundaries from sdpa and eager
    return kwargs


def _mask_positions(model, attention_mask) -> torch.Tensor | None:
    """Position ids of left-padded rows, when the model's forward takes them."""
    return positions_from_mask(attention_mask) if forward_accepts(model, "position_ids") else None


def _forward_kwargs(model, attention_mask, n_keep: int) -> dict:
    """_sequence_kwargs for left-padded rows: position ids from the mask."""
    return _sequence_kwargs(model, _mask_positions(model, attention_mask), n_keep)


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Logits of the last `n_keep` positions.

    Args:
        model: a causal LM (possibly wrapped by DDP or PEFT).
        input_ids: [N, L] token ids, left-padded prompt followed by the completion.
        attention_mask: [N, L], 1 for real tokens.
        n_keep: positions to return, counted from the end.
    Returns:
        [N, n_keep, V] logits.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   **_forward_kwargs(model, attention_mask, n_keep)).logits
    if logits.size(1) < n_keep:
        keep = logits_to_keep_kwarg(model)
        raise RuntimeError(f"{type(unwrap(model)).__name__} returned logits for {logits.size(1)} positions when "
                           f"{n_keep} were asked for with {keep}: its forward does not honour that keyword.")
    return logits[:, -n_keep:]


def whole_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, T, V] logits of every position of right-padded (or, with `position_ids` and no mask, packed) rows, as the
    model computes them: only for a user's compute_metrics, the training and eval passes never build them."""
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 **_sequence_kwargs(model, position_ids, 0)).logits


def output_layer(model) -> torch.nn.Linear | None:
    """The model's output projection if it is a plain Linear (not LoRA-wrapped or custom)."""
    get = getattr(unwrap(model), "get_output_embeddings", None)
    layer = get() if get is not None else None
    return layer if is_plain_linear(layer) else None


def final_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """[N, L, H] input of the output layer, from the model's own forward with one position of logits."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                **_forward_kwargs(model, attention_mask, 1))
    return out.hidden_states[-1]


def fast_path_available(model) -> bool:
    """Whether the chunked path reproduces this model's logits; decided once per model object and cached (on the
    first call, a forward of `model`: under sharding a collective, which every process reaches alike). Where it does
    not, a warning says why: the logits path holds [tokens, vocabulary] logits at once."""
    return fast_paths.decided(model, "chunked_output_layer", lambda: _decide_fast_path(model))


def _decide_fast_path(model) -> bool:
    plain = unwrap(model)
    layer = output_layer(plain)
    try:
        if layer is not None and _whole_in_model_forward(layer):  # FSDP1, FSDP2: gathered by the model's forward
            works = _check_in_forward_path(model, layer)
        else:  # ZeRO-3's hooks gather the weights of the plain module's parts
            works = _check_fast_path(plain)
        reason = None if works else _why_not_chunked(plain)
    except CHECK_ERRORS as err:  # no hidden states, or not the shapes we expect: the logits path
        works, reason = False, f"its one-time check raised {raised(err)}"
    if not works:
        fallback_said(plain, "log-probs come from the model's whole logits ([tokens, vocabulary] at once, as in "
                             "TRL), not from its output layer in chunks", reason)
    return works


def _why_not_chunked(plain) -> str:
    head = plain.get_output_embeddings() if hasattr(plain, "get_output_embeddings") else None
    if output_layer(plain) is None:
        return (f"its output layer is {type(head).__name__}, not a plain Linear (a LoRA adapter on it, or a custom "
                "head)")
    missing = missing_from_forward(plain, ("logits_to_keep",))
    return missing or "its logits are not its output layer's output (it changes them, as soft-capping does)"


def _check_in_forward_path(model, layer) -> bool:
    """Whether the model returns its output layer's output as its logits, unchanged (the chunked path computed as
    that layer's forward then gives the model's log-probs). One forward through `model`, FSDP1's root wrapper,
    which gathers the weights outside the decoder layers."""
    plain = unwrap(model)
    if logits_to_keep_kwarg(plain) is None:
        return False
    seen = []
    hook = layer.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    ids = (torch.arange(1, 9) % layer.out_features).unsqueeze(0).to(next(plain.parameters()).device)
    try:
        with _in_eval_mode(plain), torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           **_forward_kwargs(plain, torch.ones_like(ids), 4)).logits
        return len(seen) == 1 and seen[0].shape == logits.shape and bool(torch.equal(seen[0], logits))
    finally:
        hook.remove()


def _check_fast_path(plain) -> bool:
    layer = output_layer(plain)
    if layer is None or logits_to_keep_kwarg(plain) is None:
        return False
    ids = (torch.arange(1, 9, device=layer.weight.device) % layer.out_features).unsqueeze(0)
    mask = torch.ones_like(ids)
    with _in_eval_mode(plain), torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask, **_forward_kwargs(plain, mask, 4)).logits[:, -4:]
        hidden = final_hidden(plain, ids, mask)[:, -4:]
        return bool(torch.allclose(layer(hidden).float(), logits.float(), atol=1e-5, rtol=1e-4))


@contextlib.contextmanager
def _in_eval_mode(plain):
    """The model in eval mode for the block (dropout would make two forwards of a check differ), then as it was."""
    was_training = plain.training
    plain.eval()
    try:
        yield
    finally:
        plain.train(was_training)


WHOLE_ONLY_IN_FORWARD = "_posttrain_whole_only_in_forward"  # set on an output layer by training/sharding.py


def whole_only_in_forward(layer: torch.nn.Module) -> bool:
    """Whether the layer's weight is whole only inside the model's forward and backward: DeepSpeed ZeRO-3
    partitions it and gathers it around the layer's own; FSDP1 gathers it around its root wrapper's (marked so);
    FSDP2, where the layer is a unit of its own (as accelerate makes it), around its group's."""
    return hasattr(layer.weight, "ds_tensor") or _whole_in_model_forward(layer)


def _whole_in_model_forward(layer: torch.nn.Module) -> bool:
    """Whether the chunked output layer must run inside the model's forward, and its check through the model: FSDP1
    gathers the layer's weight only around its root wrapper's forward (the layer is marked so); FSDP2 gathers a
    unit's weights around its group's forward and, unless told otherwise, reshards them after it."""
    return getattr(layer, WHOLE_ONLY_IN_FORWARD, False) or is_fully_shard_unit(layer)


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
                   packing: bool = True, share_prompts: bool = False):
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
    Returns:
        (logps [N, C] float32, entropy [N, C] float32 or None). Padding positions hold 0 on the fast path
        and finite garbage otherwise; callers mask them.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    with_entropy = with_entropy or entropy_grad
    if fast_path_available(model):
        # packing_works runs on every call, so its one-time check (a forward) is reached by every process alike
        packed = pack_rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask) \
            if packing_works(model) and packing else None
        shared = _shared_prompts(model, prompt_ids, prompt_mask, completion_ids.size(1),
                                 input_ids.numel() if packed is None else packed.input_ids.numel()) \
            if share_prompts else None
        if shared is not None:
            return _at_completions(model, lambda rows: rows(_shared_prompt_hidden(model, shared, completion_ids,
                                                                                   completion_mask)),
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


def _through_output_layer(model, input_ids, attention_mask, position_ids, n_keep: int, compute: Callable):
    """`compute(h)` on the final hidden states [B, n_keep, H] of the last `n_keep` positions (every position when
    n_keep is 0), from the model's own forward: as the output layer's forward where its weight is whole only there
    (see `_computing_in`), else on the hidden states of a forward that computes one position of logits."""
    layer = output_layer(model)
    if whole_only_in_forward(layer):
        with _computing_in(layer, compute):
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         **_sequence_kwargs(model, position_ids, n_keep)).logits
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                   **_sequence_kwargs(model, position_ids, 1)).hidden_states[-1]
    return compute(hidden[:, -n_keep:])  # n_keep 0: every position


def _chunked_logprobs(model, input_ids, attention_mask, completion_ids, completion_mask, temperature,
                      with_entropy, loss_gradient=None, entropy_grad=False):
    n = completion_ids.size(1)
    position_ids = _mask_positions(model, attention_mask)

    def run(rows):  # the model may keep more positions than asked (>= C + 1): C of them predict the C tokens
        return _through_output_layer(model, input_ids, attention_mask, position_ids, n + 1,
                                     lambda hidden: rows(hidden[:, -n - 1:-1]))

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
                                      with_entropy, predictor, entropy_grad)

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
                                      temperature, with_entropy, predictor, entropy_grad)

    logps, entropy = _through_output_layer(model, packed.input_ids, None, packed.position_ids, 0, rows)
    full = _at_positions(logps, packed.positions, shape)
    return full, (_at_positions(entropy, packed.positions, shape) if with_entropy else None)


def packing_works(model) -> bool:
    """Whether the model attends within each sequence of a packed row (position ids restarting at 0, no attention
    mask); decided once per model object and cached. The check (two forwards: a packed row of two sequences, and
    the same sequences as a padded batch) runs on every process alike, on the first call."""
    return fast_paths.decided(model, "packed_rows", lambda: _decide_packing(model))


def _decide_packing(model) -> bool:
    plain = unwrap(model)
    layer = output_layer(plain)
    # FSDP1 gathers the weights only around its root wrapper's forward, FSDP2 around its units' (the root a PEFT
    # model's, when it wraps one): the check goes through the model as given
    runner = model if layer is not None and _whole_in_model_forward(layer) else plain
    missing = missing_from_forward(plain, ("position_ids",))
    return fallback_said(plain, PACKING_OFF, missing) if missing else _check_packing(runner, plain)


def _check_packing(runner, plain) -> bool:
    """Hidden states of sequences of 3 and 5 tokens, packed into one row against the same two as a right-padded
    batch, within a tolerance (relative to the largest value; 1e-4 in float32, 3e-2 in a 16-bit dtype) that the
    model's own rounding meets and a sequence seeing the other's tokens misses."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    ids = (torch.arange(3, 11, device=device) * 7919) % vocab  # [8]
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], device=device)
    padded = torch.zeros((2, 5), dtype=torch.long, device=device)
    padded[0, :3], padded[1] = ids[:3], ids[3:]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], device=device)
    try:  # in the model's own precision: the check is about attention, not about an autocast around the call
        with _in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = runner(input_ids=ids[None], output_hidden_states=True,
                              **_sequence_kwargs(plain, packed_positions, 1)).hidden_states[-1][0].float()
            apart = runner(input_ids=padded, attention_mask=mask, output_hidden_states=True,
                           **_sequence_kwargs(plain, torch.arange(5, device=device).expand(2, 5), 1)
                           ).hidden_states[-1].float()
        return _agree(plain, together, torch.cat([apart[0, :3], apart[1]]))
    except CHECK_ERRORS as err:
        return check_raised(plain, PACKING_OFF, err)


def _shared_prompts(model, prompt_ids, prompt_mask, completion_width: int, positions_otherwise: int):
    """The rollouts' distinct prompts (models/prompt_sharing.py) when running them once pays and the model allows it
    (for a model trained across processes: on every process), else None."""
    plain = unwrap(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.static_graph:
        return None  # a static graph is recorded for one forward per backward (the same on every process)
    shared = None
    # transformers turns the cache off in a checkpointed module's training forward
    if not checkpointing(plain) and prompt_sharing_works(model):
        min_saved = MIN_SHARED_SAVING_FLOP / (2 * max(_body_parameters(plain), 1))
        shared = distinct_prompts(prompt_ids, prompt_mask, completion_width, positions_otherwise,
                                  math.ceil(min_saved))
    group = _group_in_step(model)
    return shared if group is None or _on_every_process(model, group, shared is not None) else None


def _group_in_step(model):
    """The process group of a model wrapped for training across processes (DDP's group; the default one for
    DeepSpeed's engine), else None. Its processes share prompts all or none: DDP broadcasts the model's buffers at
    every forward, so each must run as many forwards as the others (two where the prompts are shared, one where
    not); DeepSpeed's engine is kept in the same step alike."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() < 2:
        return None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.process_group
    return distributed.group.WORLD if getattr(model, "module", None) is not None else None


def _on_every_process(model, group, local: bool) -> bool:
    """Whether `local` holds on every process of `group` (a collective)."""
    flag = torch.tensor([int(local)], device=next(model.parameters()).device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _body_parameters(plain) -> int:
    """Parameters of the model's body (all but the input embedding and the output layer), counted once per model: a
    position's forward through the body's products costs 2 FLOPs per parameter."""
    def count() -> int:
        edges = {id(p) for module in (plain.get_input_embeddings(), output_layer(plain)) if module is not None
                 for p in module.parameters()}
        return sum(p.numel() for p in plain.parameters() if id(p) not in edges)

    return fast_paths.remembered(plain, "body_parameters", count)


def _shared_prompt_hidden(model, shared: SharedPrompts, completion_ids, completion_mask) -> torch.Tensor:
    """[N, C, H] final hidden states that predict each completion token: the distinct prompts' forward with a cache
    (its last position predicts the first token), the cache's rows selected for the N rollouts, then the completions'
    forward against it (its positions 0 .. C - 2 predict tokens 1 .. C - 1)."""
    kwargs = {"use_cache": True, "output_hidden_states": True, logits_to_keep_kwarg(model): 1}
    prompts = model(input_ids=shared.prompt_ids, attention_mask=shared.prompt_mask,
                    position_ids=positions_from_mask(shared.prompt_mask), **kwargs)
    cache = returned_cache(prompts)
    cache.batch_select_indices(shared.source)
    mask = torch.cat([shared.prompt_mask[shared.source], completion_mask.long()], dim=1)  # [N, Lp + C]
    completions = model(input_ids=completion_ids, attention_mask=mask, **{cache_kwarg(model): cache},
                        position_ids=positions_from_mask(mask)[:, shared.prompt_ids.size(1):], **kwargs)
    last = prompts.hidden_states[-1][:, -1][shared.source]  # [N, H]
    return torch.cat([last[:, None], completions.hidden_states[-1][:, :-1]], dim=1)


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
    `_agree`'s tolerance."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    ids = (torch.arange(3, 10, device=device) * 7919) % vocab  # [7]
    prompt, completions = ids[None, :4], torch.stack([ids[4:], ids[4:]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    shared = SharedPrompts(prompt, torch.ones_like(prompt), torch.zeros(2, dtype=torch.long, device=device))
    try:  # in the model's own precision, as the packing check
        with _in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = _shared_prompt_hidden(plain, shared, completions, completion_mask)
            mask = torch.cat([torch.ones((2, 4), dtype=torch.long, device=device), completion_mask], dim=1)
            apart = final_hidden(plain, torch.cat([prompt.expand(2, 4), completions], dim=1), mask)[:, 3:-1]
        real = completion_mask.bool()
        return _agree(plain, together[real].float(), apart[real].float())
    except CHECK_ERRORS as err:
        return check_raised(plain, SHARING_OFF, err)


def _agree(plain, together: torch.Tensor, apart: torch.Tensor) -> bool:
    """Whether two computations of the same hidden states agree within what the model's own rounding allows: 1e-4
    in float32, 3e-2 in a 16-bit dtype, relative to the largest value; a position that sees other tokens misses."""
    precise = plain.get_input_embeddings().weight.dtype == torch.float32
    tolerance = (1e-4 if precise else 3e-2) * max(1.0, float(apart.abs().max()))
    return bool((together - apart).abs().max() <= tolerance)


def _logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature, with_entropy, entropy_grad=False):
    n = completion_ids.size(1)
    logits = completion_logits(model, input_ids, attention_mask, n + 1)[:, :-1]  # [N, C, V]
    # No full-size copy unless needed: float32 at temperature 1 is used as it comes back.
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    flat = logits.reshape(-1, logits.size(-1))  # [N*C, V]
    ids = completion_ids.reshape(-1)
    step = max(1, CHUNK_ELEMENTS // flat.size(1))
    logps, entropies = [], []
    for start in range(0, flat.size(0), step):
        rows = flat[start:start + step]  # [k, V]
        lse = rows.logsumexp(-1)
        logps.append(rows.gather(-1, ids[start:start + step, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(lse - (rows.softmax(-1) * rows).sum(-1))
    shape = completion_ids.shape
    return torch.cat(logps).view(shape), (torch.cat(entropies).view(shape) if with_entropy else None)


# ---------------------------------------------------------------------- sequences with their own targets (SFT, DPO)


@_with_cpu_linears
def next_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, source_mask: torch.Tensor, targets: torch.Tensor,
                        with_entropy: bool = False, with_top1: bool = False, predict_grad=None,
                        with_stats: bool = False):
    """Log-probabilities of the target tokens of right-padded or packed rows, through the output layer only at the
    positions that predict a target (never [B, T, V] logits on the fast path).

    Args:
        input_ids: [B, T] token ids.
        attention_mask: [B, T] (right padding), or None for padding-free rows, whose sequences are told apart by
            `position_ids` restarting at 0 (sdpa and eager then build a block-diagonal mask; it needs no cache and
            no mask, which is why both are left out).
        position_ids: [B, T] or None (0, 1, 2, ... per row).
        source_mask: [B, T] bool, True at position t when token t + 1 is a target (its hidden state predicts it).
        targets: [M] the target token ids, in the row-major order of source_mask's True entries.
        with_entropy, with_top1: also return each target position's entropy / whether the target is the top token.
        predict_grad: (rows, logps) -> d loss / d logps, for the chunked output layer (models/chunked.py).
        with_stats: also return [M, 2] statistics of each target position: its mean logit over the vocabulary and
            log sum_v p(v)^2 (no gradient).
    Returns:
        (logps [M] float32, entropy [M] or None, is_top1 [M] bool or None), and with `with_stats` the statistics.
    """
    if fast_path_available(model):
        layer = output_layer(model)

        def rows(hidden):  # [B, T, H] the final hidden states
            return chunked_token_logprobs(hidden[source_mask], layer.weight, layer.bias, targets, 1.0, with_entropy,
                                          predict_grad, with_top1=True, with_stats=with_stats)

        out = _through_output_layer(model, input_ids, attention_mask, position_ids, 0, rows)
        logps, entropy, top1 = out[:3]
        result = (logps, entropy if with_entropy else None, top1 if with_top1 else None)
        return result + (out[3],) if with_stats else result
    # the model post-processes its logits (or its output layer is wrapped): take them whole, as it computes them
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   **_sequence_kwargs(model, position_ids, 0)).logits[source_mask].float()  # [M, V]
    step = max(1, CHUNK_ELEMENTS // logits.size(1))
    logps, entropies, tops, stats = [], [], [], []
    for start in range(0, logits.size(0), step):
        rows, ids = logits[start:start + step], targets[start:start + step]
        lse = rows.logsumexp(-1)
        chosen = rows.gather(-1, ids[:, None]).squeeze(-1)
        logps.append(chosen - lse)
        with torch.no_grad():
            if with_entropy:
                entropies.append(lse - (rows.softmax(-1) * rows).sum(-1))
            tops.append(chosen >= rows.amax(-1))
            if with_stats:
                stats.append(torch.stack([rows.mean(-1), (2 * rows).logsumexp(-1) - 2 * lse], -1))
    logps = torch.cat(logps)
    result = (logps, torch.cat(entropies) if with_entropy else None, torch.cat(tops) if with_top1 else None)
    if with_stats:
        return result + ((torch.cat(stats) if stats else logps.new_zeros((0, 2))),)
    return result
