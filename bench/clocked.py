"""Run a benchmark script (ours or a TRL anchor) with a per-step clock and, optionally, a ceiling on its RSS.

Usage: python bench/clocked.py [--rss-limit-gib 20] [--optimizer-states-first] [--random-completions] SCRIPT [flags]

The script runs unchanged as __main__ in this process. A hook on every torch optimizer's step (step_clock.py's
OptimizerStepClock: TRL's optimizers and posttrain's alike) notes when each step ends, and the script's own JSON line
is printed again with:
- `step_s`: the seconds of each optimizer step after the first, and `median_step_s`, their median. The first step
  holds one-time work (the optimizer's states made, pages touched for the first time), which on a model of real size
  is seconds: with a few steps, the anchors' `s_per_step` (wall / steps) carries a large share of it.
- `rss_limit_gib`, and where the ceiling was passed: a thread samples the process's RSS every 20 ms; past the ceiling
  it writes the main thread's Python stack (the innermost frames, as `where`) and the RSS, then ends the process with
  exit status 3 and a JSON line `{"out_of_memory": true, ...}`. A machine with less memory than the ceiling plus
  what the kernel needs would kill the run before that: keep the ceiling below the machine's memory.
- `--optimizer-states-first`: every torch Adam/AdamW (TRL's default optimizer and posttrain's) makes its states when
  it is built, as its first step would (zeros, step 0: the same update), so that a one-step run's peak holds them
  as every later step's does. Without it, a one-step run's forward and backward run before the two moments exist
  (2 x the parameters in float32) and its peak understates a real run's.
- `--random-completions`: the decode replaced, on either side, by random full-length completions drawn in no time
  (bench/random_completions.py), for memory rows whose peak is in the training: the JSON line (the out-of-memory one
  too) gains `random_completions: true`, and its times hold no decode.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/step_clock.py

from step_clock import OptimizerStepClock  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def watch_rss(limit_bytes: int, started: float, stdout, extra: dict) -> None:
    """Sample RSS; past `limit_bytes`, print the main thread's innermost frames and the RSS (with `extra`'s keys), and
    end the process."""
    main_id = threading.main_thread().ident
    while True:
        rss = rss_bytes()
        if rss > limit_bytes:
            frame = sys._current_frames().get(main_id)
            stack = traceback.format_stack(frame) if frame is not None else []
            where = [line.strip().splitlines()[0] for line in stack[-8:]]
            print(json.dumps({"out_of_memory": True, "rss_limit_gib": limit_bytes / 2**30,
                              "rss_mib": round(rss / 2**20), "after_s": round(time.perf_counter() - started, 1),
                              "where": where, **extra}), file=stdout, flush=True)
            os._exit(3)
        time.sleep(0.02)


def adam_states_first() -> None:
    """Make every torch Adam/AdamW create its states (what its first step would: zero moments, step 0) when built."""
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    original = torch.optim.Adam.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.requires_grad):
                on_device = group["fused"] or group["capturable"]
                step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
                        if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()))
                self.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                if group["amsgrad"]:
                    self.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)

    torch.optim.Adam.__init__ = init  # AdamW is an Adam


def main() -> None:
    args = sys.argv[1:]
    limit_gib = None
    if args[:1] == ["--rss-limit-gib"]:
        limit_gib, args = float(args[1]), args[2:]
    if args[:1] == ["--optimizer-states-first"]:
        adam_states_first()
        args = args[1:]
    random_decode = args[:1] == ["--random-completions"]
    if random_decode:
        import random_completions

        random_completions.install()
        args = args[1:]
    started = time.perf_counter()
    if limit_gib is not None:
        extra = {"random_completions": True} if random_decode else {}
        threading.Thread(target=watch_rss, args=(int(limit_gib * 2**30), started, sys.stdout, extra),
                         daemon=True).start()
    clock = OptimizerStepClock()
    sys.argv = args
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        runpy.run_path(args[0], run_name="__main__")
    lines = [line for line in captured.getvalue().splitlines() if line.startswith("{")]
    record = json.loads(lines[-1]) if lines else {}
    steps = [round(gap, 3) for gap in clock.step_gaps()]
    record.update(step_s=steps, median_step_s=sorted(steps)[len(steps) // 2] if steps else None,
                  rss_limit_gib=limit_gib)
    if random_decode:
        record.update(random_completions=True)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
