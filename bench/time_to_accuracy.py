"""Time to accuracy on `posttrain demo`'s task (issue 38, item 2): TRL 1.16's GRPOTrainer against posttrain's, one
run, one JSON line.

Usage: python bench/time_to_accuracy.py --impl trl|posttrain --seed N [--steps N] [--threads 2] [--out DIR]
                                        [--window 10] [--no-final-eval]

Both sides train the demo's model (posttrain.demo.demo_model_path(): a 2-layer Qwen2 with a character vocabulary)
on the demo's 25 prompts "a+b=" (demo_dataset()) with the demo's config (demo_config(output_dir, steps, seed); on
TRL's side a trl.GRPOConfig with each of its fields set to the same value, plus use_cpu=True, bf16=False,
report_to="none") and the same reward function object, posttrain.rewards.builtin.accuracy, passed as a callable on
both sides (it takes TRL's calling convention: completions as strings, the dataset's `answer` column as a keyword).
--steps defaults to `posttrain demo`'s --max_steps. Torch runs --threads threads on both sides (the demo itself
uses min(cpus, 4); keep the sides equal).

Measured through a transformers TrainerCallback's on_log (both trainers call it once per step, logging_steps=1, with
the step's mean reward under the key "reward", posttrain's as TRL's): for every step the wall-clock seconds since
train() was called and the step's mean reward, which with the accuracy reward is the share of the step's 64 sampled
completions that are right: the "sampled accuracy". "First reaches X%" is read on the moving average of the per-step
accuracy over the last --window steps (default 10; the first window-1 steps average what there is), so a single
lucky step does not count: t50_s/t70_s are the seconds at the end of the first step whose moving average is >= 0.5
/ >= 0.7 (step50/step70 that step's number), null if never. acc_end is the mean accuracy over the last 10% of steps
(as posttrain.demo.summarize). s_per_step is (time of the last step - time of the first) / (steps - 1): the steady
step, without the start-up; wall_s is the whole train() call (posttrain's includes drawing plots.png and report.html
at the end, as `posttrain demo` does). final_sampled_accuracy: after training, 16 completions sampled for each of the
25 prompts (the demo's sampled_accuracy: posttrain's own generator; on TRL's side model.generate with TRL's sampling
settings), the share right.

Prints one JSON line: impl, seed, steps, window, threads, wall_s, s_per_step, t50_s, t70_s, step50, step70, acc_end,
final_sampled_accuracy; writes it with the per-step series (step, time_s, accuracy) to
OUT/{impl}-seed{N}.json for bench/tta_table.py.

Config check. TRL 1.16's trl.GRPOConfig(output_dir=..., use_cpu=True) against posttrain's
GRPOConfig(output_dir=..., use_cpu=True) (use_cpu on both: TRL refuses its own defaults on a machine without a GPU),
field by field over the fields both have (TRL has none posttrain lacks), transformers 5.24. Equal: every field that
shapes the update or the sampling, among them beta 0.0, temperature 1.0, top_p 1.0, top_k 0, min_p None,
repetition_penalty 1.0, loss_type "dapo", scale_rewards "group", epsilon 0.2, num_iterations 1,
importance_sampling_level "token", mask_truncated_completions False, top_entropy_quantile 1.0, max_grad_norm 1.0,
weight_decay 0, warmup_steps 0, shuffle_dataset True, num_generations 8, steps_per_generation 1,
multi_objective_aggregation "sum_then_normalize", disable_dropout False, model_init_kwargs None (both load float32).
Different:
  bf16: TRL True (bf16 autocast, on CPU too), posttrain None (off on CPU). Set bf16=False on TRL's side.
  epsilon_high: TRL None, posttrain 0.2. The same: TRL's trainer reads None as epsilon (0.2).
  pad_to_multiple_of: TRL None, posttrain "auto". The same: TRL resolves "auto" to None off Neuron devices.
  dataloader_pin_memory: TRL False, posttrain True. No effect on CPU.
  accelerator_config, debug, disable_tqdm: the same defaults written differently, or the progress bar only.
posttrain-only fields stay at the demo's values (fast_paths True, plot_on_end None: posttrain's train() ends by
writing the model, plots.png and report.html, inside wall_s but after the last step's time). config_differences()
runs before each training and prints the differences of the two configs actually used to stderr (the list above
less bf16); --check-config prints them and exits.
"""

import argparse
import json
import os
import sys
import tempfile
import time

READ_END = 0.1  # acc_end: the mean over the last 10% of steps, as posttrain.demo.summarize
THRESHOLDS = (0.5, 0.7)
# Fields that name where or how a run reports, not what it trains: not compared.
_NOT_TRAINING = {"output_dir", "logging_dir", "run_name", "hub_token", "report_to", "push_to_hub", "hub_model_id"}


def demo_steps() -> int:
    """`posttrain demo`'s default --max_steps, read from the CLI's own parser."""
    from posttrain.cli import build_parser

    return build_parser().parse_args(["demo"]).max_steps


def posttrain_config(output_dir: str, steps: int, seed: int):
    """The demo's own config (posttrain.demo.demo_config)."""
    from posttrain.demo import demo_config

    return demo_config(output_dir, steps, seed)


def demo_settings(output_dir: str, steps: int, seed: int) -> dict:
    """Every field demo_config sets: the fields of its config that differ from posttrain's defaults."""
    from dataclasses import fields

    from posttrain.configs import GRPOConfig

    demo, default = posttrain_config(output_dir, steps, seed), GRPOConfig(output_dir=output_dir)
    return {f.name: getattr(demo, f.name) for f in fields(demo)
            if f.name not in _NOT_TRAINING and getattr(demo, f.name) != getattr(default, f.name)}


def trl_config(output_dir: str, steps: int, seed: int):
    """TRL's GRPOConfig with each field demo_config sets at the demo's value, plus use_cpu, bf16 off, no reporting."""
    import trl

    settings = {k: v for k, v in demo_settings(output_dir, steps, seed).items() if k in _trl_fields()}
    settings.update(max_steps=steps, seed=seed, use_cpu=True, bf16=False, report_to="none")
    return trl.GRPOConfig(output_dir=output_dir, **settings)


def _trl_fields() -> set:
    from dataclasses import fields

    import trl

    return {f.name for f in fields(trl.GRPOConfig)}


def config_differences(a, b) -> dict:
    """{field: (a's value, b's value)} over the dataclass fields both configs have, reporting fields left out."""
    from dataclasses import fields

    def plain(value):  # transformers' enums (IntervalStrategy.STEPS) against their strings ("steps")
        return getattr(value, "value", value)

    names = {f.name for f in fields(a)} & {f.name for f in fields(b)}
    return {n: (plain(getattr(a, n)), plain(getattr(b, n))) for n in sorted(names - _NOT_TRAINING)
            if repr(plain(getattr(a, n))) != repr(plain(getattr(b, n)))}


class AccuracyClock:
    """A TrainerCallback recording (step, seconds since start(), step's mean reward) at every on_log that has a reward
    and is not the end-of-training summary. Built lazily (transformers is imported inside)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.t0, self.series = None, []

            def start(self):
                self.t0 = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs and "train_runtime" not in logs and self.t0 is not None:
                    self.series.append({"step": state.global_step, "time_s": round(time.perf_counter() - self.t0, 3),
                                        "accuracy": round(float(logs["reward"]), 6)})

        return _Clock()


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def first_reaching(series: list[dict], smoothed: list[float], threshold: float) -> tuple:
    """(seconds, step) at the first step whose moving average is >= threshold, or (None, None)."""
    for point, acc in zip(series, smoothed):
        if acc >= threshold:
            return point["time_s"], point["step"]
    return None, None


def summarize_series(series: list[dict], window: int) -> dict:
    """t50/t70 and their steps, acc_end (last 10% of steps) and the steady seconds per step."""
    accs = [p["accuracy"] for p in series]
    smoothed = moving_average(accs, window)
    out = {}
    for x in THRESHOLDS:
        t, step = first_reaching(series, smoothed, x)
        out[f"t{round(x * 100)}_s"], out[f"step{round(x * 100)}"] = t, step
    k = max(1, round(len(accs) * READ_END))
    out["acc_end"] = round(sum(accs[-k:]) / k, 4) if accs else None
    span = series[-1]["time_s"] - series[0]["time_s"] if len(series) > 1 else None
    out["s_per_step"] = round(span / (len(series) - 1), 4) if span is not None else None
    for p, s in zip(series, smoothed):
        p["accuracy_ma"] = round(s, 6)
    return out


def prompts() -> list[str]:
    from posttrain.demo import MAX_DIGIT

    return [f"{a}+{b}=" for a in range(MAX_DIGIT + 1) for b in range(MAX_DIGIT + 1)]


def posttrain_final_accuracy(trainer) -> float:
    """The demo's end-of-training sampled accuracy (16 samples a prompt, posttrain's generator)."""
    from posttrain.demo import sampled_accuracy

    shares = sampled_accuracy(trainer, prompts())
    return sum(share for share, _ in shares) / len(shares)


def trl_final_accuracy(trainer, samples: int = 16) -> float:
    """The same measure on TRL's side: model.generate with TRL's sampling settings (do_sample, temperature, top_p,
    top_k, min_p, repetition_penalty) and max_completion_length new tokens, scored by the same reward."""
    import torch

    from posttrain.demo import _sum_of
    from posttrain.rewards.builtin import accuracy

    model, tok, a = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class, trainer.args
    model.eval()
    shares = []
    for prompt in prompts():
        ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids] * samples)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=a.temperature,
                                 top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                                 max_new_tokens=a.max_completion_length, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        scores = accuracy(texts, answer=[str(_sum_of(prompt))] * samples)
        shares.append(sum(scores) / samples)
    return sum(shares) / len(shares)


def build_trainer(impl: str, output_dir: str, steps: int, seed: int, clock):
    """The trainer of `impl` on the demo's model, dataset and reward, with `clock` as a callback."""
    from posttrain.demo import demo_dataset, demo_model_path
    from posttrain.rewards.builtin import accuracy

    path = demo_model_path()
    if impl == "trl":
        import trl

        return trl.GRPOTrainer(model=path, reward_funcs=accuracy, args=trl_config(output_dir, steps, seed),
                               train_dataset=demo_dataset(), callbacks=[clock])
    from posttrain import GRPOTrainer

    return GRPOTrainer(path, accuracy, posttrain_config(output_dir, steps, seed), train_dataset=demo_dataset(),
                       callbacks=[clock])


def check_config(output_dir: str, steps: int, seed: int) -> dict:
    """The field-by-field differences of the two configs this script trains with, and of the two defaults."""
    import trl

    from posttrain.configs import GRPOConfig

    def show(diff):
        return {k: [repr(x), repr(y)] for k, (x, y) in diff.items()}

    # use_cpu on both: TRL's GRPOConfig refuses its own defaults (bf16) on a machine without a GPU
    return {"run (trl, posttrain)": show(config_differences(trl_config(output_dir, steps, seed),
                                                            posttrain_config(output_dir, steps, seed))),
            "defaults (trl, posttrain)": show(config_differences(trl.GRPOConfig(output_dir=output_dir, use_cpu=True),
                                                                 GRPOConfig(output_dir=output_dir, use_cpu=True)))}


def run(args) -> dict:
    """Train one side once; the JSON record (with its series)."""
    import torch

    torch.set_num_threads(args.threads)
    output_dir = tempfile.mkdtemp(prefix=f"tta-{args.impl}-")
    print(json.dumps({"config_differences": check_config(output_dir, args.steps, args.seed)}), file=sys.stderr)
    clock = AccuracyClock()
    trainer = build_trainer(args.impl, output_dir, args.steps, args.seed, clock)
    clock.start()
    trainer.train()
    wall = time.perf_counter() - clock.t0
    final = None
    if args.final_eval:
        final = (trl_final_accuracy if args.impl == "trl" else posttrain_final_accuracy)(trainer)
    record = {"impl": args.impl, "seed": args.seed, "steps": len(clock.series), "window": args.window,
              "threads": args.threads, "wall_s": round(wall, 2), **summarize_series(clock.series, args.window),
              "final_sampled_accuracy": None if final is None else round(final, 4)}
    if hasattr(trainer, "close"):
        trainer.close()
    return {**record, "series": clock.series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["trl", "posttrain"], required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="default: posttrain demo's --max_steps")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same on both sides (default 2)")
    ap.add_argument("--window", type=int, default=10, help="moving-average window, steps (default 10)")
    ap.add_argument("--out", default="/tmp/tta-results", help="directory of the per-run JSON files")
    ap.add_argument("--no-final-eval", dest="final_eval", action="store_false",
                    help="skip the end-of-training sampled accuracy (25 prompts x 16 samples)")
    ap.add_argument("--check-config", action="store_true", help="print the config differences and exit")
    args = ap.parse_args()
    args.steps = args.steps or demo_steps()
    if args.check_config:
        print(json.dumps(check_config(tempfile.mkdtemp(prefix="tta-check-"), args.steps, args.seed), indent=1))
        return
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.impl}-seed{args.seed}.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "series"}))


if __name__ == "__main__":
    main()
