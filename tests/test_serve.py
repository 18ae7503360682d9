"""`posttrain serve` and its client, end to end over real sockets on 127.0.0.1: the wire format, generation equal to
the in-process generator, verified weight sync (LoRA merged), versions, auth, and faults that must raise one
sentence within their timeout instead of hanging. Requests that must be refused (limits, the host check, bad values,
update ownership and deadlines) go to the app in this process, through `asgi` (no socket, no server)."""

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load as safetensors_load

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("requests")

from posttrain.generation import SamplingParams  # noqa: E402
from posttrain.generation.server import GenerationError, ServerClient  # noqa: E402
from posttrain.generation.server_generator import ServerGenerator  # noqa: E402
from posttrain.generation.transformers_backend import TransformersGenerator, draw_seed  # noqa: E402
from posttrain.serving import wire  # noqa: E402
from posttrain.serving.app import make_app  # noqa: E402
from posttrain.serving.connections import server_config  # noqa: E402
from posttrain.serving.engine import TransformersEngine  # noqa: E402
from posttrain.testing import tiny_model  # noqa: E402
from posttrain.weights import export_weights  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = [[5, 76, 5, 84]] * 4 + [[7, 76, 9, 84, 11]] * 4  # two groups of 4, of different lengths


@contextlib.contextmanager
def running(engine, api_key=None, limits=None, **connection_limits):
    """The app on a real uvicorn server configured as serve() configures it (serving/connections.py), on a free
    port of 127.0.0.1, in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as serve() does
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(make_app(engine, api_key, limits), "error", **connection_limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def _engine(tokenizer, seed=0):
    return TransformersEngine(tiny_model(tokenizer, seed=seed), tokenizer, max_model_len=64, name="tiny")


def _client(url, **kw):
    return ServerClient(url, connect_timeout=kw.pop("connect_timeout", 10), request_timeout=kw.pop("request_timeout",
                        30), sync_timeout=30, **kw)


def _in_process(model, tokenizer, seed):
    return TransformersGenerator(model, tokenizer, PARAMS).generate_seeded(PROMPTS, seed)


def _first_request_seed(seed):
    return draw_seed(torch.Generator().manual_seed(seed))


def _same(a, b):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_eos", "sampler_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ---------------------------------------------------------------------- the wire


def test_buckets_round_trip_with_tied_weights_and_a_size_cap(tokenizer):
    model = tiny_model(tokenizer)  # tied input and output embeddings
    named = list(export_weights(model))
    parts = list(wire.buckets(named, max_bytes=4096))
    assert len(parts) > 2
    sent = {n for bucket, _ in parts for n, _ in bucket}
    aliases = {a: s for _, al in parts for a, s in al.items()}
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" not in sent
    for bucket, al in parts:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= 4096 or len(bucket) == 1
        body = wire.Body(bucket, al)
        data = body.to_bytes()
        assert len(data) == len(body)
        tensors, back = wire.decode(data)
        assert back == al and all(torch.equal(tensors[n], t) for n, t in bucket)
        assert safetensors_load(data).keys() == tensors.keys()  # what safetensors itself reads
    mixed = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.arange(5.0)), ("c", torch.zeros(0)),
             ("d", torch.tensor([True, False, True])), ("e", torch.arange(4, dtype=torch.int64))]  # b, e unaligned
    tensors, _ = wire.decode(wire.Body(mixed, {}).to_bytes())
    assert all(tensors[n].dtype == t.dtype and torch.equal(tensors[n], t) for n, t in mixed)


@pytest.mark.parametrize("damage", ["not json", "short header", "offset outside", "a hole", "bad dtype", "trailing"])
def test_a_malformed_bucket_is_refused_without_reading_outside_it(damage):
    good = wire.Body([("w", torch.arange(6.0).reshape(2, 3)), ("v", torch.ones(2))], {}).to_bytes()
    header = json.loads(good[8:8 + int.from_bytes(good[:8], "little")])
    if damage == "not json":
        data = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"
    elif damage == "short header":
        data = (1 << 40).to_bytes(8, "little") + good[8:]
    else:
        if damage == "offset outside":
            header["v"]["data_offsets"] = [24, 1 << 20]
        elif damage == "a hole":
            header["v"]["data_offsets"] = [28, 36]
        elif damage == "bad dtype":
            header["w"]["dtype"] = "F128"
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + good[8 + int.from_bytes(good[:8], "little"):]
        if damage == "trailing":
            data += b"\x00" * 4
    with pytest.raises(ValueError, match="not a safetensors bucket"):
        wire.decode(data)


# ---------------------------------------------------------------------- generation and sync


def test_generation_equals_the_in_process_generator_and_sync_is_verified(tokenizer):
    engine = _engine(tokenizer)
    with running(engine) as url:
        client = _client(url)
        model = tiny_model(tokenizer)
        generator = ServerGenerator(client, PARAMS, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id],
                                    seed=3, model_fingerprint=wire.fingerprint(export_weights(model)))
        assert generator.server_info["engine"] == "transformers"
        _same(generator.generate(PROMPTS), _in_process(model, tokenizer, _first_request_seed(3)))
        # new weights: pushed, verified by digest, and sampled from
        other = tiny_model(tokenizer, seed=1)
        generator.rng.manual_seed(4)
        generator.sync_weights(export_weights(other))
        assert client.info()["weight_version"] == "run:sync-1"
        _same(generator.generate(PROMPTS), _in_process(other, tokenizer, _first_request_seed(4)))


def test_the_server_honours_token_bans_as_the_process_does(tokenizer):
    """suppress_tokens and begin_suppress_tokens (generation_kwargs', a vision-language model's image tokens) reach
    posttrain serve, which samples what the in-process generator samples with them."""
    banned = SamplingParams(max_new_tokens=6, suppress_tokens=(7, 9), begin_suppress_tokens=(11,))
    model = tiny_model(tokenizer)
    with running(_engine(tokenizer)) as url:
        generator = ServerGenerator(_client(url), banned, pad_id=tokenizer.pad_token_id,
                                    eos_ids=[tokenizer.eos_token_id], seed=3)
        served = generator.generate(PROMPTS)
    _same(served, TransformersGenerator(model, tokenizer, banned).generate_seeded(PROMPTS, _first_request_seed(3)))
    assert not torch.isin(served.completion_ids, torch.tensor([7, 9])).any()
    assert not (served.completion_ids[:, 0] == 11).any()


@pytest.mark.peft
def test_a_lora_policy_reaches_the_server_merged(tokenizer):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))
    with running(_engine(tokenizer)) as url:
        generator = ServerGenerator(_client(url), PARAMS, pad_id=tokenizer.pad_token_id,
                                    eos_ids=[tokenizer.eos_token_id], seed=5)
        generator.sync_weights(export_weights(policy))  # plain names: the server would refuse base_model.model.*
        merged = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8,
                                                                  target_modules=["q_proj", "v_proj"]))
        merged.load_state_dict(policy.state_dict())
        merged = merged.merge_and_unload()
        _same(generator.generate(PROMPTS), _in_process(merged, tokenizer, _first_request_seed(5)))


# ---------------------------------------------------------------------- errors, each one sentence


def test_bad_requests_get_a_clear_4xx_and_the_server_lives_on(tokenizer):
    import requests

    engine = _engine(tokenizer)
    with running(engine) as url:
        client = _client(url)
        long = SamplingParams(max_new_tokens=10)
        with pytest.raises(GenerationError, match="400: prompt 0 has 60 tokens, and with max_tokens=10 that exceeds "
                                                  "this server's max_model_len=64"):
            client.completions([[5] * 60], 1, 0, long)
        with pytest.raises(GenerationError, match=r"422: body.n: Input should be greater than or equal to 1"):
            client.completions([[5, 6]], 0, 0, PARAMS)
        opened = client._call("POST", "/start_weight_update", 5, retry=False, json={"weight_version": "v9"})
        with pytest.raises(GenerationError, match="409: a weight update to version 'v9' is in progress"):
            # the client waits out an update for request_timeout, then says so
            _client(url, request_timeout=1).completions([[5, 6]], 1, 0, PARAMS)
        bucket, aliases = next(wire.buckets(export_weights(tiny_model(tokenizer)), 1 << 30))
        data = bytearray(wire.Body(bucket, aliases).to_bytes())
        headers = {"X-Weight-Version": "v9", "X-Bucket-Digest": wire.bucket_digest(bucket),
                   "X-Update-Id": opened["update_id"]}
        data[-100] ^= 1  # a flipped bit in transit
        response = requests.post(f"{url}/update_weights", data=bytes(data), headers=headers, timeout=10)
        assert response.status_code == 400 and "corrupted in transit" in response.json()["error"]
        engine.abort_update()
        assert requests.get(f"{url}/health", timeout=5).status_code == 200


def test_the_wrong_model_at_the_other_end(tokenizer):
    with running(_engine(tokenizer)) as url:
        bigger = tiny_model(tokenizer, hidden=48)
        with pytest.raises(GenerationError, match="serves another model than the one being trained"):
            ServerGenerator(_client(url), PARAMS, pad_id=0, eos_ids=[1],
                            model_fingerprint=wire.fingerprint(export_weights(bigger)))
        generator = ServerGenerator(_client(url), PARAMS, pad_id=0, eos_ids=[1])
        with pytest.raises(GenerationError, match=r"400: weight '\S+' has shape \([\d, ]+\), the served model's "
                                                  r"\([\d, ]+\): the trainer's model differs from the served one"):
            generator.sync_weights(export_weights(bigger))


def test_no_server_raises_within_the_connect_timeout():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    start = time.time()
    with pytest.raises(GenerationError, match=rf"No generation server answered at http://127.0.0.1:{port} within "
                                              r"1.5 s \(vllm_server_timeout\)"):
        ServerGenerator(_client(f"http://127.0.0.1:{port}", connect_timeout=1.5), PARAMS, pad_id=0, eos_ids=[1])
    assert time.time() - start < 5


def test_a_hung_generate_raises_within_the_request_timeout(tokenizer):
    released = threading.Event()

    class Hanging(TransformersEngine):
        def generate(self, *args, **kwargs):
            released.wait(30)

    with running(Hanging(tiny_model(tokenizer), tokenizer)) as url:
        client = _client(url, request_timeout=1.0)
        start = time.time()
        with pytest.raises(GenerationError, match="did not answer POST /v1/completions within 1 s"):
            client.completions([[5, 6]], 1, 0, PARAMS)
        assert time.time() - start < 5
        released.set()  # the server can then stop at once


def test_a_500_on_a_bucket_is_retried(tokenizer):
    class Flaky(TransformersEngine):
        failures = 1

        def load(self, *args, **kwargs):
            if Flaky.failures:
                Flaky.failures -= 1
                raise RuntimeError("transient")
            return super().load(*args, **kwargs)

    with running(Flaky(tiny_model(tokenizer), tokenizer)) as url:
        generator = ServerGenerator(_client(url), PARAMS, pad_id=0, eos_ids=[1])
        generator.sync_weights(export_weights(tiny_model(tokenizer, seed=2)))  # verified by digest after the retry
        assert Flaky.failures == 0


def test_a_server_killed_mid_sync_raises_instead_of_hanging(tmp_path, tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--model", tiny_model_dir, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("posttrain serve: ready at http://127.0.0.1:"), line + proc.stderr.read()[-2000:]
        url = line.split("ready at ")[1].strip()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # the served model: only the kill can fail it

        def dying():
            for i, pair in enumerate(export_weights(model)):
                if i == 3:
                    proc.kill()
                    proc.wait()
                yield pair

        client = _client(url)
        client.max_bucket_bytes = 1024  # many buckets: the kill lands between two of them
        client.retries = 2
        start = time.time()
        with pytest.raises(GenerationError, match=f"The generation server at {url} refused POST /update_weights"):
            client.push(dying(), "v1")
        assert time.time() - start < 10
    finally:
        proc.kill()


# ---------------------------------------------------------------------- in process: the app without a socket


def asgi(app, method, path, body=b"", headers=None, host="127.0.0.1:8000", pieces=None, disconnect=False):
    """One request to `app` in this process, no socket: (status, JSON answer). `body` goes in one piece with its
    Content-Length unless `headers` gives one; `pieces` (any iterable) sends the body in those pieces instead, and
    with `disconnect` the client leaves after them. `host` None sends no Host header."""

    async def run():
        given = {k.lower(): str(v) for k, v in (headers or {}).items()}
        if pieces is None:
            given.setdefault("content-length", str(len(body)))
        chunks = iter(pieces if pieces is not None else [body])
        raw = ([(b"host", host.encode())] if host is not None else []) + [(k.encode(), v.encode())
                                                                           for k, v in given.items()]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": raw, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
        answered, out = asyncio.Event(), {"body": b""}
        pending = [next(chunks, None)]

        async def receive():
            if pending[0] is not None:
                chunk, pending[0] = pending[0], next(chunks, None)
                return {"type": "http.request", "body": chunk, "more_body": pending[0] is not None or disconnect}
            if not disconnect:
                await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
            else:
                out["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    answered.set()

        await app(scope, receive, send)
        return out["status"], json.loads(out["body"])

    return asyncio.run(run())


JSON = {"Content-Type": "application/json"}
GENERATE = {"prompt": [[5, 6]], "n": 2, "max_tokens": 3, "seed": 0, "return_weight_versions": True}


def post(app, path, body, headers=None, **kwargs):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asgi(app, "POST", path, raw, {**JSON, **(headers or {})}, **kwargs)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _app(tokenizer, limits=None, api_key=None):
    """(app, engine, clock): the app in process over a tiny model, its updates abandoned after 60 s of the clock."""
    clock = Clock()
    engine = TransformersEngine(tiny_model(tokenizer), tokenizer, max_model_len=64, name="tiny", update_timeout=60,
                                clock=clock)
    return make_app(engine, api_key, limits), engine, clock


def _bucket_headers(update_id, version, bucket, **extra):
    return {"X-Weight-Version": version, "X-Update-Id": update_id, "X-Bucket-Digest": wire.bucket_digest(bucket),
            "X-Bucket": "1", **extra}


def _send_bucket(app, update_id, version, bucket, aliases, **extra):
    body = wire.Body(bucket, aliases).to_bytes()
    return asgi(app, "POST", "/update_weights", body, _bucket_headers(update_id, version, bucket, **extra))


def _start(app, version):
    status, answer = post(app, "/start_weight_update", {"weight_version": version})
    assert status == 200, answer
    return answer["update_id"]


def _push_in_process(app, named, version, max_bytes=1 << 30):
    """A whole update through the app: (status, answer) of its finish."""
    update_id = _start(app, version)
    for bucket, aliases in wire.buckets(named, max_bytes):
        status, answer = _send_bucket(app, update_id, version, bucket, aliases)
        assert status == 200, answer
    return post(app, "/finish_weight_update", {"weight_version": version, "update_id": update_id})


def test_one_request_cannot_take_the_server_memory(tokenizer):
    """Sequences, tokens and bytes are bounded, each refusal naming the option that raises it; a weight bucket's
    owner and size are checked before memory is taken for its body (a 3 GiB Content-Length with 1 KiB sent)."""
    import tracemalloc

    from posttrain.serving.routes import Limits

    limits = Limits(max_num_seqs=8, max_batch_tokens=100, max_bucket_bytes=4096, max_pixel_bytes=3000)
    app, engine, _ = _app(tokenizer, limits)
    status, answer = post(app, "/v1/completions", {"prompt": [[5, 6]], "n": 10 ** 9})
    assert status == 413 and answer["error"] == (
        "the request asks for 1000000000 sequences (1 prompt(s) x n=1000000000), more than this server's "
        "max_num_seqs=8: send fewer per request, or restart it with a larger --max_num_seqs.")
    status, answer = post(app, "/v1/completions", {"prompt": [[5, 6]] * 9})
    assert status == 413 and "9 sequences (9 prompt(s) x n=1)" in answer["error"]
    status, answer = post(app, "/v1/completions", {"prompt": [[5, 6, 7, 8]] * 4, "n": 2, "max_tokens": 10})
    assert status == 413 and answer["error"].startswith("the request holds 112 tokens (8 sequences x (longest "
                                                        "prompt + max_tokens=10))")
    assert "--max_batch_tokens" in answer["error"]
    assert post(app, "/v1/completions", {"prompt": [[5, 6, 7, 8]] * 4, "max_tokens": 10})[0] == 200  # 56 tokens
    # a prompt's pixels (model_inputs): bounded, well-formed, one row per prompt, for a vision-language model
    pixels = {"0.pixel_values": torch.zeros(4, 8)}
    for model_inputs, code, said in [
            (wire.to_text({"0.pixel_values": torch.zeros(1000)}), 413, "more than this server's max_pixel_bytes=3000"),
            ("not base64!", 422, "model_inputs is not ModelInputs.tensors('') of one row per prompt"),
            (wire.to_text({"3.pixel_values": torch.zeros(2)}), 422, "model_inputs is not ModelInputs.tensors"),
            (wire.to_text(pixels), 400, "this server's model (Qwen2ForCausalLM) is a text model")]:
        status, answer = post(app, "/v1/completions", {"prompt": [[5, 6]], "model_inputs": model_inputs})
        assert status == code and said in answer["error"], answer
    # JSON bodies: a declared length over the limit is refused unread, a chunked one once it passes it
    status, answer = asgi(app, "POST", "/v1/completions", b"{}", {**JSON, "Content-Length": 1 << 40})
    assert status == 413 and "--max_batch_tokens" in answer["error"]
    megabyte = b" " * (1 << 20)
    status, answer = asgi(app, "POST", "/v1/completions", headers=JSON,
                          pieces=[megabyte] * (limits.max_json_bytes // len(megabyte) + 2))
    assert status == 413
    huge = {"Content-Length": 3 << 30, "X-Weight-Version": "v1", "X-Update-Id": "0" * 32,
            "X-Bucket-Digest": "0" * 64}
    tracemalloc.start()
    try:
        status, answer = asgi(app, "POST", "/update_weights", b"\0" * 1024, huge)
        assert status == 409 and answer["error"].startswith("no weight update is open")
        update_id = _start(app, "v1")
        status, answer = asgi(app, "POST", "/update_weights", b"\0" * 1024, {**huge, "X-Update-Id": update_id})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == 413 and "more than this server takes in one" in answer["error"]
    assert "--max_bucket_bytes" in answer["error"] and peak < 64 << 20
    assert asgi(app, "GET", "/health")[0] == 200


def test_the_client_fits_its_requests_and_buckets_to_the_server_limits(tokenizer):
    """A round larger than max_num_seqs / max_batch_tokens is split over several requests and samples what the
    in-process generator samples; buckets are packed within the server's max_bucket_bytes, and a tensor larger
    than it stops the push with the option to raise."""
    from posttrain.serving.routes import Limits

    engine = _engine(tokenizer)
    sizes = []
    generate = engine.generate

    def recording(prompts, n, *args):
        sizes.append(len(prompts) * n)
        return generate(prompts, n, *args)

    engine.generate = recording
    largest = 4 * engine.largest_tensor_elements
    loaded = []
    load = engine.load
    engine.load = lambda tensors, *args: (loaded.append(sum(t.numel() * 4 for t in tensors.values())),
                                          load(tensors, *args))
    with running(engine, limits=Limits(max_num_seqs=3, max_batch_tokens=3 * (5 + 6), max_bucket_bytes=largest)) \
            as url:
        model = tiny_model(tokenizer)
        generator = ServerGenerator(_client(url), PARAMS, pad_id=tokenizer.pad_token_id,
                                    eos_ids=[tokenizer.eos_token_id], seed=3)
        split, whole = generator.generate(PROMPTS), _in_process(model, tokenizer, _first_request_seed(3))
        assert sorted(sizes) == [1, 1, 3, 3]  # each group of 4 as 3 + 1 (the requests are sent together)
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_eos"):
            assert torch.equal(getattr(split, name), getattr(whole, name)), name
        # the same tokens; their log-probs from batches of other shapes, equal but for the last bits
        assert torch.allclose(split.sampler_logprobs, whole.sampler_logprobs, atol=1e-5)
        generator.sync_weights(export_weights(tiny_model(tokenizer, seed=1)))
        assert len(loaded) > 1 and max(loaded) <= largest
        big = torch.zeros((largest + wire.MAX_HEADER_BYTES) // 8 + 1, dtype=torch.float64)  # past the header room
        with pytest.raises(GenerationError, match=rf"Weight 'big' alone has {big.numel() * 8} bytes, more than the "
                                                  rf"generation server at {url} takes in one bucket "
                                                  rf"\(max_bucket_bytes={largest}\): restart it with "
                                                  r"--max_bucket_bytes \d+ or more"):
            generator.client.push([("big", big)], "too-big")


def test_without_a_key_only_loopback_names_are_answered(tokenizer):
    """DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1 sends its own Host (and
    Origin); without an API key the server answers loopback names only, and nothing is opened."""
    app, engine, _ = _app(tokenizer)
    for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", "localhost.attacker.example", None):
        status, answer = post(app, "/start_weight_update", {"weight_version": "evil"}, host=host)
        assert status == 403, host
        assert answer["error"] == (f"this server has no API key, so it answers only requests addressed to a loopback "
                                   f"name (localhost, 127.0.0.1, [::1]), and the Host header is "
                                   f"{repr(host) if host else 'missing'}: use one of "
                                   "those names in the URL, or start the server with an API key.")
    assert engine.update is None
    status, answer = post(app, "/v1/completions", GENERATE, {"Origin": "http://attacker.example"})
    assert status == 403 and "the Origin header is 'http://attacker.example'" in answer["error"]
    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "0.0.0.0:8000", "127.0.0.2"):
        assert post(app, "/v1/completions", GENERATE, host=host)[0] == 200, host
    assert post(app, "/v1/completions", GENERATE, {"Origin": "http://localhost:3000"})[0] == 200
    keyed = make_app(engine, "s3cret")  # a key guards it: any name may reach it
    assert asgi(keyed, "GET", "/health", host="gpu-box.internal:8000")[0] == 401
    assert asgi(keyed, "GET", "/health", host="gpu-box.internal:8000",
                headers={"Authorization": "Bearer s3cret"})[0] == 200


def test_an_update_is_owned_and_one_left_silent_is_abandoned(tokenizer):
    """A sender that leaves mid-bucket does not block generation for good: after weight_update_timeout without a
    call its update is abandoned and, nothing having been loaded, the previous version is served again. While it
    lives, nobody else can take it over or send into it; a bucket still arriving keeps it alive."""
    app, engine, clock = _app(tokenizer)
    before = post(app, "/v1/completions", GENERATE)[1]["choices"]
    update_id = _start(app, "v1")
    bucket, aliases = next(wire.buckets(export_weights(tiny_model(tokenizer, seed=1)), 1 << 30))
    body = wire.Body(bucket, aliases).to_bytes()
    headers = {**_bucket_headers(update_id, "v1", bucket), "Content-Length": len(body)}
    status, answer = asgi(app, "POST", "/update_weights", headers=headers, pieces=[body[:1000]], disconnect=True)
    assert status == 400 and answer["error"] == "the client went away after 1000 bytes of the bucket."
    status, answer = post(app, "/v1/completions", GENERATE)
    assert status == 409 and answer["error"] == ("a weight update to version 'v1' is in progress: retry after it "
                                                 "finishes (an update whose sender stays silent for 60 s is "
                                                 "abandoned).")
    clock.now += 30
    status, answer = post(app, "/start_weight_update", {"weight_version": "v2"})
    assert status == 409 and answer["error"] == (
        "a weight update to version 'v1' is already open (its last call 30 s ago): wait until it finishes, or until "
        "it has been silent for 60 s (--weight_update_timeout), when a new one may take over.")
    for other, version, match in (("f" * 32, "v1", "does not carry the id of the open weight update"),
                                  (update_id, "v2", "weights for version 'v2' arrived in the update to version 'v1'")):
        status, answer = _send_bucket(app, other, version, bucket, aliases)
        assert status == 409 and match in answer["error"]
    status, answer = post(app, "/finish_weight_update", {"weight_version": "v1"})
    assert status == 422 and answer["error"] == "body.update_id: Field required."
    clock.now += 61
    status, answer = post(app, "/v1/completions", GENERATE)
    assert status == 200 and answer["choices"] == before
    assert asgi(app, "GET", "/weight_info")[1] == {"weight_version": "initial", "weights": "ready"}
    status, answer = _send_bucket(app, update_id, "v1", bucket, aliases)  # its sender comes back too late
    assert status == 409 and answer["error"].startswith("no weight update is open")

    def slowly():  # 90 s in all, never 60 s silent
        for start in range(0, len(body), len(body) // 3 + 1):
            clock.now += 30
            yield body[start:start + len(body) // 3 + 1]

    update_id = _start(app, "v3")
    status, answer = asgi(app, "POST", "/update_weights", headers=_bucket_headers(update_id, "v3", bucket),
                          pieces=slowly())
    assert status == 200, answer


def test_an_abandoned_update_that_loaded_buckets_is_never_served(tokenizer):
    """Some buckets copied, then silence: the model holds two versions mixed, so it has no version and generation
    answers 503 until a complete update (which may take over at once) has rewritten every tensor the abandoned one
    wrote; an update that does not stays partial, and says so."""
    app, engine, clock = _app(tokenizer)
    named = list(export_weights(tiny_model(tokenizer, seed=1)))
    parts = list(wire.buckets(named, 4096))
    update_id = _start(app, "v1")
    assert _send_bucket(app, update_id, "v1", *parts[0])[0] == 200
    clock.now += 61
    status, answer = post(app, "/v1/completions", GENERATE)
    assert status == 503 and answer["error"].startswith("the weights are partial: an abandoned update wrote ")
    assert asgi(app, "GET", "/weight_info")[1] == {"weight_version": None, "weights": "partial"}
    status, answer = _push_in_process(app, parts[-1][0], "v2")  # other tensors only
    assert status == 409 and "did not rewrite" in answer["error"] and "still partial" in answer["error"]
    assert post(app, "/v1/completions", GENERATE)[0] == 503
    status, answer = _push_in_process(app, named, "v3")
    assert status == 200 and answer["weight_version"] == "v3"
    status, answer = post(app, "/v1/completions", GENERATE)
    assert status == 200 and {c["weight_versions"][0]["version"] for c in answer["choices"]} == {"v3"}


BAD_COMPLETIONS = [
    (b'{"prompt": [[5, 6]], "temperature": NaN}', 422, "body.temperature: Input should be a finite number (got nan)."),
    (b'{"prompt": [[5, 6]], "top_p": Infinity}', 422, "body.top_p: Input should be a finite number (got inf)."),
    (b'{"prompt": [[5, 6]], "min_p": -Infinity}', 422, "body.min_p: Input should be a finite number"),
    (b'{"prompt": [[5, 6]], "repetition_penalty": NaN}', 422, "body.repetition_penalty: Input should be a finite"),
    ({"temperature": 1e-300}, 422, "body.temperature: Input should be greater than or equal to 0.01"),
    ({"repetition_penalty": 1e300}, 422, "body.repetition_penalty: Input should be less than or equal to 100"),
    ({"top_p": 1e-300}, 422, "body.top_p: Input should be greater than or equal to 0.000001 (got 1e-300)."),
    ({"seed": 2 ** 64}, 422, "body.seed: Input should be less than or equal to 9223372036854775807"),
    ({"sample_keys": [2 ** 64]}, 422, "body.sample_keys.0: Input should be less than or equal to"),
    ({"sample_keys": [2 ** 63 - 1], "n": 2}, 422, "sample_keys holds 9223372036854775807, and with n=2"),
    ({"sample_keys": [1, 2]}, 422, "sample_keys holds 2 keys for 1 prompts"),
    ({"stop_token_ids": [2 ** 64]}, 422, "body.stop_token_ids.0: Input should be less than or equal to"),
    ({"stop_token_ids": [10 ** 6]}, 422, "stop_token_ids holds 1000000, outside the vocabulary [0, "),
    ({"top_k": 2 ** 64}, 422, "top_k=18446744073709551616 exceeds the vocabulary ("),
    ({"logprobs": 5}, 422, "logprobs=5 asks for the most likely tokens' log-probs"),
    ({"min_tokens": 5, "max_tokens": 3}, 422, "min_tokens=5 exceeds max_tokens=3: lower min_tokens or raise"),
    ({"max_tokens": 2 ** 64}, 400, "and with max_tokens=18446744073709551616 that exceeds this server's"),
    ({"prompt": [[5, 2 ** 64]]}, 400, "prompt 0 holds a token id outside the vocabulary [0, "),
    ({"prompt": [[5, True]]}, 422, "prompt 0 holds 'True', which is not a token id"),
    ({"prompt": [[5, -1]]}, 422, "prompt 0 holds '-1', which is not a token id"),
    ({"prompt": [[5], 6]}, 422, "prompt mixes token ids and lists"),
    ({"prompt": "hello"}, 422, "body.prompt: Input should be a valid list"),
    ({"n": 1.5}, 422, "body.n: Input should be a valid integer (got 1.5)."),
    ({"stream": True}, 422, "body.stream: Extra inputs are not permitted (got True)."),
    ({"model": "other"}, 404, "model 'other' is not served here: this server serves 'tiny'."),
    (b'{"prompt": [[5, 6]', 422, "the body is not a JSON object: send one, with Content-Type: application/json."),
]


@pytest.fixture(scope="module")
def served(tokenizer):
    return _app(tokenizer)


@pytest.mark.parametrize("body,status,message", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_a_bad_completions_field_gets_a_4xx_naming_it(served, body, status, message):
    app, engine, _ = served
    raw = body if isinstance(body, bytes) else json.dumps({"prompt": [[5, 6]], **body}).encode()
    got, answer = post(app, "/v1/completions", raw)
    assert got == status and message in answer["error"], answer
    assert post(app, "/v1/completions", GENERATE)[0] == 200  # and the server serves on


def test_a_bad_bucket_header_or_alias_is_refused_before_anything_is_loaded(tokenizer):
    """Every header of /update_weights is checked (422 or 400 naming it); a bucket whose alias names a source the
    update has not sent is refused whole: not one of its tensors is copied."""
    app, engine, _ = _app(tokenizer)
    update_id = _start(app, "v1")
    other = dict(export_weights(tiny_model(tokenizer, seed=1)))
    bucket = [(name, other[name]) for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight")]
    body = wire.Body(bucket, {}).to_bytes()
    good = _bucket_headers(update_id, "v1", bucket)
    for change, status, message in (
            ({"X-Update-Id": None}, 422, "the X-Update-Id header is missing"),
            ({"X-Weight-Version": None}, 422, "the X-Weight-Version header is missing"),
            ({"X-Weight-Version": "v" * 300}, 422, "the X-Weight-Version header is too long"),
            ({"X-Bucket-Digest": "abc"}, 422, "the X-Bucket-Digest header is missing or not 64 lowercase hex"),
            ({"X-Bucket": "first"}, 422, "the X-Bucket header 'first' is not a bucket number"),
            ({"Content-Length": "-5"}, 400, "Content-Length '-5' is not a number of bytes."),
            ({"Content-Length": "5e3"}, 400, "Content-Length '5e3' is not a number of bytes."),
            ({"X-Bucket-Digest": "0" * 64}, 400, "do not match its X-Bucket-Digest")):
        headers = {k: v for k, v in {**good, **change}.items() if v is not None}
        got, answer = asgi(app, "POST", "/update_weights", body, headers)
        assert got == status and message in answer["error"], (change, answer)
    held = {name: engine._state[name].clone() for name, _ in bucket}
    for aliases, message in (({"lm_head.weight": "model.unknown.weight"}, "which this update has not sent"),
                             ({"lm_head.weight": "model.embed_tokens.weight"}, "which this update has not sent"),
                             ({"model.norm.weight": "model.layers.0.mlp.up_proj.weight"}, "is both sent and"),
                             ({"model.not_there": "model.norm.weight"}, "is not in the served model")):
        got, answer = _send_bucket(app, update_id, "v1", bucket, aliases)
        assert got == 400 and message in answer["error"], answer
        assert all(torch.equal(engine._state[name], value) for name, value in held.items())
    assert _send_bucket(app, update_id, "v1", bucket, {})[0] == 200
    assert torch.equal(engine._state["model.norm.weight"], other["model.norm.weight"])


def test_the_api_key_from_a_flag_a_file_or_the_environment(tmp_path):
    """`posttrain serve` takes its key from --api_key, --api_key_file or POSTTRAIN_API_KEY; the trainer sends
    POSTTRAIN_API_KEY, else vLLM's VLLM_API_KEY: one variable set for both processes is enough."""
    from posttrain.configs import ConfigError
    from posttrain.generation.server import api_key_from_env
    from posttrain.serving.app import api_key_from

    path = tmp_path / "key"
    path.write_text("s3cret\n")
    assert api_key_from(None, str(path), {}) == ("s3cret", f"--api_key_file {path}")
    assert api_key_from(None, None, {"POSTTRAIN_API_KEY": "env"}) == ("env", "POSTTRAIN_API_KEY")
    assert api_key_from("flag", None, {"POSTTRAIN_API_KEY": "env"}) == ("flag", "--api_key")
    assert api_key_from(None, None, {"POSTTRAIN_API_KEY": "", "VLLM_API_KEY": "v"}) == (None, "none")
    with pytest.raises(ConfigError, match="--api_key and --api_key_file both given: pass one"):
        api_key_from("flag", str(path), {})
    with pytest.raises(ConfigError, match=r"--api_key_file '\S+missing' cannot be read \(FileNotFoundError\)"):
        api_key_from(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="the API key from --api_key_file .+ is empty"):
        api_key_from(None, str(tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="the API key from --api_key is not printable ASCII"):
        api_key_from("two words", None, {})
    assert api_key_from_env({"POSTTRAIN_API_KEY": "p", "VLLM_API_KEY": "v"}) == "p"
    assert api_key_from_env({"VLLM_API_KEY": "v"}) == "v"
    assert api_key_from_env({"POSTTRAIN_API_KEY": ""}) is None


@pytest.mark.parametrize("option,value,message", [
    ("max_num_seqs", 0, "--max_num_seqs 0 must be at least 1."),
    ("max_batch_tokens", -1, "--max_batch_tokens -1 must be at least 1."),
    ("max_bucket_bytes", 0, "--max_bucket_bytes 0 must be at least 1."),
    ("weight_update_timeout", float("nan"), "--weight_update_timeout nan must be a positive number of seconds."),
    ("api_key", "", "the API key from --api_key is empty"),
    ("port", 70000, "--port 70000 is not a port: give one from 1 to 65535, or 0 for a free one."),
    ("port", -1, "--port -1 is not a port: "),
    ("max_model_len", 0, "--max_model_len 0 must be at least 1 (leave it out for the model's own position limit).")])
def test_serve_refuses_bad_options_before_loading_anything(option, value, message):
    from posttrain.configs import ConfigError
    from posttrain.serving.app import serve

    with pytest.raises(ConfigError, match=re.escape(message)):
        serve("no/such-model", **{option: value})


def test_a_slow_but_alive_server_gets_the_sync_timeout(tokenizer):
    """While a bucket loads for longer than request_timeout, /health keeps answering: the push waits."""
    class Slow(TransformersEngine):
        def load(self, *args, **kwargs):
            time.sleep(1.2)
            return super().load(*args, **kwargs)

    with running(Slow(tiny_model(tokenizer), tokenizer)) as url:
        client = _client(url, request_timeout=0.3)
        start = time.time()
        client.push(export_weights(tiny_model(tokenizer, seed=2)), "v1")
        assert time.time() - start > 1.2 and client.weight_version() == "v1"


def test_a_stopped_server_fails_the_push_within_the_request_timeout_and_ctrl_c_stops_it(tmp_path, tiny_model_dir):
    """`posttrain serve --api_key_file`: the trainer's client with the key from POSTTRAIN_API_KEY; the server
    stopped (SIGSTOP) in the middle of a push fails it within about request_timeout, not weight_sync_timeout; and
    Ctrl-C stops the server with a server's message, not training advice."""
    import os
    import signal

    import requests

    from posttrain.generation.server import api_key_from_env

    (tmp_path / "key").write_text("k3y\n")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--model", tiny_model_dir, "--port", "0",
                             "--api_key_file", str(tmp_path / "key")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("posttrain serve: ready at http://127.0.0.1:"), line + proc.stderr.read()[-2000:]
        url = line.split("ready at ")[1].strip()
        assert requests.get(f"{url}/health", timeout=5).status_code == 401
        client = ServerClient(url, api_key=api_key_from_env({"POSTTRAIN_API_KEY": "k3y"}), connect_timeout=10,
                              request_timeout=1.0, sync_timeout=120)
        client.wait_until_up()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

        def stopping():
            for i, pair in enumerate(export_weights(model)):
                if i == 3:
                    os.kill(proc.pid, signal.SIGSTOP)
                yield pair

        client.max_bucket_bytes = 1024  # many buckets: the stop lands between two of them
        start = time.time()
        with pytest.raises(GenerationError, match=rf"The generation server at {url} stopped answering /health "
                                                  r"within 1 s \(request_timeout\) while POST /update_weights was in "
                                                  "flight: it is stopped or dead"):
            client.push(stopping(), "v1")
        assert time.time() - start < 10
        os.kill(proc.pid, signal.SIGCONT)
        client.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip() == "posttrain serve: stopped.", (out, err)
        assert "checkpoint" not in err and "Traceback" not in err
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- auth


def test_a_key_guards_every_route(tokenizer):
    import requests

    with running(_engine(tokenizer), api_key="s3cret") as url:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/server_info"),
                             ("POST", "/v1/completions"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
                             ("POST", "/finish_weight_update")):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert requests.request(method, f"{url}{path}", headers=headers, timeout=5).status_code == 401, path
        with pytest.raises(GenerationError, match="refused the API key"):
            ServerGenerator(_client(url, connect_timeout=3, api_key="wrong"), PARAMS, pad_id=0, eos_ids=[1])
        generator = ServerGenerator(_client(url, api_key="s3cret"), PARAMS, pad_id=0, eos_ids=[1])
        assert len(generator.generate([[5, 6]] * 2)) == 2


def _half_finished(port: int, n: int) -> list:
    """n connections that send a request line and one header, and stop (a Slowloris client)."""
    held = []
    for _ in range(n):
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        held.append(conn)
    return held


def _closed_by_server(conn) -> bool:
    """Whether the server closed the connection (within 5 seconds)."""
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _still_open(held: list) -> int:
    """How many of `held` the server has not closed (nothing to read yet: no EOF, no reset)."""
    import select

    poller = select.poll()
    for conn in held:
        poller.register(conn, select.POLLIN)
    return len(held) - len(poller.poll(0))


@pytest.fixture
def descriptors():
    """Room for a thousand connections, both ends in this process (the soft limit raised to the hard one)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 2600:
        pytest.skip(f"needs ~2600 file descriptors, and the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_half_finished_connections_do_not_lock_the_trainer_out(tokenizer, descriptors):
    """A thousand connections that stop after one header (before the API key could be read): the server keeps at
    most max_connections open, closing the oldest that wait for their headers, closes those that stall past
    header_seconds, and serves the trainer's request, key checked, meanwhile."""
    engine = _engine(tokenizer)
    with running(engine, api_key="k", header_seconds=2.0, max_connections=64) as url:
        port = int(url.rsplit(":", 1)[1])
        held = _half_finished(port, 1000)
        try:
            start = time.perf_counter()
            generator = ServerGenerator(_client(url, api_key="k"), PARAMS, pad_id=0, eos_ids=[1])
            assert len(generator.generate([[5, 6]] * 2)) == 2 and time.perf_counter() - start < 10
            assert all(_closed_by_server(conn) for conn in held[:900:50])  # evicted, oldest first
            assert _still_open(held) <= 64  # the bound, however fast they came
            time.sleep(2.5)
            assert _still_open(held) == 0  # past header_seconds
        finally:
            for conn in held:
                conn.close()


def test_binding_beyond_loopback_needs_a_key(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "serve", "--model", tiny_model_dir, "--host",
                          "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "has no --api_key" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------- the trainer through a server


def _grpo(tokenizer, tmp_path, **overrides):
    from conftest import length_reward, tiny_config
    from datasets import Dataset

    from posttrain.grpo.trainer import GRPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    config = tiny_config(tmp_path, max_steps=3, logging_steps=1, **overrides)
    return GRPOTrainer(tiny_model(tokenizer), reward_funcs=length_reward, args=config, train_dataset=prompts,
                       processing_class=tokenizer)


def test_grpo_through_posttrain_serve_equals_in_process(tokenizer, tmp_path):
    """The same seed gives the same completions, rewards, losses and final weights whether the policy samples
    in-process or a server does, its weights pushed and verified before every round. With the importance-sampling
    correction on (TRL's default with use_vllm) the logged mismatch is ~0: the server samples with posttrain's
    sampler, so every ratio is 1 to float precision and the run matches to 1e-5."""
    local = _grpo(tokenizer, tmp_path / "local")
    local.train()
    engine = TransformersEngine(tiny_model(tokenizer, seed=9), tokenizer, name="tiny")  # other weights: the push
    with running(engine) as url:                                                        # must replace them all
        server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=10.0)
        served = _grpo(tokenizer, tmp_path / "served", vllm_importance_sampling_correction=False, **server)
        served.train()
        assert engine.version.endswith(":sync-3")
        corrected = _grpo(tokenizer, tmp_path / "corrected", top_p=0.9, **server)
        corrected.train()
        top_p = _grpo(tokenizer, tmp_path / "top_p", top_p=0.9)
        top_p.train()
    for a, b in zip([h for h in local.state.log_history if "loss" in h],
                    [h for h in served.state.log_history if "loss" in h]):
        for key in ("loss", "reward", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key)
    for (name, p), (_, q) in zip(local.policy.named_parameters(), served.policy.named_parameters()):
        assert torch.equal(p, q), name
    logs = [h for h in corrected.state.log_history if "loss" in h]
    assert len(logs) == 3
    for a, b in zip([h for h in top_p.state.log_history if "loss" in h], logs):
        assert b["sampling/sampling_logp_difference/max"] < 1e-4  # over the top-p support: the same distribution
        assert abs(b["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)


@pytest.mark.peft
def test_grpo_with_lora_through_a_server_samples_from_the_trained_policy(tokenizer, tmp_path):
    """TRL's two LoRA failures with an engine, through a server: the adapter reaching it under peft's names, and a
    merged snapshot emptied by the unmerge (a flat reward curve). After LoRA training, the server's model gives a
    fixed completion the trained policy's log-probs, which differ from the base model's."""
    from peft import LoraConfig

    from posttrain.models import token_logprobs

    from conftest import length_reward, tiny_config
    from datasets import Dataset

    from posttrain.grpo.trainer import GRPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    base = tiny_model(tokenizer)
    engine = TransformersEngine(tiny_model(tokenizer), tokenizer, name="tiny")
    with running(engine) as url:
        config = tiny_config(tmp_path / "lora", max_steps=3, logging_steps=1, learning_rate=0.05, use_vllm=True,
                             vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=10.0)
        trainer = GRPOTrainer(tiny_model(tokenizer), reward_funcs=length_reward, args=config, train_dataset=prompts,
                              processing_class=tokenizer,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        trainer.train()
        trainer.generator.sync_weights(export_weights(trainer.model))  # the weights after the last step
    ids = torch.tensor([[5, 76, 5, 84]]), torch.ones(1, 4, dtype=torch.bool)
    completion = torch.tensor([[9, 84, 11, tokenizer.eos_token_id]]), torch.ones(1, 4, dtype=torch.bool)
    with torch.no_grad():
        served, _ = token_logprobs(engine.model, *ids, *completion)
        policy, _ = token_logprobs(trainer.policy, *ids, *completion)
        untrained, _ = token_logprobs(base, *ids, *completion)
    assert torch.allclose(served, policy, atol=1e-5)
    assert not torch.allclose(served, untrained, atol=1e-3)  # the adapter moved, and its effect reached the server


def test_grpo_config_for_a_server():
    from posttrain.configs import ConfigError, GRPOConfig

    assert GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_port=9000).server_url == "http://0.0.0.0:9000"
    assert GRPOConfig(use_vllm=True).vllm_mode == "colocate"  # TRL's default mode; it needs vLLM at start-up
    with pytest.raises(ConfigError, match=r"vllm_structured_outputs_regex='a\+' is not supported"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_structured_outputs_regex="a+")


@contextlib.contextmanager
def serve_process(model_dir, *extra):
    """`posttrain serve --port 0` in a subprocess; yields its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--model", model_dir, "--port", "0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("posttrain serve: ready at "), line + proc.stderr.read()[-2000:]
        yield line.split("ready at ")[1].strip()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.multiproc
def test_two_processes_share_one_server(tmp_path, tiny_model_dir):
    """`posttrain grpo` on 2 processes (gloo) through one `posttrain serve`: process 0 pushes, both generate and
    train in step, and the completions are the one-process run's (each row is sampled with its key's stream, not
    its process's); a server that dies mid-run makes both processes stop with one sentence."""
    import json

    from test_cli import _env, _write_data

    common = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
              "--reward_funcs", "length", "--num_generations", "4", "--max_completion_length", "6",
              "--logging_steps", "1", "--save_strategy", "no", "--gradient_checkpointing", "false", "--use_cpu",
              "true", "--use_vllm", "true", "--vllm_mode", "server"]
    two = ["--per_device_train_batch_size", "8", "--accelerate_config", "multi_gpu", "--num_processes", "2"]

    def records(name):
        return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]

    with serve_process(tiny_model_dir) as url:
        for name, layout in (("two", two), ("one", ["--per_device_train_batch_size", "16"])):
            out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", *common, *layout, "--max_steps",
                                  "3", "--vllm_server_base_url", url, "--vllm_server_timeout", "30", "--output_dir",
                                  str(tmp_path / name)], capture_output=True, text=True, env=_env(), timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
        assert [r["step"] for r in records("two")] == [1, 2, 3]
        for a, b in zip(records("one"), records("two")):
            for key in ("reward", "completions/mean_length", "completions/clipped_ratio"):
                assert a[key] == b[key], (a["step"], key)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        import requests

        assert requests.get(f"{url}/server_info", timeout=5).json()["weight_version"].endswith(":sync-3")
    # the server is gone: both processes stop at start-up with the same sentence, within the timeout
    start = time.time()
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", *common, *two, "--max_steps", "1",
                          "--vllm_server_base_url", url, "--vllm_server_timeout", "2", "--output_dir",
                          str(tmp_path / "gone")], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode != 0 and time.time() - start < 120
    errors = [line for line in out.stderr.splitlines() if line.startswith("posttrain: error:")]
    assert len(errors) == 1 and f"No generation server answered at {url} within 2 s" in errors[0]  # printed once
