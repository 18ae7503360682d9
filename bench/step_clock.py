"""The step times both sides of a benchmark report: a transformers TrainerCallback, which TRL's trainers and posttrain's
both take."""

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
