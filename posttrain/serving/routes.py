"""The routes of `posttrain serve` (app.py documents them): the request bodies, and `Routes`, the handlers over one
engine, which `make_app` registers on its FastAPI app. Imported by `make_app` once fastapi is known to be installed.

    Completion, Version     the JSON bodies of /v1/completions and the weight-update calls (a malformed one: 422)
    Routes(engine, api_version)
                            the handlers; every engine call runs on its one worker thread, in arrival order
        .register(app)      adds every route to `app`
    engine_error            an EngineError as {"error": message} with its status
"""

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from posttrain import wire
from posttrain.generation.protocol import SamplingParams
from posttrain.serving.engine import EngineError


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


async def engine_error(request: Request, err: EngineError):
    return JSONResponse({"error": str(err)}, err.status)


class Routes:
    """The handlers of one app over `engine`.

    Every engine call runs on one worker thread, in arrival order: the engine is never entered twice at once, and
    torch keeps one warm intra-op thread pool (a fresh worker thread per request made generation ~20% slower)."""

    def __init__(self, engine, api_version: str):
        self.engine = engine
        self.api_version = api_version  # /server_info's api_version (app.API_VERSION)
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
        return {**self.engine.info(), "api_version": self.api_version}

    def weight_info(self):
        return {"weight_version": self.engine.version}

    async def completions(self, body: Completion):
        engine = self.engine
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

        return {"object": "text_completion", "model": engine.name, "choices": await self.on_engine(generate)}

    async def start_weight_update(self, body: Version):
        await self.on_engine(self.engine.begin_update, body.weight_version)
        return {"status": "ok"}

    async def update_weights(self, request: Request):
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
            self.engine.load(tensors, aliases, version)
            return len(tensors), len(aliases)

        tensors, aliases = await self.on_engine(check_and_load)  # off the event loop: /health stays answered
        return {"status": "ok", "tensors": tensors, "aliases": aliases}

    async def finish_weight_update(self, body: Version):
        digest = await self.on_engine(self.engine.finish_update, body.weight_version)
        return {"status": "ok", "digest": digest, "weight_version": self.engine.version}


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
