"""What a trainer sets up before its loop: its config (TRL's conversion of a TrainingArguments), the quantization
config, the Accelerator (DDP, process group, DeepSpeed plugin; on a CPU the heap kept, training/heap.py), log levels,
and the FLOP count of a token."""

import dataclasses
import datetime
import logging
import os

import torch

from posttrain.training.distributed import mark_agreed
from posttrain.training.heap import heap_pays, keep_freed_host_memory, return_freed_host_memory
from posttrain.training.optim import make_adam_states

logger = logging.getLogger("posttrain")


def training_flops_per_token(model) -> int:
    """6 x the parameters outside the input embeddings (transformers' count; a ZeRO-3 parameter counts whole)."""
    from posttrain.training.zero import whole_numel

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return 6 * sum(whole_numel(p) for p in model.parameters() if id(p) not in embeddings)


def run_length_unknown() -> Exception:
    """The error of a run over an IterableDataset without max_steps (every trainer's)."""
    from posttrain.configs import ConfigError

    return ConfigError("With an IterableDataset the length of training is unknown: set max_steps.")


def allow_unused_parameters(args, accelerator, model) -> None:
    """For a vision-language model, whose vision tower a text batch never reaches, DDP looks for parameters that get
    no gradient (ddp_find_unused_parameters=True where it is unset), as TRL sets it; not under reentrant
    checkpointing, which fails with it. Before the accelerator prepares the model."""
    from accelerate.utils import DistributedDataParallelKwargs

    from posttrain.models.checkpoint_classes import is_vision_language

    if not is_vision_language(model) or args.ddp_find_unused_parameters is not None or \
            (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        return
    args.ddp_find_unused_parameters = True
    if accelerator.ddp_handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    else:
        accelerator.ddp_handler.find_unused_parameters = True


def make_accelerator(args, mixed_precision: str):
    """An Accelerator for `args` (DDP and process-group options included); in a process that already made one with
    another precision (a notebook, a test run), its process-wide state is reset first. The distributed state
    (process group) is kept."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    init = {"timeout": datetime.timedelta(seconds=args.ddp_timeout)}
    if args.ddp_backend is not None:
        init["backend"] = args.ddp_backend
    handlers = [InitProcessGroupKwargs(**init)]
    ddp = {key: getattr(args, f"ddp_{key}") for key in ("find_unused_parameters", "bucket_cap_mb",
                                                          "broadcast_buffers", "static_graph")}
    ddp = {k: v for k, v in ddp.items() if v is not None}
    if ddp:
        handlers.append(DistributedDataParallelKwargs(**ddp))
    if not torch.accelerator.is_available():  # DeepSpeed, imported by accelerate and transformers wherever it is
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # installed, would warn in every run that it found no GPU
    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    # The schedule is built for optimizer steps: accelerate would otherwise step it once per process at every step
    # (it assumes a schedule sized for one process's batches), and with 2 processes the learning rate decays twice
    # as fast.
    try:
        accelerator = Accelerator(cpu=args.use_cpu, mixed_precision=mixed_precision, kwargs_handlers=handlers,
                                  step_scheduler_with_optimizer=False, deepspeed_plugin=_deepspeed_plugin(args))
    except RuntimeError as err:
        from posttrain.configs import ConfigError

        # accelerate's words for it: "no available devices found" up to 1.15, "`sync_module_states=True` is not
        # supported on cpu" from 1.16
        said = any(words in str(err) for words in ("no available devices found", "is not supported on cpu"))
        if said and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            raise mark_agreed(ConfigError(  # every process raises it
                "This run was launched with FSDP loading the weights on one process and sharing them "
                "(fsdp_cpu_ram_efficient_loading or fsdp_sync_module_states), which accelerate sets up only on a "
                "GPU, and this machine has none: run it on GPUs, or launch with DDP (accelerate_config multi_gpu)."
            )) from err
        raise
    return accelerator


def prepare_host_memory(accelerator, args, model, optimizer) -> None:
    """The step's buffers reused without page faults (training/heap.py), where that pays: on a CPU, with fast paths
    on, a model whose weights take at least HEAP_PAYS_FROM bytes, and not where the user traded time for memory
    (gradient checkpointing). With the heap kept, a lone process's torch Adam or AdamW also makes its states now, as
    its first step would (training/optim.py make_adam_states): the first step then holds all the one-time work, where
    the second one otherwise faulted in another 1 GB of pages (1.5-2 s at Qwen2.5-0.5B's shape). Where the user
    traded time for memory, large freed blocks go back to the system at once instead (heap.return_freed_host_memory)."""
    from accelerate.utils import DistributedType

    if accelerator.device.type != "cpu" or not args.fast_paths:
        return
    if args.gradient_checkpointing:
        return_freed_host_memory()
    elif heap_pays(model):
        keep_freed_host_memory()
        if accelerator.distributed_type == DistributedType.NO:
            make_adam_states(optimizer)


def _deepspeed_plugin(args):
    """accelerate's DeepSpeed plugin for the `deepspeed` field (a JSON path or a dict), or None."""
    if not args.deepspeed:
        return None
    import copy

    from accelerate.utils import DeepSpeedPlugin

    from posttrain.configs import ConfigError

    config = os.path.expanduser(args.deepspeed) if isinstance(args.deepspeed, str) else copy.deepcopy(args.deepspeed)
    try:
        return DeepSpeedPlugin(hf_ds_config=config)
    except (ValueError, OSError, TypeError, KeyError) as err:
        raise ConfigError(f"deepspeed={args.deepspeed!r} is not a DeepSpeed config accelerate can read "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}).") from err


def set_log_level(args, is_main: bool) -> None:
    level = args.log_level if is_main else args.log_level_replica
    if level == "passive":
        return
    import transformers

    logger.setLevel(level.upper())
    transformers.utils.logging.set_verbosity(getattr(logging, level.upper()))


def trainer_config(config_cls, args, model, title: str):
    """A trainer's config, as TRL's trainers take `args`: the config itself; None: TRL's defaults with output_dir
    `<model name>-<title>`; a transformers TrainingArguments: converted to `config_cls` with its values (the trainer's
    own fields at their defaults). A TrainingArguments field the config does not know stops the run only when it is
    set to something other than its default."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(output_dir=f"{name.rstrip('/').split('/')[-1]}-{title}")
    from posttrain.configs import ConfigError

    if isinstance(args, config_cls):
        if type(args) is not config_cls and type(args).__module__.startswith("posttrain."):  # RLOOConfig to GRPO
            raise ConfigError(f"args is a {type(args).__name__}, which configures another trainer: give the "
                              f"{title} trainer a {config_cls.__name__}.")
        return args
    from transformers import TrainingArguments

    if not isinstance(args, TrainingArguments):
        raise ConfigError(f"args is a {type(args).__name__}: pass a {config_cls.__name__} (or transformers' "
                          "TrainingArguments).")
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict hides it
    values.pop("push_to_hub_token", None)
    known = {f.name for f in dataclasses.fields(config_cls)}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    unknown = sorted(k for k in values if k not in known and values[k] != defaults.get(k, dataclasses.MISSING))
    if unknown:
        raise ConfigError(f"args sets TrainingArguments field(s) {', '.join(unknown)}, which {config_cls.__name__} "
                          "does not have: leave them at their defaults.")
    return config_cls(**{k: v for k, v in values.items() if k in known})


def take_quantization_config(model, args, quantization_config) -> None:
    """A trainer's `quantization_config` argument (TRL's, from get_quantization_config) into model_init_kwargs, for a
    model loaded from a path or hub id; refused, in one sentence, for a model already loaded."""
    if quantization_config is None:
        return
    from posttrain.configs import ConfigError

    if not isinstance(model, str):
        raise ConfigError("quantization_config applies when the model is loaded from a path or hub id, and this model "
                          "is already loaded: pass its path, or load it quantized yourself.")
    init = args.model_init_kwargs or {}
    if init.get("quantization_config") is not None:
        raise ConfigError("quantization_config is given both to the trainer and in model_init_kwargs: keep one.")
    args.model_init_kwargs = {**init, "quantization_config": quantization_config}
