"""The trainer's Generator over a generation server (`posttrain serve`, or vLLM's own server): a handshake at connect,
one seed per round from its own RNG (saved in checkpoints) and each row sampled with its key's stream, a group's
identical prompts folded into one request with n (split to fit posttrain serve's max_num_seqs and max_batch_tokens),
every completion checked to come from the weights just pushed (over HTTP to posttrain serve, over vLLM's NCCL transfer
to vllm serve). Prompts with images: posttrain serve takes their pixels with the request; vLLM renders their images
into features (generation/server.py's ServerClient.image_features), which `place_features` points at the prompt's
image tokens, as TRL's server mode does.

    ServerGenerator(client, params, ...)    the Generator protocol over a connected ServerClient
    place_features(features, prompt, ids)   vLLM's features of a prompt's images, placed at its runs of image tokens
"""

from typing import Iterable

import torch

from posttrain import wire
from posttrain.generation.protocol import GenerationError, Rollouts, SamplingParams
from posttrain.generation.server import ServerClient
from posttrain.generation.server_requests import _fitting_runs, _runs, _shared_requests, stream_seed
from posttrain.generation.transformers_backend import draw_seed
from posttrain.model_inputs import ModelInputs


class ServerGenerator:
    """The Generator protocol over a ServerClient.

    Args:
        client: the connected client.
        params: sampling parameters.
        pad_id, eos_ids: for padding the rollouts and telling EOS from a cut at max length.
        seed: seed of the RNG the request seeds are drawn from.
        model_fingerprint: wire.fingerprint of the trainer's export; must equal the server's model.
        image_token_ids: a vision-language model's image tokens (a prompt's runs of them are its images).
    """

    # the server orders a push against the requests in flight (posttrain serve answers 409 while it loads, which the
    # client waits out; vLLM pauses), so a rollout worker may sample while the trainer pushes
    samples_during_push = True

    def __init__(self, client: ServerClient, params: SamplingParams, *, pad_id: int, eos_ids: list[int], seed: int = 0,
                 model_fingerprint: str | None = None, pushes: bool = True, run_id: str = "run", device="cpu",
                 max_length: int | None = None, needs_processed_logprobs: bool = False, group_port: int = 51216,
                 versions_advance: bool = False, image_token_ids: tuple = ()):
        self.client = client
        self.params = params
        self.image_token_ids = tuple(image_token_ids)  # where a prompt's images sit (vLLM's features point there)
        self.pad_id = pad_id
        self.eos_ids = list(params.eos_token_ids) or list(eos_ids)
        self.rng = torch.Generator().manual_seed(seed)
        self._round_seed: int | None = None  # the last round's (generate's new_round)
        self.pushes = pushes  # one process pushes; the others wait until the server holds that version
        # async_generation: pushes land between a round's requests, so a row may be sampled by a newer version than
        # the round started with (the rollout worker records the version it started with)
        self.versions_advance = versions_advance
        self.run_id = run_id
        self.device = device
        self.syncs = 0
        self.version = None
        self.server_info = client.wait_until_up()
        self.is_vllm = "vllm_config" in self.server_info
        if self.is_vllm:  # vLLM samples the image tokens too (as under TRL); posttrain serve suppresses them
            params.check_no_bans("a vLLM server")
        else:
            self.params = params.banning(self.image_token_ids)
        self._handshake(model_fingerprint, max_length, needs_processed_logprobs)
        self._nccl = None
        if self.is_vllm and pushes:
            from posttrain.generation.vllm_transfer import NcclWeightPush

            dtype = self.server_info["vllm_config"].get("model_config", {}).get("dtype")
            self._nccl = NcclWeightPush(client, client.world_size(), group_port, _torch_dtype(dtype))

    def _handshake(self, fingerprint: str | None, max_length: int | None, needs_processed_logprobs: bool) -> None:
        """Stop with one sentence when the server cannot serve this run: another model, too short a max_model_len,
        sampler log-probs that are not the processed ones the correction needs, or (vLLM) no weight transfer."""
        info, url = self.server_info, self.client.base_url
        if self.is_vllm:
            config = info["vllm_config"]
            model_config = config.get("model_config") or {}
            served_len, logprobs_mode = model_config.get("max_model_len"), model_config.get("logprobs_mode")
            backend = (config.get("weight_transfer_config") or {}).get("backend")
            if backend != "nccl":
                raise GenerationError(f"The vLLM server at {url} was started without NCCL weight transfer, so it "
                                      "cannot receive the trained weights: start it with `posttrain vllm-serve "
                                      "--model ...` (or pass --weight-transfer-config '{\"backend\": \"nccl\"}').")
        else:
            served_len, logprobs_mode = info.get("max_model_len"), info.get("logprobs_mode")
            if fingerprint is not None and info.get("fingerprint") not in (None, fingerprint):
                raise GenerationError(f"The generation server at {url} serves another model than the one being "
                                      f"trained ({info.get('model')}, fingerprint {info.get('fingerprint')} against "
                                      f"{fingerprint}): start it with the trainer's model.")
        batch_tokens = None if self.is_vllm else info.get("max_batch_tokens")
        if max_length is not None and batch_tokens is not None and int(batch_tokens) < max_length:
            raise GenerationError(f"The generation server at {url} holds at most {batch_tokens} tokens per request, "
                                  f"and one of this run's sequences reaches {max_length}: restart it with "
                                  f"--max_batch_tokens {max_length} or more.")
        if max_length is not None and served_len is not None and int(served_len) < max_length:
            raise GenerationError(f"The generation server at {url} serves at most {served_len} tokens per sequence, "
                                  f"and this run's prompts and completions reach {max_length}: restart it with "
                                  f"--max_model_len {max_length} or more, or lower max_prompt_length / "
                                  "max_completion_length.")
        if needs_processed_logprobs and logprobs_mode not in (None, "processed_logprobs"):
            raise GenerationError(f"The generation server at {url} returns {logprobs_mode} log-probs, which would bias "
                                  "the importance-sampling correction: restart it with --logprobs-mode "
                                  "processed_logprobs (posttrain vllm-serve does), or set "
                                  "vllm_importance_sampling_correction=False.")

    @property
    def pushes_in_background(self) -> bool:
        """Whether a push may be sent from a copy of the weights while the trainer steps on (async_generation):
        over HTTP to posttrain serve; vLLM's NCCL transfer sends from the trainer's own tensors, in step."""
        return not self.is_vllm

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Process 0 pushes the weights (to posttrain serve over HTTP, checked by digest; to vLLM over its NCCL
        transfer); every other process waits, with the sync timeout, until the server reports that version: no
        collective, so a failure anywhere cannot leave one waiting."""
        self.syncs += 1
        version = f"{self.run_id}:sync-{self.syncs}"
        if not self.pushes:
            self.client.wait_for_version(version)
        elif self._nccl is not None:
            self._nccl.push(weights, version)
        else:
            self.client.push(weights, version)
        self.version = version

    def generate(self, prompts: list[list[int]], row_keys: list[int] | None = None,
                 new_round: bool = True, model_inputs: ModelInputs | None = None,
                 images: list[list] | None = None) -> Rollouts:
        """One round: a seed drawn from this generator's RNG (the same on every process), and each row sampled with
        the stream of its key, so rows get the completions the in-process generator would give them whichever
        process asks. Runs of one prompt with consecutive keys (and the same images) fold into one prompt with n
        copies; runs with the same n share a request (posttrain's `sample_keys` carry their first keys, and
        `model_inputs` their rows' pixels). A server that does not take `sample_keys` (vLLM) gets one request per
        run, seeded by its stream, sent concurrently; a run with images goes as its ids with the features vLLM
        made of its images (`image_features`, pointed at the ids' image tokens), as TRL's server mode sends them."""
        keys = list(row_keys) if row_keys is not None else list(range(len(prompts)))
        runs = _runs(prompts, keys, images)
        row_of = {key: row for row, key in enumerate(keys)}  # a run's first key -> its first row
        if new_round or self._round_seed is None:  # a multi-turn rollout's later turns sample within the round
            self._round_seed = draw_seed(self.rng)
        seed = self._round_seed
        pixels = model_inputs is not None and bool(model_inputs.names)
        if self.server_info.get("engine") == "transformers":  # posttrain serve: it takes sample_keys
            max_seqs, max_tokens = self.server_info.get("max_num_seqs"), self.server_info.get("max_batch_tokens")
            runs = _fitting_runs(runs, max_seqs, max_tokens, self.params.max_new_tokens)
            requests = _shared_requests(runs, max_seqs, max_tokens, self.params.max_new_tokens)
            bodies = [([runs[i][0] for i in idx], runs[idx[0]][2], seed, [runs[i][1] for i in idx],
                       wire.to_text(model_inputs.select([row_of[runs[i][1]] for i in idx]).tensors("")) if pixels else None)
                      for idx in requests]
        else:
            requests = [[i] for i in range(len(runs))]
            run_images = [images[row_of[key]] if images is not None else [] for _, key, _ in runs]
            bodies = [([p], n, stream_seed(seed, key), None, shown or None)
                      for (p, key, n), shown in zip(runs, run_images)]
        answers = self._complete_all(bodies)
        rows: list[tuple[list[int], dict]] = []
        for idx, body, choices in zip(requests, bodies, answers):
            n = body[1]
            if len(choices) != len(idx) * n:
                raise GenerationError(f"The generation server at {self.client.base_url} returned {len(choices)} "
                                      f"completions for {len(idx) * n} asked.")
            for i, choice in enumerate(sorted(choices, key=lambda c: c["index"])):
                self._check_version(choice)
                rows.append((runs[idx[i // n]][0], choice))
        return self._rollouts(rows)

    def _complete_all(self, bodies: list[tuple]) -> list[list[dict]]:
        """Each body's completions, in order; several requests are in flight together (a vLLM server batches them).
        A body is (prompts, n, seed, sample keys, extra): extra is posttrain serve's model_inputs text, or a vLLM
        run's images."""
        if len(bodies) == 1:
            return [self._complete(*bodies[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, len(bodies))) as pool:
            futures = [pool.submit(self._complete, *body) for body in bodies]
            return [f.result() for f in futures]

    def _complete(self, prompts: list[list[int]], n: int, seed: int, keys: list[int] | None, extra) -> list[dict]:
        if not self.is_vllm or extra is None:
            return self.client.completions(prompts, n, seed, self.params, keys, extra)
        features = place_features(self.client.image_features(extra), prompts[0], self.image_token_ids)
        return self.client.generate_tokens(prompts[0], features, n, seed, self.params)

    def _check_version(self, choice: dict) -> None:
        if self.version is None or self.versions_advance:
            return
        spans = choice.get("weight_versions")
        if spans is None:
            return  # a server that does not report versions: the digest check at sync is the guarantee
        stale = [s["version"] for s in spans if s["version"] != self.version]
        if stale:
            raise GenerationError(f"The generation server at {self.client.base_url} sampled with weights "
                                  f"{stale[0]!r}, not the {self.version!r} just pushed: stale weights; check that no "
                                  "other trainer pushes to it.")

    def _rollouts(self, rows: list[tuple[list[int], dict]]) -> Rollouts:
        return Rollouts.from_lists([(p, c["token_ids"], c["logprobs"]["token_logprobs"]) for p, c in rows],
                                   self.pad_id, self.eos_ids, self.device)

    def round_done(self) -> None:
        pass  # the server's memory is its own

    def close(self) -> None:
        self.client.close()


def place_features(features: dict, prompt: list[int], image_token_ids) -> dict:
    """`features` with its image placeholders pointed at the runs of image tokens in `prompt` (the server's point
    into the message it rendered the images in); GenerationError when the runs and the images differ in number."""
    runs, offset = [], 0
    image_tokens = set(image_token_ids)
    while offset < len(prompt):
        if prompt[offset] in image_tokens:
            start = offset
            while offset < len(prompt) and prompt[offset] in image_tokens:
                offset += 1
            runs.append({"offset": start, "length": offset - start})
        else:
            offset += 1
    processed = len(features["mm_placeholders"].get("image", []))
    if len(runs) != processed:
        raise GenerationError(f"A prompt holds {len(runs)} runs of image tokens but the vLLM server processed "
                              f"{processed} images for it: each image must be one run of image tokens in the prompt "
                              "(its processor's expansion).")
    return {**features, "mm_placeholders": {**features["mm_placeholders"], "image": runs}}


def _torch_dtype(name) -> torch.dtype | None:
    """vLLM's served dtype ("torch.bfloat16" or "bfloat16") as a torch dtype; None when unknown."""
    value = getattr(torch, str(name or "").removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None
