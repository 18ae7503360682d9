"""vllm_mode="colocate": a vLLM engine inside every training process, as TRL 1.16 builds it, kept thin.

    LLM(model=path, distributed_executor_backend="external_launcher", seed=process // tp, tensor_parallel_size=tp,
        gpu_memory_utilization, max_model_len, max_num_seqs, enable_sleep_mode, model_impl, kv_cache_dtype,
        logprobs_mode="processed_logprobs", max_num_batched_tokens=4096, dtype="auto")
    sync_weights: [wake_up(weights)] -> apply_model(model.load_weights(export)) -> update_weight_version
                  -> reset_prefix_cache
    generate:     [wake_up(kv_cache)] -> generate(one request per run of a prompt, n copies, seeded by the run's
                  stream); a multi-turn rollout's later turns generate on the same awake engine
    round_done:   [sleep(level=2)] once the round's every turn is sampled (level 2 drops the weights, which the next
                  round's sync loads again: sleeping between turns would leave the later turns none)

With external_launcher the engine's worker runs in this process, so `apply_model` hands the model object itself to
the loader: the exported tensors (plain names, LoRA merged) are loaded in place with no copy through a socket.
With tensor parallelism each group of `tp` processes runs one engine on the union of its prompts (gathered in the
group) and every process keeps its own rows. vLLM symbols come through generation/vllm_compat.py only.
"""

import itertools
import os
import tempfile
from typing import Iterable

import torch

from posttrain.generation import vllm_compat
from posttrain.generation.protocol import GenerationError, Rollouts, SamplingParams
from posttrain.generation.server_requests import _runs, stream_seed
from posttrain.generation.transformers_backend import draw_seed


def model_path(policy, workdir: str) -> str:
    """A directory vLLM can load the policy's architecture from: the policy's own when it was loaded from one, else
    its export saved there (plain names, LoRA merged)."""
    from posttrain.weights import export_weights

    plain = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    path = getattr(plain.config, "_name_or_path", "") or ""
    if path and os.path.isdir(path):
        return path
    from safetensors.torch import save_file

    plain.config.save_pretrained(workdir)
    save_file({name: t.detach().cpu().clone() for name, t in export_weights(policy)},  # tied names: own copies
              os.path.join(workdir, "model.safetensors"))
    return workdir


def vllm_sampling_params(params: SamplingParams, n: int, seed: int, eos_ids: list[int]) -> dict:
    """SamplingParams keywords for one request: posttrain's sampling fields under vLLM's names."""
    return dict(n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
                min_p=params.min_p or 0.0, repetition_penalty=params.repetition_penalty,
                max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, logprobs=0, seed=seed,
                stop_token_ids=list(eos_ids))


class ColocateGenerator:
    """The Generator protocol over a vLLM `LLM` in this process.

    Args:
        config: the GRPOConfig (its vllm_* fields).
        policy: the model being trained (its path, or its export, builds the engine).
        params: sampling parameters; eos_ids end a completion.
        seed: seed of the RNG each round's seed is drawn from (the same on every process).
        process_index, local_process_index, num_processes: this process in the run.
    """

    samples_during_push = pushes_in_background = False  # the policy's own weights: neither (protocol.py)

    def __init__(self, config, policy, tokenizer, params: SamplingParams, *, eos_ids: list[int], seed: int,
                 process_index: int, local_process_index: int, num_processes: int, max_num_seqs: int):
        vllm_compat.check_installed("vllm_mode='colocate'")
        self.tp = config.vllm_tensor_parallel_size
        if num_processes % self.tp:
            raise GenerationError(f"vllm_tensor_parallel_size={self.tp} must divide the number of processes "
                                  f"({num_processes}): each group of {self.tp} processes shares one engine.")
        self.params, self.pad_id = params, tokenizer.pad_token_id
        self.eos_ids = list(params.eos_token_ids) or list(eos_ids)
        self.rng = torch.Generator().manual_seed(seed)
        self._round_seed: int | None = None  # the last round's (generate's new_round)
        self.sleeps = config.vllm_enable_sleep_mode
        self.device = next(policy.parameters()).device
        self.group = self._tp_group(process_index, num_processes)
        os.environ.update(RANK=str(process_index), LOCAL_RANK=str(local_process_index),
                          WORLD_SIZE=str(num_processes))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        self._workdir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        kwargs = dict(model=model_path(policy, self._workdir.name), tensor_parallel_size=self.tp,
                      gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                      max_model_len=config.vllm_max_model_length, max_num_seqs=max_num_seqs,
                      enable_sleep_mode=self.sleeps, model_impl=config.vllm_model_impl,
                      kv_cache_dtype=config.vllm_kv_cache_dtype, distributed_executor_backend="external_launcher",
                      seed=process_index // self.tp, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
                      # the checkpoint's 16-bit dtype as vLLM picks it (TRL passes none), not the float32 policy's:
                      # half the engine's weights and KV cache, and its FlashAttention backend; load_weights casts
                      dtype="auto")
        vllm_compat.check_kwargs("LLM.__init__", kwargs, "An LLM argument")
        self.llm = vllm_compat.symbol("LLM")(**kwargs)
        self._asleep: set[str] = set()  # the engine's tags that sleep mode released
        self.round_done()
        self.syncs = 0

    def _tp_group(self, process_index: int, num_processes: int):
        if self.tp == 1:
            return None
        groups = [list(range(i, i + self.tp)) for i in range(0, num_processes, self.tp)]
        group, _ = torch.distributed.new_subgroups_by_enumeration(groups)
        return group

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the exported weights into the engine's model in place, then drop the prefix cache (its keys were
        computed with the old weights)."""
        self.syncs += 1
        self._wake("weights")  # loading into released memory writes nowhere (TRL #5142)
        # streamed: the engine's worker runs in this process (external_launcher), so the export is consumed one tensor
        # at a time as the model loads it, never a second whole copy of the policy held at once
        self.llm.apply_model(lambda model: model.load_weights(iter(weights)))
        self.llm.update_weight_version(f"sync-{self.syncs}")
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], row_keys: list[int] | None = None,
                 new_round: bool = True, model_inputs=None, images: list[list] | None = None) -> Rollouts:
        """`images`: each row's images (a vision-language model's prompts: their ids hold the expanded image tokens),
        given to vLLM as the request's multi_modal_data, which it processes itself; `model_inputs` (the pixels the
        trainer's processor made) are not needed here."""
        keys = list(row_keys) if row_keys is not None else list(range(len(prompts)))
        mine = len(prompts)
        if self.group is not None:  # the group's engine samples the union of its processes' rows
            gathered = [None] * self.tp
            torch.distributed.all_gather_object(gathered, (prompts, keys, images), group=self.group)
            prompts = [p for part, _, _ in gathered for p in part]
            keys = [k for _, part, _ in gathered for k in part]
            images = None if images is None else [i for _, _, part in gathered for i in part]
        if new_round or self._round_seed is None:  # a multi-turn rollout's later turns sample within the round
            self._round_seed = draw_seed(self.rng)
        seed = self._round_seed
        runs = _runs(prompts, keys, images)
        sampling = vllm_compat.symbol("SamplingParams")
        requests = [sampling(**vllm_sampling_params(self.params, n, stream_seed(seed, key), self.eos_ids))
                    for _, key, n in runs]
        if "weights" in self._asleep:
            raise GenerationError("vLLM colocate was asked to generate with its weights released by sleep mode: sync "
                                  "the policy's weights first (a posttrain bug if the trainer did this).")
        self._wake("kv_cache")
        prompts_in = [{"prompt_token_ids": p} for p, _, _ in runs]
        first_rows = itertools.accumulate([n for _, _, n in runs], initial=0)
        for prompt, row in zip(prompts_in, first_rows):  # a run's images: its first row's
            if images is not None and images[row]:
                prompt["multi_modal_data"] = {"image": images[row] if len(images[row]) > 1 else images[row][0]}
        outputs = self.llm.generate(prompts_in, requests, use_tqdm=False)
        # logprobs=0: one {token_id: Logprob} per position, holding the sampled token's
        rows = [(list(out.prompt_token_ids), list(c.token_ids),
                 [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                for out in outputs for c in out.outputs]
        if self.group is not None:
            start = torch.distributed.get_rank(self.group) * mine
            rows = rows[start:start + mine]
        return Rollouts.from_lists(rows, self.pad_id, self.eos_ids, self.device)

    def round_done(self) -> None:
        """With vllm_enable_sleep_mode, release the weights and the KV cache (level 2) for training, once the round's
        every turn is sampled."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)

    def close(self) -> None:
        self.llm = None
        self._workdir.cleanup()

