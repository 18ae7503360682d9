"""`posttrain serve`: the HTTP face of an engine (engine.py), speaking a subset of vLLM's own server API so that the
trainer's one client talks to it and to `vllm serve` alike.

    GET  /health                  200 while the engine is up (answered by the event loop, also while it loads)
    GET  /v1/models               the served model (its id, max_model_len)
    GET  /server_info             engine, model fingerprint, max_model_len, logprobs mode, weight version, the
                                  weights' state, api version, and this server's limits
    GET  /weight_info             {"weight_version", "weights"}: the version the engine holds (as vLLM's; null while
                                  an abandoned update's leftovers are in the model) and "ready", "updating" or
                                  "partial"
    POST /v1/completions          token-id prompts, n, seed, sampling fields, logprobs, return_token_ids,
                                  return_weight_versions: choices prompt-major (prompt i's copies at i*n .. i*n+n-1);
                                  posttrain's `sample_keys` (one per prompt) makes copy c of prompt i sample with the
                                  stream of row key sample_keys[i] + c (default i*n + c) under `seed`, so a row gets
                                  the same completion whichever request carries it; posttrain's `suppress_tokens`
                                  and `begin_suppress_tokens` (transformers' names), and `model_inputs`: each
                                  prompt's pixels as the trainer's processor made them (wire.to_text of
                                  ModelInputs.tensors("")), for a vision-language model
    POST /start_weight_update     {"weight_version"} -> {"update_id"}: opens an update (generation answers 409 until
                                  it finishes); its later calls carry the id; silent for weight_update_timeout, it is
                                  abandoned and a new one may start
    POST /update_weights          one safetensors bucket as the body (application/octet-stream) with headers
                                  X-Update-Id, X-Weight-Version, X-Bucket (its index, from 1) and X-Bucket-Digest
                                  (wire.combine of its tensors' SHA-256 digests); owner and size are checked before
                                  the body is read, the whole bucket before anything is loaded; re-sending a bucket
                                  is harmless
    POST /finish_weight_update    {"weight_version", "update_id"} -> {"digest"}: SHA-256 of the tensors the engine now
                                  holds

Every request is bounded (routes.Limits: sequences, tokens, JSON and bucket bytes; 413 beyond, naming the option
that raises it). With an API key every route, the weight routes and /health included, needs `Authorization: Bearer
KEY` (401 otherwise); without one, only requests addressed to a loopback name are answered (403 otherwise: DNS
rebinding). Bad input gets a 4xx naming the cause (a malformed body 422 naming the field); the server never dies on
it. The request bodies and the handlers are serving/routes.py's; this module builds the app (`make_app`), finds the
key (`api_key_from`) and runs it (`serve`).
"""

import hmac
import ipaddress
import json
import logging
import os
import sys

from posttrain.serving.engine import EngineError

API_VERSION = "2"
API_KEY_ENV = "POSTTRAIN_API_KEY"
LOOPBACK_NAMES = ("localhost", "0.0.0.0", "::")  # besides loopback addresses; 0.0.0.0 is the trainer's default host
logger = logging.getLogger("posttrain.serve")


def make_app(engine, api_key: str | None = None, limits=None):
    """The FastAPI app serving `engine` within `limits` (routes.Limits; default its defaults): the routes of
    serving/routes.py, behind a bearer key when `api_key` is given, else answering loopback host names only; an
    EngineError answers {"error": message} with its status, a malformed body {"error": ...} with 422."""
    from posttrain._optional import require

    require("fastapi", "posttrain serve")
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    from posttrain.serving.routes import Limits, Routes, engine_error, validation_error

    limits = limits or Limits()
    app = FastAPI(title="posttrain serve", docs_url=None, redoc_url=None, openapi_url=None)
    # plain ASGI (not BaseHTTPMiddleware, which relays every body chunk through a stream)
    app.add_middleware(_Guard, api_key=api_key, max_json_bytes=limits.max_json_bytes)
    app.exception_handler(EngineError)(engine_error)
    app.exception_handler(RequestValidationError)(validation_error)
    Routes(engine, API_VERSION, limits).register(app)
    return app


STREAMED_PATHS = ("/update_weights",)  # bodies read by their route, in bounded pieces


class _Guard:
    """Before any route: the bearer key (401), or without one a loopback Host and Origin (403); and every body but a
    weight bucket read here, at most `max_json_bytes` (413), then handed on whole."""

    def __init__(self, app, api_key: str | None, max_json_bytes: int):
        self.app, self.max_json_bytes = app, max_json_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(headers)
        if refusal is not None:
            return await _answer(send, *refusal)
        if scope["path"] in STREAMED_PATHS:
            return await self.app(scope, receive, send)
        body = await self._bounded_body(headers, receive)
        if isinstance(body, tuple):
            return await _answer(send, *body)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _refusal(self, headers: dict) -> tuple[int, str] | None:
        if self.expected is not None:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return 401, "missing or wrong API key: send Authorization: Bearer <key>."
            return None
        for name in (b"host", b"origin"):
            value = headers.get(name)
            if (value is not None or name == b"host") and not _is_loopback(value, name == b"origin"):
                shown = repr(value.decode("latin-1")[:80]) if value is not None else "missing"
                return 403, (f"this server has no API key, so it answers only requests addressed to a loopback name "
                             f"(localhost, 127.0.0.1, [::1]), and the {name.decode().title()} header is {shown}: "
                             "use one of those names in the URL, or start the server with an API key.")
        return None

    async def _bounded_body(self, headers: dict, receive) -> bytes | tuple[int, str]:
        """The whole body, or (status, message) when it is longer than max_json_bytes or the client left."""
        declared = headers.get(b"content-length")
        too_long = (413, f"the body is longer than this server takes in a JSON request ({self.max_json_bytes} "
                         "bytes: 32 per token of --max_batch_tokens, plus --max_pixel_bytes in base64, plus 1 MiB): "
                         "send fewer prompts per request, or restart it with a larger --max_batch_tokens (or "
                         "--max_pixel_bytes for images).")
        if declared is not None and declared.isdigit() and int(declared) > self.max_json_bytes:
            return too_long
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return 400, "the client went away before its body ended."
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > self.max_json_bytes:
                return too_long
            chunks.append(chunk)
        return b"".join(chunks)


def _is_loopback(value: bytes | None, is_origin: bool) -> bool:
    """Whether a Host (name[:port]) or Origin (scheme://name[:port]) header names this machine's loopback."""
    if value is None:
        return False
    text = value.decode("latin-1").strip().lower()
    if is_origin:
        scheme, sep, text = text.partition("://")
        if not sep or scheme not in ("http", "https"):
            return False
    if text.startswith("["):  # [v6]:port
        name = text[1:text.find("]")] if "]" in text else ""
    else:
        name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def api_key_from(flag: str | None, path: str | None, environ=os.environ) -> tuple[str | None, str]:
    """The API key and where it came from: --api_key, else the file --api_key_file names (its content, surrounding
    whitespace removed), else the POSTTRAIN_API_KEY environment variable (empty: unset); (None, "none") without
    any. ConfigError for both flags, an unreadable or empty file, or a key that cannot travel in a header."""
    from posttrain.configs import ConfigError

    if flag is not None and path is not None:
        raise ConfigError("--api_key and --api_key_file both given: pass one (the file keeps the key out of the "
                          "process list).")
    if flag is not None:
        key, source = flag, "--api_key"
    elif path is not None:
        try:
            with open(path, encoding="utf-8") as file:
                key = file.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--api_key_file {path!r} cannot be read ({err.__class__.__name__}): pass a readable "
                              "text file holding the key.") from None
        source = f"--api_key_file {path}"
    elif environ.get(API_KEY_ENV):
        key, source = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None, "none"
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise ConfigError(f"the API key from {source} is {'empty' if not key else 'not printable ASCII'}: use "
                          "letters, digits and punctuation, without spaces.")
    return key, source


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_model_len: int | None = None, dtype: str = "auto", device: str = "cpu",
          trust_remote_code: bool = False, log_level: str = "warning", api_key_file: str | None = None,
          max_num_seqs: int = 256, max_batch_tokens: int = 1 << 18, max_bucket_bytes: int | None = None,
          weight_update_timeout: float = 120.0, max_pixel_bytes: int = 64 << 20) -> None:
    """Load `model` and serve it until interrupted; prints `ready at http://HOST:PORT` once it accepts requests,
    and `posttrain serve: stopped.` on Ctrl-C or SIGTERM (while loading too)."""
    import signal

    from posttrain.configs import ConfigError
    from posttrain.serving.routes import Limits

    key, source = api_key_from(api_key, api_key_file)
    if host not in ("127.0.0.1", "localhost", "::1") and not key:
        raise ConfigError(f"posttrain serve binds {host!r}, which other machines can reach, and has no --api_key "
                          f"(nor --api_key_file or {API_KEY_ENV}): its weight routes would take any sender's weights; "
                          "pass --api_key_file PATH (or set the variable) or bind 127.0.0.1.")
    _check_limits(max_num_seqs, max_batch_tokens, max_bucket_bytes, weight_update_timeout, max_pixel_bytes)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port: give one from 1 to 65535, or 0 for a free one.")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"--max_model_len {max_model_len} must be at least 1 (leave it out for the model's own "
                          "position limit).")
    limits = Limits(max_num_seqs, max_batch_tokens, max_bucket_bytes, max_pixel_bytes)
    # uvicorn shuts down on SIGINT / SIGTERM, then raises the signal again: here it ends the server, not the process
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _run(model, host, port, key, source, limits, max_model_len, dtype, device, trust_remote_code, log_level,
             weight_update_timeout)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("posttrain serve: stopped.", flush=True)


def _run(model, host, port, key, source, limits, max_model_len, dtype, device, trust_remote_code, log_level,
         update_timeout) -> None:
    """Load the model, bind, and run uvicorn until it is stopped."""
    import socket

    from posttrain._optional import require

    uvicorn = require("uvicorn", "posttrain serve")

    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.serving.connections import server_config
    from posttrain.serving.engine import TransformersEngine

    kwargs = {"trust_remote_code": trust_remote_code}
    if dtype != "auto":
        kwargs["dtype"] = dtype
    loaded = load_causal_lm(model, kwargs).to(device)
    engine = TransformersEngine(loaded, load_tokenizer(model, trust_remote_code), max_model_len=max_model_len,
                                name=model, update_timeout=update_timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: without, each keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        from posttrain.configs import ConfigError

        raise ConfigError(f"posttrain serve cannot bind {host}:{port} ({err.strerror or err}): choose another --port "
                          "(0 picks a free one) or --host.") from None
    bound = sock.getsockname()[1]
    # a slow client cannot hold the server: time limits on a request's headers and body, a bound on connections
    server = uvicorn.Server(server_config(make_app(engine, key, limits), log_level))
    original = server.startup

    async def startup(sockets=None):
        await original(sockets=sockets)
        if key:
            print(f"posttrain serve: every request needs the API key from {source}.", file=sys.stderr, flush=True)
        print(f"posttrain serve: ready at http://{host}:{bound}", flush=True)

    server.startup = startup
    server.run(sockets=[sock])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_limits(max_num_seqs: int, max_batch_tokens: int, max_bucket_bytes: int | None,
                  weight_update_timeout: float, max_pixel_bytes: int) -> None:
    from posttrain.configs import ConfigError

    for name, value in (("--max_num_seqs", max_num_seqs), ("--max_batch_tokens", max_batch_tokens),
                        ("--max_bucket_bytes", max_bucket_bytes), ("--max_pixel_bytes", max_pixel_bytes)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value} must be at least 1.")
    if not 0 < weight_update_timeout < float("inf"):
        raise ConfigError(f"--weight_update_timeout {weight_update_timeout} must be a positive number of seconds.")
