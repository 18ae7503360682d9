"""A step's (or an evaluation's) statistics: the sums its micro-batches add to, which know how to add up, how to
reduce across processes and which metrics they make.

A trainer's statistics subclass `Statistics` as a dataclass of float fields (sums over the micro-batch: a loss summed
over its items, counts, ...) and define `metrics()`; a field made by `min_field()` / `max_field()` is a minimum /
maximum instead, one made by `local_field()` a sum over micro-batches of a value every process already agreed on (a
KL reference point reduced when it was computed), not summed across processes.

The loop adds the micro-batches' statistics (`total`), reduces them across processes (`reduced`) and logs `metrics()`,
so the loss and every mean are computed once, from the sums, whatever the split into micro-batches and processes.
"""

import dataclasses

import torch


@dataclasses.dataclass
class Statistics:
    """The sums of one micro-batch (or of many, added up): each field a number or a 0-dim tensor (detached, on the
    batch's device: nothing waits for the device until the step's statistics are reduced, once). Subclasses add the
    fields and `metrics`, which reads them as floats (after `reduced`)."""

    def metrics(self, prefix: str = "") -> dict:
        """The logged metrics, each name prefixed with `prefix`; `loss` among them."""
        raise NotImplementedError

    def __add__(self, other: "Statistics") -> "Statistics":
        return type(self)(**{f.name: _combine(_reduction(f), getattr(self, f.name), getattr(other, f.name))
                             for f in dataclasses.fields(self)})

    @classmethod
    def total(cls, parts: list) -> "Statistics":
        """The statistics of a list of them (a step's micro-batches) added up; the empty ones for none."""
        out = cls.empty()
        for part in parts:
            out = out + part
        return out

    @classmethod
    def empty(cls) -> "Statistics":
        """Statistics of nothing: sums 0, a minimum +inf, a maximum -inf."""
        start = {"min": float("inf"), "max": float("-inf")}
        return cls(**{f.name: start.get(_reduction(f), 0.0) for f in dataclasses.fields(cls)})

    def reduced(self, accelerator) -> "Statistics":
        """The statistics over every process (summed, or as each field's metadata says), as Python floats: one
        transfer from the device, and one collective per kind of reduction."""
        fields = dataclasses.fields(self)
        values = torch.stack([torch.as_tensor(getattr(self, f.name), dtype=torch.float64, device=accelerator.device)
                              .detach().reshape(()) for f in fields])
        if accelerator.num_processes > 1:
            values = values.clone()
            for how in ("sum", "min", "max"):  # the same order on every process (a set's is not)
                index = torch.tensor([i for i, f in enumerate(fields) if _reduction(f) == how], device=values.device)
                if not len(index):
                    continue
                if how == "sum":
                    values[index] = accelerator.reduce(values[index], reduction="sum")
                elif how in ("min", "max"):
                    import torch.distributed as dist

                    part = values[index].contiguous()
                    dist.all_reduce(part, op=dist.ReduceOp.MIN if how == "min" else dist.ReduceOp.MAX)
                    values[index] = part
        return type(self)(**dict(zip((f.name for f in fields), values.tolist())))


def _reduction(f) -> str:
    return f.metadata.get("reduce", "sum")


def _combine(how: str, a, b):
    if how in ("min", "max"):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            pick = torch.minimum if how == "min" else torch.maximum
            device = a.device if isinstance(a, torch.Tensor) else b.device
            return pick(torch.as_tensor(a, dtype=torch.float64, device=device),
                        torch.as_tensor(b, dtype=torch.float64, device=device))
        return min(a, b) if how == "min" else max(a, b)
    return a + b


def min_field():
    """A field that is the minimum over micro-batches and processes."""
    return dataclasses.field(default=float("inf"), metadata={"reduce": "min"})


def max_field():
    """A field that is the maximum over micro-batches and processes."""
    return dataclasses.field(default=float("-inf"), metadata={"reduce": "max"})


def local_field():
    """A sum over micro-batches of a value every process has already agreed on (not summed across processes)."""
    return dataclasses.field(default=0.0, metadata={"reduce": "local"})


@dataclasses.dataclass
class StepCounts(Statistics):
    """What a step's micro-batches hold, this process's (then every process's, `reduced`): `items`, what the step's
    loss is normalised over (transformers' num_items_in_batch: target tokens, pairs, examples), and `tokens`, what its
    forwards see (num_tokens, FLOPs). A trainer whose loss has another normaliser adds a field."""

    items: float = 0.0
    tokens: float = 0.0


@dataclasses.dataclass
class SidedStatistics(Statistics):
    """Sums kept per side, chosen and rejected (DPO's pairs' two completions, KTO's desirable and undesirable
    examples): the implicit rewards, the sequence log-probs, the targets' logits and their count; and the entropy over
    every target."""

    chosen_reward: float = 0.0
    rejected_reward: float = 0.0
    chosen_logps: float = 0.0
    rejected_logps: float = 0.0
    chosen_logits: float = 0.0
    chosen_tokens: float = 0.0
    rejected_logits: float = 0.0
    rejected_tokens: float = 0.0
    entropy: float = 0.0
