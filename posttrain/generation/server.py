"""Generation through a server (`posttrain serve`, or anything speaking its subset of vLLM's API): the client.

Every call has a timeout, so nothing waits forever: start-up polls /health until `connect_timeout`; completions take
`request_timeout`; each weight call `sync_timeout`, while /health, asked on another connection every few seconds
with `request_timeout`, must keep answering (a stopped or dead server fails the push within about request_timeout, a
slow but alive one gets sync_timeout). Only idempotent calls are retried: GETs, weight buckets (a bucket re-sent
under the same version is loaded again, harmlessly) and seeded completions answered 503. A failure becomes a
GenerationError of one sentence naming the server, the call and the fix.

    api_key_from_env  the key the trainer sends: POSTTRAIN_API_KEY (what `posttrain serve` reads too), else
                      VLLM_API_KEY (what `vllm serve` reads)
    ServerClient      the HTTP calls: wait_until_up, info, completions, push (an owned update: buckets within the
                      server's max_bucket_bytes, each carrying the update's id, and a verified digest)
                      image_features / generate_tokens: vLLM's routes for prompts with images (TRL's server mode)

The trainer's Generator over a client is generation/server_generator.py's ServerGenerator.
"""

import os
import threading
import time
from typing import Iterable

import torch

from posttrain import wire
from posttrain.generation.protocol import GenerationError, SamplingParams


def api_key_from_env(environ=os.environ) -> str | None:
    """The API key the trainer sends: POSTTRAIN_API_KEY, else VLLM_API_KEY; None when neither is set (or empty)."""
    return environ.get("POSTTRAIN_API_KEY") or environ.get("VLLM_API_KEY") or None


class ServerClient:
    """Args:
        base_url: e.g. http://127.0.0.1:8000.
        api_key: sent as a bearer token when set.
        connect_timeout: seconds to wait for /health at start-up (TRL's vllm_server_timeout).
        request_timeout: seconds one completions request may take.
        sync_timeout: seconds each weight-update call may take.
        retries: attempts of an idempotent call that failed on the connection or with a 5xx.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout: float = 240.0,
                 request_timeout: float = 600.0, sync_timeout: float = 1800.0, retries: int = 3,
                 max_bucket_bytes: int = wire.MAX_BUCKET_BYTES):
        from posttrain._optional import require

        requests = require("requests", "Generation through a server (vllm_mode='server')")

        self.base_url = base_url.rstrip("/")
        self._requests, self._api_key = requests, api_key
        self._local = threading.local()  # a session per thread (async_generation's worker samples while a push runs)
        self.connect_timeout, self.request_timeout, self.sync_timeout = connect_timeout, request_timeout, sync_timeout
        self.retries = retries
        self.max_bucket_bytes = max_bucket_bytes
        self.server_info: dict = {}  # /server_info, once wait_until_up has read it

    @property
    def session(self):
        """This thread's session: a connection the server closed under another thread's request is never reused
        here (a thread's session is closed when the thread ends)."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self._requests.Session()
            session.trust_env = False  # a proxy from the environment must not see the weights or the key
            if self._api_key:
                session.headers["Authorization"] = f"Bearer {self._api_key}"
        return session

    # ------------------------------------------------------------------ calls

    def _call(self, method: str, path: str, timeout: float, retry: bool, busy_until: float | None = None,
              refusals: dict[int, str] | None = None, **kwargs):
        """One call; `retry`: again after a connection error or a 5xx; `busy_until`: see `_request`; `refusals`:
        {status: the sentence for it} where a status means more than the server's own words."""
        import requests

        url = f"{self.base_url}{path}"
        attempts = self.retries if retry else 1
        for attempt in range(attempts):
            try:
                response = self._request(method, url, timeout, busy_until, **kwargs)
            except requests.Timeout:
                raise GenerationError(f"The generation server at {self.base_url} did not answer {method} {path} "
                                      f"within {timeout:g} s: check that it is alive and not overloaded, or raise the "
                                      "timeout (request_timeout, weight_sync_timeout).") from None
            except requests.ConnectionError as err:
                if attempt + 1 < attempts:
                    time.sleep(0.2 * 2 ** attempt)
                    continue
                raise GenerationError(f"The generation server at {self.base_url} refused {method} {path} "
                                      f"({type(err).__name__}): is it still running?") from None
            if response.status_code >= 500 and attempt + 1 < attempts:
                time.sleep(0.2 * 2 ** attempt)
                continue
            if response.status_code in (refusals or {}):
                raise GenerationError(refusals[response.status_code])
            if response.status_code >= 400:
                raise GenerationError(f"The generation server at {self.base_url} answered {method} {path} with "
                                      f"{response.status_code}: {_error_text(response)}")
            return response.json()
        raise AssertionError("unreachable")

    def _request(self, method: str, url: str, timeout: float, busy_until: float | None, **kwargs):
        """The response to one request, asked again while the server answers 409 (a weight update in progress:
        another process's push, or this one's trainer's) until the monotonic time `busy_until`, when given."""
        while True:
            response = self.session.request(method, url, timeout=timeout, **kwargs)
            if response.status_code != 409 or busy_until is None or time.monotonic() >= busy_until:
                return response
            time.sleep(0.02)

    def wait_until_up(self) -> dict:
        """Poll /health until it answers (or connect_timeout passes), then return /server_info."""
        import requests

        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                response = self.session.get(f"{self.base_url}/health", timeout=min(5.0, self.connect_timeout))
                if response.status_code == 200:
                    break
                if response.status_code == 401:
                    raise GenerationError(f"The generation server at {self.base_url} refused the API key (401): "
                                          "pass the key it was started with.")
            except (requests.ConnectionError, requests.Timeout):
                pass
            if time.monotonic() >= deadline:
                raise GenerationError(f"No generation server answered at {self.base_url} within "
                                      f"{self.connect_timeout:g} s (vllm_server_timeout): start one (posttrain serve "
                                      "--model ...), or check vllm_server_base_url / host / port.")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self.server_info = self.info()
        return self.server_info

    def info(self) -> dict:
        """/server_info: posttrain serve's flat fields, or vLLM's {"vllm_config": ...} (its dev mode)."""
        return self._call("GET", "/server_info?config_format=json", 60.0, retry=True)

    def _weight_call(self, path: str, retry: bool, **kwargs) -> dict:
        """POST `path` within sync_timeout, on a daemon thread, while this thread asks /health (request_timeout)
        every few seconds it is in flight: a server that stops answering fails the call within about
        request_timeout (the thread is left to its own timeout); a slow but alive one gets sync_timeout."""
        outcome: dict = {}

        def call():
            try:
                outcome["answer"] = self._call("POST", path, self.sync_timeout, retry=retry, **kwargs)
            except BaseException as err:  # handed to the waiting thread
                outcome["error"] = err

        thread = threading.Thread(target=call, name="posttrain-weight-call", daemon=True)
        thread.start()
        while True:
            thread.join(min(5.0, self.request_timeout))
            if not thread.is_alive():
                break
            self._check_alive(path)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def _check_alive(self, path: str) -> None:
        """GenerationError unless /health answers within request_timeout (on a connection of its own)."""
        import requests

        try:
            if self.session.get(f"{self.base_url}/health", timeout=self.request_timeout).status_code < 500:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass
        raise GenerationError(f"The generation server at {self.base_url} stopped answering /health within "
                              f"{self.request_timeout:g} s (request_timeout) while POST {path} was in flight: it is "
                              "stopped or dead; restart it (and the run, from its newest checkpoint).")

    def weight_version(self) -> str | None:
        return self._call("GET", "/weight_info", 60.0, retry=True).get("weight_version")

    def wait_for_version(self, version: str) -> None:
        """Poll /weight_info until the server holds `version` (pushed by another process), within sync_timeout."""
        deadline = time.monotonic() + self.sync_timeout
        while self.weight_version() != version:
            if time.monotonic() >= deadline:
                raise GenerationError(f"The generation server at {self.base_url} did not receive weights {version!r} "
                                      f"within {self.sync_timeout:g} s (weight_sync_timeout): the process pushing "
                                      "them stalled or failed.")
            time.sleep(0.05)

    def world_size(self) -> int:
        """The vLLM server's workers (its /get_world_size)."""
        return int(self._call("GET", "/get_world_size", 60.0, retry=True)["world_size"])

    def completions(self, prompts: list[list[int]], n: int, seed: int, params: SamplingParams,
                    sample_keys: list[int] | None = None, model_inputs: str | None = None) -> list[dict]:
        """/v1/completions' choices; `model_inputs`: each prompt's pixels (wire.to_text, posttrain serve's)."""
        body = {"prompt": prompts, **_sampling_fields(params, n, seed), "return_token_ids": True,
                "return_tokens_as_token_ids": True, "return_weight_versions": True}
        if sample_keys is not None:
            body["sample_keys"] = list(sample_keys)
        for name in ("suppress_tokens", "begin_suppress_tokens"):  # posttrain serve's (vLLM's are refused before)
            if getattr(params, name):
                body[name] = list(getattr(params, name))
        if model_inputs is not None:
            body["model_inputs"] = model_inputs
        # a push in progress (async_generation samples while the trainer pushes) answers 409: wait it out
        return self._call("POST", "/v1/completions", self.request_timeout, retry=True,
                          busy_until=time.monotonic() + self.request_timeout, json=body)["choices"]

    def image_features(self, images: list) -> dict:
        """vLLM's features of one prompt's images (its `/v1/chat/completions/render` of a message holding only
        them, as TRL's VLLMClient.image_features asks): the processed images and their hashes, with placeholders
        that point into that throwaway message (`place_features` points them at a prompt)."""
        content = [{"type": "image_url", "image_url": {"url": _data_url(image)}} for image in images]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        disabled = (f"The vLLM server at {self.base_url} does not render images (/v1/chat/completions/render), which "
                    "prompts with images need: restart it with `posttrain vllm-serve` (or `vllm serve "
                    "--enable-scale-out`).")  # 403: the scale-out routes are off; 404: a vLLM without them
        return self._call("POST", "/v1/chat/completions/render", self.request_timeout, retry=True,
                          refusals={403: disabled, 404: disabled}, json=body)["features"]

    def generate_tokens(self, prompt: list[int], features: dict | None, n: int, seed: int,
                        params: SamplingParams) -> list[dict]:
        """vLLM's `/inference/v1/generate` of one prompt's token ids with its images' `features`: n choices in
        `completions`' form ({index, token_ids, logprobs: {token_logprobs}, weight_versions})."""
        import uuid

        # output_kind FINAL_ONLY: every one of the n sequences, not only the last to finish
        sampling = {**_sampling_fields(params, n, seed), "output_kind": 2}
        body = {"request_id": f"posttrain-{uuid.uuid4().hex}", "token_ids": list(prompt), "features": features,
                "sampling_params": sampling}
        choices = self._call("POST", "/inference/v1/generate", self.request_timeout, retry=True,
                             busy_until=time.monotonic() + self.request_timeout, json=body)["choices"]
        return [{"index": c["index"], "token_ids": c["token_ids"], "weight_versions": c.get("weight_versions"),
                 "logprobs": {"token_logprobs": [e["logprob"] for e in (c.get("logprobs") or {}).get("content")
                                                 or ()]}} for c in choices]

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> str:
        """Send every weight under `version` in an update this client owns (its id on every call), in buckets
        within the server's max_bucket_bytes, and check that the server holds exactly what was sent; returns the
        digest."""
        opened = self._weight_call("/start_weight_update", retry=False, json={"weight_version": version})
        owner = {"X-Update-Id": opened["update_id"]} if opened.get("update_id") else {}
        server_max = self.server_info.get("max_bucket_bytes")
        packing = min(self.max_bucket_bytes, server_max) if server_max else self.max_bucket_bytes
        digests = wire.PushDigests()
        for index, (bucket, aliases) in enumerate(wire.buckets(weights, packing)):
            body = wire.Body(bucket, aliases)  # streamed from the tensors' memory: no copy of the weights
            if server_max and len(body) > server_max + wire.MAX_HEADER_BYTES:
                raise GenerationError(f"Weight {bucket[0][0]!r} alone has {len(body) - len(body.header)} bytes, more "
                                      f"than the generation server at {self.base_url} takes in one bucket "
                                      f"(max_bucket_bytes={server_max}): restart it with --max_bucket_bytes "
                                      f"{len(body)} or more.")
            headers = {"Content-Type": "application/octet-stream", "X-Weight-Version": version,
                       "X-Bucket": str(index + 1), "X-Bucket-Digest": digests.of_bucket(body, aliases), **owner}
            self._weight_call("/update_weights", retry=True, data=body, headers=headers)
        expected = digests.total()
        finish = {"weight_version": version, **({"update_id": opened["update_id"]} if owner else {})}
        held = self._weight_call("/finish_weight_update", retry=False, json=finish)["digest"]
        if held != expected:
            raise GenerationError(f"The generation server at {self.base_url} holds other weights than were sent for "
                                  f"version {version} (digest {held[:12]} against {expected[:12]}): its model differs "
                                  "from the trainer's, or a tensor was lost; restart it with the trainer's model.")
        return expected

    def close(self) -> None:
        self.session.close()


def _error_text(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    if isinstance(body, dict) and "detail" in body:  # FastAPI's validation errors: name the field
        detail = body["detail"]
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            return f"{'.'.join(str(p) for p in detail[0].get('loc', []))}: {detail[0].get('msg', '')}"
        return str(detail)
    return str(body)[:300]


def _sampling_fields(params: SamplingParams, n: int, seed: int) -> dict:
    """How to sample, in the names vLLM's SamplingParams and /v1/completions share (posttrain serve's too)."""
    fields = {"n": n, "max_tokens": params.max_new_tokens, "min_tokens": params.min_new_tokens,
              "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
              "min_p": params.min_p or 0.0, "repetition_penalty": params.repetition_penalty, "seed": seed,
              "logprobs": 0}
    if params.eos_token_ids:
        fields["stop_token_ids"] = list(params.eos_token_ids)
    return fields


def _data_url(image) -> str:
    """A PIL image as a PNG data URL (lossless), the form vLLM's chat routes take."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
