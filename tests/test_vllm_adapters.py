"""posttrain's vLLM adapters against the manifest-built double (tests/vllm_double.py): the colocate engine's call
order and conversion, and weights to a `vllm serve` over its NCCL transfer: driven by vLLM's own trainer-side order,
through posttrain's HTTP client (real sockets to a stand-in of vLLM's RL routes), bounded by timeouts."""

import contextlib
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")

from vllm_double import fake_vllm  # noqa: E402

from posttrain.configs import GRPOConfig  # noqa: E402
from posttrain.generation import SamplingParams, make_generator  # noqa: E402
from posttrain.generation.server import GenerationError, ServerClient  # noqa: E402
from posttrain.generation.server_generator import ServerGenerator  # noqa: E402
from posttrain.testing import tiny_model  # noqa: E402
from posttrain.weights import export_weights  # noqa: E402

@pytest.fixture(autouse=True)
def _restore_environment():
    """Colocate sets RANK, WORLD_SIZE, MASTER_PORT... for vLLM's external launcher, as TRL does: keep them out of
    the other tests' subprocesses."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


MANIFEST = json.load(open(__import__("posttrain.generation.vllm_compat", fromlist=["x"]).MANIFEST_PATH))
PROMPTS = [[5, 76, 5, 84]] * 3 + [[7, 76, 9, 84, 11]] * 3


def _colocate_config(**overrides):
    values = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_kv_cache_dtype="fp8",
                  per_device_train_batch_size=6, num_generations=3, max_completion_length=5, use_cpu=True)
    values.update(overrides)
    return GRPOConfig(**values)


def test_colocate_builds_loads_and_samples_in_vllms_order(tokenizer):
    policy, engine_model = tiny_model(tokenizer, seed=1), tiny_model(tokenizer, seed=2)
    with fake_vllm(model=engine_model) as double:
        generator = make_generator(_colocate_config(), policy, tokenizer, seed=4)
        init = dict(double.log[0][1])
        options = {**init, **init.pop("kwargs", {})}
        assert options["distributed_executor_backend"] == "external_launcher"
        assert options["logprobs_mode"] == "processed_logprobs" and options["kv_cache_dtype"] == "fp8"
        assert options["enable_sleep_mode"] and options["seed"] == 0 and options["max_num_seqs"] == 6
        assert options["dtype"] == "auto"  # vLLM's pick from the checkpoint, as TRL lets it: not the float32 policy's
        generator.sync_weights(export_weights(policy))
        rollouts = generator.generate(PROMPTS, list(range(6)))
        generator.round_done()
        calls = [name for name, _ in double.log]
        assert calls == ["LLM.__init__", "LLM.sleep", "LLM.wake_up", "LLM.apply_model", "LLM.update_weight_version",
                         "LLM.reset_prefix_cache", "LLM.wake_up", "LLM.generate",
                         "LLM.sleep"], calls
        assert [args["tags"] for name, args in double.log if name == "LLM.wake_up"] == [["weights"], ["kv_cache"]]
        # the policy's weights, loaded in place into the engine's model under their plain names
        for (name, p), (_, q) in zip(policy.named_parameters(), engine_model.named_parameters()):
            assert torch.equal(p, q), name
        generated = double.log[-2][1]
        requests = generated["sampling_params"]
        assert [r.n for r in requests] == [3, 3] and len({r.seed for r in requests}) == 2
        assert all(r.logprobs == 0 and r.max_tokens == 5 for r in requests)
    assert rollouts.completion_ids.shape[0] == 6 and rollouts.prompt_ids[3:, -5:].tolist() == [PROMPTS[3]] * 3
    assert rollouts.completion_mask.all() and (rollouts.sampler_logprobs < 0).all()  # Logprob.logprob, per token


def test_sleep_mode_keeps_the_engine_awake_through_a_rounds_later_turns(tokenizer):
    """vllm_enable_sleep_mode: a multi-turn rollout's later turns (new_round=False) sample on the weights the round
    started with; the engine sleeps (level 2: weights and KV cache released) only once the round is done, and the
    next round's sync wakes it (before: it slept after every generate, and the next turn sampled with no weights)."""
    policy, engine_model = tiny_model(tokenizer, seed=1), tiny_model(tokenizer, seed=2)
    with fake_vllm(model=engine_model) as double:
        generator = make_generator(_colocate_config(), policy, tokenizer, seed=4)
        for _ in range(2):  # two rounds of two turns
            generator.sync_weights(export_weights(policy))
            generator.generate(PROMPTS, list(range(6)))
            generator.generate(PROMPTS, list(range(6)), new_round=False)
            generator.round_done()
        calls = [name for name, _ in double.log]
        turns = ["LLM.wake_up", "LLM.apply_model", "LLM.update_weight_version", "LLM.reset_prefix_cache",
                 "LLM.wake_up", "LLM.generate", "LLM.generate", "LLM.sleep"]
        assert calls == ["LLM.__init__", "LLM.sleep", *turns, *turns], calls


def test_a_colocate_weight_sync_never_holds_a_second_copy_of_the_policy(tokenizer):
    """The export is streamed into the engine's load_weights: while it loads a tensor, the export's earlier tensors
    (fresh copies of the trainable weights) are no longer held (before: the whole export was listed first, a second
    copy of the policy in memory: +6 GB at 1.5B in bf16)."""
    import weakref

    policy, engine_model = tiny_model(tokenizer, seed=1), tiny_model(tokenizer, seed=2)
    held = []

    def load_weights(weights):
        earlier = []
        for name, tensor in weights:
            held.append(sum(ref() is not None for ref in earlier))
            engine_model.state_dict()[name].copy_(tensor)
            earlier.append(weakref.ref(tensor))
            del tensor
        return set()

    engine_model.load_weights = load_weights
    with fake_vllm(model=engine_model):
        generator = make_generator(_colocate_config(), policy, tokenizer, seed=4)
        generator.sync_weights(export_weights(policy))
    # at most one: the tied embedding's copy, which the export yields again as lm_head
    assert len(held) > 5 and max(held) <= 1, held
    for (name, p), (_, q) in zip(policy.named_parameters(), engine_model.named_parameters()):
        assert torch.equal(p, q), name


def test_colocate_refuses_what_vllm_would_fail_on(tokenizer):
    with fake_vllm():
        with pytest.raises(GenerationError, match="vllm_tensor_parallel_size=2 must divide the number of processes"):
            make_generator(_colocate_config(vllm_tensor_parallel_size=2), tiny_model(tokenizer), tokenizer,
                           num_processes=3)
    with fake_vllm(version="0.31.0"):
        with pytest.raises(Exception, match=r"needs vllm>=0.33,<0.34 .* but vllm 0.31.0 is installed"):
            make_generator(_colocate_config(), tiny_model(tokenizer), tokenizer)


def test_grpo_colocate_trains_with_the_engine_following_the_policy(tokenizer, tmp_path):
    """A GRPO run in colocate mode on the double: every round loads the policy's weights into the engine first, and
    the importance-sampling metrics are logged (the double's log-probs are not the model's, so the ratios vary)."""
    from conftest import length_reward, tiny_config
    from datasets import Dataset

    from posttrain.grpo.trainer import GRPOTrainer

    engine_model = tiny_model(tokenizer, seed=5)
    with fake_vllm(model=engine_model) as double:
        config = tiny_config(tmp_path, max_steps=2, use_vllm=True, vllm_mode="colocate",
                             vllm_importance_sampling_mode="token_truncate", max_completion_length=4)
        trainer = GRPOTrainer(tiny_model(tokenizer), reward_funcs=length_reward, args=config,
                              train_dataset=Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]}),
                              processing_class=tokenizer)
        trainer.train()
        loads = [name for name, _ in double.log if name == "LLM.apply_model"]
    assert len(loads) == 2
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert {"sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/max"} <= set(logged[0])
    assert logged[0]["sampling/importance_sampling_ratio/max"] <= 3.0  # truncated at clip_max


# ---------------------------------------------------------------------- a vLLM server over HTTP, NCCL transfer


class FakeVLLMServer:
    """vLLM's dev-mode RL routes as posttrain's client meets them, recording each call (path, body); `hang` and
    `fail` make one route stall or answer 500."""

    def __init__(self, backend="nccl", logprobs_mode="processed_logprobs", max_model_len=64):
        self.calls, self.hang, self.fail = [], None, None
        self.version = "default"
        self.scale_out = True  # False: as `vllm serve` without --enable-scale-out (its render route answers 403)
        self.config = {"model_config": {"max_model_len": max_model_len, "logprobs_mode": logprobs_mode,
                                        "dtype": "torch.float32"},
                       "weight_transfer_config": {"backend": backend} if backend else None}

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI()

        async def record(request: Request):
            body = await request.body()
            path = request.url.path
            self.calls.append((path, json.loads(body) if body else None))
            if self.hang == path:
                time.sleep(30)
            if self.fail == path:
                return JSONResponse({"error": "boom"}, 500)
            if path == "/finish_weight_update":
                self.version = self.calls[-1][1]["weight_version"]
            return None

        @app.get("/health")
        async def health():
            return {}

        @app.get("/server_info")
        async def server_info():
            return {"vllm_config": self.config, "vllm_env": {}}

        @app.get("/get_world_size")
        async def world():
            return {"world_size": 1}

        @app.get("/weight_info")
        async def weight_info():
            return {"weight_version": self.version}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.calls.append(("/v1/completions", body))
            choices = [{"index": i * body["n"] + c, "token_ids": [7 + c, 2], "finish_reason": "stop",
                        "logprobs": {"token_logprobs": [-0.5, -0.25]},
                        "weight_versions": [{"version": self.version, "start": 0, "end": 2}]}
                       for i in range(len(body["prompt"])) for c in range(body["n"])]
            return {"choices": choices}

        @app.post("/v1/chat/completions/render")
        async def render(request: Request):
            """The features of a message holding only images (each image 3 tokens, placed after a 2-token header)."""
            body = await request.json()
            self.calls.append(("/v1/chat/completions/render", body))
            if not self.scale_out:
                return JSONResponse({"error": {"message": "Scale-out endpoints are disabled."}}, 403)
            parts = body["messages"][0]["content"]
            assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in parts)
            places = [{"offset": 2 + 5 * i, "length": 3} for i in range(len(parts))]
            return {"token_ids": [1] * (2 + 5 * len(parts)), "sampling_params": {},
                    "features": {"mm_hashes": {"image": [p["image_url"]["url"][-12:] for p in parts]},
                                 "mm_placeholders": {"image": places}, "kwargs_data": {"image": ["x"] * len(parts)}}}

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            body = await request.json()
            self.calls.append(("/inference/v1/generate", body))
            n = body["sampling_params"]["n"]
            choices = [{"index": c, "token_ids": [7 + c, 2], "finish_reason": "stop",
                        "logprobs": {"content": [{"token_id": 7 + c, "logprob": -0.5}, {"token_id": 2,
                                                                                        "logprob": -0.25}]},
                        "weight_versions": [{"version": self.version, "start": 0, "end": 2}]} for c in range(n)]
            return {"request_id": body["request_id"], "output_mode": "tokens", "choices": choices}

        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update"):
            async def route(request: Request):
                answer = await record(request)
                return answer if answer is not None else {"message": "ok"}
            app.post(path)(route)
        return app


@contextlib.contextmanager
def serving(fake):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True


def _vllm_generator(url, sync_timeout=10.0, **kw):
    client = ServerClient(url, connect_timeout=5, request_timeout=5, sync_timeout=sync_timeout)
    return ServerGenerator(client, SamplingParams(max_new_tokens=4), pad_id=0, eos_ids=[2], group_port=51999, **kw)


def test_weights_reach_a_vllm_server_in_vllms_order_with_the_version(tokenizer):
    policy = tiny_model(tokenizer)
    fake = FakeVLLMServer()
    with fake_vllm() as double, serving(fake) as url:
        generator = _vllm_generator(url)
        generator.sync_weights(export_weights(policy))
        generator.sync_weights(export_weights(policy))
    paths = [p for p, _ in fake.calls]
    assert paths == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update", "/start_weight_update", "/update_weights", "/finish_weight_update"]
    routes = MANIFEST["routes"]
    for path, body in fake.calls:  # every body holds only fields vLLM's route takes
        assert set(body or {}) <= set(routes[path]["body"]), (path, body)
    init = fake.calls[0][1]["init_info"]
    assert init["world_size"] == 2 and init["master_port"] == 51999 and init["rank_offset"] == 1
    assert init["master_address"] == "127.0.0.1"  # this host's address on the route to the server
    first = fake.calls[2][1]["update_info"]
    assert first["names"] == [name for name, _ in export_weights(policy)]
    assert fake.calls[5][1]["update_info"]["names"] == []  # unchanged metadata: vLLM reuses the last round's
    assert [b["weight_version"] for p, b in fake.calls if p == "/finish_weight_update"] == [
        generator.version.replace("sync-2", "sync-1"), generator.version]
    sent = dict(double.sent[:len(first["names"])])
    for name, tensor in export_weights(policy):
        assert torch.equal(sent[name], tensor), name


def test_completions_from_a_vllm_server_go_one_request_per_group_with_its_own_seed(tokenizer):
    """vLLM gives every prompt of a request the same seed (child i: seed + i) and ignores unknown fields, so each
    group goes as its own request, seeded by its stream, sent concurrently; bodies hold only CompletionRequest's
    fields."""
    fake = FakeVLLMServer()
    with fake_vllm(), serving(fake) as url:
        generator = _vllm_generator(url)
        generator.sync_weights(export_weights(tiny_model(tokenizer)))
        rollouts = generator.generate(PROMPTS, list(range(6)))
    requests = [b for p, b in fake.calls if p == "/v1/completions"]
    assert sorted(len(b["prompt"]) * b["n"] for b in requests) == [3, 3] and len({b["seed"] for b in requests}) == 2
    fields = set(MANIFEST["fields"]["CompletionRequest"])
    assert all(set(b) <= fields and b["return_weight_versions"] for b in requests)
    assert rollouts.completion_ids.tolist() == [[7, 2], [8, 2], [9, 2]] * 2 and rollouts.is_eos.all()


def test_prompts_with_images_reach_a_vllm_server_as_trls_server_mode_sends_them(tokenizer):
    """A prompt with images: its images rendered alone into vLLM's features (/v1/chat/completions/render), the
    features' placeholders pointed at the runs of image tokens in the prompt's own ids, then its ids generated with
    them (/inference/v1/generate, every one of its n sequences asked for), as TRL's VLLMClient sends them; a text
    prompt in the same round goes to /v1/completions. Bodies hold only the fields of vLLM's request models."""
    from PIL import Image

    red, blue, green = (Image.new("RGB", (8, 8), c) for c in ("red", "blue", "green"))
    image_token = 99
    with_images = [5, 6, image_token, image_token, image_token, 8, image_token, image_token, image_token, 9]
    prompts = [with_images] * 3 + [PROMPTS[3]] * 3
    images = [[red, blue]] * 3 + [[]] * 3
    fake = FakeVLLMServer()
    with fake_vllm(), serving(fake) as url:
        generator = _vllm_generator(url, image_token_ids=(image_token,))
        generator.sync_weights(export_weights(tiny_model(tokenizer)))
        rollouts = generator.generate(prompts, list(range(6)), images=images)
        first_round = list(fake.calls)
        fake.scale_out = False
        with pytest.raises(GenerationError, match=r"does not render images .*restart it with `posttrain vllm-serve`"):
            generator.generate(prompts, list(range(6)), images=images)
    rendered = [b for p, b in first_round if p == "/v1/chat/completions/render"][0]
    assert set(rendered) <= set(MANIFEST["fields"]["ChatCompletionRequest"])
    assert len(rendered["messages"][0]["content"]) == 2  # the prompt's two images, alone
    generated = [b for p, b in first_round if p == "/inference/v1/generate"]
    assert len(generated) == 1 and set(generated[0]) <= set(MANIFEST["fields"]["GenerateRequest"])
    body = generated[0]
    assert body["token_ids"] == with_images and set(body["sampling_params"]) <= set(MANIFEST["fields"]["SamplingParams"])
    assert body["sampling_params"]["n"] == 3 and body["sampling_params"]["output_kind"] == 2  # FINAL_ONLY
    assert body["features"]["mm_placeholders"]["image"] == [{"offset": 2, "length": 3}, {"offset": 6, "length": 3}]
    assert body["features"]["kwargs_data"] == {"image": ["x", "x"]}  # what vLLM processed, sent back as it came
    assert set(body["features"]) <= set(MANIFEST["fields"]["MultiModalFeatures"])
    assert [len(b["prompt"]) for p, b in first_round if p == "/v1/completions"] == [1]  # the text prompt
    assert rollouts.completion_ids.tolist() == [[7, 2], [8, 2], [9, 2]] * 2
    assert rollouts.sampler_logprobs[:3].tolist() == [[-0.5, -0.25]] * 3


def test_a_prompt_whose_image_runs_and_images_differ_is_one_sentence():
    from posttrain.generation.server_generator import place_features

    features = {"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}] * 2}}
    with pytest.raises(GenerationError, match=r"^A prompt holds 1 runs of image tokens but the vLLM server processed "
                                              r"2 images"):
        place_features(features, [5, 99, 99, 6], [99])


@pytest.mark.parametrize("fault,message", [
    ("hang", r"did not finish a weight round within 2 s \(weight_sync_timeout\)"),
    ("fail", r"The generation server at .* answered POST /update_weights with 500: boom"),
])
def test_a_stalled_or_failing_transfer_raises_in_time_and_is_never_resent(tokenizer, fault, message):
    fake = FakeVLLMServer()
    setattr(fake, fault, "/update_weights")
    with fake_vllm(), serving(fake) as url:
        generator = _vllm_generator(url, sync_timeout=2.0)
        start = time.monotonic()
        with pytest.raises(GenerationError, match=message):
            generator.sync_weights(export_weights(tiny_model(tokenizer)))
        assert time.monotonic() - start < 10
    assert [p for p, _ in fake.calls].count("/update_weights") == 1  # a re-sent update would open a second receive


@pytest.mark.parametrize("server,kw,message", [
    (dict(backend=None), {}, "started without NCCL weight transfer"),
    (dict(logprobs_mode="raw_logprobs"), dict(needs_processed_logprobs=True),
     "returns raw_logprobs log-probs, which would bias the importance-sampling correction"),
    (dict(max_model_len=32), dict(max_length=40), "serves at most 32 tokens per sequence.*reach 40"),
])
def test_the_handshake_refuses_a_server_that_does_not_fit(server, kw, message):
    with fake_vllm(), serving(FakeVLLMServer(**server)) as url:
        with pytest.raises(GenerationError, match=message):
            _vllm_generator(url, **kw)


def test_token_bans_vllm_cannot_honour_are_refused_not_dropped(tokenizer):
    """generation_kwargs' suppress_tokens / bad_words_ids / begin_suppress_tokens have no vLLM sampling parameter:
    colocate and a vLLM server refuse them in one sentence, where they would be dropped and sampled anyway."""
    from posttrain.configs import ConfigError

    said = r"^generation_kwargs ban tokens .*which a (colocated vLLM|vLLM server)'s sampler has no parameter for"
    with fake_vllm():
        with pytest.raises(ConfigError, match=said):
            make_generator(_colocate_config(generation_kwargs={"suppress_tokens": [3]}), tiny_model(tokenizer),
                           tokenizer)
    with fake_vllm(), serving(FakeVLLMServer()) as url:
        client = ServerClient(url, connect_timeout=5, request_timeout=5, sync_timeout=5)
        with pytest.raises(ConfigError, match=said):
            ServerGenerator(client, SamplingParams(max_new_tokens=4, begin_suppress_tokens=(3,)), pad_id=0,
                            eos_ids=[2])


@pytest.mark.multiproc
def test_tensor_parallel_colocate_shares_one_engine_per_group(tmp_path, tokenizer):
    """vllm_tensor_parallel_size=2 on 2 processes: the group's engine samples the union of both shares (gathered in
    the group) and each process keeps its own rows, which are the rows a 1-process run gives those prompts."""
    import os
    import subprocess
    import sys

    from test_cli import _env

    here = os.path.dirname(__file__)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(here, "multiproc_colocate.py"), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    prompts = [[5, 76, 5, 84]] * 2 + [[7, 76, 9, 84, 11]] * 2 + [[6, 6]] * 2 + [[9, 8, 7]] * 2
    config = GRPOConfig(use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8, num_generations=2,
                        max_completion_length=4, use_cpu=True)
    with fake_vllm(model=tiny_model(tokenizer)):
        alone = make_generator(config, tiny_model(tokenizer), tokenizer, seed=3).generate(prompts, list(range(8)))
    assert ranks[0]["seeds"] == ranks[1]["seeds"]  # one engine call per group, the same requests on both
    assert ranks[0]["completions"] + ranks[1]["completions"] == alone.completion_ids.tolist()


def test_colocate_gives_each_prompt_its_images_as_vllms_multi_modal_data(tokenizer):
    """A vision-language model's prompts (ids with their image tokens expanded) go to vLLM with their images as the
    request's multi_modal_data, as TRL's colocate mode sends them: one request per prompt and its images, so two
    prompts whose ids agree but whose images differ are two requests."""
    from PIL import Image

    red, blue, green = (Image.new("RGB", (8, 8), c) for c in ("red", "blue", "green"))
    policy = tiny_model(tokenizer, seed=1)
    images = [[red]] * 3 + [[blue, green]] * 3  # the same ids for both prompts, other images
    prompts = [PROMPTS[0]] * 6
    with fake_vllm(model=tiny_model(tokenizer, seed=2)) as double:
        generator = make_generator(_colocate_config(), policy, tokenizer, seed=4)
        generator.sync_weights(export_weights(policy))
        rollouts = generator.generate(prompts, list(range(6)), images=images)
        generated = [args for name, args in double.log if name == "LLM.generate"][-1]
        sent = generated["prompts"]
        assert [p["prompt_token_ids"] for p in sent] == [PROMPTS[0]] * 2
        assert sent[0]["multi_modal_data"] == {"image": red}
        assert sent[1]["multi_modal_data"]["image"] == [blue, green]
        assert [r.n for r in generated["sampling_params"]] == [3, 3]
    assert rollouts.completion_ids.shape[0] == 6


def test_grpo_colocate_trains_on_image_prompts(tmp_path):
    """GRPO in colocate mode on a vision-language model's image prompts (on the double): each round's requests carry
    their images, the engine loads the policy's weights, and the rows' pixels ride into training's forwards."""
    from datasets import Dataset
    from vlm_data import prompt_only

    from posttrain.configs import GRPOConfig as Config
    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.testing import tiny_vision_processor

    model, processor = tiny_vision_processor("qwen2_5_vl")
    engine_model, _ = tiny_vision_processor("qwen2_5_vl", seed=5)
    with fake_vllm(model=engine_model) as double:  # its tokens lie below 100: never an image token
        config = Config(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=4, use_vllm=True, vllm_mode="colocate", use_cpu=True,
                        report_to="none", save_strategy="no", logging_steps=1)
        trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                              args=config, train_dataset=Dataset.from_list(prompt_only(4)), processing_class=processor)
        trainer.train()
        sent = [args["prompts"] for name, args in double.log if name == "LLM.generate"]
    assert len(sent) == 2 and all("multi_modal_data" in p for requests in sent for p in requests)
    assert all(e["loss"] == e["loss"] for e in trainer.state.log_history if "loss" in e)  # finite, not NaN
