"""Command line: `posttrain TRAINER` (each trainer of posttrain/registry.py that has a command: grpo, sft, dpo, ...),
`posttrain serve | vllm-serve | demo | plot | report | env`, `posttrain --version`.

    posttrain grpo --config run.yaml [--any_field value ...]
    posttrain sft --config run.yaml --num_processes 2          (relaunches itself through accelerate)
    accelerate launch -m posttrain.cli sft --config run.yaml
    posttrain vllm-serve --model Qwen/Qwen3-0.6B [--print_command] [any `vllm serve` flag ...]

Arguments are parsed before torch is imported, so `--help` answers at once. Every field of the trainer's config and
every script field (model, dataset or mixture, rewards for grpo, LoRA) is a flag (posttrain/cli_help.py, which shows
them a page at a time: `--help`, `--help GROUP|FIELD`, `--help-all`); values given on the command line override the
YAML file. accelerate's launch flags, `--accelerate_config NAME|PATH` and YAML `env:` are taken as in
TRL's CLI (posttrain/launch.py). What each trainer command then runs is posttrain/runs.py.
"""

import argparse
import os
import sys
import time

from posttrain._version import __version__
from posttrain.cli_help import USAGE, add_fields, add_launch_flags, add_run_options, field_classes, help_topic, \
    trainer_help
from posttrain import registry
from posttrain.configs import (ConfigError, DPOConfig, GRPOConfig, LoraArguments, SFTConfig, ScriptArguments, build,
                               field_types, load_yaml, split_values, suggest)
from posttrain.configs.parsing import refuse_repeated_flags
from posttrain.configs.script import BaseScriptArguments
from posttrain.registry import load

# command -> (script arguments, trainer config, help line), from the registry
TRAINERS = {name: (ScriptArguments if entry.script == "prompts" else BaseScriptArguments, load(entry.config),
                   entry.command) for name, entry in registry.COMMANDS.items()}
COMMANDS = (*TRAINERS, "serve", "vllm-serve", "demo", "plot", "report", "env")


def _hint(command: str, name: str = "") -> str:
    """What to say after an unknown flag `name` of `command`: which other trainers have that field, where one does."""
    others = [other for other, (_, config_cls, _) in TRAINERS.items()
              if other != command and name in field_types(config_cls)]
    if others:
        return (f" It is a field of {', '.join(f'posttrain {o}' for o in others)}, not of posttrain {command}: "
                "remove it.")
    return f" `posttrain {command} --help-all` and docs/config.md list every field."


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """posttrain's parser, every command's; `only`: that trainer command's alone (what parse_command reads: a
    trainer's 200 flags, not all nine trainers')."""
    parser = argparse.ArgumentParser(prog="posttrain", description=f"Post-train language models: {', '.join(e.title for e in registry.COMMANDS.values())}.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for command, (script_cls, config_cls, line) in TRAINERS.items():
        if only is not None and command != only:
            continue
        trainer = sub.add_parser(command, help=line, allow_abbrev=False, usage=USAGE.format(command=command),
                                 description=f"{line} Flags override the values in --config.")
        add_run_options(trainer)
        seen = set(config_cls.NOT_FLAGS)  # fields the trainer's TRL config lacks: refused when set, so not flags
        for cls in field_classes(script_cls, config_cls):  # --help shows them a page at a time (cli_help.py)
            add_fields(trainer, cls, seen)
        add_launch_flags(trainer)
    if only is not None:
        return parser
    _add_serve(sub)
    _add_vllm_serve(sub)
    demo = sub.add_parser("demo", help="Train a tiny model on a built-in task on CPU and show it learning.",
                          description="GRPO teaches a tiny random model single-digit addition on the CPU (about a "
                          "minute), then prints the share of right answers before and after.")
    demo.add_argument("--output_dir", default="posttrain-demo", metavar="DIR",
                      help="Where the run writes its metrics, plots and model (default posttrain-demo).")
    demo.add_argument("--max_steps", type=int, default=1200, metavar="N",
                      help="Optimizer steps (default 1200).")
    demo.add_argument("--seed", type=int, default=0, help="Random seed of the run (default 0).")
    plot = sub.add_parser("plot", help="Draw the curves of one or more runs from their metrics.jsonl.",
                          allow_abbrev=False)
    plot.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="A run's output_dir (several: overlaid).")
    plot.add_argument("--out", default=None, metavar="FILE",
                      help="FILE.png, .svg or .html (one self-contained page); default OUTPUT_DIR/plots.png of the "
                           "first run.")
    report = sub.add_parser("report", help="Write a run's report: one self-contained HTML page with its summary, "
                            "curves, sampled completions and config.", allow_abbrev=False)
    report.add_argument("output_dir", metavar="OUTPUT_DIR", help="A run's output_dir.")
    report.add_argument("--out", default=None, metavar="FILE.html", help="Default OUTPUT_DIR/report.html.")
    report.add_argument("--steps", type=int, nargs="+", default=None, metavar="STEP",
                        help="The steps whose completions are shown (default: the first, middle and last logged).")
    report.add_argument("--rows", type=int, default=8, help="Completions shown per step (default 8).")
    sub.add_parser("env", help="Print versions and devices for bug reports.",
                   description="Print posttrain's, Python's and the libraries' versions and the devices, for bug "
                   "reports.")
    return parser


def _bool(value: str) -> bool:
    """A flag's optional true/false value, as TRL's parser reads it."""
    if str(value).lower() in ("true", "yes", "1", "t", "y"):
        return True
    if str(value).lower() in ("false", "no", "0", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _add_serve(sub) -> None:
    """`posttrain serve`'s options (posttrain/serving/app.py serves them)."""
    serve = sub.add_parser("serve", help="Serve a model for generation over HTTP (a subset of vLLM's API), CPU "
                                         "included; the trainer pushes its weights to it.", allow_abbrev=False)
    serve.add_argument("--model", required=True, help="Local path or hub id of the model to serve.")
    serve.add_argument("--host", default="127.0.0.1",
                       help="Address to bind (default loopback; any other needs an API key).")
    serve.add_argument("--port", type=int, default=8000, help="Port (0 picks a free one, printed at start).")
    serve.add_argument("--api_key", default=None, help="Bearer token every route then requires (visible in the "
                       "process list: prefer --api_key_file or the POSTTRAIN_API_KEY environment variable).")
    serve.add_argument("--api_key_file", default=None, metavar="PATH",
                       help="A file holding the bearer token (its content, surrounding whitespace removed).")
    serve.add_argument("--max_num_seqs", type=int, default=256,
                       help="Sequences one completions request may sample together, prompts x n (default 256).")
    serve.add_argument("--max_batch_tokens", type=int, default=1 << 18,
                       help="Tokens one completions request may hold, sequences x (longest prompt + max_tokens): "
                       "what its KV cache grows to (default 262144).")
    serve.add_argument("--max_bucket_bytes", type=int, default=None,
                       help="Tensor bytes one weight bucket may carry (default: 256 MiB, or the model's largest "
                       "tensor in float32 when larger).")
    serve.add_argument("--max_pixel_bytes", type=int, default=64 << 20,
                       help="Bytes of pixels (a vision-language model's processed images) one completions request "
                       "may carry (default 64 MiB).")
    serve.add_argument("--weight_update_timeout", type=float, default=120.0,
                       help="Seconds an open weight update may go without a call from its sender before it is "
                       "abandoned (default 120).")
    serve.add_argument("--max_model_len", type=int, default=None,
                       help="Longest prompt + completion served (default: the model's position limit).")
    serve.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16.")
    serve.add_argument("--device", default="cpu", help="cpu or cuda[:N].")
    serve.add_argument("--trust_remote_code", action="store_true", help="Allow models with custom code from their "
                       "repository.")
    serve.add_argument("--log_level", default="warning", help="uvicorn's log level.")


def _add_vllm_serve(sub) -> None:
    """`posttrain vllm-serve`: `trl vllm-serve`'s arguments (TRL's names, dashed too), run as vLLM's own server."""
    parser = sub.add_parser("vllm-serve", allow_abbrev=False, help="Run vLLM's own server with its weight-transfer "
                            "routes on, as `trl vllm-serve` does (needs vllm; other arguments go to `vllm serve`).")

    def add(name, **kwargs):
        parser.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), **kwargs)

    add("model", required=True, help="Local path or hub id of the model to serve.")
    add("revision", default=None, help="Model revision (branch, tag or commit).")
    add("tensor_parallel_size", type=int, default=1, help="GPUs one model is split over.")
    add("data_parallel_size", type=int, default=1, help="Keep 1 for dense models (vllm#30739).")
    add("host", default="127.0.0.1", help="Address to bind (default loopback; TRL's is 0.0.0.0, but vLLM's "
        "weight-transfer routes are unauthenticated).")
    add("port", type=int, default=8000, help="Port.")
    add("gpu_memory_utilization", type=float, default=0.9, help="Share of each GPU's memory vLLM may take.")
    add("dtype", default="auto", help="auto, float32, bfloat16 or float16.")
    add("max_model_len", type=int, default=None, help="Longest prompt + completion (default: the model's).")
    add("enable_prefix_caching", type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
        help="vLLM's prefix caching (default: vLLM's choice).")
    add("enforce_eager", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
        help="No CUDA graphs (slower, starts faster).")
    add("kv_cache_dtype", default="auto", help="The KV cache's dtype (auto: the model's).")
    add("trust_remote_code", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
        help="Allow models with custom code from their repository.")
    add("log_level", default="info", help="uvicorn's log level.")
    add("vllm_model_impl", default="vllm", help="vllm or transformers.")
    add("distributed_executor_backend", default=None, help="ray to spread tensor parallelism over nodes.")
    add("speculative_config", default=None, help="JSON speculative decoding config.")
    add("api_key", default=None, help="Bearer token for the /v1 routes (only those: vLLM does not guard the "
        "weight-transfer routes).")
    add("print_command", action="store_true", help="Print the command and its environment instead of running it.")


def run_vllm_serve(args, extra: list[str]) -> int:
    """Warn for a non-loopback host, then print the `vllm serve` command or exec it (after checking vllm)."""
    import ipaddress
    import shlex

    from posttrain.generation.vllm_compat import check_installed, vllm_serve_command

    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        print(f"posttrain: warning: --host {args.host} lets anyone who can reach port {args.port} call vLLM's "
              "dev-mode routes (/update_weights, /init_weight_transfer_engine, /weight_checker, /collective_rpc, "
              "/sleep) without authentication (--api_key guards only /v1 and /inference); bind 127.0.0.1 unless "
              "the network is trusted.", file=sys.stderr)
    argv, env = vllm_serve_command(args, extra)
    if args.print_command:
        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)]))
        return 0
    check_installed("posttrain vllm-serve")
    os.execvpe(argv[0], argv, {**os.environ, **env})


def parse_command(command: str, argv: list[str]):
    """Merge YAML and flags into (script arguments, LoraArguments, trainer config, accelerate launch flags); unknown
    flags raise with the closest valid name."""
    from posttrain.launch import launch_args_from_yaml, split_launch_args

    refuse_repeated_flags(argv)
    launch, argv = split_launch_args(argv)
    script_cls, config_cls, _ = TRAINERS[command]
    classes = (script_cls, LoraArguments, config_cls)
    args, unknown = build_parser(only=command).parse_known_args([command, *argv])
    from posttrain.launch import LAUNCH_FLAGS

    known = [n for cls in classes for n in field_types(cls) if n not in config_cls.NOT_FLAGS] + list(LAUNCH_FLAGS) + [
        "accelerate_config"]
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        name = flag.lstrip("-").split("=")[0]
        raise ConfigError(f"Unknown argument {flag!r}.{suggest(name, known, _hint(command, name))}")
    values = load_yaml(args.config) if args.config else {}
    launch = launch_args_from_yaml(values) + launch
    values.update({k: v for k, v in vars(args).items() if k not in ("command", "config", "quiet", "verbose")})
    if getattr(args, "quiet", False) and getattr(args, "verbose", False):
        raise ConfigError("--quiet and --verbose both given: choose one.")
    if getattr(args, "quiet", False):
        values.update(log_level="error", disable_tqdm=True)
    elif getattr(args, "verbose", False):
        values.update(log_level="info")
    script_values, lora_values, config_values = split_values(values, *classes, hint=_hint(command))
    return (build(script_cls, script_values), build(LoraArguments, lora_values), build(config_cls, config_values),
            launch)


def parse_grpo(argv: list[str]) -> tuple[ScriptArguments, LoraArguments, GRPOConfig]:
    """The grpo command's configs (launch flags are parsed and left out)."""
    return parse_command("grpo", argv)[:3]


def parse_sft(argv: list[str]) -> tuple[BaseScriptArguments, LoraArguments, SFTConfig]:
    """The sft command's configs (launch flags are parsed and left out)."""
    return parse_command("sft", argv)[:3]


def parse_dpo(argv: list[str]) -> tuple[BaseScriptArguments, LoraArguments, DPOConfig]:
    """The dpo command's configs (launch flags are parsed and left out)."""
    return parse_command("dpo", argv)[:3]


def _runner(entry: registry.TrainerEntry):
    """What the command runs with its parsed (script, lora, config): the entry's run function (posttrain/runs.py)."""
    return lambda script, lora, config: load(entry.run)(entry, script, lora, config)


RUNS = {name: _runner(entry) for name, entry in registry.COMMANDS.items()}


def run_command(command: str, argv: list[str]) -> int:
    """Parse, then train here, or (given launch settings, outside a launched process) relaunch with accelerate."""
    from posttrain.launch import in_launched_process, launcher_asks_cpu, relaunch, split_launch_args

    script, lora, config, launch = parse_command(command, argv)
    if launch and not in_launched_process():
        return relaunch(command, launch, split_launch_args(argv)[1], config.use_cpu)
    config.use_cpu = config.use_cpu or launcher_asks_cpu()  # accelerate's --cpu: the run's use_cpu, and its config's
    RUNS[command](script, lora, config)
    return 0


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
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    try:
        return _run(parser, argv)
    except Exception as err:
        code = _report_error(err)
        if code is None:  # not the user's to fix: its traceback
            raise
        return code
    except KeyboardInterrupt:  # a second SIGINT: stopped at once, mid-step
        print("posttrain: interrupted mid-step; resume from the newest checkpoint in output_dir "
              "(resume_from_checkpoint=true).", file=sys.stderr)
        return 130


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Run the command argv[0] (one of COMMANDS) with its arguments; its exit code."""
    command = argv[0]
    if command in TRAINERS:
        topic = help_topic(argv[1:])
        if topic is not None:  # a page at a time: the first one short (cli_help.py)
            print(trainer_help(command, *TRAINERS[command], topic), end="")
            return 0
        return run_command(command, argv[1:])
    if command == "vllm-serve":
        args, extra = parser.parse_known_args(argv)
        return run_vllm_serve(args, extra)
    if command == "env":
        parser.parse_args(argv)  # --help answers, anything else is refused
        print_env()
        return 0
    SIMPLE_COMMANDS[command](parser.parse_args(argv))
    return 0


def _serve(args: argparse.Namespace) -> None:
    from posttrain.serving.app import serve

    serve(args.model, args.host, args.port, args.api_key, args.max_model_len, args.dtype, args.device,
          args.trust_remote_code, args.log_level, api_key_file=args.api_key_file, max_num_seqs=args.max_num_seqs,
          max_batch_tokens=args.max_batch_tokens, max_bucket_bytes=args.max_bucket_bytes,
          weight_update_timeout=args.weight_update_timeout, max_pixel_bytes=args.max_pixel_bytes)


def _demo(args: argparse.Namespace) -> None:
    from posttrain.demo import run_demo

    run_demo(args.output_dir, args.max_steps, args.seed)


def _plot(args: argparse.Namespace) -> None:
    from posttrain.plotting import plot_runs

    out = args.out or os.path.join(args.output_dirs[0], "plots.png")
    print(f"posttrain: wrote {plot_runs(args.output_dirs, out)}")


def _report(args: argparse.Namespace) -> None:
    from posttrain.report import write_report

    print(f"posttrain: wrote {write_report(args.output_dir, args.out, args.steps, args.rows)}")


SIMPLE_COMMANDS = {"serve": _serve, "demo": _demo, "plot": _plot, "report": _report}  # parsed whole, exit code 0


def _report_error(err: Exception) -> int | None:
    """Say what stopped the command (once across processes) and give its exit code; None for an error that is not
    the user's to fix (main raises it, with its traceback)."""
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
        _say_error(err)
        return 2
    if not _is_user_error(err):
        return None
    from posttrain.errors import user_code_cause

    cause = user_code_cause(err)
    if cause is not None:  # an exception from the user's code (e.g. inside a reward function): its traceback helps
        import traceback

        traceback.print_exception(cause, file=sys.stderr)
    _say_error(err)
    return code


def _say_error(err: Exception) -> None:
    """`posttrain: error: ...` in one write, so that processes failing together never splice their lines (a
    launcher's stderr is unbuffered: print would write the text and its newline apart)."""
    sys.stderr.write(f"posttrain: error: {err}\n")
    sys.stderr.flush()


def _is_user_error(err: Exception) -> bool:
    """Errors a user can cause and fix: reported as one sentence, without a traceback."""
    from posttrain.errors import UserError

    return isinstance(err, UserError)


if __name__ == "__main__":
    sys.exit(main())
