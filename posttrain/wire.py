"""Weights on the wire: size-capped safetensors buckets streamed from the tensors' own memory, and digests both
ends compute the same way.

This is the protocol the generation client (generation/server.py) and `posttrain serve` (serving/) share: both
import it, and it imports nothing of posttrain, so generation never imports serving (serving imports generation's
protocol and its transformers backend, one way only).

    buckets(named, max_bytes)   (name, tensor) pairs -> lists of at most max_bytes each (a larger tensor alone);
                                a tensor yielded under several names (tied embeddings: the same memory, still
                                alive) is sent once, its other names listed as aliases
    storage_key(t)              where a tensor's values live: equal keys are one tensor (tied weights)
    Body(bucket, aliases)       one bucket as safetensors bytes (never pickle: safe to load from a network),
                                aliases in the metadata; iterating it yields the header, then each tensor's own
                                memory in slices (no copy is made), and len() is the whole size (Content-Length)
    decode(buffer)              -> ({name: tensor}, {alias: name}); the tensors are views of the buffer; ValueError
                                for bytes that are not a well-formed bucket
    data_digest(t)              SHA-256 of a tensor's bytes (raw, 32 bytes)
    tensor_digest(name, dtype, shape, data_digest)
                                SHA-256 of the name, dtype, shape and bytes of one tensor (tied names share the
                                bytes' digest: each distinct tensor is read once)
    combine(digests)            SHA-256 over the sorted per-tensor digests: independent of order and bucketing, so
                                a bucket carries the digest of its tensors and the whole push the digest of all
    bucket_digest(tensors)      a received bucket's digest (the server checks it against X-Bucket-Digest)
    PushDigests                 the sender's side: each Body's digest, then the whole push's
    to_text(named) / from_text(text)
                                {name: tensor} as the base64 text of one bucket, for a JSON field (a prompt's pixels
                                in a completions request), and back; ValueError for text that is not one
"""

import hashlib
import json
import math
import weakref
from typing import Iterable, Iterator

import torch

MAX_BUCKET_BYTES = 256 << 20  # tensor bytes the trainer packs into one bucket (a larger tensor goes alone)
MAX_HEADER_BYTES = 16 << 20  # what a receiver allows a bucket's header beyond its tensor bytes
SLICE_BYTES = 4 << 20  # the pieces a body is handed to the socket in
ALIASES_KEY = "posttrain.aliases"

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def storage_key(tensor: torch.Tensor) -> tuple:
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
        key = storage_key(tensor)
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


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy where it is already a contiguous CPU tensor."""
    t = tensor.detach().to("cpu").contiguous()
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the array keeps the tensor alive


class Body:
    """One bucket as the bytes of a safetensors file, produced without copying the tensors.

    Iterating yields the header and then each tensor's memory in slices of SLICE_BYTES; `len()` is the total, so an
    HTTP client sends it with a Content-Length. It can be iterated again (a re-sent bucket)."""

    def __init__(self, bucket: list[tuple[str, torch.Tensor]], aliases: dict[str, str]):
        self.tensors = [(name, tensor, _bytes_of(tensor)) for name, tensor in bucket]
        entries, offset = {}, 0
        for name, tensor, data in self.tensors:
            if tensor.dtype not in _CODES:
                raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which safetensors cannot carry.")
            entries[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
        entries["__metadata__"] = {ALIASES_KEY: json.dumps(aliases)}
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # as safetensors writes it: the data starts 8-byte aligned
        self.header = len(header).to_bytes(8, "little") + header
        self.length = len(self.header) + offset

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[memoryview | bytes]:
        yield self.header
        for _, _, data in self.tensors:
            for start in range(0, len(data), SLICE_BYTES):
                yield data[start:start + SLICE_BYTES]

    def to_bytes(self) -> bytes:
        return b"".join(bytes(part) for part in self)


def decode(buffer: bytes | bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (views of `buffer` where aligned, else copies) and aliases of one bucket; ValueError when the bytes
    are not a well-formed safetensors bucket: every offset is checked, so malformed input cannot read outside it."""
    if isinstance(buffer, bytes):
        buffer = bytearray(buffer)  # torch.frombuffer wants writable memory
    try:
        header, data_start = _header(buffer)
        metadata = header.pop("__metadata__", None) or {}  # _header checked that it is an object
        aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
        tensors = _tensors(buffer, header, data_start)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as err:
        raise ValueError(f"not a safetensors bucket ({err})") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise ValueError("not a safetensors bucket (its aliases are not names)")
    return tensors, aliases


def _header(buffer: bytearray) -> tuple[dict, int]:
    if len(buffer) < 8:
        raise ValueError("shorter than a header")
    size = int.from_bytes(buffer[:8], "little")
    if size > len(buffer) - 8:
        raise ValueError(f"a header of {size} bytes in a body of {len(buffer)}")
    header = json.loads(bytes(buffer[8:8 + size]))
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    metadata = header.get("__metadata__")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError("its metadata is not an object")
    return header, 8 + size


def _tensors(buffer: bytearray, header: dict, data_start: int) -> dict[str, torch.Tensor]:
    tensors, spans = {}, []
    for name, entry in header.items():
        dtype = _DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        count = math.prod(shape)
        if min(shape, default=0) < 0 or end - begin != count * dtype.itemsize:
            raise ValueError(f"{name!r}: shape {shape} does not fit offsets {begin}..{end}")
        if begin < 0 or data_start + end > len(buffer):
            raise ValueError(f"{name!r}: offsets {begin}..{end} fall outside the {len(buffer) - data_start} bytes")
        spans.append((begin, end, name))
        offset = data_start + begin
        if not count:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif offset % dtype.itemsize:  # unaligned: a copy
            tensors[name] = torch.frombuffer(bytearray(buffer[offset:data_start + end]), dtype=dtype).reshape(shape)
        else:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{name!r} starts at {begin}, not {position}: the data has a hole or an overlap")
        position = end
    if data_start + position != len(buffer):
        raise ValueError(f"the tensors cover {position} bytes of {len(buffer) - data_start}")
    return tensors


def to_text(named: dict[str, torch.Tensor]) -> str:
    """`named` as the base64 text of one safetensors bucket (no aliases)."""
    import base64

    return base64.b64encode(Body(list(named.items()), {}).to_bytes()).decode("ascii")


def from_text(text: str) -> dict[str, torch.Tensor]:
    """The tensors `to_text` wrote; ValueError for text that is not base64 of a well-formed bucket."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64 text") from None
    tensors, aliases = decode(raw)
    if aliases:
        raise ValueError("a bucket of tensors with aliases, where none are taken")
    return tensors


def data_digest(tensor: torch.Tensor) -> bytes:
    return hashlib.sha256(_bytes_of(tensor)).digest()


def tensor_digest(name: str, dtype: torch.dtype, shape, data: bytes) -> str:
    """The digest of one named tensor from its bytes' digest (`data_digest`)."""
    return hashlib.sha256(f"{name}|{dtype}|{tuple(shape)}|".encode() + data).hexdigest()


def combine(digests: Iterable[str]) -> str:
    h = hashlib.sha256()
    for d in sorted(digests):
        h.update(d.encode())
    return h.hexdigest()


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What a model is, for the handshake: SHA-256 over its sorted (name, shape, dtype), not its values."""
    h = hashlib.sha256()
    for name, shape, dtype in sorted((n, tuple(t.shape), str(t.dtype)) for n, t in named):
        h.update(f"{name}|{shape}|{dtype};".encode())
    return h.hexdigest()[:16]


def bucket_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What a bucket's `X-Bucket-Digest` header carries: `combine` over its tensors' digests."""
    return combine(tensor_digest(name, t.dtype, t.shape, data_digest(t)) for name, t in tensors)


class PushDigests:
    """The digests of one push as it streams: each bucket's (for its header) and, at the end, the whole push's over
    every name sent, aliases included. Each distinct tensor's bytes are read once, from the body that sends them (no
    second copy off the device); an alias reuses its source's."""

    def __init__(self):
        self._names: list[str] = []
        self._data: dict[str, tuple[bytes, torch.dtype, tuple]] = {}  # sent name -> (bytes' digest, dtype, shape)

    def of_bucket(self, body: Body, aliases: dict[str, str]) -> str:
        own = []
        for name, tensor, data in body.tensors:
            digest = hashlib.sha256(data).digest()
            self._data[name] = (digest, tensor.dtype, tuple(tensor.shape))
            own.append(tensor_digest(name, tensor.dtype, tensor.shape, digest))
        for alias, source in aliases.items():
            digest, dtype, shape = self._data[source]
            self._names.append(tensor_digest(alias, dtype, shape, digest))
        self._names.extend(own)
        return combine(own)

    def total(self) -> str:
        return combine(self._names)
