"""`posttrain serve`: the HTTP face of an engine (engine.py), speaking a subset of vLLM's own server API so that the
trainer's one client talks to it and to `vllm serve` alike.

    GET  /health                  200 while the engine is up
    GET  /v1/models               the served model (its id, max_model_len)
    GET  /server_info             engine, model fingerprint, max_model_len, logprobs mode, weight version, api version
    GET  /weight_info             {"weight_version"}: the version the engine holds (as vLLM's)
    POST /v1/completions          token-id prompts, n, seed, sampling fields, logprobs, return_token_ids,
                                  return_weight_versions: choices prompt-major (prompt i's copies at i*n .. i*n+n-1);
                                  posttrain's `sample_keys` (one per prompt) makes copy c of prompt i sample with the
                                  stream of row key sample_keys[i] + c (default i*n + c) under `seed`, so a row gets
                                  the same completion whichever request carries it
    POST /start_weight_update     {"weight_version"}: opens an update (generation answers 409 until it finishes)
    POST /update_weights          one safetensors bucket as the body (application/octet-stream) with headers
                                  X-Weight-Version, X-Bucket (its index, from 1) and X-Bucket-Digest (wire.combine
                                  of its tensors' SHA-256 digests), checked before anything is loaded; re-sending a
                                  bucket is harmless
    POST /finish_weight_update    {"weight_version"} -> {"digest"}: SHA-256 of the tensors the engine now holds

With an API key every route, the weight routes and /health included, needs `Authorization: Bearer KEY` (401
otherwise). Bad input gets a 4xx naming the cause (a malformed body 422 naming the field); the server never dies on
it.
"""

import hmac
import json
import logging
import secrets

from posttrain.serving import wire
from posttrain.serving.engine import EngineError

API_VERSION = "1"
logger = logging.getLogger("posttrain.serve")


def make_app(engine, api_key: str | None = None):
    from typing import Optional, Union

    from posttrain._optional import require

    require("fastapi", "posttrain serve")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field

    from posttrain.generation import SamplingParams

    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    app = FastAPI(title="posttrain serve", docs_url=None, redoc_url=None, openapi_url=None)
    # every engine call runs on this one thread, in arrival order: the engine is never entered twice at once, and
    # torch keeps one warm intra-op thread pool (a fresh worker thread per request made generation ~20% slower)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-engine")

    async def on_engine(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    if api_key is not None:  # plain ASGI (not BaseHTTPMiddleware, which relays every body chunk through a stream)
        app.add_middleware(_BearerToken, api_key=api_key)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, err: EngineError):
        return JSONResponse({"error": str(err)}, err.status)

    class Completion(BaseModel):
        model: Optional[str] = None
        prompt: Union[list[list[int]], list[int]]
        n: int = Field(1, ge=1)
        max_tokens: int = Field(16, ge=1)
        min_tokens: int = Field(0, ge=0)
        temperature: float = Field(1.0, gt=0)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=-1)
        min_p: float = Field(0.0, ge=0, le=1)
        repetition_penalty: float = Field(1.0, gt=0)
        seed: Optional[int] = Field(None, ge=0)
        sample_keys: Optional[list[int]] = None
        stop_token_ids: Optional[list[int]] = None
        logprobs: Optional[int] = Field(None, ge=0)
        return_token_ids: bool = False
        return_tokens_as_token_ids: bool = False
        return_weight_versions: bool = False

    class Version(BaseModel):
        weight_version: str = Field(..., min_length=1)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "owned_by": "posttrain",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/server_info")
    def server_info():
        return {**engine.info(), "api_version": API_VERSION}

    @app.get("/weight_info")
    def weight_info():
        return {"weight_version": engine.version}

    @app.post("/v1/completions")
    async def completions(body: Completion):
        prompts = body.prompt if body.prompt and isinstance(body.prompt[0], list) else [body.prompt]
        params = SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=max(body.top_k, 0), min_p=body.min_p or None,
                                repetition_penalty=body.repetition_penalty, min_new_tokens=body.min_tokens,
                                eos_token_ids=tuple(body.stop_token_ids or ()))

        keys = body.sample_keys  # None: the engine numbers the rows in order
        if keys is not None and len(keys) != len(prompts):
            raise EngineError(f"sample_keys holds {len(keys)} keys for {len(prompts)} prompts: send one per prompt.",
                              422)
        seed = body.seed if body.seed is not None else secrets.randbelow(2 ** 31)

        def generate():
            version = engine.version
            rollouts = engine.generate(prompts, body.n, params, seed, keys)
            return _choices(rollouts, prompts, body.n, version, body.return_weight_versions)

        return {"object": "text_completion", "model": engine.name, "choices": await on_engine(generate)}

    @app.post("/start_weight_update")
    async def start_weight_update(body: Version):
        await on_engine(engine.begin_update, body.weight_version)
        return {"status": "ok"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        version = request.headers.get("x-weight-version")
        if not version:
            raise EngineError("the X-Weight-Version header is missing: send the version of the open update.", 422)
        digest = request.headers.get("x-bucket-digest")
        if not digest:
            raise EngineError("the X-Bucket-Digest header is missing: send the digest of the bucket's tensors.", 422)
        data = await _read_body(request)

        def check_and_load():
            try:
                tensors, aliases = wire.decode(data)
            except ValueError as err:
                raise EngineError(f"the body is {err}.", 400) from None
            if wire.bucket_digest(tensors.items()) != digest:
                raise EngineError("the bucket's tensors do not match its X-Bucket-Digest (corrupted in transit): "
                                  "re-send it.", 400)
            engine.load(tensors, aliases, version)
            return len(tensors), len(aliases)

        tensors, aliases = await on_engine(check_and_load)  # off the event loop: /health stays answered
        return {"status": "ok", "tensors": tensors, "aliases": aliases}

    @app.post("/finish_weight_update")
    async def finish_weight_update(body: Version):
        digest = await on_engine(engine.finish_update, body.weight_version)
        return {"status": "ok", "digest": digest, "weight_version": engine.version}

    return app


async def _read_body(request) -> bytearray:
    """The request body in one writable buffer, filled as it arrives (sized by Content-Length when given): the
    bucket's tensors are then views of it, with no further copy."""
    declared = request.headers.get("content-length")
    if declared is None:  # chunked: gather, then join
        return bytearray(b"".join([chunk async for chunk in request.stream()]))
    try:
        size = int(declared)
    except ValueError:
        raise EngineError(f"Content-Length {declared!r} is not a number of bytes.", 400) from None
    buffer, position = bytearray(size), 0
    view = memoryview(buffer)
    async for chunk in request.stream():
        end = position + len(chunk)
        if end > size:
            raise EngineError(f"the body is longer than its Content-Length ({size} bytes).", 400)
        view[position:end] = chunk
        position = end
    if position != size:
        raise EngineError(f"the body ended after {position} of its {size} bytes: re-send it.", 400)
    return buffer


class _BearerToken:
    """Every request needs `Authorization: Bearer <api_key>` (401 otherwise)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                body = json.dumps({"error": "missing or wrong API key: send Authorization: Bearer <key>"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


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


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_model_len: int | None = None, dtype: str = "auto", device: str = "cpu",
          trust_remote_code: bool = False, log_level: str = "warning") -> None:
    """Load `model` and serve it until interrupted; prints `ready at http://HOST:PORT` once it accepts requests."""
    import socket

    from posttrain._optional import require

    uvicorn = require("uvicorn", "posttrain serve")

    from posttrain.configs import ConfigError
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.serving.engine import TransformersEngine

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        raise ConfigError(f"posttrain serve binds {host!r}, which other machines can reach, and has no --api_key: "
                          "its weight routes would take any sender's weights; pass --api_key TOKEN or bind "
                          "127.0.0.1.")
    kwargs = {"trust_remote_code": trust_remote_code}
    if dtype != "auto":
        kwargs["dtype"] = dtype
    loaded = load_causal_lm(model, kwargs).to(device)
    engine = TransformersEngine(loaded, load_tokenizer(model, trust_remote_code), max_model_len, name=model)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: without, each keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(make_app(engine, api_key), log_level=log_level)
    server = uvicorn.Server(config)

    original = server.startup

    async def startup(sockets=None):
        await original(sockets=sockets)
        print(f"posttrain serve: ready at http://{host}:{bound}", flush=True)

    server.startup = startup
    server.run(sockets=[sock])
