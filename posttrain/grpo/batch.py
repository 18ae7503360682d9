"""The unit the optimizer consumes: rollouts with their advantages and reference log-probs (GRPO's), or with their
loss mask alone (distillation's)."""

from dataclasses import dataclass, replace
from typing import Callable

import torch

from posttrain.generation import Rollouts
from posttrain.model_inputs import ModelInputs


# a micro-batch runs as no more passes than rerun its distinct prompts in at most 1/8 more positions than one pass
PROMPT_RERUN_SHARE = 8


@dataclass(frozen=True)
class TrainingBatch:
    """N scored completions. C = completion width.

    Attributes:
        rollouts: the sampled completions.
        advantages: [N] float32, or None for a round that has none (distillation's).
        loss_mask: [N, C] bool, tokens that carry loss (the model's completion tokens, Rollouts.model_tokens, minus
            truncated completions when mask_truncated_completions is on).
        old_logps: [N, C] log-probs of the sampling policy, or None when every micro-step is on-policy.
        ref_logps: [N, C] reference-model log-probs, or None when beta = 0.
        sampling_ratio: [N, C] importance weight of each token for the engine's sampling distribution differing
            from the trainer's (grpo/sampler_correction.py; 1 on padding), or None when not corrected.
    """

    rollouts: Rollouts
    advantages: torch.Tensor | None
    loss_mask: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampling_ratio: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rollouts)

    def select(self, index: torch.Tensor) -> "TrainingBatch":
        """Rows `index`, trimmed to the widest completion among them."""
        rollouts = self.rollouts.select(index)
        width = rollouts.completion_ids.size(1)

        def take(x):
            return None if x is None else x[index][:, :width]

        advantages = None if self.advantages is None else self.advantages[index]
        return TrainingBatch(rollouts, advantages, take(self.loss_mask), take(self.old_logps),
                             take(self.ref_logps), take(self.sampling_ratio))

    def rows_with_gradient(self) -> "TrainingBatch":
        """The rows whose advantage is not 0 (the others' gradient is exactly 0); at least one row, so every process
        still runs a backward and DDP's gradient synchronisation stays in step."""
        keep = (self.advantages != 0).nonzero().squeeze(1).cpu()
        if len(keep) == len(self):
            return self
        return self.select(keep if len(keep) else torch.zeros(1, dtype=torch.long))

    def padded(self, multiple: int | None) -> "TrainingBatch":
        """Prompt and completion widths padded to a multiple of `multiple` (see Rollouts.padded)."""
        rollouts = self.rollouts.padded(multiple)
        right = rollouts.completion_ids.size(1) - self.rollouts.completion_ids.size(1)
        if rollouts is self.rollouts:
            return self

        def pad(x, value=0.0):
            return None if x is None else torch.nn.functional.pad(x, (0, right), value=value)

        return TrainingBatch(rollouts, self.advantages, pad(self.loss_mask), pad(self.old_logps), pad(self.ref_logps),
                             pad(self.sampling_ratio, 1.0))

    def pass_count(self, max_completion_tokens: int) -> int:
        """How many passes of whole rows keep each pass's completion tokens (rows x completion width, padding
        included) within `max_completion_tokens`: 1 when the micro-batch fits, at most `most_passes`."""
        rows, width = self.rollouts.completion_ids.shape
        wanted = -(-rows // max(1, max_completion_tokens // max(width, 1)))
        return 1 if wanted <= 1 else min(wanted, self.most_passes(self.pass_positions(1)))

    def most_passes(self, one_pass: int) -> int:
        """The most passes the rows may run in: at most one row a pass, and since a pass runs its rows' distinct
        prompts again (models/prompt_sharing.py runs each once a pass), no more passes than keep those runs within
        1/PROMPT_RERUN_SHARE of the `one_pass` positions (pass_positions(1)) one pass runs."""
        rows = len(self)
        prompt_width = self.rollouts.prompt_ids.size(1)
        if prompt_width == 0:
            return rows
        return max(1, min(rows, 1 + one_pass // (PROMPT_RERUN_SHARE * prompt_width)))

    def pass_positions(self, count: int) -> int:
        """The positions (prompt and completion, padding included) of the largest of the `count` passes `in_passes`
        makes: its distinct prompts at the prompt width, its rows at their widest completion (Rollouts.select)."""
        groups = self._prompt_groups()
        order = groups.argsort(stable=True)
        groups = groups[order]
        mask = self.rollouts.completion_mask.cpu()
        last = (mask * torch.arange(1, mask.size(1) + 1)).amax(1)[order]  # each row's last completion position
        rows = len(groups)
        sizes = torch.full((count,), rows // count)
        sizes[:rows % count] += 1  # tensor_split's parts: the first ones a row longer
        part = torch.repeat_interleave(torch.arange(count), sizes)
        starts = torch.ones(rows, dtype=torch.bool)  # a row that opens a distinct prompt within its part
        starts[1:] = (groups[1:] != groups[:-1]) | (part[1:] != part[:-1])
        prompts = torch.bincount(part, weights=starts.double(), minlength=count)
        widths = torch.zeros(count, dtype=last.dtype).scatter_reduce(0, part, last, "amax").clamp(min=1)
        positions = prompts * self.rollouts.prompt_ids.size(1) + sizes * widths
        return int(positions.max())

    def in_passes(self, count: int) -> list["TrainingBatch"]:
        """The rows as `count` parts of whole rows, sizes differing by at most one, rows of one prompt together (the
        fewest prompts a part), each trimmed to its widest completion; [self] when `count` is 1. A micro-batch's loss
        divides by the step's counts (grpo/losses.py StepNormalizer), so its parts' gradients add up to its own."""
        if count <= 1:
            return [self]
        return [self.select(rows) for rows in self.pass_rows(count)]

    def pass_rows(self, count: int) -> list[torch.Tensor]:
        """The row indices of each of `count` passes (see in_passes)."""
        if count > len(self):
            raise ValueError(f"{len(self)} rows cannot run as {count} passes.")
        return list(self._prompt_groups().argsort(stable=True).tensor_split(count))

    def _prompt_groups(self) -> torch.Tensor:
        """[N] the index of each row's prompt among the micro-batch's distinct prompts."""
        return torch.unique(self.rollouts.prompt_ids.cpu(), dim=0, return_inverse=True)[1]

    def micro_batches(self, size: int, generator: torch.Generator) -> list["TrainingBatch"]:
        """Shuffle the rows once and split them into micro-batches of `size`."""
        order = torch.randperm(len(self), generator=generator)
        return [self.select(order[i:i + size]) for i in range(0, len(self), size)]


@dataclass(frozen=True)
class RowLayout:
    """How the log-prob forwards lay a batch's rows out (models/logprobs.py): packed, prompts shared, padded to a
    multiple; `passes`: how many passes of whole rows a micro-batch runs in (the trainer's rule for
    max_completion_tokens_per_pass, which the forwards without gradient follow too), or None for one."""

    packing: bool
    share_prompts: bool
    pad_to_multiple_of: int | None
    passes: Callable[["TrainingBatch"], int] | None = None


_ROLLOUT_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_eos", "sampler_logprobs",
                   "tool_mask")
_BATCH_FIELDS = ("advantages", "loss_mask", "old_logps", "ref_logps", "sampling_ratio")


def buffer_tensors(buffer: list[TrainingBatch]) -> dict[str, torch.Tensor]:
    """Buffered micro-batches as a flat name -> tensor dict (for a checkpoint's safetensors file); a row's model_inputs
    as `<micro-batch>.model_inputs.<row>.<name>`."""
    out = {}
    for i, mb in enumerate(buffer):
        if mb.rollouts.model_inputs is not None:
            out.update(mb.rollouts.model_inputs.tensors(f"{i}.model_inputs."))
        for name in _ROLLOUT_FIELDS:
            if getattr(mb.rollouts, name) is not None:
                out[f"{i}.{name}"] = getattr(mb.rollouts, name).contiguous().cpu()
        for name in _BATCH_FIELDS:
            value = getattr(mb, name)
            if value is not None:
                out[f"{i}.{name}"] = value.contiguous().cpu()
    return out


def buffer_from_tensors(tensors: dict[str, torch.Tensor], device) -> list[TrainingBatch]:
    """The micro-batches `buffer_tensors` flattened, on `device`."""
    count = len({key.split(".")[0] for key in tensors})
    buffer = []
    for i in range(count):
        def get(name):
            key = f"{i}.{name}"
            return tensors[key].to(device) if key in tensors else None

        rollouts = Rollouts(**{name: get(name) for name in _ROLLOUT_FIELDS})
        inputs = ModelInputs.from_tensors(tensors, f"{i}.model_inputs.", len(rollouts), device)
        rollouts = rollouts if inputs is None else replace(rollouts, model_inputs=inputs)
        buffer.append(TrainingBatch(rollouts, **{name: get(name) for name in _BATCH_FIELDS}))
    return buffer
