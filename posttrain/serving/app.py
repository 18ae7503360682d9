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
it. The request bodies and the handlers are serving/routes.py's; this module builds the app (`make_app`) and runs
it (`serve`).
"""

import hmac
import json
import logging

from posttrain.serving.engine import EngineError

API_VERSION = "1"
logger = logging.getLogger("posttrain.serve")


def make_app(engine, api_key: str | None = None):
    """The FastAPI app serving `engine`: the routes of serving/routes.py (its request bodies and handlers), behind a
    bearer key when `api_key` is given; an EngineError answers {"error": message} with its status."""
    from posttrain._optional import require

    require("fastapi", "posttrain serve")
    from fastapi import FastAPI

    from posttrain.serving.routes import Routes, engine_error

    app = FastAPI(title="posttrain serve", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:  # plain ASGI (not BaseHTTPMiddleware, which relays every body chunk through a stream)
        app.add_middleware(_BearerToken, api_key=api_key)
    app.exception_handler(EngineError)(engine_error)
    Routes(engine, API_VERSION).register(app)
    return app


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
