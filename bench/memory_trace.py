"""Where a GRPO step's memory goes: bench/grpo_step.py under an RSS sampler, its decode optionally replaced.

Usage: python bench/memory_trace.py [--real-decode] [--trace OUT.json] MODEL_DIR [grpo_step.py's flags]

Runs bench/grpo_step.py through bench/clocked.py --optimizer-states-first (AdamW's states made up front, as the
memory row of bench/compare_real_shape.sh), with a thread that samples the process's RSS every 10 ms. At the end it
prints (stderr) the peak and the innermost posttrain / transformers frames of the main thread when it was reached,
and writes the [seconds, MiB] samples to --trace (default /tmp/memory_trace.json) for a timeline.

Without --real-decode, every completion is drawn at random, full length (max_completion_length tokens, no EOS), in
no time (clocked.py --random-completions): the training passes see the shapes the bench's forced full-length decode
gives them, and a long row's trace takes the training's time only (a 2,048-token GRPO step at Qwen2.5-0.5B's shape:
15 minutes instead of 27; its peak within 1 MiB of the bench run's, which is in the training, not the decode). Not a
benchmark: its timings mean nothing.
"""

import json
import os
import runpy
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/clocked.py

from clocked import rss_bytes  # noqa: E402

OWN_FRAMES = ("posttrain", "transformers/models", "checkpoint")


def innermost_frames(thread_id: int, count: int = 6) -> str:
    frame, out = sys._current_frames().get(thread_id), []
    while frame is not None and len(out) < count:
        if any(part in frame.f_code.co_filename for part in OWN_FRAMES):
            out.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


def sample(samples: list, peak: list, main_id: int) -> None:
    started = time.perf_counter()
    while True:
        rss = rss_bytes()
        if rss > peak[0]:
            peak[:] = [rss, innermost_frames(main_id)]
        samples.append((round(time.perf_counter() - started, 2), rss >> 20))
        time.sleep(0.01)


def main() -> None:
    args = sys.argv[1:]
    real_decode = "--real-decode" in args
    args = [a for a in args if a != "--real-decode"]
    trace = "/tmp/memory_trace.json"
    if args[:1] == ["--trace"]:
        trace, args = args[1], args[2:]
    samples, peak = [], [0, ""]
    threading.Thread(target=sample, args=(samples, peak, threading.main_thread().ident), daemon=True).start()
    stand_in = [] if real_decode else ["--random-completions"]
    sys.argv = ["clocked.py", "--optimizer-states-first", *stand_in, os.path.join(HERE, "grpo_step.py"), *args]
    try:
        runpy.run_path(os.path.join(HERE, "clocked.py"), run_name="__main__")
    finally:
        print(f"peak {peak[0] >> 20} MiB at {peak[1]}", file=sys.stderr)
        with open(trace, "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main()
