"""The weights' wire format now lives in posttrain/wire.py, the protocol module the generation client
(generation/server.py) and this server share; its names stay importable from here."""

from posttrain.wire import (ALIASES_KEY, MAX_BUCKET_BYTES, MAX_HEADER_BYTES, SLICE_BYTES, Body, PushDigests,
                            bucket_digest, buckets, combine, data_digest, decode, fingerprint, storage_key,
                            tensor_digest, to_text, from_text)

__all__ = ["ALIASES_KEY", "MAX_BUCKET_BYTES", "MAX_HEADER_BYTES", "SLICE_BYTES", "Body", "PushDigests",
           "bucket_digest", "buckets", "combine", "data_digest", "decode", "fingerprint", "storage_key",
           "tensor_digest", "to_text", "from_text"]
