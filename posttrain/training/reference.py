"""The reference model of a run that trains its policy against a frozen one (DPO; KTO's reference fields are the
same), and reference log-probs computed once before training.

Which reference (in this order):
    reference_free            none: its log-probs are 0 (DPO's field; a config without it has a reference)
    ref_model given           that model (a path or hub id is loaded with ref_model_init_kwargs or model_init_kwargs)
    LoRA                      the policy with adapters off, or with a frozen copy of the adapter it came with
    precompute_ref_log_probs  the policy itself, before its first update (no copy is kept)
    otherwise                 a frozen copy of the initial policy

A ref_model given must read the policy's token ids (check_vocabulary): one whose embedding has fewer rows than the
tokenizer has tokens, or whose own tokenizer (beside it on disk) gives an id another token, is refused. A padded
embedding (more rows than tokens, as resize_token_embeddings(pad_to_multiple_of=64) leaves it) is the same vocabulary.

Precomputed log-probs are cached under $POSTTRAIN_CACHE/ref_logps (default ~/.cache/posttrain), one file per key:
the prepared rows (which already reflect the data, the chat template, max_length and truncation), a digest of every
byte of the reference's weights and its config (weights_digest), the chat template, and the trainer's settings that
change the log-probs (DPO: max_length, truncation_mode and ld_alpha). Each file holds the log-probs and a SHA-256 of
them; a file whose content does not match its digest (corrupted, or edited) is recomputed, with a warning, and
rewritten.
"""

import hashlib
import json
import logging
import os

import numpy as np
import torch

from posttrain.configs import ConfigError
from posttrain.data import vocabulary_rows
from posttrain.models.keywords import unwrap
from posttrain.models.partitioned import gathered, is_partitioned
from posttrain.models.peft import is_peft_model
from posttrain.models.preparation import disable_dropout, reference_of

logger = logging.getLogger("posttrain")


def _frozen(model, args, device):
    if args.disable_dropout:
        disable_dropout(model)
    return model.to(device).eval().requires_grad_(False)


def make_reference(policy, ref_model, args, came_with_adapter: bool, device, trust_remote_code: bool, tokenizer):
    """(reference model or None, reference adapter name or None) for this run (see the module's docstring);
    `tokenizer` is the policy's (processing_class), which a given ref_model must share."""
    if ref_model is not None and (ref_model is policy or (is_peft_model(policy) and ref_model is
                                                           policy.get_base_model())):
        raise ConfigError("model and ref_model are the same object: omit ref_model and a frozen copy of the model "
                          "is made for you.")
    if getattr(args, "reference_free", False):
        return None, None
    if ref_model is not None:
        source = _tokenizer_source(ref_model, policy)
        if isinstance(ref_model, str):
            from posttrain.models.loading import load_causal_lm, with_trl_default_dtype

            kwargs = getattr(args, "ref_model_init_kwargs", None) or args.model_init_kwargs or {}
            ref_model = load_causal_lm(ref_model, with_trl_default_dtype({"trust_remote_code": trust_remote_code,
                                                                          **kwargs}))
        check_vocabulary(ref_model, policy, tokenizer, _tokenizer_beside(source, trust_remote_code), source)
        if args.sync_ref_model:
            _check_same_shapes(ref_model, policy)
        return _frozen(ref_model, args, device), None
    if args.precompute_ref_log_probs and not is_peft_model(policy):
        return None, None  # the policy, before its first update, computes them
    return reference_of(policy, args.sync_ref_model, came_with_adapter)


def check_teacher_given(teacher, args) -> None:
    """One sentence when distillation has no teacher (`teacher`, the trainer's argument, nor the config's
    teacher_model_name_or_path): before the student and the data load."""
    if teacher is None and args.teacher_model_name_or_path is None:
        raise ConfigError("DistillationTrainer needs a teacher: pass teacher_model=<a model or its path>, or set "
                          "teacher_model_name_or_path.")


def make_teacher(teacher, policy, args, device, trust_remote_code: bool, tokenizer):
    """On-policy distillation's teacher, frozen: `teacher` (a model, or a path or hub id) or the config's
    teacher_model_name_or_path, loaded with teacher_model_init_kwargs and teacher_model_revision. It must predict over
    the student's vocabulary (TRL compares the configs' vocab_size) and read its token ids (check_vocabulary)."""
    check_teacher_given(teacher, args)
    if teacher is None:
        teacher = args.teacher_model_name_or_path
    source = _tokenizer_source(teacher, policy)
    if isinstance(teacher, str):
        from posttrain.models.loading import load_causal_lm, with_trl_default_dtype

        kwargs = {"trust_remote_code": trust_remote_code, **(args.teacher_model_init_kwargs or {})}
        if args.teacher_model_revision is not None:
            kwargs.setdefault("revision", args.teacher_model_revision)
        teacher = load_causal_lm(teacher, with_trl_default_dtype(kwargs))
    elif args.teacher_model_init_kwargs is not None:
        raise ConfigError("teacher_model_init_kwargs is set, and the teacher is a model already loaded, so they would "
                          "be ignored: load the teacher with them yourself, or pass its path instead.")
    _check_language_model_head(teacher)
    if unwrap(teacher) is unwrap(policy):
        raise ConfigError("The teacher is the student model itself (the same object): the divergence between them is "
                          "0 and nothing trains; give a different (usually larger or fine-tuned) teacher.")
    mine, theirs = (getattr(unwrap(m).config.get_text_config(), "vocab_size", None) for m in (policy, teacher))
    if mine is not None and theirs is not None and mine != theirs:
        raise ConfigError(f"The student's vocab_size is {mine} and the teacher's {theirs}: distillation compares the "
                          f"two models' next-token distributions, which needs one vocabulary: "
                          f"{_FIX['teacher']}.")
    check_vocabulary(teacher, policy, tokenizer, _tokenizer_beside(source, trust_remote_code), source, "teacher")
    _note_teacher(teacher, policy, args)
    return teacher.to(device).eval().requires_grad_(False)


def _check_language_model_head(teacher) -> None:
    """The teacher must predict tokens: a sequence classifier (a reward model) or a bare body has no distribution to
    distil."""
    plain = unwrap(teacher)
    get = getattr(plain, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        kind = ("a sequence classifier (its head scores a whole sequence)"
                if type(plain).__name__.endswith("ForSequenceClassification") else "a model without a language-model "
                "head")
        raise ConfigError(f"The teacher ({type(plain).__name__}) is {kind}: distillation matches the teacher's "
                          "next-token distribution, so give a causal language model (its *ForCausalLM checkpoint).")


def _note_teacher(teacher, policy, args) -> None:
    """Warn once where the teacher cannot teach as given: the student's own weights (the divergence is 0, nothing
    trains), or a context shorter than the student's rollouts (it would score tokens past its positions)."""
    if _same_weights(unwrap(teacher), unwrap(policy)):
        logger.warning("The teacher has the student's own weights, so the divergence between them is 0 and nothing "
                       "trains: give a different (usually larger or fine-tuned) teacher.")
    student = getattr(unwrap(policy).config.get_text_config(), "max_position_embeddings", None)
    theirs = getattr(unwrap(teacher).config.get_text_config(), "max_position_embeddings", None)
    reach = min(x for x in (student, (args.max_prompt_length or student or 0) + args.max_completion_length) if x)
    if theirs is not None and reach and theirs < reach:
        logger.warning(f"The teacher's context is {theirs} positions, and the student's rollouts reach {reach} "
                       f"(max_prompt_length + max_completion_length, within the student's context): the teacher would "
                       f"score tokens past its positions; give a teacher with a longer context, or lower "
                       f"max_completion_length.")


def _same_weights(a, b) -> bool:
    """Whether two models hold the same parameters (names, shapes and values): compared until the first that
    differs."""
    theirs = dict(b.named_parameters())
    mine = list(a.named_parameters())
    if len(mine) != len(theirs):
        return False
    for name, p in mine:
        q = theirs.get(name)
        if q is None or is_partitioned(p) or is_partitioned(q):  # ZeRO-3's shards: not compared
            return False
        if q.shape != p.shape or q.device != p.device or not torch.equal(p.detach(), q.detach()):
            return False
    return True


# ---------------------------------------------------------------------- a given ref_model's vocabulary


def _name_or_path(model) -> str:
    return getattr(getattr(unwrap(model), "config", None), "_name_or_path", "") or ""


def _tokenizer_source(ref_model, policy) -> str | None:
    """Where a tokenizer saved with the ref_model can be found: the path or hub id it is given as, or the directory on
    this machine a model object was loaded from; None where that is the policy's own (its tokenizer is the policy's)
    or there is none."""
    path = ref_model if isinstance(ref_model, str) else _name_or_path(ref_model)
    if not path or (not isinstance(ref_model, str) and not os.path.isdir(path)):
        return None
    policy_path = _name_or_path(policy)
    return None if policy_path and os.path.abspath(path) == os.path.abspath(policy_path) else path


def _tokenizer_beside(source: str | None, trust_remote_code: bool):
    """The tokenizer saved with a ref_model (its path, hub id or local directory), or None where it has none."""
    if source is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                             local_files_only=os.path.isdir(source))
    except Exception as err:  # no tokenizer files beside the weights: only the embedding check applies
        logger.debug("No tokenizer beside ref_model %r (%s): its vocabulary is checked by size only.", source, err)
        return None


def _id_conflict(mine: dict, theirs: dict) -> tuple[int, str, str] | None:
    """(id, my token, their token) of an id the two vocabularies (token -> id) give different tokens, else None.
    Tokens only one of them has (added tokens) are no conflict."""
    by_id: dict[int, set] = {}
    for token, i in mine.items():
        by_id.setdefault(i, set()).add(token)
    their_ids: dict[int, set] = {}
    for token, i in theirs.items():
        their_ids.setdefault(i, set()).add(token)
    for i in sorted(set(by_id) & set(their_ids)):
        if not by_id[i] & their_ids[i]:
            return i, min(by_id[i]), min(their_ids[i])
    return None


_FIX = {"ref_model": "pass a ref_model that uses the policy's tokenizer, or omit ref_model for a frozen copy of the "
                     "model",
        "teacher": "distil from a teacher of the student's tokenizer (TRL's GOLD trainer maps between tokenizers)"}


def check_vocabulary(ref_model, policy, tokenizer, ref_tokenizer, source: str | None, role: str = "ref_model") -> None:
    """Refuse, in one sentence, a ref_model (or a distillation `teacher`) that cannot read the policy's token ids: an
    embedding with fewer rows than the tokenizer's tokens (and the policy's rows), or a tokenizer saved with it that
    names an id another token. More rows than tokens is padding (resize_token_embeddings' pad_to_multiple_of), not
    another vocabulary."""
    fix = _FIX[role]
    rows, policy_rows, tokens = vocabulary_rows(ref_model), vocabulary_rows(policy), len(tokenizer)
    if rows is not None and rows < min(tokens, policy_rows or tokens):
        raise ConfigError(f"{role}'s embedding has {rows} rows and the tokenizer (processing_class) has {tokens} "
                          f"tokens, so {role} was built for another vocabulary: {fix}.")
    if ref_tokenizer is None:
        return
    conflict = _id_conflict(tokenizer.get_vocab(), ref_tokenizer.get_vocab())
    if conflict is not None:
        i, mine, theirs = conflict
        raise ConfigError(f"{role}'s tokenizer ({source}) gives id {i} to {theirs!r} where the processing_class "
                          f"gives it to {mine!r}, so the {'teacher' if role == 'teacher' else 'reference'} would score "
                          f"other tokens than the policy: {fix}.")


def _check_same_shapes(ref_model, policy) -> None:
    """sync_ref_model mixes the policy's weights into the reference's, parameter by parameter."""
    def shapes(model):
        return [(name, tuple(getattr(p, "ds_shape", p.shape))) for name, p in unwrap(model).named_parameters()]

    reference, trained = shapes(ref_model), shapes(policy)
    if len(reference) != len(trained):
        raise ConfigError(f"sync_ref_model=True mixes the policy's weights into ref_model's, and ref_model has "
                          f"{len(reference)} parameters where the policy has {len(trained)}: pass a ref_model of the "
                          "policy's architecture and size, or omit it.")
    for (name, mine), (_, theirs) in zip(reference, trained):
        if mine != theirs:
            raise ConfigError(f"sync_ref_model=True mixes the policy's weights into ref_model's, and ref_model's "
                              f"{name} is {mine} where the policy's is {theirs}: pass a ref_model of the policy's "
                              "architecture and size, or omit it.")


# ---------------------------------------------------------------------- the precomputed log-probs' cache

_VOLATILE = {"_name_or_path", "transformers_version", "use_cache", "_attn_implementation", "_commit_hash",
             "architectures", "torch_dtype", "dtype"}  # where it came from, not what it computes (dtypes: the tensors')
DIGEST_CHUNK = 1 << 26  # bytes of a tensor hashed at a time (a GPU tensor is copied to the CPU this much at a time)


def _tensor_bytes(tensor: torch.Tensor):
    """A tensor's bytes (any dtype, bf16 included) as uint8 arrays of at most DIGEST_CHUNK, on the CPU."""
    flat = tensor.detach().reshape(-1).contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_zeros(0, dtype=torch.uint8)
    for start in range(0, raw.numel(), DIGEST_CHUNK):
        yield raw[start:start + DIGEST_CHUNK].cpu().numpy()  # a view on the CPU: hashed without a copy


def weights_digest(model) -> str:
    """SHA-256 of what a model computes with: its config (less where it was loaded from) and every byte of every
    parameter and buffer (names, shapes and dtypes with them; LoRA adapters left out: the reference runs with them
    off). Under ZeRO-3 each parameter is gathered whole (a collective: every process computes it). About 2 GB/s of
    weights on a CPU with SHA instructions (docs/dpo.md)."""
    plain = unwrap(model)
    h = hashlib.sha256()
    config = {k: v for k, v in plain.config.to_dict().items() if k not in _VOLATILE}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    tensors = sorted([*plain.named_parameters(), *plain.named_buffers()], key=lambda item: item[0])
    for name, tensor in tensors:
        if "lora_" in name or "modules_to_save" in name:
            continue
        with gathered([tensor]):
            h.update(f"\0{name}{tuple(tensor.shape)}{tensor.dtype}\0".encode())
            for chunk in _tensor_bytes(tensor):
                h.update(chunk)
    return h.hexdigest()


def cache_key(rows_fingerprint: str, reference_digest: str, tokenizer, settings: tuple) -> str:
    """The cache's key of the log-probs of these prepared rows under this reference, with the tokenizer's chat
    template and the trainer's `settings` that change them."""
    h = hashlib.sha256()
    for part in (rows_fingerprint, reference_digest, str(getattr(tokenizer, "chat_template", None)),
                 *map(str, settings)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def cache_path(key: str) -> str:
    root = os.environ.get("POSTTRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "posttrain"))
    return os.path.join(root, "ref_logps", f"{key}.npz")


def _content_digest(ref: np.ndarray) -> str:
    """SHA-256 of the log-probs' shape, dtype and bytes."""
    h = hashlib.sha256(f"{ref.shape}{ref.dtype}".encode())
    h.update(np.ascontiguousarray(ref).tobytes())
    return h.hexdigest()


def load_cached(key: str, shape: tuple, announce: bool = True) -> np.ndarray | None:
    """The cached log-probs of `shape` (DPO: [P, 2], each pair's chosen and rejected) under `key`, or None: none
    cached, or (with a warning, from the `announce`ing process) a file that does not hold what was written (its
    content does not match the digest stored with it), which is then recomputed and rewritten. A cache is not a
    store of record: recomputing costs one pass over the rows, while refusing would leave the user to find and
    delete the file."""
    path = cache_path(key)
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            ref, digest = stored["ref"], str(stored["sha256"])
    except Exception as err:  # truncated, not an npz, a missing entry: unreadable is as good as absent
        if announce:
            logger.warning("The cached reference log-probs at %s cannot be read (%s: %s): computing them again.",
                           path, type(err).__name__, err)
        return None
    if digest != _content_digest(ref):
        problem = "do not match the digest stored with them (the file was changed after it was written)"
    elif ref.shape != tuple(shape):
        problem = (f"are a {' x '.join(map(str, ref.shape)) or 'scalar'} array, not the "
                   f"{' x '.join(map(str, shape))} this data needs")
    elif not np.isfinite(ref).all():
        problem = f"hold values that are not finite (NaN or infinite: {int((~np.isfinite(ref)).sum())} of {ref.size})"
    else:
        return ref
    if announce:
        logger.warning("The cached reference log-probs at %s %s: computing them again.", path, problem)
    return None


def save_cached(key: str, ref: np.ndarray) -> None:
    """Write the log-probs under `key` with their digest (atomically: a reader sees the old file or the new one)."""
    path = cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.savez(f, ref=ref, sha256=np.array(_content_digest(ref)))
        os.replace(tmp, path)
    except OSError as err:  # a read-only cache costs a recomputation next time, never the run
        logger.warning("Could not cache the reference log-probs at %s (%s).", path, err)


# ---------------------------------------------------------------------- the pass that precomputes them


def precompute_logps(accelerator, model, reference, rows, width: int, settings: tuple, tokenizer, name: str,
                     noun: str, compute, batch_size: int) -> np.ndarray:
    """[len(rows), width] float64 reference log-probs of prepared rows (DPO: each pair's chosen and rejected; KTO:
    each example's completion and its KL pair): from the cache when every process finds them there, else computed,
    each process a strided share in batches of `batch_size` (`compute(indices) -> [k, width]` with `model` in eval
    mode), gathered, and cached by the main process. `reference` is the model whose weights key the cache, None where
    the reference is an adapter (not cached).

    Each block that can fail on one process alone is guarded, and the collectives sit between them, so a failure never
    leaves a process waiting in a collective the others do not reach."""
    import time

    from accelerate.utils import gather_object

    from posttrain.training.distributed import guarded

    acc = accelerator
    key, cached = None, None
    with guarded(acc):
        if reference is not None:
            key = cache_key(rows.fingerprint(), weights_digest(reference), tokenizer, settings)
            cached = load_cached(key, (len(rows), width), announce=acc.is_main_process)
    hits = torch.tensor([float(cached is not None)], device=acc.device)
    if acc.num_processes > 1:  # every process takes the cache, or every process computes
        hits = acc.reduce(hits, reduction="sum")
    if int(hits.item()) == acc.num_processes:
        logger.info("%s: reference log-probs of %d %s read from the cache.", name, len(rows), noun)
        return cached
    start = time.time()
    mine = np.arange(acc.process_index, len(rows), acc.num_processes)
    out = []
    with guarded(acc):
        was_training = model.training
        model.eval()
        try:
            for i in range(0, len(mine), batch_size):
                part = mine[i:i + batch_size]
                out.extend(zip(part.tolist(), compute(part).tolist()))
        finally:
            model.train(was_training)
    gathered_rows = gather_object(out) if acc.num_processes > 1 else out
    ref = np.zeros((len(rows), width), dtype=np.float64)
    for index, values in gathered_rows:
        ref[index] = values
    logger.info("%s: reference log-probs of %d %s computed in %.1f s.", name, len(rows), noun, time.time() - start)
    if key is not None and acc.is_main_process:
        save_cached(key, ref)
    return ref
