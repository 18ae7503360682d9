"""The routes of `posttrain serve` (app.py documents them): the request bodies, the limits every request is held to,
and `Routes`, the handlers over one engine, which `make_app` registers on its FastAPI app. Imported by `make_app`
once fastapi is known to be installed.

    Limits                  what one request may ask: sequences, tokens, bytes (posttrain serve's options)
    Completion, Version, Finish
                            the JSON bodies of /v1/completions and the weight-update calls: strict types, unknown
                            fields refused, every number bounded (a bad one: 422 naming the field)
    Routes(engine, api_version, limits)
                            the handlers; every engine call runs on its one worker thread, in arrival order
        .register(app)      adds every route to `app`
    engine_error            an EngineError as {"error": message} with its status
    validation_error        a malformed body as {"error": "body.FIELD: what is wrong (got VALUE)."}, 422
"""

import asyncio
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from posttrain import wire
from posttrain.generation.protocol import SamplingParams
from posttrain.model_inputs import ModelInputs
from posttrain.serving.engine import MAX_INT64, EngineError

# below it, float32 logits divided by the temperature (or the penalty) can overflow into NaN: vLLM raises smaller
# temperatures to it (with a warning); posttrain refuses them
MIN_SCALE = 0.01
MAX_PENALTY = 100.0
MIN_TOP_P = 1e-6  # smaller is greedy sampling, and below float32's range it empties the nucleus (NaN)
MAX_NAME = 256  # characters of a weight version or update id


@dataclass(frozen=True)
class Limits:
    """What one request may ask of `posttrain serve` (its options of the same names).

    max_num_seqs: sequences one completions request samples together, prompts x n (vLLM's name for its batch).
    max_batch_tokens: tokens one completions request holds, sequences x (its longest prompt + max_tokens): what its
        KV cache grows to.
    max_bucket_bytes: tensor bytes in one weight bucket (its body may add MAX_HEADER_BYTES of header); None: the
        larger of wire.MAX_BUCKET_BYTES (what the trainer packs) and the served model's largest tensor in float32.
    max_pixel_bytes: bytes of a completions request's `model_inputs` (a vision-language model's pixels).
    """

    max_num_seqs: int = 256
    max_batch_tokens: int = 1 << 18
    max_bucket_bytes: Optional[int] = None
    max_pixel_bytes: int = 64 << 20

    @property
    def max_json_bytes(self) -> int:
        """The largest JSON body taken: 1 MiB, plus 32 bytes for each token max_batch_tokens allows, plus
        max_pixel_bytes in base64."""
        return (1 << 20) + 32 * self.max_batch_tokens + self.max_pixel_text

    @property
    def max_pixel_text(self) -> int:
        """The characters of max_pixel_bytes in base64 (4 for each 3 bytes, the last 3 padded)."""
        return 4 * -(-self.max_pixel_bytes // 3)

    def bucket_bytes(self, engine) -> int:
        if self.max_bucket_bytes is not None:
            return self.max_bucket_bytes
        return max(wire.MAX_BUCKET_BYTES, 4 * engine.largest_tensor_elements)


Int64 = Annotated[int, Field(ge=0, le=MAX_INT64)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a field the server would ignore is refused


class Completion(_Body):
    model: Optional[str] = Field(None, max_length=1024)
    prompt: list  # token ids, or a list of token-id lists: checked by `token_lists` with a sentence
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=MIN_SCALE, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=MIN_SCALE, le=MAX_PENALTY, allow_inf_nan=False)
    seed: Optional[Int64] = None
    sample_keys: Optional[list[Int64]] = None
    stop_token_ids: Optional[list[Int64]] = None
    suppress_tokens: Optional[list[Int64]] = None  # posttrain's: never sampled (transformers' generate's name)
    begin_suppress_tokens: Optional[list[Int64]] = None  # posttrain's: never a completion's first token
    # posttrain's: base64 of a safetensors bucket, ModelInputs.tensors("") of one row per prompt (a vision-language
    # model's pixels, as the trainer's processor made them)
    model_inputs: Optional[str] = None
    logprobs: Optional[int] = Field(None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_weight_versions: bool = False


class Version(_Body):
    weight_version: str = Field(..., min_length=1, max_length=MAX_NAME)


class Finish(Version):
    update_id: str = Field(..., min_length=1, max_length=MAX_NAME)


async def engine_error(request: Request, err: EngineError):
    return JSONResponse({"error": str(err)}, err.status)


async def validation_error(request: Request, err):
    """FastAPI's RequestValidationError as one sentence naming the first bad field (422)."""
    errors = err.errors()
    first = errors[0] if errors else {}
    if first.get("type") in ("json_invalid", "model_attributes_type", "dict_type") or first.get("loc") == ("body",):
        return JSONResponse({"error": "the body is not a JSON object: send one, with Content-Type: "
                                      "application/json."}, 422)
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    message = f"{where}: {first.get('msg', 'invalid')}"
    if "input" in first and first.get("type") != "missing" and len(repr(first["input"])) <= 80:
        message += f" (got {first['input']!r})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s) in the body"
    return JSONResponse({"error": message + "."}, 422)


def token_lists(prompt: list) -> list[list[int]]:
    """`prompt` as a list of token-id lists (one list of ids is one prompt); 422 for anything else."""
    if prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    elif all(not isinstance(p, list) for p in prompt):
        prompts = [prompt]
    else:
        raise EngineError("prompt mixes token ids and lists: send a list of token ids or a list of such lists.", 422)
    for i, ids in enumerate(prompts):
        bad = next((t for t in ids if type(t) is not int or t < 0), None)  # noqa: E721 (a bool is not an id)
        if bad is not None:
            raise EngineError(f"prompt {i} holds {str(bad)[:40]!r}, which is not a token id (an integer from 0): "
                              "send token ids, not text.", 422)
    return prompts


class Routes:
    """The handlers of one app over `engine`.

    Every engine call runs on one worker thread, in arrival order: the engine is never entered twice at once, and
    torch keeps one warm intra-op thread pool (a fresh worker thread per request made generation ~20% slower)."""

    def __init__(self, engine, api_version: str, limits: Limits | None = None):
        self.engine = engine
        self.api_version = api_version  # /server_info's api_version (app.API_VERSION)
        self.limits = limits or Limits()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-engine")

    def register(self, app) -> None:
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.get("/server_info")(self.server_info)
        app.get("/weight_info")(self.weight_info)
        app.post("/v1/completions")(self.completions)
        app.post("/start_weight_update")(self.start_weight_update)
        app.post("/update_weights")(self.update_weights)
        app.post("/finish_weight_update")(self.finish_weight_update)

    async def on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def health(self):
        return {"status": "ok"}

    def models(self):
        return {"object": "list", "data": [{"id": self.engine.name, "object": "model", "owned_by": "posttrain",
                                            "max_model_len": self.engine.max_model_len}]}

    def server_info(self):
        limits = self.limits
        return {**self.engine.info(), "api_version": self.api_version, "max_num_seqs": limits.max_num_seqs,
                "max_batch_tokens": limits.max_batch_tokens, "max_bucket_bytes": limits.bucket_bytes(self.engine),
                "weight_update_timeout": self.engine.update_timeout}

    def weight_info(self):
        return {"weight_version": self.engine.version, "weights": self.engine.weights}

    # ------------------------------------------------------------------ completions

    async def completions(self, body: Completion):
        engine = self.engine
        if body.model is not None and body.model != engine.name:
            raise EngineError(f"model {body.model!r} is not served here: this server serves {engine.name!r}.", 404)
        prompts = token_lists(body.prompt)
        self._check_size(prompts, body.n, body.max_tokens)
        params = self._sampling_params(body)
        keys = body.sample_keys  # None: the engine numbers the rows in order
        if keys is not None and len(keys) != len(prompts):
            raise EngineError(f"sample_keys holds {len(keys)} keys for {len(prompts)} prompts: send one per prompt.",
                              422)
        if keys is not None and max(keys, default=0) > MAX_INT64 - (body.n - 1):
            raise EngineError(f"sample_keys holds {max(keys)}, and with n={body.n} its copies' keys pass "
                              f"{MAX_INT64} (the largest 64-bit key): send smaller keys.", 422)
        seed = body.seed if body.seed is not None else secrets.randbelow(2 ** 31)
        model_inputs = self._model_inputs(body.model_inputs, len(prompts))

        def generate():
            version = engine.version
            rollouts = engine.generate(prompts, body.n, params, seed, keys, model_inputs)
            return _choices(rollouts, prompts, body.n, version, body.return_weight_versions)

        return {"object": "text_completion", "model": engine.name, "choices": await self.on_engine(generate)}

    def _check_size(self, prompts: list[list[int]], n: int, max_tokens: int) -> None:
        """413 when the request asks for more sequences or tokens than this server's limits."""
        limits, rows = self.limits, len(prompts) * n
        if rows > limits.max_num_seqs:
            raise EngineError(f"the request asks for {rows} sequences ({len(prompts)} prompt(s) x n={n}), more than "
                              f"this server's max_num_seqs={limits.max_num_seqs}: send fewer per request, or restart "
                              "it with a larger --max_num_seqs.", 413)
        self.engine.check_prompts(prompts, max_tokens)
        tokens = rows * (max(len(p) for p in prompts) + max_tokens)
        if tokens > limits.max_batch_tokens:
            raise EngineError(f"the request holds {tokens} tokens ({rows} sequences x (longest prompt + "
                              f"max_tokens={max_tokens})), more than this server's max_batch_tokens="
                              f"{limits.max_batch_tokens}: send fewer sequences per request, or restart it with a "
                              "larger --max_batch_tokens.", 413)

    def _model_inputs(self, text: str | None, prompts: int) -> ModelInputs | None:
        """The body's `model_inputs` (one row per prompt), checked (413 beyond max_pixel_bytes, 422 malformed)."""
        if text is None:
            return None
        if len(text) > self.limits.max_pixel_text:
            raise EngineError(f"model_inputs holds more than this server's max_pixel_bytes="
                              f"{self.limits.max_pixel_bytes}: send fewer images per request, or restart it with a "
                              "larger --max_pixel_bytes.", 413)
        try:
            inputs = ModelInputs.from_tensors(wire.from_text(text), "", prompts)
        except (ValueError, IndexError, KeyError, TypeError) as err:
            raise EngineError(f"model_inputs is not ModelInputs.tensors('') of one row per prompt as base64 "
                              f"safetensors ({err}).", 422) from None
        if inputs is not None:
            self.engine.check_model_inputs(inputs, prompts)
        return inputs

    def _sampling_params(self, body: Completion) -> SamplingParams:
        """The body's sampling fields, each checked against the served model (422 naming the field)."""
        vocab = self.engine.vocab_size
        if body.min_tokens > body.max_tokens:
            raise EngineError(f"min_tokens={body.min_tokens} exceeds max_tokens={body.max_tokens}: lower min_tokens "
                              "or raise max_tokens.", 422)
        if body.top_k > vocab:
            raise EngineError(f"top_k={body.top_k} exceeds the vocabulary ({vocab} tokens): send at most {vocab}, or "
                              "-1 (or 0) to keep every token.", 422)
        for field in ("stop_token_ids", "suppress_tokens", "begin_suppress_tokens"):
            bad = next((t for t in getattr(body, field) or () if t >= vocab), None)
            if bad is not None:
                raise EngineError(f"{field} holds {bad}, outside the vocabulary [0, {vocab}).", 422)
        if body.logprobs:
            raise EngineError(f"logprobs={body.logprobs} asks for the most likely tokens' log-probs, which this "
                              "server does not return (each choice carries its sampled tokens' log-probs): send 0.",
                              422)
        return SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(body.top_k, 0), min_p=body.min_p or None,
                              repetition_penalty=body.repetition_penalty, min_new_tokens=body.min_tokens,
                              eos_token_ids=tuple(body.stop_token_ids or ()),
                              suppress_tokens=tuple(body.suppress_tokens or ()),
                              begin_suppress_tokens=tuple(body.begin_suppress_tokens or ()))

    # ------------------------------------------------------------------ weight updates

    async def start_weight_update(self, body: Version):
        update_id = await self.on_engine(self.engine.begin_update, body.weight_version)
        return {"status": "ok", "update_id": update_id, "weight_update_timeout": self.engine.update_timeout}

    async def update_weights(self, request: Request):
        """One bucket: its headers checked, then its owner and size, before any memory is taken for its body."""
        version, digest, update_id = _bucket_headers(request.headers)
        size = _declared_size(request.headers)
        self.engine.claim(update_id, version)  # 409 unless the open update is this caller's
        limit = self.limits.bucket_bytes(self.engine) + wire.MAX_HEADER_BYTES
        if size is not None and size > limit:
            raise EngineError(_too_large(size, limit), 413)
        data = await _read_body(request, size, limit, self.engine.update_timeout,
                                lambda: self.engine.touch(update_id))

        def check_and_load():
            try:
                tensors, aliases = wire.decode(data)
            except ValueError as err:
                raise EngineError(f"the body is {err}.", 400) from None
            if wire.bucket_digest(tensors.items()) != digest:
                raise EngineError("the bucket's tensors do not match its X-Bucket-Digest (corrupted in transit): "
                                  "re-send it.", 400)
            self.engine.load(tensors, aliases, version, update_id)
            return len(tensors), len(aliases)

        tensors, aliases = await self.on_engine(check_and_load)  # off the event loop: /health stays answered
        return {"status": "ok", "tensors": tensors, "aliases": aliases}

    async def finish_weight_update(self, body: Finish):
        digest = await self.on_engine(self.engine.finish_update, body.weight_version, body.update_id)
        return {"status": "ok", "digest": digest, "weight_version": self.engine.version}


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _bucket_headers(headers) -> tuple[str, str, str]:
    """(X-Weight-Version, X-Bucket-Digest, X-Update-Id), each checked (422 naming the header)."""
    version = headers.get("x-weight-version")
    if not version or len(version) > MAX_NAME:
        raise EngineError(f"the X-Weight-Version header is {'missing' if not version else 'too long'}: send the "
                          f"version of the open update (1 to {MAX_NAME} characters).", 422)
    digest = headers.get("x-bucket-digest")
    if not digest or not _DIGEST.fullmatch(digest):
        raise EngineError("the X-Bucket-Digest header is missing or not 64 lowercase hex digits: send the digest of "
                          "the bucket's tensors (wire.bucket_digest).", 422)
    bucket = headers.get("x-bucket")
    if bucket is not None and not (bucket.isascii() and bucket.isdigit() and 1 <= int(bucket) <= 1 << 31):
        raise EngineError(f"the X-Bucket header {bucket[:40]!r} is not a bucket number (an integer from 1).", 422)
    update_id = headers.get("x-update-id")
    if not update_id or len(update_id) > MAX_NAME:
        raise EngineError("the X-Update-Id header is missing: send the update_id start_weight_update returned.", 422)
    return version, digest, update_id


def _declared_size(headers) -> int | None:
    """Content-Length as a number of bytes; None when the body is chunked; 400 when it is not a number."""
    declared = headers.get("content-length")
    if declared is None:
        return None
    if not (declared.isascii() and declared.isdigit()):
        raise EngineError(f"Content-Length {declared[:40]!r} is not a number of bytes.", 400)
    return int(declared)


def _too_large(size: int, limit: int) -> str:
    return (f"the bucket has {size} bytes, more than this server takes in one ({limit}: --max_bucket_bytes plus "
            f"{wire.MAX_HEADER_BYTES} of header): send smaller buckets, or restart it with a larger "
            "--max_bucket_bytes.")


async def _read_body(request: Request, size: int | None, limit: int, timeout: float, touch) -> bytearray:
    """The request body in one writable buffer, filled as it arrives (sized by Content-Length when given: the
    bucket's tensors are then views of it, with no further copy); at most `limit` bytes; each piece must arrive
    within `timeout` seconds, and `touch()` is called for each (the owner is still sending)."""
    buffer = bytearray(size) if size is not None else bytearray()
    view = memoryview(buffer) if size is not None else None  # a chunked body grows the buffer: no view of it
    position, more = 0, True
    try:
        while more:
            try:
                message = await asyncio.wait_for(request.receive(), timeout)
            except asyncio.TimeoutError:
                raise EngineError(f"no byte of the bucket arrived for {timeout:g} s (after {position}): re-send it.",
                                  408) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk, more = message.get("body", b""), message.get("more_body", False)
            end = position + len(chunk)
            if size is None:
                if end > limit:
                    raise EngineError(_too_large(end, limit), 413)
                buffer.extend(chunk)
            else:
                if end > size:
                    raise EngineError(f"the body is longer than its Content-Length ({size} bytes).", 400)
                view[position:end] = chunk
            position = end
            touch()
    except ClientDisconnect:
        raise EngineError(f"the client went away after {position} bytes of the bucket.", 400) from None
    finally:
        if view is not None:
            view.release()
    if size is not None and position != size:
        raise EngineError(f"the body ended after {position} of its {size} bytes: re-send it.", 400)
    return buffer


def _choices(rollouts, prompts, n, version, with_versions: bool) -> list[dict]:
    out = []
    lengths = rollouts.completion_mask.sum(1).tolist()
    for row in range(len(rollouts)):
        k = lengths[row]
        ids = rollouts.completion_ids[row, :k].tolist()
        choice = {"index": row, "prompt_token_ids": prompts[row // n], "token_ids": ids, "text": "",
                  "finish_reason": "stop" if bool(rollouts.is_eos[row]) else "length",
                  "logprobs": {"token_logprobs": rollouts.sampler_logprobs[row, :k].tolist(),
                               "tokens": [f"token_id:{t}" for t in ids]}}
        if with_versions:
            choice["weight_versions"] = [{"version": version, "start": 0, "end": k}]
        out.append(choice)
    return out
