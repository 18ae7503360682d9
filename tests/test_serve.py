"""`posttrain serve` and its client, end to end over real sockets on 127.0.0.1: the wire format, generation equal to
the in-process generator, verified weight sync (LoRA merged), versions, auth, and faults that must raise one
sentence within their timeout instead of hanging."""

import contextlib
import json
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
from posttrain.generation.server import GenerationError, ServerClient, ServerGenerator  # noqa: E402
from posttrain.generation.transformers_backend import TransformersGenerator, draw_seed  # noqa: E402
from posttrain.serving import wire  # noqa: E402
from posttrain.serving.app import make_app  # noqa: E402
from posttrain.serving.engine import TransformersEngine  # noqa: E402
from posttrain.testing import tiny_model  # noqa: E402
from posttrain.weights import export_weights  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = [[5, 76, 5, 84]] * 4 + [[7, 76, 9, 84, 11]] * 4  # two groups of 4, of different lengths


@contextlib.contextmanager
def running(engine, api_key=None):
    """The app on a real uvicorn server, on a free port of 127.0.0.1, in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as serve() does
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(engine, api_key), log_level="error"))
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
        generator = ServerGenerator(client, PARAMS, tokenizer.pad_token_id, [tokenizer.eos_token_id], seed=3,
                                    model_fingerprint=wire.fingerprint(export_weights(model)))
        assert generator.server_info["engine"] == "transformers"
        _same(generator.generate(PROMPTS), _in_process(model, tokenizer, _first_request_seed(3)))
        # new weights: pushed, verified by digest, and sampled from
        other = tiny_model(tokenizer, seed=1)
        generator.rng.manual_seed(4)
        generator.sync_weights(export_weights(other))
        assert client.info()["weight_version"] == "run:sync-1"
        _same(generator.generate(PROMPTS), _in_process(other, tokenizer, _first_request_seed(4)))


@pytest.mark.peft
def test_a_lora_policy_reaches_the_server_merged(tokenizer):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))
    with running(_engine(tokenizer)) as url:
        generator = ServerGenerator(_client(url), PARAMS, tokenizer.pad_token_id, [tokenizer.eos_token_id], seed=5)
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
        client._call("POST", "/start_weight_update", 5, retry=False, json={"weight_version": "v9"})
        with pytest.raises(GenerationError, match="409: a weight update to version 'v9' is in progress"):
            client.completions([[5, 6]], 1, 0, PARAMS)
        bucket, aliases = next(wire.buckets(export_weights(tiny_model(tokenizer)), 1 << 30))
        data = bytearray(wire.Body(bucket, aliases).to_bytes())
        headers = {"X-Weight-Version": "v9", "X-Bucket-Digest": wire.bucket_digest(bucket)}
        data[-100] ^= 1  # a flipped bit in transit
        response = requests.post(f"{url}/update_weights", data=bytes(data), headers=headers, timeout=10)
        assert response.status_code == 400 and "corrupted in transit" in response.json()["error"]
        engine.abort_update()
        assert requests.get(f"{url}/health", timeout=5).status_code == 200


def test_the_wrong_model_at_the_other_end(tokenizer):
    with running(_engine(tokenizer)) as url:
        bigger = tiny_model(tokenizer, hidden=48)
        with pytest.raises(GenerationError, match="serves another model than the one being trained"):
            ServerGenerator(_client(url), PARAMS, 0, [1], model_fingerprint=wire.fingerprint(export_weights(bigger)))
        generator = ServerGenerator(_client(url), PARAMS, 0, [1])
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
        ServerGenerator(_client(f"http://127.0.0.1:{port}", connect_timeout=1.5), PARAMS, 0, [1])
    assert time.time() - start < 5


def test_a_hung_generate_raises_within_the_request_timeout(tokenizer):
    class Hanging(TransformersEngine):
        def generate(self, *args, **kwargs):
            time.sleep(30)

    with running(Hanging(tiny_model(tokenizer), tokenizer)) as url:
        client = _client(url, request_timeout=1.0)
        start = time.time()
        with pytest.raises(GenerationError, match="did not answer POST /v1/completions within 1 s"):
            client.completions([[5, 6]], 1, 0, PARAMS)
        assert time.time() - start < 5


def test_a_500_on_a_bucket_is_retried(tokenizer):
    class Flaky(TransformersEngine):
        failures = 1

        def load(self, *args, **kwargs):
            if Flaky.failures:
                Flaky.failures -= 1
                raise RuntimeError("transient")
            return super().load(*args, **kwargs)

    with running(Flaky(tiny_model(tokenizer), tokenizer)) as url:
        generator = ServerGenerator(_client(url), PARAMS, 0, [1])
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
            ServerGenerator(_client(url, connect_timeout=3, api_key="wrong"), PARAMS, 0, [1])
        generator = ServerGenerator(_client(url, api_key="s3cret"), PARAMS, 0, [1])
        assert len(generator.generate([[5, 6]] * 2)) == 2


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
