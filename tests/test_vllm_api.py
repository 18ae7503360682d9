"""posttrain's vLLM surface, offline: the manifest read from vLLM's wheels (posttrain/generation/vllm_api.json),
vllm_compat's checks against a double built from it (tests/vllm_double.py), `posttrain vllm-serve`'s command line,
and tools/check_vllm_api.py's parser on a tiny fake wheel (the real download is not run in tests)."""

import functools
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import zipfile

import pytest
import torch
from vllm_double import fake_vllm, load_manifest, vllm_double  # noqa: F401 (a fixture)

from posttrain.generation import vllm_compat
from posttrain.generation.vllm_compat import VLLMAPIError, check_installed, check_kwargs, symbol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(ROOT, "tools", "check_vllm_api.py")
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/completions": "POST", "/server_info": "GET",
          "/init_weight_transfer_engine": "POST", "/start_weight_update": "POST", "/update_weights": "POST",
          "/finish_weight_update": "POST", "/update_weight_version": "POST", "/pause": "POST", "/resume": "POST",
          "/reset_prefix_cache": "POST", "/weight_checker": "POST", "/get_world_size": "GET", "/weight_info": "GET",
          "/v1/chat/completions/render": "POST", "/inference/v1/generate": "POST"}
# what posttrain's client puts in a /v1/completions body (research note, section 5)
COMPLETION_KEYS = ["model", "prompt", "n", "seed", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "max_tokens", "min_tokens", "stop_token_ids", "logprobs", "return_token_ids",
                   "return_tokens_as_token_ids", "return_weight_versions"]


def test_manifest_names_every_symbol_posttrain_uses():
    spec = load_manifest()
    assert spec["checked"] and all(vllm_compat.in_window(v) for v in spec["checked"])
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert f'vllm = ["vllm{spec["window"]}"]' in pyproject  # the extra installs the checked window
    for key in [*spec["signatures"], *spec["fields"]]:
        assert key.partition(".")[0] in spec["classes"], key
    for name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "WeightVersionSpan",
                 "WeightTransferTrainerFactory", "NCCLTrainerInitInfo", "ParamMeta", "WeightSource",
                 "VLLMWeightSyncClient"):
        assert spec["classes"][name].startswith("vllm.") and name in spec["classes"][name], name
    for method in ("__init__", "generate", "sleep", "wake_up", "apply_model", "collective_rpc", "reset_prefix_cache",
                   "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                   "update_weight_version", "get_weight_version"):
        assert f"LLM.{method}" in spec["signatures"]
    assert {"metadata", "iter_full"} <= set(spec["fields"]["WeightSource"])
    assert set(spec["fields"]["VLLMWeightSyncClient"]) == {k.partition(".")[2] for k in spec["signatures"]
                                                          if k.startswith("VLLMWeightSyncClient.")}
    assert "processed_logprobs" in spec["fields"]["LogprobsMode"] and "nccl" in spec["fields"][
        "WeightTransferConfig.backend"] and "wait" in spec["fields"]["PauseMode"]
    assert set(COMPLETION_KEYS) <= set(spec["fields"]["CompletionRequest"])
    assert {"token_ids", "logprobs", "finish_reason", "weight_versions"} <= set(spec["fields"]["CompletionOutput"])
    assert {path: r["method"] for path, r in spec["routes"].items()} == ROUTES
    assert spec["routes"]["/finish_weight_update"]["body"] == ["weight_version"]
    assert spec["routes"]["/v1/completions"]["body"] == "CompletionRequest"
    # prompts with images: their images rendered into features, then their ids generated with them (as TRL's)
    assert spec["routes"]["/v1/chat/completions/render"]["body"] == "ChatCompletionRequest"
    assert spec["routes"]["/inference/v1/generate"]["body"] == "GenerateRequest"
    assert {"messages", "max_tokens"} <= set(spec["fields"]["ChatCompletionRequest"])
    assert {"request_id", "token_ids", "features", "sampling_params"} <= set(spec["fields"]["GenerateRequest"])
    assert {"seed", "n", "output_kind", "logprobs"} <= set(spec["fields"]["SamplingParams"])
    assert spec["cli"]["env"] == {"VLLM_SERVER_DEV_MODE": "1"}


def test_check_installed_passes_against_the_double(vllm_double):
    assert check_installed() is sys.modules["vllm"] and vllm_double.version in load_manifest()["checked"]
    assert symbol("LLM") is vllm_double.classes["LLM"] and symbol("PauseMode").__args__ == ("abort", "wait", "keep")


def test_the_double_leaves_no_vllm_behind():
    with fake_vllm():
        assert "vllm.distributed.weight_transfer.factory" in sys.modules
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)


def _one_sentence(err) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith(".")
    return text


def test_check_installed_refuses_a_version_outside_the_window():
    with fake_vllm(version="0.32.0"), pytest.raises(VLLMAPIError) as err:
        check_installed()
    text = _one_sentence(err.value)
    assert "vllm 0.32.0 is installed" in text and f"pip install 'vllm{vllm_compat.WINDOW}'" in text


def test_check_installed_names_a_changed_signature():
    spec = load_manifest()
    spec["signatures"]["LLM.sleep"] = [t for t in spec["signatures"]["LLM.sleep"] if t != "level="]
    spec["signatures"]["ParamMeta"] = spec["signatures"]["ParamMeta"] + ["extra"]
    with fake_vllm(manifest=spec), pytest.raises(VLLMAPIError) as err:
        check_installed()
    text = _one_sentence(err.value)
    assert "LLM.sleep: parameter 'level' gone" in text and "ParamMeta: new required parameter 'extra'" in text
    assert vllm_compat.INSTALL in text


def test_check_installed_without_vllm_names_the_install_command():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[vllm\]'"):
        check_installed()


def test_check_kwargs_against_the_manifest():
    check_kwargs("SamplingParams", {"top_k": 5, "min_p": 0.1, "seed": 3, "stop_token_ids": [2]})
    with pytest.raises(VLLMAPIError, match=r"generation_kwargs 'topk' is not .*did you mean 'top_k'\?"):
        check_kwargs("SamplingParams", {"topk": 5}, what="generation_kwargs")
    check_kwargs("LLM.__init__", {"gpu_memory_utilization": 0.3, "max_num_seqs": 8, "logprobs_mode": "x"})
    with pytest.raises(VLLMAPIError, match="'no_such_engine_arg'"):
        check_kwargs("LLM.__init__", {"no_such_engine_arg": 1})
    with pytest.raises(VLLMAPIError, match="--made-up"):
        vllm_compat._flag("--made-up")


def test_the_double_binds_calls_and_drives_the_client_in_vllms_order():
    module = torch.nn.Linear(3, 2)
    with fake_vllm(model=module) as double:
        LLM, SamplingParams = symbol("LLM"), symbol("SamplingParams")
        with pytest.raises(TypeError, match="nonsense"):
            LLM("m", nonsense=1)
        llm = LLM("m", seed=0, weight_transfer_config={"backend": "nccl"})
        with pytest.raises(TypeError):
            llm.sleep(lvl=2)
        with pytest.raises(TypeError):
            SamplingParams(topk=3)
        out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(n=2, seed=7, max_tokens=3, logprobs=0))
        first, second = out[0].outputs
        alone = llm.generate([[5, 6]], SamplingParams(n=1, seed=8, max_tokens=3))[0].outputs[0]
        assert second.token_ids == alone.token_ids != first.token_ids  # child i samples with seed + i
        assert first.logprobs[0][first.token_ids[0]].logprob < 0 and alone.logprobs is None
        llm.sleep(level=2)
        with pytest.raises(RuntimeError):
            llm.generate([[1]])
        llm.wake_up(["weights"])
        llm.apply_model(lambda m: m.load_weights([("bias", torch.ones(2))]))
        assert torch.equal(module.bias, torch.ones(2))

        ParamMeta = symbol("ParamMeta")

        class Source(symbol("WeightSource")):
            @functools.cached_property
            def metadata(self):
                return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in module.named_parameters()]

            def iter_full(self):
                yield from module.named_parameters()

        calls = []

        class Client:
            def init_weight_transfer_engine(self, init_info):
                calls.append(("init", init_info))

            def start_weight_update(self):
                calls.append(("start",))

            def update_weights(self, update_info):
                calls.append(("update", update_info["names"]))

            def finish_weight_update(self, weight_version=None):
                calls.append(("finish", weight_version))

        double.log.clear()
        init = symbol("NCCLTrainerInitInfo")("127.0.0.1", 51216, 2, rank=0)
        engine = symbol("WeightTransferTrainerFactory").trainer_init(init, client=Client(), source=Source())
        engine.send_weights()
        engine.send_weights()
    assert calls[0] == ("init", {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1,
                                 "world_size": 2, "packed": True, "packed_buffer_size_bytes": 1 << 30,
                                 "packed_num_buffers": 2})
    assert calls[1:] == [("start",), ("update", ["weight", "bias"]), ("finish", None),
                         ("start",), ("update", []), ("finish", None)]  # an unchanged round resends no metadata
    names = [name for name, _ in double.log]
    assert names[:3] == ["WeightTransferTrainerFactory.trainer_init", "client.init_weight_transfer_engine",
                         "trainer.open_endpoint"]
    assert names[3:10] == ["NCCLTrainerWeightTransferEngine.send_weights", "client.start_weight_update",
                           "client.update_weights", "trainer.broadcast_start", "trainer.broadcast",
                           "trainer.broadcast", "client.finish_weight_update"]


def _vllm_serve(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "posttrain.cli", "vllm-serve", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def _flags(argv: list[str], extra=()) -> list[str]:
    passed = [a for a in argv if a.startswith("--") and a not in extra]
    return passed


def test_vllm_serve_prints_trls_command_with_loopback_default():
    out = _vllm_serve("--model", "Qwen/Qwen3-0.6B", "--print_command", "--max-num-seqs", "8")
    assert out.returncode == 0 and out.stderr == ""
    words = shlex.split(out.stdout)
    assert words[0] == "VLLM_SERVER_DEV_MODE=1"
    assert words[2:6] == ["-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-0.6B"]
    assert "--enable-scale-out" in words  # the routes prompts with images are sampled through, as TRL's command
    valued = [w for w in words if w != "--enable-scale-out"]
    options = dict(zip(valued[6::2], valued[7::2]))
    assert options["--host"] == "127.0.0.1" and options["--port"] == "8000"
    assert options["--weight-transfer-config"] == '{"backend": "nccl"}'
    assert options["--logprobs-mode"] == "processed_logprobs" and options["--max-logprobs"] == "-1"
    for flag in ("--tensor-parallel-size", "--data-parallel-size", "--gpu-memory-utilization", "--dtype",
                 "--kv-cache-dtype", "--model-impl", "--uvicorn-log-level"):
        assert flag in options, flag
    assert words[-2:] == ["--max-num-seqs", "8"]  # passed through, last
    assert set(_flags(words, ["--max-num-seqs"])) <= set(load_manifest()["cli"]["flags"])


def test_vllm_serve_options_and_the_public_host_warning():
    out = _vllm_serve("--model", "m", "--host", "0.0.0.0", "--revision", "main", "--max_model_len", "4096",
                      "--enable_prefix_caching", "false", "--enforce_eager", "--trust_remote_code",
                      "--speculative_config", '{"method": "ngram"}', "--api_key", "k",
                      "--distributed_executor_backend", "ray", "--print_command")
    assert out.returncode == 0
    assert out.stderr.startswith("posttrain: warning: --host 0.0.0.0") and "/update_weights" in out.stderr
    words = shlex.split(out.stdout)
    for flag in ("--revision", "--max-model-len", "--no-enable-prefix-caching", "--enforce-eager",
                 "--trust-remote-code", "--speculative-config", "--api-key", "--distributed-executor-backend"):
        assert flag in words, flag
    assert words[words.index("--speculative-config") + 1] == '{"method": "ngram"}'
    assert set(_flags(words)) <= set(load_manifest()["cli"]["flags"])


def test_vllm_serve_without_vllm_is_one_error_line():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    out = _vllm_serve("--model", "m")
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1
    assert lines[0].startswith("posttrain: error:") and "pip install 'posttrain[vllm]'" in lines[0]


# --- tools/check_vllm_api.py on a tiny wheel whose sources hold every construct the parser reads

WHEEL_SOURCES = {
    "vllm/__init__.py": "",
    "vllm/envs.py": "VLLM_SERVER_DEV_MODE: bool = False\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/cli/main.py": "def main(): ...\n",
    "vllm/entrypoints/rl/offline.py": (
        "class RLOfflineMixin:\n"
        "    def init_weight_transfer_engine(self, request: dict) -> None: ...\n"),
    "vllm/entrypoints/llm.py": (
        "from vllm.entrypoints.rl.offline import RLOfflineMixin\n"
        "class LLM(RLOfflineMixin):\n"
        "    def __init__(self, model: str, *, seed: int = 0, **kwargs): ...\n"
        "    def sleep(self, level: int = 1, mode: str = 'abort'): ...\n"
        "    def generate(self, prompts, sampling_params=None, *, use_tqdm=True): ...\n"),
    "vllm/sampling_params.py": (
        "import msgspec\n"
        "class SamplingParams(msgspec.Struct, omit_defaults=True):\n"
        "    n: int = 1\n    top_k: int = 0\n    _eos_token_id: int | None = None\n"
        "    seed: int | None = None\n"),
    "vllm/config/model.py": ("from typing import Literal\n"
                             "LogprobsMode = Literal['raw_logprobs', 'processed_logprobs']\n"),
    "vllm/v1/engine/__init__.py": "from typing import Literal\nPauseMode = Literal['abort', 'wait', 'keep']\n",
    "vllm/distributed/weight_transfer/base.py": (
        "from dataclasses import dataclass, field\nfrom typing import ClassVar\n"
        "@dataclass\nclass TrainerInitInfo:\n    backend: ClassVar[str]\n    rank: int = field(kw_only=True)\n"),
    "vllm/distributed/weight_transfer/nccl_engine.py": (
        "from dataclasses import dataclass\nfrom typing import ClassVar\n"
        "from .base import TrainerInitInfo\n"
        "@dataclass\nclass NCCLTrainerInitInfo(TrainerInitInfo):\n    backend: ClassVar[str] = 'nccl'\n"
        "    master_address: str\n    world_size: int\n    packed: bool = True\n"),
    "vllm/entrypoints/serve/engine/protocol.py": (
        "from pydantic import BaseModel, ConfigDict\n"
        "class OpenAIBaseModel(BaseModel):\n    model_config = ConfigDict(extra='allow')\n"),
    "vllm/entrypoints/openai/completion/protocol.py": (
        "from pydantic import Field\nfrom vllm.entrypoints.serve.engine.protocol import OpenAIBaseModel\n"
        "class CompletionRequest(OpenAIBaseModel):\n    model: str | None = None\n    n: int = 1\n"
        "    return_weight_versions: bool = Field(default=False, description='spans')\n"),
    "vllm/entrypoints/openai/completion/api_router.py": (
        "from fastapi import APIRouter, Request\n"
        "from vllm.entrypoints.openai.completion.protocol import CompletionRequest\nrouter = APIRouter()\n"
        "@router.post('/v1/completions', dependencies=[])\n"
        "async def create_completion(request: CompletionRequest, raw_request: Request): ...\n"),
    "vllm/entrypoints/rl/online/api_router.py": (
        "from typing import Annotated, Any\nfrom fastapi import APIRouter, Body, Query, Request\n"
        "from vllm.v1.engine import PauseMode\nrouter = APIRouter()\n"
        "@router.post('/pause')\n"
        "async def pause(raw_request: Request, mode: Annotated[PauseMode, Query()] = 'abort',\n"
        "                clear_cache: Annotated[bool, Query()] = True): ...\n"
        "@router.post('/update_weights')\n"
        "async def update_weights(raw_request: Request, update_info: Annotated[dict, Body(embed=True)]): ...\n"
        "@router.post('/init_weight_transfer_engine')\n"
        "async def init(raw_request: Request):\n"
        "    body = await raw_request.json()\n    init_info = body.get('init_info')\n"
        "@router.get('/get_world_size')\nasync def world(raw_request: Request, include_dp: bool = Query(True)): ...\n"),
    "vllm/engine/arg_utils.py": (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass EngineArgs:\n    logprobs_mode: str = 'raw_logprobs'\n"
        "    enable_prefix_caching: bool | None = None\n"
        "    @staticmethod\n    def add_cli_args(parser):\n"
        "        parser.add_argument('--logprobs-mode')\n        parser.add_argument('--enable-prefix-caching')\n"),
    "vllm/entrypoints/common/cli_args.py": (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass BaseFrontendArgs:\n    api_key: list[str] | None = None\n"
        "@dataclass\nclass FrontendArgs(BaseFrontendArgs):\n    port: int = 8000\n"),
}
TINY_MANIFEST = {
    "window": ">=0.33,<0.34", "checked": ["0.33.0"],
    "classes": {"LLM": "vllm.entrypoints.llm.LLM", "SamplingParams": "vllm.sampling_params.SamplingParams",
                "LogprobsMode": "vllm.config.model.LogprobsMode",
                "NCCLTrainerInitInfo": "vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerInitInfo",
                "CompletionRequest": "vllm.entrypoints.openai.completion.protocol.CompletionRequest",
                "EngineArgs": "vllm.engine.arg_utils.EngineArgs",
                "FrontendArgs": "vllm.entrypoints.common.cli_args.FrontendArgs"},
    "signatures": {"LLM.__init__": ["model", "*", "seed=", "**kwargs"], "LLM.sleep": ["level=", "mode="],
                   "LLM.generate": ["prompts", "sampling_params=", "*", "use_tqdm="],
                   "LLM.init_weight_transfer_engine": ["request"],
                   "NCCLTrainerInitInfo": ["master_address", "world_size", "packed=", "*", "rank"]},
    "fields": {"SamplingParams": ["n", "top_k", "seed"], "LogprobsMode": ["raw_logprobs", "processed_logprobs"],
               "CompletionRequest": ["model", "n", "return_weight_versions"]},
    "routes": {
        "/v1/completions": {"method": "POST", "query": [], "body": "CompletionRequest", "values": {}},
        "/pause": {"method": "POST", "query": ["mode", "clear_cache"], "body": [],
                   "values": {"mode": ["abort", "wait", "keep"]}},
        "/update_weights": {"method": "POST", "query": [], "body": ["update_info"], "values": {}},
        "/init_weight_transfer_engine": {"method": "POST", "query": [], "body": ["init_info"], "values": {}},
        "/get_world_size": {"method": "GET", "query": ["include_dp"], "body": [], "values": {}}},
    "cli": {"module": "vllm.entrypoints.cli.main", "subcommand": "serve", "env": {"VLLM_SERVER_DEV_MODE": "1"},
            "flags": ["--port", "--api-key", "--logprobs-mode", "--enable-prefix-caching",
                      "--no-enable-prefix-caching"]},
}


def _wheel(tmp_path, **replace) -> str:
    path = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, source in {**WHEEL_SOURCES, **replace}.items():
            wheel.writestr(name, source)
    return str(path)


def _check(*args):
    return subprocess.run([sys.executable, CHECKER, *args], capture_output=True, text=True, timeout=60)


def test_checker_reads_a_wheel_and_reports_a_removed_parameter(tmp_path):
    manifest = tmp_path / "vllm_api.json"
    manifest.write_text(json.dumps(TINY_MANIFEST))
    out = _check("--wheel", _wheel(tmp_path), "--manifest", str(manifest))
    assert out.returncode == 0 and "vllm 0.33.0: holds the manifest" in out.stdout, out.stdout + out.stderr
    out = _check("--wheel", _wheel(tmp_path), "--manifest", str(manifest), "--write")  # extraction == hand-written
    assert out.returncode == 0 and json.loads(manifest.read_text()) == TINY_MANIFEST, out.stdout + out.stderr

    llm = WHEEL_SOURCES["vllm/entrypoints/llm.py"].replace("level: int = 1, ", "")
    router = WHEEL_SOURCES["vllm/entrypoints/rl/online/api_router.py"].replace("'/pause'", "'/pause_all'")
    out = _check("--wheel", _wheel(tmp_path, **{"vllm/entrypoints/llm.py": llm,
                                                  "vllm/entrypoints/rl/online/api_router.py": router}),
                 "--manifest", str(manifest))
    assert out.returncode == 1
    assert out.stdout.splitlines() == ["vllm 0.33.0: LLM.sleep: parameter 'level' gone",
                                       "vllm 0.33.0: POST /pause: route gone",
                                       out.stdout.splitlines()[-1]]
    assert out.stdout.splitlines()[-1].startswith("vllm 0.33.0: 2 differences")
