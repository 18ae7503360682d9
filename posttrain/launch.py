"""accelerate's launch flags on posttrain's command line: `posttrain sft --num_processes 2 --config run.yaml`
relaunches itself through `accelerate launch`, as TRL's `trl sft` does.

The flags come from an explicit list (checked against accelerate's own launch parser by tests/test_cli.py), so a
misspelled flag is still an error with a suggestion rather than something passed on. `--accelerate_config NAME|PATH`
names a config file: one of the files shipped in posttrain/accelerate_configs (TRL's names), or a path. In the YAML
config, the same names (`num_processes: 2`, `accelerate_config: multi_gpu`) are launch settings, and `env:` sets
environment variables for the run.
"""

import os
import subprocess
import sys

from posttrain.configs import ConfigError

# accelerate launch flags posttrain passes on: name -> takes a value
LAUNCH_FLAGS = {
    "config_file": True, "num_processes": True, "num_machines": True, "machine_rank": True, "main_process_ip": True,
    "main_process_port": True, "mixed_precision": True, "gpu_ids": True, "num_cpu_threads_per_process": True,
    "rdzv_backend": True, "rdzv_conf": True, "max_restarts": True, "monitor_interval": True, "log_dir": True,
    "tee": True, "role": True, "dynamo_backend": True,
    "multi_gpu": False, "cpu": False, "same_network": False, "enable_cpu_affinity": False,
}
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_configs")
SHIPPED = ("single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2")
LAUNCHED = "POSTTRAIN_LAUNCHED"  # set in the processes accelerate starts: they train, they do not relaunch


def accelerate_config_path(value: str) -> str:
    """A shipped config's name, or a path to an accelerate config file."""
    if value in SHIPPED:
        return os.path.join(CONFIG_DIR, f"{value}.yaml")
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ConfigError(f"accelerate_config {value!r} is neither a shipped config ({', '.join(SHIPPED)}) nor a "
                          "file: give one of those names, or the path of an accelerate config file.")
    return path


def split_launch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch flags, the rest) of a command line; --accelerate_config becomes --config_file."""
    launch, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        name, has_value, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        name = name.replace("-", "_") if token.startswith("--") else ""
        if name == "accelerate_config":
            value = inline if has_value else (argv[i + 1] if i + 1 < len(argv) else "")
            launch += ["--config_file", accelerate_config_path(value)]
            i += 1 if has_value else 2
        elif name in LAUNCH_FLAGS:
            if LAUNCH_FLAGS[name] and not has_value:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{name} needs a value (accelerate launch's --{name}).")
                launch += [f"--{name}", argv[i + 1]]
                i += 2
            else:
                launch.append(token if LAUNCH_FLAGS[name] else f"--{name}")
                i += 1
        else:
            rest.append(token)
            i += 1
    return launch, rest


def launch_args_from_yaml(values: dict) -> list[str]:
    """Pop the launch settings (and `env:`) out of a YAML config's values; returns them as launch flags."""
    env = values.pop("env", None)
    if env is not None:
        if not isinstance(env, dict):
            raise ConfigError(f"env in the config file must be a mapping of NAME: value, not {type(env).__name__}.")
        os.environ.update({str(k): str(v) for k, v in env.items()})
    flags = []
    if "accelerate_config" in values:
        flags += ["--config_file", accelerate_config_path(str(values.pop("accelerate_config")))]
    for name, takes_value in LAUNCH_FLAGS.items():
        if name in values:
            value = values.pop(name)
            if takes_value:
                flags += [f"--{name}", str(value)]
            elif value:
                flags.append(f"--{name}")
    return flags


def in_launched_process() -> bool:
    return os.environ.get(LAUNCHED) == "1"


def relaunch(command: str, launch: list[str], rest: list[str]) -> int:
    """Run `posttrain <command> <rest>` under `accelerate launch <launch>`; its exit code."""
    if "--quiet" in rest:  # posttrain's --quiet, and accelerate's (only the failing process's traceback)
        launch = [*launch, "--quiet"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "posttrain.cli", command, *rest]
    if "--quiet" not in rest:
        print("posttrain: launching with accelerate: " + " ".join(launch), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env={**os.environ, LAUNCHED: "1"})
