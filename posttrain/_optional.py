"""Optional dependencies: imported where needed, with the exact install line when missing."""

import importlib

from posttrain.errors import UserError

INSTALL_HINTS = {
    "peft": "pip install 'posttrain[peft]'",
    "vllm": "pip install 'posttrain[vllm]'",
    "wandb": "pip install 'posttrain[trackers]'",
    "trackio": "pip install 'posttrain[trackers]'",
    "fastapi": "pip install 'posttrain[server]'",
    "uvicorn": "pip install 'posttrain[server]'",
    "requests": "pip install 'posttrain[server]'",
    "tensorboard": "pip install 'posttrain[trackers]'",
    "math_verify": "pip install 'posttrain[math]'",
    "matplotlib": "pip install matplotlib",
}


class MissingDependency(UserError, ImportError):
    """An optional package a feature needs is not installed."""


def require(module: str, feature: str):
    """Import `module` for `feature`, or raise MissingDependency naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        hint = INSTALL_HINTS.get(top, f"pip install {top}")
        raise MissingDependency(f"{feature} needs the optional package {top!r}: install it with `{hint}`.") from err
