"""posttrain's per-model fast paths: what was decided for each model, kept beside it (weakly), never on it; and the
switch that turns them all off.

The fast paths: the output layer in chunks (models/chunked.py), packed rows (models/packing.py), shared prompts
(models/prompt_sharing.py), the lean decoder (generation/lean_decoder.py) and oneDNN's products on a CPU
(models/onednn.py). Each is decided once per model object by a check (a forward or two against the model's own
results) and remembered here, keyed by the unwrapped model; the entry goes when the model does.

`turn_off(model)` (the config field `fast_paths: false`) makes every decision for that model "no": its log-probs come
from its own forward's whole logits, rows are padded, every rollout runs its prompt, decoding calls the model's own
forward with its own cache, and products are torch's. For debugging, and for models the checks do not know; the
numbers agree with the fast paths' within float rounding (tests/test_fast_paths.py).

A reference deep-copied from the policy is the same model at the copy: the same classes, config and wrappers, so the
same checks decide the same. `note_copy` records where it came from; a strategy that runs both alike (one process,
DDP: training/sharding/base.py NoSharding) then `share_with_source`s its entry, and each check runs once for the two
(about 0.13 s of a tiny GRPO run's first step). Sharded strategies wrap the reference apart, and it decides apart.
"""

import weakref
from typing import Callable, TypeVar

import torch

from posttrain.models.keywords import unwrap

T = TypeVar("T")
_DECISIONS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_SOURCES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()  # copy -> source
OFF = "off"  # the entry that turn_off sets


def _entry(model) -> dict:
    plain = unwrap(model)
    entry = _DECISIONS.get(plain)
    if entry is None:
        entry = _DECISIONS[plain] = {}
    return entry


def turn_off(model) -> None:
    """Every fast path of `model` off from now on (the plain transformers forward, padded rows, torch's products)."""
    _entry(model)[OFF] = True


def enabled(model) -> bool:
    """Whether `model`'s fast paths may be used at all (not turned off)."""
    return not _entry(model).get(OFF, False)


def decided(model, name: str, decide: Callable[[], T], off: T = False) -> T:
    """The decision `name` for `model`: `decide()` on the first call, remembered; `off` when the model's fast paths
    are turned off (decide is then never called)."""
    entry = _entry(model)
    if entry.get(OFF, False):
        return off
    if name not in entry:
        entry[name] = decide()
    return entry[name]


def remembered(model, name: str, compute: Callable[[], T]) -> T:
    """A per-model value computed once (a parameter count, ...), whether or not the fast paths are on."""
    entry = _entry(model)
    if name not in entry:
        entry[name] = compute()
    return entry[name]


def note_copy(copy, source) -> None:
    """`copy` was deep-copied from `source` (a reference from the policy): see the module's docstring."""
    _SOURCES[unwrap(copy)] = weakref.ref(unwrap(source))


def share_with_source(model) -> bool:
    """Where `model` is a noted copy whose source lives, has decided nothing of its own yet, and has its fast paths on
    or off as its source has, make its decisions its source's (one entry for both); True where it did."""
    source = _SOURCES.get(unwrap(model))
    source = source() if source is not None else None
    if source is None:
        return False
    mine, theirs = _entry(model), _entry(source)
    if mine is theirs:
        return True
    if set(mine) - {OFF} or mine.get(OFF, False) != theirs.get(OFF, False):
        return False
    _DECISIONS[unwrap(model)] = theirs
    return True
