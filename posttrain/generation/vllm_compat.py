"""The only module of posttrain that imports vLLM, and only the API listed in vllm_api.json.

vllm_api.json is read from vLLM's own wheels by tools/check_vllm_api.py (which never imports vLLM): the version
window it holds for, the module path of every symbol posttrain uses, the parameters of every callable, the fields of
the objects exchanged, the HTTP routes, and the `vllm serve` flags. Adapters get vLLM objects through `symbol(name)`;
`check_installed()` compares the installed package with the manifest before anything runs, so a vLLM that changed
fails at once with one sentence instead of deep inside a training step. Nothing here imports vLLM at import time.
"""

import difflib
import functools
import importlib
import inspect
import json
import sys
from pathlib import Path

from posttrain.errors import UserError

MANIFEST_PATH = Path(__file__).with_name("vllm_api.json")


@functools.cache
def manifest() -> dict:
    """The committed manifest (posttrain/generation/vllm_api.json)."""
    return json.loads(MANIFEST_PATH.read_text())


WINDOW = manifest()["window"]
INSTALL = f"pip install 'vllm{WINDOW}'"


class VLLMAPIError(UserError):
    """The installed vLLM, or a name passed to it, is outside the API posttrain was checked against."""


def symbol(name: str):
    """The real vLLM object the manifest names ("LLM", "SamplingParams", "WeightTransferTrainerFactory", ...),
    imported from the module that defines it."""
    module, _, attr = manifest()["classes"][name].rpartition(".")
    return getattr(importlib.import_module(module), attr)


def in_window(version: str) -> bool:
    """Whether vLLM `version` is inside the manifest's window (pre-releases and local builds of it included)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(WINDOW).contains(version, prereleases=True)
    except InvalidVersion:
        return False


def signature_tokens(sig: inspect.Signature) -> list[str]:
    """A signature in the manifest's form: Python's syntax without default values (["prompts", "sampling_params=",
    "*", "use_tqdm=", "**kwargs"])."""
    tokens, params = [], list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not any(t.startswith("*") for t in tokens):
            tokens.append("*")
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        tokens.append(prefix + p.name + ("=" if p.default is not p.empty else ""))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            tokens.append("/")
    return tokens


def parsed_signature(tokens: list[str]) -> dict:
    """name -> (kind, has default); kinds: positional, either, keyword, *args, **kwargs."""
    out, kind = {}, "positional" if "/" in tokens else "either"
    for t in tokens:
        if t in ("/", "*"):
            kind = "either" if t == "/" else "keyword"
        elif t.startswith("*"):
            kind = "keyword"
            out[t.lstrip("*")] = ("**kwargs" if t.startswith("**") else "*args", True)
        else:
            out[t.rstrip("=")] = (kind, t.endswith("="))
    return out


def signature_gaps(expected: list[str], actual: list[str]) -> list[str]:
    """How `actual` fails to accept every call `expected` allows (tools/check_vllm_api.py applies this rule to the
    wheels): a parameter gone, of another kind, or without its default; a new required one; a new order."""
    want, have = parsed_signature(expected), parsed_signature(actual)
    gaps = []
    for name, (kind, default) in want.items():
        if name not in have:
            gaps.append(f"parameter '{name}' gone" if kind != "**kwargs" else "**kwargs gone")
        elif have[name][0] != kind:
            gaps.append(f"parameter '{name}' is now {have[name][0]}, was {kind}")
        elif default and not have[name][1]:
            gaps.append(f"parameter '{name}' lost its default")
    gaps += [f"new required parameter '{n}'" for n, (k, d) in have.items() if n not in want and not d]
    order = [n for n, (k, _) in want.items() if k in ("positional", "either")]
    if not gaps and order != [n for n, (k, _) in have.items() if n in order]:
        gaps.append("positional parameters reordered")
    return gaps


def installed_signature(key: str) -> list[str] | None:
    """The installed vLLM's signature for a manifest key ("LLM.sleep", or a dataclass such as "ParamMeta"), without
    self or cls; None if the method is gone."""
    owner, _, method = key.partition(".")
    target = symbol(owner)
    if not method:
        return signature_tokens(inspect.signature(target))
    try:
        raw = inspect.getattr_static(target, method)
    except AttributeError:
        return None
    sig = inspect.signature(getattr(target, method))
    if not isinstance(raw, (staticmethod, classmethod)):  # a plain function looked up on its class: drop self
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return signature_tokens(sig)


def check_installed(feature: str = "Generation with vLLM"):
    """Import vLLM and check it against the manifest: its version inside the window, and every callable posttrain
    uses accepting the manifest's parameters. Returns the vllm module; raises one sentence naming what differs."""
    from posttrain._optional import require

    vllm = require("vllm", feature)
    version = str(getattr(vllm, "__version__", "unknown"))
    if not in_window(version):
        raise VLLMAPIError(f"{feature} needs vllm{WINDOW} (the versions whose API posttrain was checked against), but "
                           f"vllm {version} is installed: install it with `{INSTALL}`.")
    gaps = []
    for key, expected in manifest()["signatures"].items():
        try:
            actual = installed_signature(key)
        except ImportError as err:  # a module moved, or vLLM's own import failed: say which
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            gaps.append(f"{manifest()['classes'][key.partition('.')[0]]} does not import ({reason})")
            continue
        except (AttributeError, ValueError, TypeError):
            actual = None
        gaps += [f"{key} is gone"] if actual is None else [f"{key}: {g}" for g in signature_gaps(expected, actual)]
    gaps = list(dict.fromkeys(gaps))
    if gaps:
        more = f" and {len(gaps) - 3} more" if len(gaps) > 3 else ""
        raise VLLMAPIError(f"The installed vllm {version} differs from the API posttrain was checked against "
                           f"({'; '.join(gaps[:3])}{more}): install `{INSTALL}`.")
    return vllm


def accepted_names(name: str) -> list[str]:
    """The keyword names the manifest lists for a callable ("LLM.__init__": its parameters and, through its
    **kwargs, EngineArgs' fields) or an object ("SamplingParams": its fields)."""
    spec = manifest()
    if name not in spec["signatures"]:
        return list(spec["fields"][name])
    names = [n for n, (kind, _) in parsed_signature(spec["signatures"][name]).items() if kind not in ("*args", "**kwargs")]
    return names + (spec["fields"]["EngineArgs"] if name == "LLM.__init__" else [])


def check_kwargs(name: str, kwargs, what: str | None = None) -> None:
    """Raise one sentence for a keyword of `kwargs` that vLLM's `name` does not take, e.g. a generation_kwargs key
    that is no SamplingParams field (vLLM's HTTP server would ignore it silently)."""
    names = accepted_names(name)
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise VLLMAPIError(f"{what or 'Keyword'} {key!r} is not one of vLLM's {name} names (vllm{WINDOW}){hint}")


def _flag(name: str) -> str:
    """`name` if the manifest lists it among the `vllm serve` flags checked against the wheel, else raise."""
    if name not in manifest()["cli"]["flags"]:
        raise VLLMAPIError(f"posttrain would pass {name} to `vllm serve`, which tools/check_vllm_api.py did not find "
                           f"in vllm{WINDOW}; add it to vllm_api.json's cli flags and run the checker.")
    return name


def vllm_serve_command(args, extra=()) -> tuple[list[str], dict]:
    """The `vllm serve` command TRL 1.16's `trl vllm-serve` runs, from its arguments (`args`, with TRL's names) and
    `extra` arguments passed through: (argv starting with this Python, environment variables to add)."""
    cli = manifest()["cli"]
    valued = [("--host", args.host), ("--port", args.port), ("--tensor-parallel-size", args.tensor_parallel_size),
              ("--data-parallel-size", args.data_parallel_size),
              ("--gpu-memory-utilization", args.gpu_memory_utilization), ("--dtype", args.dtype),
              ("--kv-cache-dtype", args.kv_cache_dtype), ("--model-impl", args.vllm_model_impl),
              ("--uvicorn-log-level", args.log_level), ("--revision", args.revision),
              ("--max-model-len", args.max_model_len)]
    switches = [{True: "--enable-prefix-caching", False: "--no-enable-prefix-caching"}.get(args.enable_prefix_caching),
                "--enforce-eager" if args.enforce_eager else None,
                "--trust-remote-code" if args.trust_remote_code else None,
                "--enable-scale-out"]  # the render and token-generate routes that prompts with images use (as TRL)
    trailing = [("--distributed-executor-backend", args.distributed_executor_backend),
                ("--speculative-config", args.speculative_config), ("--api-key", args.api_key),
                ("--weight-transfer-config", json.dumps({"backend": "nccl"})),
                ("--logprobs-mode", "processed_logprobs"), ("--max-logprobs", -1)]
    argv = [sys.executable, "-m", cli["module"], cli["subcommand"], args.model]
    argv += [item for flag, value in valued if value is not None for item in (_flag(flag), str(value))]
    argv += [_flag(flag) for flag in switches if flag]
    argv += [item for flag, value in trailing if value is not None for item in (_flag(flag), str(value))]
    return argv + list(extra), dict(cli["env"])
