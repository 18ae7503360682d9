"""accelerate's launch flags on posttrain's command line: `posttrain sft --num_processes 2 --config run.yaml`
relaunches itself through `accelerate launch`, as TRL's `trl sft` does.

The flags come from an explicit list (checked against accelerate's own launch parser by tests/test_cli.py), so a
misspelled flag is still an error with a suggestion rather than something passed on. `--accelerate_config NAME|PATH`
names a config file: one of the files shipped in posttrain/accelerate_configs (TRL's names), or a path. In the YAML
config, the same names (`num_processes: 2`, `accelerate_config: multi_gpu`) are launch settings, and `env:` sets
environment variables for the run.

Before relaunching, `plan_devices` matches the launch to this machine's devices. accelerate runs several processes
on GPUs only: without one, each process of a `multi_gpu` launch sets up no process group and trains alone (two runs
on one output_dir), and its `--cpu` starts a single process whatever `--num_processes` says. So several processes
without a GPU (or with `--cpu`) run on the CPU over gloo (torchrun's launcher, ACCELERATE_USE_CPU), saying so in one
line unless `--cpu` or use_cpu asked for it; a sharded config (FSDP, DeepSpeed), which accelerate does not shard on a
CPU, and more processes than GPUs stop before anything starts, in one sentence. `python -m posttrain.launch` is
accelerate's launcher, the launcher's traceback for a process that failed (which printed its own error) replaced by
one line.
"""

import os
import subprocess
import sys

from posttrain.configs import ConfigError
from posttrain.configs.parsing import yaml_problem

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
SHARDED = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "MEGATRON_LM": "Megatron-LM"}  # distributed types needing GPUs
# a process exiting 2 printed its own one-sentence error (posttrain's and argparse's status), one exiting 128 + N
# its line on the signal N that stopped it
USER_ERROR_EXIT = 2


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


def launcher_asks_cpu() -> bool:
    """Whether accelerate's launcher asked this process to run on the CPU (its --cpu, or plan_devices)."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")


def _flag_values(launch: list[str]) -> dict:
    """accelerate launch flags -> {name: value, or True for a switch}."""
    values, i = {}, 0
    while i < len(launch):
        name, has_value, inline = launch[i].lstrip("-").partition("=")
        if LAUNCH_FLAGS.get(name) and not has_value:
            values[name], i = launch[i + 1], i + 2
        else:
            values[name], i = inline if has_value else True, i + 1
    return values


def _config_file_settings(flags: dict) -> dict:
    """The accelerate config file the launch reads (accelerate's default one when none is named, as it does)."""
    import yaml

    path = flags.get("config_file")
    if path is None and not flags.get("cpu"):
        from accelerate.commands.config.config_args import default_config_file

        path = default_config_file
    if path is None or not os.path.isfile(path):
        return {}
    which = "accelerate's default config file" if flags.get("config_file") is None else "The accelerate config file"
    try:
        with open(path, encoding="utf-8") as f:
            settings = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = ("is not text (not UTF-8)" if isinstance(err, UnicodeDecodeError) else
                  yaml_problem(err) if isinstance(err, yaml.YAMLError) else
                  f"could not be read ({err.strerror or err})")
        raise ConfigError(f"{which} {path} {reason}: fix it, or name another with --accelerate_config.") from None
    if settings is not None and not isinstance(settings, dict):
        raise ConfigError(f"{which} {path} holds a {type(settings).__name__}, not accelerate's settings: fix it, or "
                          "name another with --accelerate_config.")
    return settings or {}


def _device_count() -> tuple[int, str]:
    """(devices accelerate can run one process each on, what was found when none): MPS runs one process only."""
    import torch

    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if found is None:
        return 0, "no GPU found"
    if found.type == "mps":
        return 0, "accelerate runs several processes on GPUs, not on MPS"
    return torch.accelerator.device_count(), ""


def plan_devices(launch: list[str], use_cpu: bool) -> tuple[list[str], dict, str | None]:
    """(launch flags, environment for the launch, a line to print or None): several processes on a machine without
    a GPU, or asked onto the CPU, run over gloo; a launch this machine cannot run raises ConfigError."""
    flags = _flag_values(launch)
    settings = _config_file_settings(flags)
    kind = "MULTI_GPU" if flags.get("multi_gpu") else str(settings.get("distributed_type", "NO")).upper()
    processes = flags.get("num_processes", settings.get("num_processes"))
    machines = max(int(flags.get("num_machines", settings.get("num_machines")) or 1), 1)
    on_cpu = use_cpu or bool(flags.get("cpu")) or bool(settings.get("use_cpu"))
    asked = _what_asked(flags, kind)
    if kind in SHARDED:  # with any number of processes, before they start
        devices, none_found = (0, "") if on_cpu else _device_count()  # asked onto the CPU: torch is not imported
        if on_cpu or not devices:
            where = "the CPU is asked for (--cpu or use_cpu)" if on_cpu else f"this machine has none ({none_found})"
            raise ConfigError(f"{asked} shards the model over GPUs with {SHARDED[kind]}, which accelerate does not do "
                              f"on the CPU, and {where}: run it on GPUs, or train on the CPU with --accelerate_config "
                              "multi_gpu.")
    if processes is None or int(processes) // machines < 2 or kind == "MULTI_CPU":
        return launch, {}, None  # one process (CPU or GPU, accelerate's choice), or accelerate's own CPU launch
    per_machine = int(processes) // machines
    devices, none_found = (0, "") if on_cpu else _device_count()
    if on_cpu or not devices:
        launch = [flag for flag in launch if flag != "--cpu"] + ([] if kind == "MULTI_GPU" else ["--multi_gpu"])
        note = None if on_cpu else (f"posttrain: {none_found}: running the {per_machine} processes on the CPU over "
                                    "gloo (add --cpu to say so and silence this line).")
        return launch, {"ACCELERATE_USE_CPU": "true"}, note
    if per_machine > devices and "gpu_ids" not in flags:
        raise ConfigError(f"{asked} starts {per_machine} processes on this machine, one per GPU, and it has "
                          f"{devices}: give --num_processes {devices * machines}, or add --cpu to run them on the "
                          "CPU.")
    return launch, {}, None


def with_a_free_port(launch: list[str]) -> list[str]:
    """On one machine, with no port named (flag or config file), the processes meet on a free port rather than
    torchrun's fixed 29500: two runs on one machine do not collide. Several machines need the port they agreed on."""
    flags = _flag_values(launch)
    settings = _config_file_settings(flags)
    machines = int(flags.get("num_machines", settings.get("num_machines")) or 1)
    if machines > 1 or "main_process_port" in flags or settings.get("main_process_port") is not None:
        return launch
    return [*launch, "--main_process_port", "0"]


def _what_asked(flags: dict, kind: str) -> str:
    """The launch setting that chose `kind`, as the user wrote it."""
    path = flags.get("config_file")
    if flags.get("multi_gpu") or path is None:
        return "--multi_gpu" if flags.get("multi_gpu") else f"accelerate's default config ({kind})"
    name = os.path.splitext(os.path.basename(path))[0]
    shipped = os.path.dirname(os.path.abspath(path)) == CONFIG_DIR and name in SHIPPED
    return f"accelerate_config {name}" if shipped else f"accelerate_config {path} ({kind})"


def relaunch(command: str, launch: list[str], rest: list[str], use_cpu: bool = False) -> int:
    """Run `posttrain <command> <rest>` under `accelerate launch <launch>`, fitted to this machine's devices
    (plan_devices); its exit code."""
    launch, env, note = plan_devices(launch, use_cpu)
    launch = with_a_free_port(launch)
    if "--quiet" in rest:  # posttrain's --quiet, and accelerate's (only the failing process's traceback)
        launch = [*launch, "--quiet"]
    cmd = [sys.executable, "-m", "posttrain.launch", *launch, "-m", "posttrain.cli", command, *rest]
    if "--quiet" not in rest:
        print("posttrain: launching with accelerate: " + " ".join(launch), file=sys.stderr, flush=True)
        if note:
            print(note, file=sys.stderr, flush=True)
    return _wait_for(subprocess.Popen(cmd, env={**os.environ, **env, LAUNCHED: "1"}))


def _wait_for(launcher: subprocess.Popen) -> int:
    """The launcher's exit code, once it and its processes have stopped. A terminal's Ctrl-C reaches the launcher
    as it reaches this process (one process group), and the launcher passes it on to every process and waits for
    them: SIGINT is ignored here meanwhile, and a SIGTERM sent to this process is passed on to the launcher."""
    import signal

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: launcher.send_signal(signum))}
    try:
        return launcher.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_accelerate(argv: list[str]) -> int:
    """`accelerate launch argv`; a process that failed printed its own error, so the launcher's traceback is replaced
    by one line (none for a process that printed one: USER_ERROR_EXIT, or 128 + a signal). Its exit code."""
    import logging

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger(api.__name__).setLevel(logging.CRITICAL)  # its per-process lines: the one below says it
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except subprocess.CalledProcessError as err:  # the single-process launcher
        return _report_exit("the process", err.returncode)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        return _report_exit(f"process {rank}", failure.exitcode, ", and the launcher stopped the others")
    except SignalException as err:  # passed on to every process, which stopped and said where it stopped
        return 128 + int(err.sigval)
    return 0


def _report_exit(who: str, code: int, others: str = "") -> int:
    """Say how `who` ended, unless it printed its own error; the launcher's exit code."""
    import signal

    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        print(f"posttrain: {who} was killed by {name}{' (out of memory?)' if name == 'SIGKILL' else ''}{others}.",
              file=sys.stderr)
        return 128 - code
    if code != USER_ERROR_EXIT and code <= 128:
        print(f"posttrain: {who} exited with status {code}{others}.", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(run_accelerate(sys.argv[1:]))
