"""async_generation: the next rounds sampled while the trainer steps, within a bounded staleness (TRL's
AsyncGRPOConfig names and defaults for the pipeline's fields)."""

from dataclasses import dataclass

from posttrain.configs.base import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, ConfigError, Range, _help


@dataclass
class AsyncGenerationConfig:
    """Asynchronous generation: a rollout worker samples and scores the next rounds while the trainer steps, each
    round tagged with the policy version it was sampled with (docs/async.md)."""

    async_generation: bool = _help(
        "Sample the next rounds while the trainer steps: a rollout worker (a thread of each training process) "
        "generates against the generation server (use_vllm with vllm_mode=server: posttrain serve or vllm serve) or "
        "a copy of the policy in this process, and scores the completions; the trainer takes rounds at most "
        "max_staleness weight syncs old. AsyncGRPOTrainer turns it on.", default=False)
    max_staleness: int = _help(
        "The most weight syncs a round may lag behind the policy being trained: the worker starts a round only with "
        "weights that recent, and the trainer drops (async/stale_dropped) a round staler than this. 0 trains on "
        "rounds of the current weights, as synchronous GRPO does (and equals it bit for bit).",
        range=NON_NEGATIVE, default=4)
    weight_sync_steps: int = _help(
        "With async_generation: optimizer steps between weight syncs to the generation engine.",
        range=AT_LEAST_ONE, default=1)
    max_inflight_tasks: int = _help(
        "With async_generation: the most completions sampled ahead of the trainer (queued or being generated), in "
        "whole rounds of generation_batch_size (at least one); -1 (auto): max_staleness x per_device_train_batch_size "
        "x gradient_accumulation_steps x processes, as TRL.",
        range=Range(-1, note="-1: auto"), default=-1)
    queue_maxsize: int = _help(
        "With async_generation: the most completions the queue of sampled rounds holds (in whole rounds, at least "
        "one).", range=AT_LEAST_ONE, default=1024)
    heartbeat_stale_after_s: float = _help(
        "With async_generation: seconds the rollout worker may go without a sign of life (a round started, "
        "generated, scored, or a wait) before the run stops, naming it hung.", range=POSITIVE, default=300.0)

    def _check(self):
        if not self.async_generation:
            return
        if self.use_vllm and self.vllm_mode == "colocate":
            raise ConfigError("async_generation needs an engine apart from the trainer, and vllm_mode='colocate' "
                              "shares the trainer's device and weights: set vllm_mode='server' (a vllm serve or "
                              "posttrain serve on other devices), or use_vllm=False (a copy of the policy in this "
                              "process).")
        if self.max_inflight_tasks == 0:
            raise ConfigError("max_inflight_tasks=0 leaves the rollout worker nothing to sample: set it to -1 (auto) "
                              "or a positive number of completions.")

    def rounds_ahead(self, generation_batch_size: int, processes: int) -> int:
        """The most rounds the worker samples beyond those the trainer has taken (at least one)."""
        inflight = self.max_inflight_tasks
        if inflight < 0:
            inflight = (self.max_staleness * self.per_device_train_batch_size * self.gradient_accumulation_steps
                        * processes)
        return max(1, min(inflight, self.queue_maxsize) // generation_batch_size)
