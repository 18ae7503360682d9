"""The table of bench/compare_async.sh's runs: per max_staleness (sync first), the median seconds per optimizer step
over the seeds and its ratio to synchronous GRPO's, the reward after the same number of steps (the mean of the last
15 steps, mean and spread over the seeds), the reward after the same wall-clock time (the mean of the 15 steps that
ended last before T, T the median wall time of the max_staleness 1 runs), the mean staleness and the trainer's wait.

Usage: python bench/async_table.py /tmp/async-bench.jsonl
"""

import json
import statistics
import sys


def reward_at(result: dict, seconds: float, window: int = 15) -> float:
    ended = [r for r, t in zip(result["reward"], result["step_end_s"]) if t <= seconds]
    last = ended[-window:]
    return sum(last) / len(last) if last else float("nan")


def main(path: str) -> None:
    runs = [json.loads(line)["result"] for line in open(path) if line.strip()]
    by = {}
    for r in runs:
        by.setdefault(r["staleness"], []).append(r)
    horizon = statistics.median(r["wall_s"] for r in by.get(1, runs))
    sync = statistics.median(r["median_step_s"] for r in by[-1])
    print(f"| max_staleness | s/step (median) | vs sync | reward, last 15 of {runs[0]['steps']} steps | reward at "
          f"{horizon:.0f} s | staleness | trainer wait s/step |")
    print("|---|---|---|---|---|---|---|")
    for s in sorted(by):
        rs = by[s]
        step = statistics.median(r["median_step_s"] for r in rs)
        last = [sum(r["reward"][-15:]) / 15 for r in rs]
        timed = [reward_at(r, horizon) for r in rs]
        spread = statistics.stdev(last) if len(last) > 1 else 0.0
        name = "sync" if s < 0 else str(s)
        stale = "-" if s < 0 else f"{statistics.mean(r['staleness_mean'] for r in rs):.2f}"
        wait = "-" if s < 0 else f"{statistics.mean(r['trainer_wait_s'] for r in rs):.3f}"
        print(f"| {name} | {step:.3f} | {step / sync:.2f} | {statistics.mean(last):.3f} +- {spread:.3f} | "
              f"{statistics.mean(timed):.3f} | {stale} | {wait} |")


if __name__ == "__main__":
    main(sys.argv[1])
