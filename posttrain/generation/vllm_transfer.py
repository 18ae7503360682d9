"""Weights to a real `vllm serve` over vLLM's own NCCL weight-transfer engine, bounded by timeouts.

vLLM's trainer-side engine (`WeightTransferTrainerFactory.trainer_init`, then `send_weights()` each round) drives
the round trip through a client posttrain supplies: start_weight_update, update_weights (the server receives while
this process broadcasts), finish_weight_update. posttrain's client makes each of those HTTP calls with a timeout and
never re-sends one (a re-sent update opens a second NCCL receive that no broadcast matches), and adds the version to
finish_weight_update. The rendezvous and every round run on a daemon thread joined with `weight_sync_timeout`: an
NCCL call cannot be interrupted, so a dead peer leaves that thread behind and the run raises one sentence instead of
hanging (the transfer is then unusable; the run must be restarted).

    NcclWeightPush(client, server_world_size, group_port, wire_dtype)
        .push(weights, version)   first call: rendezvous (server world + 1 ranks, this process rank 0); every call:
                                  one round, finished under `version`

vLLM symbols come through generation/vllm_compat.py only (checked against vllm_api.json).
"""

import socket
from functools import cached_property
from typing import Iterable
from urllib.parse import urlparse

import torch

from posttrain.generation import vllm_compat
from posttrain.generation.protocol import GenerationError
from posttrain.timeouts import TimedOut, run_within


class VLLMControlClient:
    """vLLM's weight-sync client protocol (VLLMWeightSyncClient) over posttrain's ServerClient: every call has the
    sync timeout and none is retried; finish_weight_update carries the round's version.

    `client` is the ServerClient of generation/server.py (which imports this module, not the other way round)."""

    def __init__(self, client):
        self.client = client
        self.version: str | None = None

    def _post(self, path: str, body: dict | None = None) -> None:
        self.client._call("POST", path, self.client.sync_timeout, retry=False, json=body)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version or self.version})


def export_source(wire_dtype: torch.dtype | None):
    """A vLLM WeightSource over posttrain's weight export (plain names, LoRA merged): its metadata is taken from the
    first export and cached (vLLM checks every later round against it); `iter_full` yields the export set by
    `feed` before each round, cast to the served dtype. Built on first use: WeightSource is vLLM's class."""
    base, param_meta = vllm_compat.symbol("WeightSource"), vllm_compat.symbol("ParamMeta")

    class ExportSource(base):
        def __init__(self):
            self._weights: list[tuple[str, torch.Tensor]] | Iterable = []

        def feed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            self._weights = weights

        def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor if wire_dtype is None else tensor.to(wire_dtype)

        @cached_property
        def metadata(self):
            self._weights = [(name, self._cast(t)) for name, t in self._weights]  # the first round, held once
            return [param_meta(name, t.dtype, tuple(t.shape)) for name, t in self._weights]

        def iter_full(self):
            for name, tensor in self._weights:
                yield name, self._cast(tensor)

    return ExportSource()


def _bounded(what: str, fn, timeout: float, base_url: str):
    """fn() on a daemon thread (posttrain/timeouts.run_within); its error as one sentence, or one if it is still running
    after `timeout` (the thread is abandoned: an NCCL call cannot be interrupted)."""
    try:
        return run_within(fn, timeout, name=f"posttrain-{what}")
    except TimedOut:
        raise GenerationError(f"The weight transfer to the vLLM server at {base_url} did not finish {what} within "
                              f"{timeout:g} s (weight_sync_timeout): the server or the NCCL link died or stalled; "
                              "restart the server and resume the run from its last checkpoint.") from None
    except GenerationError:
        raise
    except Exception as err:  # noqa: BLE001 - vLLM's and NCCL's own errors, named in the sentence
        raise GenerationError(f"The weight transfer to the vLLM server at {base_url} failed in {what}: "
                              f"{type(err).__name__}: {err}") from err


def reachable_address(base_url: str) -> str:
    """This host's address on the route to the server (what the server can reach the NCCL rendezvous at)."""
    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port or 80), timeout=10) as sock:
        return sock.getsockname()[0]


class NcclWeightPush:
    """Pushes weights to a `vllm serve` started with --weight-transfer-config '{"backend": "nccl"}', through `client`
    (generation/server.py's ServerClient)."""

    def __init__(self, client, server_world_size: int, group_port: int,
                 wire_dtype: torch.dtype | None = None):
        self.client = client
        self.control = VLLMControlClient(client)
        self.server_world_size = server_world_size
        self.group_port = group_port
        self.source = export_source(wire_dtype)
        self.engine = None

    def _connect(self) -> None:
        init_info = vllm_compat.symbol("NCCLTrainerInitInfo")(
            reachable_address(self.client.base_url), self.group_port, self.server_world_size + 1, packed=True, rank=0)
        factory = vllm_compat.symbol("WeightTransferTrainerFactory")
        self.engine = _bounded("the NCCL rendezvous",
                               lambda: factory.trainer_init(init_info, client=self.control, source=self.source),
                               self.client.sync_timeout, self.client.base_url)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self.source.feed(weights)
        if self.engine is None:
            self._connect()
        self.control.version = version
        _bounded("a weight round", self.engine.send_weights, self.client.sync_timeout, self.client.base_url)
