"""Checkpoints that resume to the same result: written atomically, loaded without pickle.

A checkpoint directory `checkpoint-<step>` holds:
    model.safetensors (or adapter_model.safetensors), tokenizer, posttrain_config.yaml   policy
    <name>.safetensors                                         other models whose weights change (e.g. ref_model)
    optimizer.pt, scheduler.pt                                 state dicts, read with weights_only=True (under
                                                               DeepSpeed the optimizer is the engine's own files,
                                                               deepspeed/, one per process: training/sharding.py)
    rng_state_<rank>.pt                                        python, numpy, torch (+cuda), the trainer's generators
    buffer_<rank>.safetensors                                  the trainer's per-process tensors (GRPO: micro-batches
                                                               generated but not yet trained on)
    trainer_state.json                                         step, epoch, log history, the trainer's data position
It is written to `checkpoint-<step>.tmp` and renamed into place once complete, so a run killed while
saving leaves the previous checkpoint as it was. trainer_state.json is written last; a directory
without it is not a checkpoint. With `save_only_model`, only the policy and trainer_state.json are written, and the
checkpoint cannot be resumed from.

save_checkpoint and load_checkpoint take the run's state as one explicit object, `RunState`, and the sharding
strategy: nothing here reads a trainer. A trainer declares what it adds to the common state (the policy, optimizer,
schedule and TrainerState) in a `CheckpointExtras`:
    meta        JSON values (data position, controllers), back in trainer_state.json
    tensors     this process's tensors, returned by load_checkpoint for the trainer to take back
    generators  random generators besides the global ones, restored in place
    models      extra models whose weights training changes (e.g. a synced ref_model), restored in place
and `RunState.identity` holds what must not change between a checkpoint and the run resuming from it (the model's
fingerprint, the config fields that give the state its meaning).
"""

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.training.distributed import guarded

logger = logging.getLogger("posttrain")
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be resumed from; the message names it."""


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `output_dir`, oldest first, as (step, path)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.exists(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve(resume, output_dir: str) -> str | None:
    """The checkpoint to resume from: a path, True for the newest intact one in output_dir, or None/False for none.

    With True, a checkpoint that fails its checksums (or whose state file does not parse) is skipped, with a
    warning naming it and the one resumed from instead.
    """
    if resume in (None, False, "", "false", "False"):
        return None
    if resume is True or resume in ("true", "True"):
        found = checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint.")
        problems = []
        for _, path in reversed(found):
            try:
                verify(path)
            except CheckpointError as err:
                problems.append(str(err))
                continue
            for problem in problems:
                logger.warning("%s Resuming from %s instead.", problem, path)
            return path
        raise CheckpointError(f"No checkpoint in {output_dir} is intact: {' '.join(problems)}")
    if not os.path.exists(os.path.join(resume, STATE_FILE)):
        raise CheckpointError(f"{resume} is not a complete checkpoint (no {STATE_FILE}): pick another, or True "
                              "for the newest complete one.")
    return resume


def _digest(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _digests(directory: str) -> dict[str, str]:
    """SHA-256 of every file in a checkpoint directory but its state file."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, directory)
            if relative != STATE_FILE:
                out[relative] = _digest(full)
    return dict(sorted(out.items()))


def read_state(path: str) -> dict:
    """A checkpoint's trainer_state.json; CheckpointError, naming it, when it cannot be read or parsed."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"Checkpoint {path} is corrupt: its {STATE_FILE} cannot be read "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'empty'}).") from err
    if not isinstance(state, dict) or "global_step" not in state:
        raise CheckpointError(f"Checkpoint {path} is corrupt: its {STATE_FILE} is not a posttrain trainer state.")
    return state


def verify(path: str) -> dict:
    """Check every file of a checkpoint against the SHA-256 written with it; returns its state.

    Checkpoints from before checksums were written are only checked for a readable state file.
    """
    state = read_state(path)
    for name, digest in state.get("files", {}).items():
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise CheckpointError(f"Checkpoint {path} is corrupt: {name} is missing.")
        if _digest(full) != digest:
            raise CheckpointError(f"Checkpoint {path} is corrupt: {name} does not match the checksum written with it "
                                  "(truncated or changed since).")
    return state


# ------------------------------------------------------------------ pieces of state


def rng_state(generators: dict) -> dict:
    """The global random states (python, numpy, torch, CUDA) and those of `generators` (name -> Generator)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss],
             "torch": torch.get_rng_state(), **{name: g.get_state() for name, g in generators.items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generators: dict) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    for name, g in generators.items():
        g.set_state(state[name])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ writing and reading


# config entries that say how a model was loaded or where from, not what it is
_VOLATILE = {"_name_or_path", "transformers_version", "use_cache", "_attn_implementation", "_commit_hash",
             "torch_dtype", "dtype", "architectures"}


def model_fingerprint(model) -> str:
    """What the model is, not how its path is spelled: a hash of its config (less where it was loaded from) and of
    its weights as they were before training (names, shapes, dtypes and an evenly strided sample of the values;
    LoRA adapters left out, since they start fresh each run).

    Computed once, at the trainer's set-up, so a resumed run (loading the same base) gets the same value wherever
    the model's directory now is or however its path is written.
    """
    import hashlib

    from posttrain.models.keywords import unwrap

    plain = unwrap(model)
    h = hashlib.sha256()
    config = {k: v for k, v in plain.config.to_dict().items() if k not in _VOLATILE}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    from posttrain.training import zero

    for name, p in sorted(plain.named_parameters()):
        if "lora_" in name or "modules_to_save" in name:
            continue
        with zero.gathered([p]):  # whole for the sample under ZeRO-3 (a collective, every process computes it)
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu()
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class CheckpointExtras:
    """What a trainer adds to its checkpoints (see the module's docstring)."""

    meta: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    generators: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)


@dataclass
class RunState:
    """What a checkpoint holds of a run, as the trainer declares it (training/trainer.py `_run_state`).

    Attributes:
        accelerator: the run's accelerate Accelerator.
        model: the policy as prepared for training (possibly wrapped); `policy` the module itself.
        processing_class: the tokenizer or processor saved beside the policy.
        optimizer, lr_scheduler: as prepared.
        progress: transformers' TrainerState (step, epoch, log history, best checkpoint).
        config: the trainer's config (saved as posttrain_config.yaml; save_only_model).
        identity: what a resuming run must match (run_identity).
        extras: the trainer's own additions.
    """

    accelerator: Any
    model: Any
    policy: Any
    processing_class: Any
    optimizer: Any
    lr_scheduler: Any
    progress: Any
    config: Any
    identity: dict
    extras: CheckpointExtras


@dataclass(frozen=True)
class Restored:
    """What load_checkpoint hands back to the trainer: trainer_state.json's values (the trainer's meta among them)
    and this process's tensors."""

    state: dict
    tensors: dict


def run_identity(config, meaning_fields: tuple, fingerprint: str, policy) -> dict:
    """What must match between a checkpoint and the run resuming from it: the model (its `fingerprint` and whether it
    trains a peft adapter) and the config's `meaning_fields`."""
    identity = {k: getattr(config, k) for k in meaning_fields}
    identity.update(model=fingerprint, peft=type(policy).__name__ if hasattr(policy, "peft_config") else None)
    return identity


def _model_path(policy) -> str:
    return getattr(policy.config, "_name_or_path", "")


def _load_weights(model, state: dict) -> None:
    """load_state_dict that tolerates only the keys save_pretrained drops for tied weights."""
    from posttrain.models.checkpoint_classes import in_model_names

    state = in_model_names(model, state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {model.get_parameter(k).data_ptr() for k in state if k in dict(model.named_parameters())}
    untied = [k for k in missing if model.get_parameter(k).data_ptr() not in loaded]
    if unexpected or untied:
        raise KeyError(f"weights do not match the model (missing {untied}, unexpected {unexpected})")


def _write_state(run: RunState, tmp: str, model_only: bool) -> None:
    progress = run.progress
    state = {"global_step": progress.global_step, "epoch": progress.epoch, "log_history": progress.log_history,
             "total_flos": progress.total_flos, "num_input_tokens_seen": progress.num_input_tokens_seen,
             "best_metric": progress.best_metric,
             "best_global_step": progress.best_global_step, "best_model_checkpoint": progress.best_model_checkpoint,
             "num_processes": run.accelerator.num_processes, "identity": run.identity, "model_only": model_only,
             "model_path": _model_path(run.policy), **run.extras.meta, "files": _digests(tmp)}
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump(state, f)


def save_checkpoint(run: RunState, sharding, output_dir: str, total_limit: int | None = None,
                    prefix: str = "checkpoint") -> str:
    """Write the run's full state to output_dir/<prefix>-<step>, atomically; every process calls it (`sharding`
    gathers sharded weights and writes the optimizer). Returns its path.

    prefix="emergency-checkpoint" writes one that `resume_from_checkpoint=True` does not pick by itself.
    """
    model_only = bool(run.config.save_only_model)
    final = os.path.join(output_dir, f"{prefix}-{run.progress.global_step}")
    tmp = final + ".tmp"
    whole = sharding.full_state_dict(run.model)  # sharded weights: gathered by every process (a collective)
    models = {} if model_only else run.extras.models
    extra = {name: sharding.full_state_dict(module) for name, module in models.items()}
    acc = run.accelerator
    with guarded(acc, writing=tmp):  # a failed write on one process stops every process (training/distributed.py)
        if acc.is_main_process:
            _write_main_files(run, tmp, whole, models, extra, model_only)
    with guarded(acc, writing=tmp):
        if not model_only:
            _write_process_files(run, sharding, tmp)
    with guarded(acc, writing=final):
        if acc.is_main_process:
            _write_state(run, tmp, model_only)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in rotated_away(checkpoints(output_dir), total_limit, run.progress.best_model_checkpoint):
                shutil.rmtree(old, ignore_errors=True)
    return final


def _write_main_files(run: RunState, tmp: str, whole, models: dict, gathered: dict, model_only: bool) -> None:
    """The main process's files: the policy, the schedule and the extra models (`gathered`: their whole state
    dicts when sharded, else None)."""
    from safetensors.torch import save_file, save_model

    from posttrain.training.saving import save_policy

    shutil.rmtree(tmp, ignore_errors=True)
    save_policy(run.policy, run.processing_class, run.config.to_dict(), tmp, whole)
    if model_only:
        return
    torch.save(run.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    for name, module in models.items():
        if gathered[name] is None:
            save_model(module, os.path.join(tmp, f"{name}.safetensors"))  # tied weights stored once
        else:  # sharded: the gathered whole state dict
            save_file(gathered[name], os.path.join(tmp, f"{name}.safetensors"))


def _write_process_files(run: RunState, sharding, tmp: str) -> None:
    """Every process's files: the optimizer (a collective when sharded), its random state and its tensors."""
    from safetensors.torch import save_file

    sharding.save_optimizer(run.model, run.optimizer, tmp)
    rank = run.accelerator.process_index
    torch.save(rng_state(run.extras.generators), os.path.join(tmp, f"rng_state_{rank}.pt"))
    save_file(run.extras.tensors, os.path.join(tmp, f"buffer_{rank}.safetensors"))


def rotated_away(found: list[tuple[int, str]], total_limit: int | None, best: str | None) -> list[str]:
    """The checkpoints (of `found`, oldest first) that save_total_limit removes: the oldest beyond the limit, never
    the best (it counts as the newest but one, as in transformers; with a limit of 1 the newest stays too)."""
    if not total_limit:
        return []
    paths = [path for _, path in found]
    if best in paths and paths.index(best) < len(paths) - 2:
        paths.remove(best)
        paths.insert(len(paths) - 1, best)
    if total_limit == 1 and best in paths and paths[-1] != best:
        total_limit = 2
    return paths[:-total_limit]


def _check_resumable(run: RunState, path: str, state: dict) -> None:
    if state.get("model_only"):
        raise CheckpointError(f"{path} was written with save_only_model=True: it holds the model but no optimizer or "
                              "data position, so it cannot be resumed from; load it as a model instead.")
    processes = run.accelerator.num_processes
    if state["num_processes"] != processes:  # first: it explains batch-size differences too
        raise CheckpointError(f"{path} was written by {state['num_processes']} process(es); this run has "
                              f"{processes}: resume with the same number of processes (and the "
                              "same per-device batch sizes).")
    now, then = run.identity, state.get("identity", {})
    if "model" in then and then["model"] != now["model"] and len(str(then["model"])) == 16:
        raise CheckpointError(f"Cannot resume from {path}: it was written for another model (its config or weights "
                              f"differ from this run's; that run loaded {state.get('model_path')!r}, this one "
                              f"{_model_path(run.policy)!r}). Load the same model, or start a new run.")
    changed = {k: (v, now.get(k)) for k, v in then.items() if k != "model" and now.get(k) != v}
    if changed:
        listing = "; ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise CheckpointError(f"Cannot resume from {path}: the run differs in what its state means ({listing}). "
                              "Use the checkpoint's values, or start a new run.")


def _load_policy(run: RunState, sharding, path: str) -> None:
    from safetensors.torch import load_file

    from posttrain.models.peft import is_peft_model

    if is_peft_model(run.policy):
        from peft import set_peft_model_state_dict

        with sharding.writable_whole(run.model):  # sharded: every process, the adapter whole
            set_peft_model_state_dict(run.policy, load_file(os.path.join(path, "adapter_model.safetensors")))
    elif sharding.shards_parameters:  # under the model's own plain names, as _load_weights reads them
        from posttrain.models.checkpoint_classes import in_model_names
        from posttrain.weights import plain_name

        own = {plain_name(name): tensor for named in (run.policy.named_parameters(remove_duplicate=False),
                                                      run.policy.named_buffers()) for name, tensor in named}
        state = in_model_names(run.policy, load_file(os.path.join(path, "model.safetensors")), own)
        sharding.load_full_state_dict(run.model, state)
    else:
        _load_weights(run.policy, load_file(os.path.join(path, "model.safetensors")))


def _load_error(path: str, err: Exception, what: str, fix: str) -> CheckpointError:
    detail = str(err).splitlines()[0] if str(err) else "no detail"
    return CheckpointError(f"Checkpoint {path} {what} ({type(err).__name__}: {detail}){fix}.")


def load_policy_weights(run: RunState, sharding, path: str) -> None:
    """The policy's weights (or adapter) from checkpoint `path`, checked against their checksums first; nothing
    else (load_best_model_at_end). Every process calls it."""
    verify(path)
    try:
        _load_policy(run, sharding, path)
    except Exception as err:  # noqa: BLE001 - safetensors and torch each raise their own types
        raise _load_error(path, err, "holds weights that do not load into the model", "") from err


def load_checkpoint(run: RunState, sharding, path: str) -> Restored:
    """Restore the weights, optimizer, scheduler, random state and the extra models and generators from `path`;
    every process calls it. Returns trainer_state.json and this process's tensors."""
    state = verify(path)  # every file against its checksum, before anything is loaded
    _check_resumable(run, path, state)
    try:
        _load_policy(run, sharding, path)
        return Restored(state, _load_the_rest(run, sharding, path))
    except Exception as err:  # noqa: BLE001 - safetensors, torch and json each raise their own types
        raise _load_error(path, err, "is incomplete or corrupt", "; resume from an earlier one") from err


def _load_the_rest(run: RunState, sharding, path: str) -> dict:
    """Everything but the policy, in place; returns this process's tensors."""
    from safetensors.torch import load_file, load_model

    for name, module in run.extras.models.items():
        if sharding.shards_parameters:
            sharding.load_full_state_dict(module, load_file(os.path.join(path, f"{name}.safetensors")))
        else:
            load_model(module, os.path.join(path, f"{name}.safetensors"))
    rank = run.accelerator.process_index
    sharding.load_optimizer(run.model, run.optimizer, path)
    run.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
    set_rng_state(torch.load(os.path.join(path, f"rng_state_{rank}.pt"), weights_only=True), run.extras.generators)
    return load_file(os.path.join(path, f"buffer_{rank}.safetensors"))  # on the CPU: the trainer places them
