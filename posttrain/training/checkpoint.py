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

What a trainer adds to its checkpoints it says through these methods:
    _checkpoint_meta() -> dict, _restore_position(meta)     JSON state (data position, controllers)
    _checkpoint_tensors() -> dict, _load_checkpoint_tensors(tensors, device)   per-process tensors
    _checkpoint_generators() -> dict[str, torch.Generator]  random generators besides the global ones
    _checkpoint_models() -> dict[str, nn.Module]            extra models whose weights training changes
    _meaning_fields                                          config fields whose change makes the state mean
                                                             something else (resume refuses such a change)
"""

import json
import logging
import os
import random
import re
import shutil

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


def run_identity(trainer) -> dict:
    """What must match between a checkpoint and the run resuming from it: the model and the batch layout."""
    identity = {k: getattr(trainer.args, k) for k in trainer._meaning_fields}
    identity.update(model=trainer._model_fingerprint,
                    peft=type(trainer.policy).__name__ if hasattr(trainer.policy, "peft_config") else None)
    return identity


def _load_weights(model, state: dict) -> None:
    """load_state_dict that tolerates only the keys save_pretrained drops for tied weights."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {model.get_parameter(k).data_ptr() for k in state if k in dict(model.named_parameters())}
    untied = [k for k in missing if model.get_parameter(k).data_ptr() not in loaded]
    if unexpected or untied:
        raise KeyError(f"weights do not match the model (missing {untied}, unexpected {unexpected})")


def _write_state(trainer, tmp: str, model_only: bool) -> None:
    acc = trainer.accelerator
    best = trainer.state
    state = {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
             "log_history": trainer.state.log_history, "total_flos": trainer.state.total_flos,
             "best_metric": best.best_metric, "best_global_step": best.best_global_step,
             "best_model_checkpoint": best.best_model_checkpoint,
             "num_processes": acc.num_processes, "identity": run_identity(trainer), "model_only": model_only,
             "model_path": getattr(trainer.policy.config, "_name_or_path", ""),
             **trainer._checkpoint_meta(), "files": _digests(tmp)}
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump(state, f)


def save_checkpoint(trainer, output_dir: str, total_limit: int | None = None, prefix: str = "checkpoint") -> str:
    """Write the trainer's full state to output_dir/<prefix>-<step>, atomically. Returns its path.

    prefix="emergency-checkpoint" writes one that `resume_from_checkpoint=True` does not pick by itself.
    """
    from safetensors.torch import save_file, save_model

    from posttrain.training.saving import save_policy

    acc = trainer.accelerator
    model_only = bool(getattr(trainer.args, "save_only_model", False))
    final = os.path.join(output_dir, f"{prefix}-{trainer.state.global_step}")
    tmp = final + ".tmp"
    sharding = trainer.sharding
    whole = sharding.full_state_dict(trainer.model)  # sharded weights: gathered by every process (a collective)
    extra = {} if model_only else {name: sharding.full_state_dict(module)
                                   for name, module in trainer._checkpoint_models().items()}
    with guarded(acc, writing=tmp):  # a failed write on one process stops every process (training/distributed.py)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            save_policy(trainer.policy, trainer.processing_class, trainer.args.to_dict(), tmp, whole)
            if not model_only:
                torch.save(trainer.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
                for name, module in trainer._checkpoint_models().items():
                    if extra[name] is None:
                        save_model(module, os.path.join(tmp, f"{name}.safetensors"))  # tied weights stored once
                    else:  # sharded: the gathered whole state dict
                        save_file(extra[name], os.path.join(tmp, f"{name}.safetensors"))
    with guarded(acc, writing=tmp):
        if not model_only:
            sharding.save_optimizer(trainer.model, trainer.optimizer, tmp)  # every process (a collective when sharded)
            rank = acc.process_index
            torch.save(rng_state(trainer._checkpoint_generators()), os.path.join(tmp, f"rng_state_{rank}.pt"))
            save_file(trainer._checkpoint_tensors(), os.path.join(tmp, f"buffer_{rank}.safetensors"))
    with guarded(acc, writing=final):
        if acc.is_main_process:
            _write_state(trainer, tmp, model_only)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in rotated_away(checkpoints(output_dir), total_limit, trainer.state.best_model_checkpoint):
                shutil.rmtree(old, ignore_errors=True)
    return final


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


def _check_resumable(trainer, path: str, state: dict) -> None:
    if state.get("model_only"):
        raise CheckpointError(f"{path} was written with save_only_model=True: it holds the model but no optimizer or "
                              "data position, so it cannot be resumed from; load it as a model instead.")
    if state["num_processes"] != trainer.accelerator.num_processes:  # first: it explains batch-size differences too
        raise CheckpointError(f"{path} was written by {state['num_processes']} process(es); this run has "
                              f"{trainer.accelerator.num_processes}: resume with the same number of processes (and the "
                              "same per-device batch sizes).")
    now = run_identity(trainer)
    then = state.get("identity", {})
    if "model" in then and then["model"] != now["model"] and len(str(then["model"])) == 16:
        raise CheckpointError(f"Cannot resume from {path}: it was written for another model (its config or weights "
                              f"differ from this run's; that run loaded {state.get('model_path')!r}, this one "
                              f"{getattr(trainer.policy.config, '_name_or_path', '')!r}). Load the same model, or start "
                              "a new run.")
    changed = {k: (v, now.get(k)) for k, v in then.items() if k != "model" and now.get(k) != v}
    if changed:
        listing = "; ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise CheckpointError(f"Cannot resume from {path}: the run differs in what its state means ({listing}). "
                              "Use the checkpoint's values, or start a new run.")


def _load_policy(trainer, path: str) -> None:
    from safetensors.torch import load_file

    from posttrain.models.peft import is_peft_model

    if is_peft_model(trainer.policy):
        from peft import set_peft_model_state_dict

        with trainer.sharding.writable_whole(trainer.model):  # sharded: every process, the adapter whole
            set_peft_model_state_dict(trainer.policy, load_file(os.path.join(path, "adapter_model.safetensors")))
    elif trainer.sharding.shards_parameters:
        trainer.sharding.load_full_state_dict(trainer.model, load_file(os.path.join(path, "model.safetensors")))
    else:
        _load_weights(trainer.policy, load_file(os.path.join(path, "model.safetensors")))


def load_policy_weights(trainer, path: str) -> None:
    """The policy's weights (or adapter) from checkpoint `path`, checked against their checksums first; nothing
    else (load_best_model_at_end). Every process calls it."""
    verify(path)
    try:
        _load_policy(trainer, path)
    except Exception as err:  # noqa: BLE001 - safetensors and torch each raise their own types
        raise CheckpointError(f"Checkpoint {path} holds weights that do not load into the model "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}).") \
            from err


def load_checkpoint(trainer, path: str) -> dict:
    """Restore weights, optimizer, scheduler, RNG and the trainer's tensors from `path`; returns trainer_state.json."""
    from safetensors.torch import load_file, load_model

    state = verify(path)  # every file against its checksum, before anything is loaded
    _check_resumable(trainer, path, state)
    try:
        _load_policy(trainer, path)
        for name, module in trainer._checkpoint_models().items():
            if trainer.sharding.shards_parameters:
                trainer.sharding.load_full_state_dict(module, load_file(os.path.join(path, f"{name}.safetensors")))
            else:
                load_model(module, os.path.join(path, f"{name}.safetensors"))
        device = trainer.accelerator.device
        rank = trainer.accelerator.process_index
        trainer.sharding.load_optimizer(trainer.model, trainer.optimizer, path)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
        set_rng_state(torch.load(os.path.join(path, f"rng_state_{rank}.pt"), weights_only=True),
                      trainer._checkpoint_generators())
        trainer._load_checkpoint_tensors(load_file(os.path.join(path, f"buffer_{rank}.safetensors")), device)
    except Exception as err:  # noqa: BLE001 - safetensors, torch and json each raise their own types
        raise CheckpointError(f"Checkpoint {path} is incomplete or corrupt ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else 'no detail'}); resume from an earlier "
                              "one.") from err
    return state
