"""A fake `vllm` package built from posttrain/generation/vllm_api.json, for testing the vLLM adapters without vLLM.

Every module the manifest names is put in `sys.modules`; every callable it lists takes exactly the manifest's
parameters (an `inspect.Signature` made from them, against which each call is bound, so an unknown keyword raises
TypeError as the real one would) and is recorded, in order, in `double.log` as `(name, arguments)`. No signature is
written here: they all come from the manifest, which tools/check_vllm_api.py keeps equal to vLLM's source.

Behaviour, enough for adapter tests:
- `LLM.generate` returns RequestOutputs whose CompletionOutputs carry deterministic token ids (a function of the
  prompt, the child's seed and the position), logprobs as lists of {token_id: Logprob(logprob=...)} when asked, and
  one WeightVersionSpan of the current version; with `n` > 1 and a seed, child `i` uses seed + i (vLLM V1's
  parallel_sampling). Sleeping state is tracked: generating while asleep, or loading weights into slept weights,
  raises.
- `LLM.apply_model(func)` calls `func` on the torch module given to `fake_vllm(model=...)`, which gets a vLLM-style
  `load_weights(pairs)` if it has none; `collective_rpc` runs callables on a fake worker and knows
  "compute_weight_checksums" and "reset_weights".
- The weight-transfer methods of LLM record, and raise as vLLM does when the LLM was built without
  `weight_transfer_config`; `finish_weight_update(v)` and `update_weight_version(v)` set the version.
- `WeightTransferTrainerFactory.trainer_init` / `send_weights` drive the client as vLLM 0.33's NCCL engine does:
  init_weight_transfer_engine concurrently with opening the trainer endpoint; then per round start_weight_update,
  update_weights (in a thread) concurrently with the broadcast of `source.iter_full()` (checked against
  `source.metadata`), finish_weight_update() without a version. An unchanged round sends empty metadata lists.
  The log holds "client.<method>" before each client call, "trainer.open_endpoint", "trainer.broadcast_start" and
  one "trainer.broadcast" per tensor (copies in `double.sent`), so a test can read the interleaving.

    with fake_vllm(model=my_module) as double:
        ...adapter code that imports vllm...
        assert [name for name, _ in double.log] == [...]

or the `vllm_double` fixture (`from vllm_double import vllm_double` in a test module) for the default double.
"""

import contextlib
import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import sys
import threading
import types
import typing
from pathlib import Path

import pytest

MANIFEST = Path(__file__).resolve().parents[1] / "posttrain" / "generation" / "vllm_api.json"
# behaviour, not signatures: SamplingParams' defaults the fake engine reads (the rest default to None)
SAMPLING_DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "max_tokens": 16, "min_tokens": 0}
# and the values of the constructors' defaults the fake engines read (vLLM 0.33's nccl_engine and packed_tensor)
CONSTRUCTOR_DEFAULTS = {"NCCLTrainerInitInfo": {"packed": True, "packed_buffer_size_bytes": 1 << 30,
                                                "packed_num_buffers": 2},
                        "NCCLWeightTransferInitInfo": {"packed": False}}


def load_manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def signature(tokens: list[str], bound: bool = True) -> inspect.Signature:
    """An inspect.Signature from the manifest's tokens (defaults are None: the manifest records only that one
    exists); `bound` adds `self` first."""
    P = inspect.Parameter
    kind = P.POSITIONAL_ONLY if "/" in tokens else P.POSITIONAL_OR_KEYWORD
    params = [P("self", kind)] if bound else []
    for t in tokens:
        if t == "/":
            kind = P.POSITIONAL_OR_KEYWORD
        elif t.startswith("**"):
            params.append(P(t[2:], P.VAR_KEYWORD))
        elif t.startswith("*"):
            kind = P.KEYWORD_ONLY
            params += [P(t[1:], P.VAR_POSITIONAL)] if t != "*" else []
        else:
            params.append(P(t.rstrip("="), kind, **({"default": None} if t.endswith("=") else {})))
    return inspect.Signature(params)


def fields_class(name: str, names: list[str], defaults: dict | None = None):
    """A dataclass with the manifest's field names, all keyword arguments (an unknown one raises TypeError)."""
    defaults = defaults or {}
    return dataclasses.make_dataclass(name, [(n, typing.Any, dataclasses.field(default=defaults.get(n)))
                                             for n in names], kw_only=True)


def constructor_class(name: str, tokens: list[str]):
    """A dataclass whose __init__ has exactly the manifest's signature for `name` (NCCLTrainerInitInfo, ParamMeta)."""
    specs, defaults = [], CONSTRUCTOR_DEFAULTS.get(name, {})
    for param in signature(tokens, bound=False).parameters.values():
        options = {"kw_only": param.kind is param.KEYWORD_ONLY}
        if param.default is not param.empty:
            options["default"] = defaults.get(param.name)
        specs.append((param.name, typing.Any, dataclasses.field(**options)))
    return dataclasses.make_dataclass(name, specs, eq=True)


class VLLMDouble:
    """The fake package: `modules` to install, `log` of calls, and the classes built from the manifest."""

    def __init__(self, model=None, version: str | None = None, manifest: dict | None = None, vocab_size: int = 100):
        self.manifest = manifest or load_manifest()
        self.version = version or self.manifest["checked"][-1]
        self.model, self.vocab_size = model, vocab_size
        self.log: list[tuple[str, dict]] = []
        self.sent: list[tuple[str, object]] = []  # what the fake trainer engine broadcast
        self.lock = threading.Lock()
        self.modules: dict[str, types.ModuleType] = {}
        self.classes = self._build_classes()
        for name, cls in self.classes.items():
            module, _, attr = self.manifest["classes"][name].rpartition(".")
            setattr(self._module(module), attr, cls)
        self.modules["vllm"].__version__ = self.version
        for name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"):
            setattr(self.modules["vllm"], name, self.classes[name])  # vllm's own top-level exports

    def _module(self, dotted: str) -> types.ModuleType:
        if dotted not in self.modules:
            self.modules[dotted] = types.ModuleType(dotted)
            parent, _, child = dotted.rpartition(".")
            if parent:
                setattr(self._module(parent), child, self.modules[dotted])
        return self.modules[dotted]

    def record(self, name: str, arguments: dict) -> None:
        with self.lock:
            self.log.append((name, dict(arguments)))

    def method(self, key: str, behaviour=None, classmethod_: bool = False):
        """A method with the manifest's signature for `key`: binds, records, then runs `behaviour(self, **args)`."""
        sig = signature(self.manifest["signatures"][key])
        double = self

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            double.record(key, arguments)
            return behaviour(bound.arguments["self"], **arguments) if behaviour else None

        call.__signature__, call.__name__ = sig, key.rpartition(".")[2]
        return classmethod(call) if classmethod_ else call

    def _build_classes(self) -> dict:
        spec = self.manifest
        classes = {name: constructor_class(name, tokens) for name, tokens in spec["signatures"].items()
                   if "." not in name}
        for name in ("RequestOutput", "CompletionOutput", "Logprob", "WeightVersionSpan", "EngineArgs",
                     "CompletionRequest", "FrontendArgs", "ChatCompletionRequest", "GenerateRequest",
                     "MultiModalFeatures", "PlaceholderRangeInfo", "GenerateTokensResponse", "GenerateTokensChoice",
                     "GenerateLogProbs", "GenerateLogProbsContent"):  # the server's request and response bodies
            classes[name] = fields_class(name, spec["fields"].get(name, []))
        classes["SamplingParams"] = fields_class("SamplingParams", spec["fields"]["SamplingParams"],
                                                 SAMPLING_DEFAULTS)
        for name in ("LogprobsMode", "PauseMode"):
            classes[name] = typing.Literal[tuple(spec["fields"][name])]
        classes["WeightTransferConfig"] = fields_class("WeightTransferConfig", ["backend"], {"backend": "nccl"})
        classes["LLM"] = self._llm_class()
        classes["VLLMWeightSyncClient"] = type("VLLMWeightSyncClient", (typing.Protocol,), {
            key.rpartition(".")[2]: self.method(key) for key in spec["signatures"]
            if key.startswith("VLLMWeightSyncClient.")})
        classes["WeightSource"] = self._source_class()
        classes["NCCLTrainerWeightTransferEngine"] = self._engine_class()
        classes["WeightTransferTrainerFactory"] = type("WeightTransferTrainerFactory", (), {
            "trainer_init": self.method("WeightTransferTrainerFactory.trainer_init", self._trainer_init, True)})
        missing = set(spec["classes"]) - set(classes)
        assert not missing, f"the double builds no {sorted(missing)}: teach tests/vllm_double.py"
        return classes

    # --- LLM

    def _llm_class(self):
        double = self
        behaviours = {"__init__": LLMState.init, "generate": LLMState.generate, "sleep": LLMState.sleep,
                      "wake_up": LLMState.wake_up, "apply_model": LLMState.apply_model,
                      "collective_rpc": LLMState.collective_rpc, "reset_prefix_cache": lambda s, **_: True,
                      "get_weight_version": lambda s: s.weight_version,
                      "update_weight_version": LLMState.update_weight_version,
                      "finish_weight_update": LLMState.finish_weight_update,
                      "init_weight_transfer_engine": LLMState.transfer, "start_weight_update": LLMState.transfer,
                      "update_weights": LLMState.transfer}
        body = {"double": double}
        for key in self.manifest["signatures"]:
            if key.startswith("LLM."):
                name = key.partition(".")[2]
                body[name] = self.method(key, behaviours.get(name))
        return type("LLM", (LLMState,), body)

    # --- trainer-side weight transfer

    def _source_class(self):
        spec = self.manifest

        class WeightSource:
            """vLLM's WeightSource: `metadata` (a cached_property) and `iter_full()`."""

            def __init_subclass__(cls, **kwargs):
                super().__init_subclass__(**kwargs)
                metadata = cls.__dict__.get("metadata")
                if metadata is not None and not isinstance(metadata, functools.cached_property):
                    raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

            @property
            def metadata(self):
                raise NotImplementedError

            def implements_iter_full(self) -> bool:
                return type(self).iter_full is not WeightSource.iter_full

            def owned_names(self, rank: int) -> list[str]:
                return [m.name for m in self.metadata]

        for name in spec["fields"]["WeightSource"]:  # iter_full, iter_local, ...: a subclass implements them
            if not hasattr(WeightSource, name):
                setattr(WeightSource, name, _not_implemented(name, spec["signatures"].get(f"WeightSource.{name}")))
        return WeightSource

    def _trainer_init(self, cls, init_info, client, source=None):
        """NCCL's trainer_init: checks, then the worker's init (a thread) while the trainer opens its endpoint."""
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        if not source.implements_iter_full():
            raise TypeError(f"NCCL broadcast sends full tensors, but {type(source).__name__} does not implement "
                            "iter_full().")
        engine = self.classes["NCCLTrainerWeightTransferEngine"](init_info, client, source)
        if init_info.rank != 0:
            return engine
        worker_info = self.classes["NCCLWeightTransferInitInfo"](
            master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
            world_size=init_info.world_size, packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers)
        payload = {k: v for k, v in dataclasses.asdict(worker_info).items() if v is not None}
        engine.concurrently(client.init_weight_transfer_engine, payload, "trainer.open_endpoint", lambda: None)
        return engine

    def _engine_class(self):
        double = self

        class NCCLTrainerWeightTransferEngine:
            """The trainer's side of one NCCL weight-transfer group (rank 0 sends)."""

            def __init__(self, init_info, client, source):
                self.init_info, self.client, self.source, self.sent_meta = init_info, client, source, None

            def concurrently(self, rpc, argument, name, work):
                """`rpc(argument)` on a thread while `work()` runs here, as vLLM pairs an RPC with NCCL."""
                double.record(f"client.{getattr(rpc, '__name__', 'rpc')}", {"argument": argument})
                errors = []
                thread = threading.Thread(target=lambda: _capture(errors, rpc, argument), daemon=True)
                thread.start()
                double.record(name, {})
                work()
                thread.join()
                if errors:
                    raise errors[0]

            def broadcast(self, meta):
                sent = 0
                for name, tensor in self.source.iter_full():
                    expected = meta[sent] if sent < len(meta) else None
                    if expected is None or (name, tensor.dtype, tuple(tensor.shape)) != (
                            expected.name, expected.dtype, tuple(expected.shape)):
                        raise ValueError(f"WeightSource metadata disagrees with iteration at index {sent}: got "
                                         f"{name!r} {tensor.dtype} {tuple(tensor.shape)}")
                    double.record("trainer.broadcast", {"name": name})
                    double.sent.append((name, tensor.detach().clone()))
                    sent += 1
                if sent != len(meta):
                    raise ValueError(f"WeightSource yielded {sent} parameters, metadata declared {len(meta)}.")

            def _send(self):
                meta = list(self.source.metadata)
                if self.init_info.rank != 0:
                    for _ in self.source.iter_full():
                        pass
                    return
                update = {"names": [], "dtype_names": [], "shapes": []}  # unchanged metadata: reuse the last
                if meta != self.sent_meta:
                    update = {"names": [m.name for m in meta], "shapes": [list(m.shape) for m in meta],
                              "dtype_names": [str(m.dtype).split(".")[-1] for m in meta]}
                double.record("client.start_weight_update", {})
                self.client.start_weight_update()
                self.concurrently(self.client.update_weights, update, "trainer.broadcast_start",
                                  lambda: self.broadcast(meta))
                double.record("client.finish_weight_update", {})
                self.client.finish_weight_update()
                self.sent_meta = meta

        NCCLTrainerWeightTransferEngine.send_weights = self.method("NCCLTrainerWeightTransferEngine.send_weights",
                                                                   lambda engine: engine._send())
        return NCCLTrainerWeightTransferEngine


def _not_implemented(name: str, tokens: list[str] | None):
    """A method a WeightSource subclass must provide, with the manifest's signature when it lists one."""

    def method(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not implement {name}()")

    if tokens is not None:
        method.__signature__ = signature(tokens)
    method.__name__ = name
    return method


def _capture(errors: list, fn, argument) -> None:
    try:
        fn(argument)
    except BaseException as err:  # re-raised on the caller's thread
        errors.append(err)


class LLMState:
    """The fake LLM's behaviour behind the manifest's methods (see the module docstring)."""

    double: VLLMDouble
    TAGS = ("weights", "kv_cache", "scheduling")

    def init(self, model, **kwargs):
        engine_fields = set(self.double.manifest["fields"]["EngineArgs"])
        unknown = sorted(set(kwargs.get("kwargs", {})) - engine_fields)
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.model_path, self.options = model, {**{k: v for k, v in kwargs.items() if k != "kwargs"},
                                               **kwargs.get("kwargs", {})}
        self.awake, self.weight_version = set(self.TAGS), "default"
        self.module = self.double.model if self.double.model is not None else _tiny_module()
        if not hasattr(self.module, "load_weights"):
            self.module.load_weights = types.MethodType(_load_weights, self.module)

    def generate(self, prompts, sampling_params=None, **_):
        if set(self.TAGS) - self.awake:
            raise RuntimeError(f"generate() while asleep ({sorted(set(self.TAGS) - self.awake)} not awake)")
        params = sampling_params or self.double.classes["SamplingParams"]()
        prompts = prompts if isinstance(prompts, list) else [prompts]
        each = params if isinstance(params, list) else [params] * len(prompts)
        return [self._request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, each))]

    def _request(self, index, prompt, params):
        ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        outputs = [self._completion(ids, params, child) for child in range(params.n or 1)]
        return self.double.classes["RequestOutput"](request_id=str(index), prompt=None, prompt_token_ids=ids,
                                                    prompt_logprobs=None, outputs=outputs, finished=True)

    def _completion(self, prompt, params, child):
        classes, seed = self.double.classes, (params.seed + child if params.seed is not None else child)
        tokens, logprobs = [], []
        stop = set(params.stop_token_ids or [])
        for position in range(params.max_tokens):
            token = (sum(prompt) * 31 + seed * 7 + position * 13 + len(prompt)) % self.double.vocab_size
            tokens.append(token)
            logprobs.append({token: classes["Logprob"](logprob=-0.1 * (1 + token % 7), rank=1)})
            if token in stop and position + 1 >= (params.min_tokens or 0):
                break
        finish = "stop" if tokens[-1:] and tokens[-1] in stop else "length"
        span = classes["WeightVersionSpan"](version=self.weight_version, start=0, end=len(tokens))
        return classes["CompletionOutput"](
            index=child, text="", token_ids=tokens, finish_reason=finish,
            stop_reason=tokens[-1] if finish == "stop" else None,
            cumulative_logprob=sum(lp[t].logprob for lp, t in zip(logprobs, tokens)),
            logprobs=logprobs if params.logprobs is not None else None, weight_versions=[span])

    def sleep(self, level=1, mode="abort"):
        self.awake -= {"scheduling"} if level == 0 else {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.awake |= set(tags or self.TAGS)
        return self.awake == set(self.TAGS)

    def apply_model(self, func):
        if "weights" not in self.awake:
            raise RuntimeError("apply_model() while the weights sleep: wake_up(['weights']) first")
        return [func(self.module)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        worker = types.SimpleNamespace(get_model=lambda: self.module, model_runner=types.SimpleNamespace(
            model=self.module))
        if callable(method):
            return [method(worker, *(args or ()), **(kwargs or {}))]
        if method == "compute_weight_checksums":
            return [{f"dp0:pp0:pcp0:tp0:{n}": hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes())
                     .hexdigest() for n, p in self.module.named_parameters()}]
        if method == "reset_weights":
            for p in self.module.parameters():
                p.data.zero_()
        return [None]

    def transfer(self, **_):
        if not self.options.get("weight_transfer_config"):
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable weight "
                               "transfer.")

    def finish_weight_update(self, weight_version=None):
        self.transfer()
        if weight_version is not None:
            self.weight_version = weight_version

    def update_weight_version(self, new_version):
        self.weight_version = new_version


def _load_weights(module, weights):
    """vLLM models' load_weights: (name, tensor) pairs copied into the parameters; returns the names loaded."""
    import torch

    params, loaded = module.state_dict(keep_vars=True), set()  # tied names included, as vLLM models accept them
    with torch.no_grad():
        for name, tensor in weights:
            params[name].copy_(tensor)
            loaded.add(name)
    return loaded


def _tiny_module():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


@contextlib.contextmanager
def fake_vllm(model=None, version: str | None = None, manifest: dict | None = None):
    """Install the double as `vllm` (and its submodules) for the block, then put back whatever was there."""
    double = VLLMDouble(model, version, copy.deepcopy(manifest) if manifest else None)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "vllm" or k.startswith("vllm.")}
    sys.modules.update(double.modules)
    try:
        yield double
    finally:
        for name in double.modules:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@pytest.fixture
def vllm_double():
    """The double with its tiny default module, installed for one test."""
    with fake_vllm() as double:
        yield double
