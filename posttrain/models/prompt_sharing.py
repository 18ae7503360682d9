"""Each distinct prompt once in the log-prob passes: the prompts' keys and values computed once, every completion run
against its prompt's.

GRPO samples `num_generations` completions of each prompt, so a micro-batch of rollouts holds each prompt several
times, and the model's body runs over every copy. Shared, the distinct prompts ([P, Lp], left-padded as given) run
once, in one of two layouts (models/logprobs.py `prefix_layout` chooses):
  a row per prompt   the prompt, then each of its completions in a slot of its own, with a mask that keeps them apart
                     (models/prefix_rows.py): one forward over P x (Lp + K x C) positions, K the most copies of one
                     prompt;
  two forwards       the prompts with a cache, the cache's rows indexed out to the N rollouts (an index_select: a
                     gradient reaching a row's keys and values flows back into its prompt, summed over the copies as
                     it would be over G separate copies), then the completions ([N, C]) against it: P x Lp + N x C
                     positions.
Either instead of N x (Lp + C); attention reads the same keys as before.

Sharing is used when it removes at least MIN_SAVING of the positions that would run otherwise (the padded batch's, or
the packed rows' where packing applies) and enough of them to outweigh a second forward's fixed cost (models/logprobs.py
MIN_SHARED_SAVING_FLOP), when every prompt ends at its last column (left padding) and is not empty
(the prompt's last position predicts the first completion token), and when the model reproduces its unshared hidden
states by the layout, checked once per model (models/logprobs.py `prompt_sharing_works`, models/prefix_rows.py
`prefix_rows_work`).
"""

from dataclasses import dataclass

import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import output_layer
from posttrain.models.packing import MIN_SAVING

# how prefixes shared by several continuations run (models/logprobs.py `prefix_layout`, the reward model's scores),
# numbered so that the least any process training a model together with others takes is one every process can run
# (`every_process_least`)
UNSHARED, TWO_FORWARDS, ONE_ROW = 0, 1, 2


@dataclass
class SharedPrompts:
    prompt_ids: torch.Tensor  # [P, Lp] each distinct prompt once, left-padded as the rollouts' are
    prompt_mask: torch.Tensor  # [P, Lp]
    source: torch.Tensor  # [N] the index in [P] of each rollout's prompt
    in_rows: bool = False  # run as a row per prompt (models/prefix_rows.py), else as two forwards (the module's)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_width: int,
                     positions_otherwise: int, min_saved_positions: int = 0) -> SharedPrompts | None:
    """The distinct prompts of [N, Lp] left-padded prompts, or None when running them once (P * Lp + N *
    completion_width positions) would remove less than MIN_SAVING of `positions_otherwise` or fewer than
    `min_saved_positions` positions, or when a prompt is empty or right-padded."""
    n, width = prompt_ids.shape
    if n < 2 or width == 0 or not bool(prompt_mask[:, -1].all()):
        return None  # a prompt that does not end at its last column (or is empty): its last position is not real
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)  # padding ids may differ between copies of one prompt
    distinct, source = torch.unique(key, dim=0, return_inverse=True)
    if len(distinct) == n or not saves_enough(len(distinct) * width + n * completion_width, positions_otherwise,
                                              min_saved_positions):
        return None
    # the distinct keys are the prompts: -1 marks padding (its id, 0 here, is never attended to)
    return SharedPrompts(distinct.clamp(min=0), (distinct >= 0).to(prompt_mask.dtype), source)


def saves_enough(positions: int, positions_otherwise: int, min_saved_positions: int = 0) -> bool:
    """Whether a layout running `positions` instead of `positions_otherwise` removes at least MIN_SAVING of them and
    at least `min_saved_positions`."""
    saved = positions_otherwise - positions
    return saved >= MIN_SAVING * positions_otherwise and saved >= min_saved_positions


def body_parameters(plain) -> int:
    """Parameters of the model's body (all but the input embedding and the output layer), counted once per model: a
    position's forward through the body's products costs 2 FLOPs per parameter."""
    def count() -> int:
        edges = {id(p) for module in (plain.get_input_embeddings(), output_layer(plain)) if module is not None
                 for p in module.parameters()}
        return sum(p.numel() for p in plain.parameters() if id(p) not in edges)

    return fast_paths.remembered(plain, "body_parameters", count)


def every_process_least(model, local: int) -> int:
    """The least of `local` (this process's layout for a pass) over the processes training `model` together: a
    collective where the model is wrapped across processes (DDP; DeepSpeed's engine), else `local` itself. The layouts
    are numbered so that the least any process takes is one every process can run, and each process then runs as many
    forwards as the others: DDP broadcasts the model's buffers at every forward, and DeepSpeed's engine is kept in the
    same step alike."""
    group = _group_in_step(model)
    if group is None:
        return local
    value = torch.tensor([local], device=next(model.parameters()).device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(value.item())


def _group_in_step(model):
    """The process group of a model wrapped for training across processes (DDP's group; the default one for
    DeepSpeed's engine), else None."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() < 2:
        return None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.process_group
    return distributed.group.WORLD if getattr(model, "module", None) is not None else None
