"""Dynamic sampling (DAPO): a generation batch made only of prompt groups whose rewards differ.

A group whose G completions all get the same reward has advantage 0 and teaches the policy nothing (beyond a KL or
entropy term). With `dynamic_sampling`, the trainer scores a generation round as usual, drops such groups (or the
groups a user's `dynamic_sampling_filter` rejects), and draws further rounds from the prompt stream until the kept
groups fill the configured batch (B prompts x G completions) before any optimizer step, so the batch size and the
loss normaliser never change. The surplus of the last round is dropped. A batch takes at most
`dynamic_sampling_max_rounds` rounds; past it the run stops with one sentence.

A user's filter is called on one group at a time, `dynamic_sampling_filter(rewards)` with the group's [G, F] rewards,
and returns whether to keep it: a bool (Python's or numpy's, or a one-element bool tensor such as `rewards.std() > 0`).
Its signature is checked when the trainer is built; a filter that raises or returns anything else stops the run with
one sentence naming it and the group (its own traceback kept as the cause).

Which groups are kept is decided on the gathered rewards (the same on every process), and the kept rows are gathered
and shared out again in order: several processes train on exactly the batch one process would.

    keep = groups_to_keep(rewards, weights, G, user_filter)     [B] bool over a round's groups
    rows = kept_rows(round, keep, first_row, gather)            every process's kept rows, in the round's order
    assemble(rows, n_needed, process, processes, ...)           this process's share of the first n_needed rows
"""

import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from posttrain.configs import ConfigError
from posttrain.errors import UserFunctionError, described, detail_of, function_name, signature_mismatch
from posttrain.grpo.advantages import nanstd, weighted_sum
from posttrain.grpo.completions import RewardLogs
from posttrain.model_inputs import ModelInputs
from posttrain.sequences.images import images_of
from posttrain.timeouts import waiting_on

DEFAULT_MAX_ROUNDS = 10


@dataclass
class ScoredRound:
    """Generation rounds' completions on this process and how every process's scored.

    Attributes:
        rows: this process's dataset rows, one per completion (the prompt repeated G times).
        texts: this process's completion texts.
        rollouts: this process's completions.
        rewards: [B*G, F] every process's rewards, gathered in row order (a skipped group's are NaN).
        logs: what the reward functions logged on this process (log_metric, log_extra).
        extra: the log_extra columns over every process's completions (with log_completions only).
        skipped: groups skipped for a non-finite reward (on_bad_reward=skip), else None.
        tool_counts: [3] the rows this process generated, their tool calls and failed calls (with tools), else None.
        images: this process's rows' images with tools (the prompt's, then the tools'); None: each row's prompt's
            (the completions log's, with log_multimodal).
    """

    rows: list[dict]
    texts: list[str]
    rollouts: Any
    rewards: torch.Tensor
    logs: RewardLogs
    extra: dict = field(default_factory=dict)
    skipped: int | None = None
    tool_counts: torch.Tensor | None = None
    images: list | None = None

    def row_images(self) -> list[list]:
        """Each row's images: `images`, else its prompt's."""
        return self.images if self.images is not None else [images_of(row) for row in self.rows]


@dataclass(frozen=True)
class KeptRow:
    """One kept completion, as plain values that travel between processes."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    row: dict
    text: str
    reward: list[float]
    extra: dict
    tool_mask: list[bool] | None = None  # a multi-turn rollout's: False on its tool results' tokens
    model_inputs: dict | None = None  # the row's extra forward inputs (posttrain/model_inputs.py), on the CPU
    images: list | None = None  # with tools: its images, the prompt's then the tools' (ScoredRound.images)


def resolve_filter(spec) -> Callable | None:
    """The user's group filter: a callable, a dotted path `module.function`, or None (keep groups whose rewards
    differ); its signature checked (check_filter)."""
    if spec is None or callable(spec):
        return check_filter(spec)
    from posttrain.rewards import import_dotted

    fn = import_dotted(spec, "dynamic_sampling_filter") if isinstance(spec, str) else None
    if not callable(fn):
        raise ConfigError(f"dynamic_sampling_filter={spec!r} is not an importable function: give a dotted path "
                          "module.function (importable from where you launch), taking a group's [G, F] rewards and "
                          "returning whether to keep it.")
    return check_filter(fn)


def check_filter(fn: Callable | None) -> Callable | None:
    """`fn`, once its signature is known to take one group's rewards: `fn(rewards)` (a signature that cannot be read,
    as some builtins', is taken as it is)."""
    problem = None if fn is None else signature_mismatch(fn, torch.zeros(0))
    if problem is not None:
        raise ConfigError(f"dynamic_sampling_filter {described(fn)} cannot be called as dynamic sampling calls it, "
                          f"with one group's [num_generations, reward functions] rewards tensor ({problem}): make it "
                          "take that tensor alone and return whether to keep the group.")
    return fn


def groups_to_keep(rewards: torch.Tensor, weights: torch.Tensor, G: int, user_filter: Callable | None = None
                   ) -> torch.Tensor:
    """[B] bool: the groups of `rewards` [B*G, F] to train on. By default a group whose weighted rewards are not all
    equal (a group with a NaN total, skipped for a bad reward or with no applicable function, is dropped); with
    `user_filter`, whatever it returns for the group's [G, F] rewards."""
    groups = rewards.view(-1, G, rewards.size(1))
    if user_filter is not None:
        return torch.tensor([_kept(user_filter, group, i) for i, group in enumerate(groups)], dtype=torch.bool)
    total = weighted_sum(rewards, weights).view(-1, G)
    std = nanstd(total, dim=1)
    return ~torch.isnan(total).any(1) & torch.isfinite(std) & ~torch.isclose(std, torch.zeros_like(std))


def _as_bool(value) -> bool | None:
    """A filter's answer as a bool: Python's or numpy's bool, or a one-element bool tensor or array; else None."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        return bool(value)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype == np.bool_:
        return bool(value)
    return None


def _kept(user_filter: Callable, group: torch.Tensor, index: int) -> bool:
    """Whether `user_filter` keeps the round's group `index`, whose [G, F] rewards are `group`."""
    try:
        with waiting_on(f"dynamic_sampling_filter {function_name(user_filter)!r}"):  # an interrupt stops it
            out = user_filter(group.clone())
    except Exception as err:  # noqa: BLE001 - the user's own exception: its traceback is kept as the cause
        name, rewards = repr(function_name(user_filter)), reprlib.repr(group.tolist())
        raise UserFunctionError(f"dynamic_sampling_filter {name} raised {type(err).__name__} on group {index} of the "
                                f"round (rewards {rewards}){detail_of(err)}; fix the function.") from err
    keep = _as_bool(out)
    if keep is None:
        name = repr(function_name(user_filter))
        what = (f"a {out.dtype} tensor {list(out.shape)}" if isinstance(out, torch.Tensor) else
                "None" if out is None else f"{reprlib.repr(out)} ({type(out).__name__})")
        raise UserFunctionError(f"dynamic_sampling_filter {name} returned {what} for group {index} of the round: "
                                "return True to keep the group or False to drop it (a bool, or a one-element bool "
                                "tensor such as rewards.std() > 0).")
    return keep


def kept_rows(scored: ScoredRound, keep: torch.Tensor, first_row: int, G: int, gather_object) -> list[KeptRow]:
    """Every process's rows whose group is kept, in the round's row order (a collective: `gather_object` joins the
    processes' lists in process order). `first_row`: the global index of this process's first row."""
    r = scored.rollouts
    mine = []
    for j in range(len(scored.rows)):
        index = first_row + j
        if not keep[index // G]:
            continue
        prompt, completion = r.prompt_mask[j].bool(), r.completion_mask[j].bool()
        mine.append(KeptRow(r.prompt_ids[j][prompt].tolist(), r.completion_ids[j][completion].tolist(),
                            r.sampler_logprobs[j][completion].tolist(), scored.rows[j], scored.texts[j],
                            scored.rewards[index].tolist(),
                            {c: values[index] for c, values in scored.extra.items()},
                            None if r.tool_mask is None else r.tool_mask[j][completion].tolist(),
                            None if r.model_inputs is None else
                            {name: value.cpu() for name, value in r.model_inputs.rows[j].items()},
                            None if scored.images is None else scored.images[j]))
    return gather_object(mine)


def assemble(rows: list[KeptRow], needed: int, process: int, processes: int, logs: RewardLogs, skipped: int | None,
             pad_id: int, eos_ids: list[int], device, tool_counts: torch.Tensor | None = None) -> ScoredRound:
    """The batch of the first `needed` kept rows, this process holding its contiguous share (as a round's rows are
    shared out); `tool_counts`: what every round this process generated called (ScoredRound.tool_counts)."""
    from posttrain.generation import Rollouts

    batch = rows[:needed]
    n = needed // processes
    mine = batch[process * n:(process + 1) * n]
    tool_masks = [r.tool_mask for r in mine] if any(r.tool_mask is not None for r in batch) else None
    inputs = ModelInputs.from_rows([r.model_inputs for r in mine]) \
        if any(r.model_inputs is not None for r in batch) else None
    rollouts = Rollouts.from_lists([(r.prompt_ids, r.completion_ids, r.sampler_logprobs) for r in mine], pad_id,
                                   eos_ids, device, tool_masks, inputs)
    columns = sorted({c for r in batch for c in r.extra})
    images = [r.images if r.images is not None else images_of(r.row) for r in mine] \
        if any(r.images is not None for r in batch) else None
    return ScoredRound(rows=[r.row for r in mine], texts=[r.text for r in mine], rollouts=rollouts,
                       rewards=torch.tensor([r.reward for r in batch], dtype=torch.float32), logs=logs,
                       extra={c: [r.extra.get(c) for r in batch] for c in columns}, skipped=skipped,
                       tool_counts=tool_counts, images=images)


def merge_logs(into: RewardLogs, logs: RewardLogs) -> None:
    """A round's log_metric values added to the batch's (its log_extra columns travel with the kept rows)."""
    for name, values in logs.metrics.items():
        into.metrics[name].extend(values)
