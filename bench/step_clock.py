"""The step times both sides of a benchmark report: a transformers TrainerCallback, which TRL's trainers and posttrain's
both take, or a global hook on every torch optimizer's step, which needs no access to the trainer."""

import time


def step_clock():
    """A TrainerCallback (both libraries take transformers' callbacks) that notes when each optimizer step ends;
    `median_step_s(clock)` is the median of steps 2 .. N (the first holds one-time work: compilation of paths, caches),
    the figure without what train() does once before and after its steps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    return StepClock()


def median_step_s(clock) -> float | None:
    gaps = sorted(b - a for a, b in zip(clock.ends, clock.ends[1:]))
    return round(gaps[len(gaps) // 2], 4) if gaps else None


class OptimizerStepClock:
    """The end time of every optimizer step of the process, per optimizer (a global torch post-step hook, so it sees
    TRL's and posttrain's optimizers alike, whatever wraps them); with `synchronize_cuda`, CUDA's queued work is
    waited for at each step's end."""

    def __init__(self, synchronize_cuda: bool = False):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.synchronize_cuda, self.ends = synchronize_cuda, {}
        register_optimizer_step_post_hook(self._record)

    def _record(self, optimizer, args, kwargs) -> None:
        if self.synchronize_cuda:
            import torch

            torch.cuda.synchronize()
        self.ends.setdefault(id(optimizer), []).append(time.perf_counter())

    def step_gaps(self) -> list[float]:
        """Seconds between consecutive step ends of the optimizer that stepped most (steps 2..N)."""
        ends = max(self.ends.values(), key=len) if self.ends else []
        return [b - a for a, b in zip(ends, ends[1:])]

    def steps(self) -> int:
        return max((len(ends) for ends in self.ends.values()), default=0)
