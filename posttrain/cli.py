"""Command line: `posttrain grpo | demo | env`, `posttrain --version`.

    posttrain grpo --config run.yaml [--any_field value ...]
    accelerate launch -m posttrain.cli grpo --config run.yaml

Arguments are parsed before torch is imported, so `--help` answers at once. Every GRPOConfig field and
every script field (model, dataset, rewards, LoRA) is a flag; values given on the command line
override the YAML file.
"""

import argparse
import dataclasses
import os
import sys
import time

from posttrain._version import __version__
from posttrain.configs import (UNKNOWN_HINT, ConfigError, GRPOConfig, LoraArguments, ScriptArguments, build,
                               field_help, field_types, load_yaml, split_values, suggest)
from posttrain.configs.parsing import refuse_repeated_flags

CONFIG_CLASSES = (ScriptArguments, LoraArguments, GRPOConfig)


def _add_fields(parser: argparse.ArgumentParser, cls, seen: set) -> None:
    """One flag per field of `cls` not already in `seen` (a field shared by two classes is one flag)."""
    group = parser.add_argument_group(cls.__name__, " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()))
    types, helps = field_types(cls), field_help(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, tp in types.items():
        if name in seen:
            continue
        seen.add(name)
        is_list = "list" in str(tp).lower()
        is_bool = tp is bool or str(tp).endswith("bool]")
        kwargs = {"nargs": "+"} if is_list else {"nargs": "?", "const": "true"} if is_bool else {}
        group.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, metavar=name.upper() if not is_bool
                           else None, help=f"{helps.get(name, '')} (default: {defaults.get(name)!r})", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-train language models with GRPO.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{grpo,demo,env}")
    grpo = sub.add_parser("grpo", help="Train with GRPO from a YAML config and flags.", allow_abbrev=False,
                          description="Train with GRPO. Flags override the values in --config.")
    grpo.add_argument("--config", help="YAML file of field: value pairs (any field below).")
    seen: set = set()
    from posttrain.configs.trl_compat import TRLCompatConfig

    # --help shows GRPOConfig group by group, the TRL fields accepted at posttrain's behaviour last
    for cls in (ScriptArguments, LoraArguments, *GRPOConfig.GROUPS, TRLCompatConfig):
        _add_fields(grpo, cls, seen)
    demo = sub.add_parser("demo", help="Train a tiny model on a built-in task on CPU and show it learning.")
    demo.add_argument("--output_dir", default="posttrain-demo")
    demo.add_argument("--max_steps", type=int, default=1200)
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("env", help="Print versions and devices for bug reports.")
    return parser


def parse_grpo(argv: list[str]) -> tuple[ScriptArguments, LoraArguments, GRPOConfig]:
    """Merge YAML and flags into the three configs; unknown flags raise with the closest valid name."""
    refuse_repeated_flags(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(["grpo", *argv])
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        known = [n for cls in CONFIG_CLASSES for n in field_types(cls)]
        raise ConfigError(f"Unknown argument {flag!r}.{suggest(flag.lstrip('-').split('=')[0], known, UNKNOWN_HINT)}")
    values = load_yaml(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    values.update(flags)
    script_values, lora_values, grpo_values = split_values(values, *CONFIG_CLASSES)
    return (build(ScriptArguments, script_values), build(LoraArguments, lora_values), build(GRPOConfig, grpo_values))


def run_grpo(script: ScriptArguments, lora: LoraArguments, config: GRPOConfig) -> None:
    if not script.model_name_or_path:
        raise ConfigError("No model given: set model_name_or_path (a local path or hub id).")
    if not script.dataset_name:
        raise ConfigError("No dataset given: set dataset_name (a hub name or a .json/.jsonl/.csv/.parquet file).")
    peft_config = lora.to_peft_config()  # before anything slow: a missing peft is reported first
    from posttrain.data import load_prompt_dataset
    from posttrain.grpo.trainer import GRPOTrainer

    init = dict(config.model_init_kwargs or {})
    for key in ("dtype", "attn_implementation"):
        if getattr(script, key) is not None:
            init.setdefault(key, getattr(script, key))
    config.trust_remote_code = config.trust_remote_code or script.trust_remote_code
    init.setdefault("trust_remote_code", config.trust_remote_code)
    init.setdefault("revision", script.model_revision)
    config.model_init_kwargs = init
    dataset = load_prompt_dataset(script.dataset_name, script.dataset_config, script.dataset_train_split)
    eval_dataset = None
    if config.eval_strategy != "no" or config.eval_on_start:
        eval_dataset = load_prompt_dataset(script.dataset_name, script.dataset_config, script.dataset_test_split,
                                           for_eval=True)
    rewards = ([script.reward_model_name_or_path] if script.reward_model_name_or_path else []) + list(
        script.reward_funcs or [])
    trainer = GRPOTrainer(script.model_name_or_path, reward_funcs=rewards, args=config, train_dataset=dataset,
                          eval_dataset=eval_dataset, peft_config=peft_config)
    try:
        trainer.train()
    except BaseException:
        trainer.close(failed=True)  # no process waits for one that stopped
        raise
    trainer.close()


def print_env() -> None:
    import importlib.metadata as md
    import platform

    rows = [("posttrain", __version__), ("python", platform.python_version()), ("platform", platform.platform())]
    for pkg in ("torch", "transformers", "accelerate", "datasets", "peft", "vllm", "deepspeed"):
        try:
            rows.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            rows.append((pkg, "not installed"))
    import torch

    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append(("device", f"cuda x{torch.cuda.device_count()} ({names}), CUDA {torch.version.cuda}"))
    else:
        rows.append(("device", f"cpu ({torch.get_num_threads()} threads)"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in ("grpo", "demo", "env"):
        parser.parse_args(argv or ["--help"])
        return 2
    try:
        if argv[0] == "grpo":
            run_grpo(*parse_grpo(argv[1:]))
        elif argv[0] == "demo":
            args = parser.parse_args(argv)
            from posttrain.demo import run_demo

            run_demo(args.output_dir, args.max_steps, args.seed)
        else:
            print_env()
    except Exception as err:
        from posttrain.training.distributed import PeerFailure, reported_elsewhere

        code = getattr(err, "exit_code", 2)  # an interrupt exits 128 + its signal
        if reported_elsewhere(err, int(os.environ.get("RANK", "0")) == 0):
            time.sleep(0.5)  # let the main process print it before a launcher tears the job down
            return code  # every process stopped on it, and the main one reports it: printed once
        from posttrain.training.interrupts import Interrupted

        if isinstance(err, Interrupted):
            print(f"posttrain: {err}", file=sys.stderr)
            return code
        if isinstance(err, PeerFailure):  # another process failed: its user traceback, then its message
            print(err.detail, file=sys.stderr, end="")
            print(f"posttrain: error: {err}", file=sys.stderr)
            return 2
        if not _is_user_error(err):
            raise
        cause = err.__cause__
        if cause is not None and not _is_user_error(cause) and not isinstance(cause, (OSError, ImportError)):
            # an exception from user code (e.g. inside a reward function): its traceback is the useful part
            import traceback

            traceback.print_exception(cause, file=sys.stderr)
        print(f"posttrain: error: {err}", file=sys.stderr)
        return code
    except KeyboardInterrupt:  # a second SIGINT: stopped at once, mid-step
        print("posttrain: interrupted mid-step; resume from the newest checkpoint in output_dir "
              "(resume_from_checkpoint=true).", file=sys.stderr)
        return 130
    return 0


def _is_user_error(err: Exception) -> bool:
    """Errors a user can cause and fix: reported as one sentence, without a traceback."""
    from posttrain.errors import UserError

    return isinstance(err, UserError)


if __name__ == "__main__":
    sys.exit(main())
