"""The reference model of a DPO run, and reference log-probs computed once before training.

Which reference (in this order):
    reference_free            none: its log-probs are 0
    ref_model given           that model (a path or hub id is loaded with ref_model_init_kwargs or model_init_kwargs)
    LoRA                      the policy with adapters off, or with a frozen copy of the adapter it came with
    precompute_ref_log_probs  the policy itself, before its first update (no copy is kept)
    otherwise                 a frozen copy of the initial policy

Precomputed log-probs are cached under $POSTTRAIN_CACHE/ref_logps (default ~/.cache/posttrain), one file per key:
the prepared pairs (which already reflect the data, the chat template, max_length and truncation_mode), the reference
weights, the chat template, max_length, truncation_mode and ld_alpha.
"""

import hashlib
import logging
import os

import numpy as np

from posttrain.configs import ConfigError
from posttrain.models.peft import is_peft_model
from posttrain.models.preparation import disable_dropout, reference_of

logger = logging.getLogger("posttrain")


def _frozen(model, args, device):
    if args.disable_dropout:
        disable_dropout(model)
    return model.to(device).eval().requires_grad_(False)


def make_reference(policy, ref_model, args, came_with_adapter: bool, device, trust_remote_code: bool):
    """(reference model or None, reference adapter name or None) for this run (see the module's docstring)."""
    if ref_model is not None and (ref_model is policy or (is_peft_model(policy) and ref_model is
                                                           policy.get_base_model())):
        raise ConfigError("model and ref_model are the same object: omit ref_model and a frozen copy of the model "
                          "is made for you.")
    if args.reference_free:
        return None, None
    if ref_model is not None:
        if isinstance(ref_model, str):
            from posttrain.models.loading import load_causal_lm, with_trl_default_dtype

            kwargs = args.ref_model_init_kwargs or args.model_init_kwargs or {}
            ref_model = load_causal_lm(ref_model, with_trl_default_dtype({"trust_remote_code": trust_remote_code,
                                                                          **kwargs}))
        return _frozen(ref_model, args, device), None
    if args.precompute_ref_log_probs and not is_peft_model(policy):
        return None, None  # the policy, before its first update, computes them
    return reference_of(policy, args.sync_ref_model, came_with_adapter)


def cache_key(pairs_fingerprint: str, reference_fingerprint: str, tokenizer, args) -> str:
    h = hashlib.sha256()
    for part in (pairs_fingerprint, reference_fingerprint, str(getattr(tokenizer, "chat_template", None)),
                 str(args.max_length), args.truncation_mode, str(args.ld_alpha)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def cache_path(key: str) -> str:
    root = os.environ.get("POSTTRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "posttrain"))
    return os.path.join(root, "ref_logps", f"{key}.npy")


def load_cached(key: str, pairs: int) -> np.ndarray | None:
    path = cache_path(key)
    try:
        ref = np.load(path)
    except (OSError, ValueError):
        return None
    return ref if ref.shape == (pairs, 2) and np.isfinite(ref).all() else None


def save_cached(key: str, ref: np.ndarray) -> None:
    path = cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, ref)
        os.replace(tmp, path)
    except OSError as err:  # a read-only cache costs a recomputation next time, never the run
        logger.warning("Could not cache the reference log-probs at %s (%s).", path, err)
