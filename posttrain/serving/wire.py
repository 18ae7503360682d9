"""Weights on the wire: size-capped safetensors buckets, and digests both ends compute the same way.

    buckets(named, max_bytes)   (name, tensor) pairs -> lists of at most max_bytes each (a larger tensor alone);
                                a tensor yielded under several names (tied embeddings: the same memory, still
                                alive) is sent once, its other names listed as aliases
    encode(bucket, aliases)     -> safetensors bytes (never pickle: safe to load from a network), aliases in the
                                metadata
    decode(data)                -> ({name: tensor}, {alias: name})
    tensor_digest(name, t)      SHA-256 of the name, dtype, shape and bytes of one tensor
    combine(digests)            SHA-256 over the sorted per-tensor digests: independent of order and bucketing,
                                so the trainer can digest as it streams and the engine over what it holds
    body_digest(data)           SHA-256 of a bucket's bytes, sent with it and checked before anything is loaded
"""

import base64
import hashlib
import json
import weakref
from typing import Iterable, Iterator

import torch

MAX_BUCKET_BYTES = 256 << 20
ALIASES_KEY = "posttrain.aliases"


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live: two names with the same key are one tensor (tied weights)."""
    return (tensor.device.type, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int = MAX_BUCKET_BYTES
            ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], dict[str, str]]]:
    """Group tensors into buckets of at most `max_bytes` (a larger tensor goes alone). Yields (tensors,
    aliases): a tensor already sent under another name is not sent again but listed as {name: sent name}."""
    sent: dict[tuple, tuple[str, weakref.ref]] = {}
    bucket: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    size = 0
    for name, tensor in named:
        key = _storage_key(tensor)
        seen = sent.get(key)
        if seen is not None and seen[1]() is not None:  # the same memory, still alive: a tie, not a reused address
            aliases[name] = seen[0]
            continue
        sent[key] = (name, weakref.ref(tensor))
        n = _nbytes(tensor)
        if bucket and size + n > max_bytes:
            yield bucket, aliases
            bucket, aliases, size = [], {}, 0
        bucket.append((name, tensor))
        size += n
    if bucket or aliases:
        yield bucket, aliases


def encode(bucket: list[tuple[str, torch.Tensor]], aliases: dict[str, str]) -> bytes:
    from safetensors.torch import save

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in bucket}
    return save(tensors, metadata={ALIASES_KEY: json.dumps(aliases)})


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and aliases of an encoded bucket; ValueError for bytes that are not one."""
    from safetensors.torch import load

    try:
        tensors = load(data)
        metadata = _metadata(data)
    except Exception as err:  # safetensors raises its own error types for malformed input
        raise ValueError(f"not a safetensors bucket ({err})") from err
    return tensors, json.loads(metadata.get(ALIASES_KEY, "{}"))


def _metadata(data: bytes) -> dict:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    return header.get("__metadata__", {}) or {}


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    return h.hexdigest()


def combine(digests: Iterable[str]) -> str:
    h = hashlib.sha256()
    for d in sorted(digests):
        h.update(d.encode())
    return h.hexdigest()


def body_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_digest(data: bytes) -> str:
    """The Content-Digest header of a body (RFC 9530: sha-256, base64 between colons)."""
    return f"sha-256=:{base64.b64encode(hashlib.sha256(data).digest()).decode()}:"


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What a model is, for the handshake: SHA-256 over its sorted (name, shape, dtype), not its values."""
    h = hashlib.sha256()
    for name, shape, dtype in sorted((n, tuple(t.shape), str(t.dtype)) for n, t in named):
        h.update(f"{name}|{shape}|{dtype};".encode())
    return h.hexdigest()[:16]
