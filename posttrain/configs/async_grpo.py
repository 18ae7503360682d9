"""AsyncGRPOConfig: TRL 1.16's experimental `trl.experimental.async_grpo.AsyncGRPOConfig`, field for field.

TRL's AsyncGRPOConfig is TrainingArguments with the sampling, vLLM-server, clipping and pipeline fields of its
asynchronous trainer. posttrain's is GRPOConfig with async_generation on (configs/async_generation.py: max_staleness,
weight_sync_steps, max_inflight_tasks, queue_maxsize, heartbeat_stale_after_s), generation through the server at
vllm_server_base_url (TRL's http://localhost:8000; use_vllm=False samples from a copy of the policy in this process
instead), AsyncGRPOConfig's defaults (learning_rate 1e-6, lr_scheduler_type constant, logging_steps 1,
max_completion_length 2048) and its `dtype`; token_budget and fork_threshold_tokens are accepted at posttrain's
behaviour (configs/trl_compat.py ASYNC_ONLY). GRPOConfig's other fields (beta, loss_type, the sampler correction, ...)
stay, as posttrain's: TRL's asynchronous loss is GRPO's clipped one at beta 0.
"""

from dataclasses import dataclass

from posttrain.configs.base import POSITIVE, ConfigError, _help, check_choice
from posttrain.configs.grpo import GRPOConfig
from posttrain.configs.trl_compat import ASYNC_ONLY, AsyncGRPOCompatConfig, check_compat

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class AsyncModelConfig:
    """The dtype the policy loads in (AsyncGRPOConfig's own field)."""

    dtype: str = _help(
        "The dtype the model loads in from a path or hub id: auto (the checkpoint's own), bfloat16, float16 or "
        "float32 (TRL's default: the trainer-sampler mismatch is smallest in float32). A dtype in model_init_kwargs "
        "wins. Serve the generation server in the same dtype.", default="float32")

    def _check(self):
        check_choice(self, "dtype", DTYPES)


@dataclass
class AsyncGRPOConfig(AsyncModelConfig, GRPOConfig, AsyncGRPOCompatConfig):
    """Everything that configures an asynchronous GRPO run (TRL's experimental `AsyncGRPOConfig` names and
    defaults): GRPOConfig with async_generation on, generation through a server."""

    GROUPS = (*GRPOConfig.GROUPS, AsyncModelConfig)
    COMPAT = AsyncGRPOCompatConfig

    async_generation: bool = _help(
        "Sample the next rounds while the trainer steps (always on for AsyncGRPOTrainer; docs/async.md).",
        default=True)
    learning_rate: float = _help("Peak learning rate (TRL's AsyncGRPOConfig default).", default=1e-6)
    lr_scheduler_type: str = _help(
        "The learning-rate schedule; TRL's AsyncGRPOConfig default constant (set a decaying one with max_steps).",
        default="constant")
    logging_steps: float = _help("Log every this many optimizer steps (TRL's AsyncGRPOConfig default 1).", default=1)
    max_completion_length: int = _help("Maximum completion length in tokens (TRL's AsyncGRPOConfig default).",
                                       default=2048)
    use_vllm: bool = _help(
        "Generate through the server at vllm_server_base_url (vllm serve or posttrain serve), as TRL's "
        "AsyncGRPOTrainer does; False samples from a copy of the policy in this process.", default=True)
    vllm_mode: str = _help("server (TRL's AsyncGRPOTrainer generates only through a server).", default="server")
    request_timeout: int = _help(
        "Seconds one generation request may take before the run stops with one sentence (TRL's AsyncGRPOConfig "
        "default).", range=POSITIVE, default=600)
    weight_sync_timeout: int = _help(
        "Seconds each weight-sync call may take before the run stops with one sentence (TRL's AsyncGRPOConfig "
        "default).", range=POSITIVE, default=1800)
    remove_unused_columns: bool = _help(
        "TRL's AsyncGRPOTrainer applies it to its training batches' columns, never to the dataset's: every column "
        "reaches the reward functions whatever its value, as here.", default=True)
    vllm_server_base_url: str = _help(
        "The generation server's base URL (TRL's AsyncGRPOConfig default http://localhost:8000).",
        default="http://localhost:8000")

    @property
    def drops_reward_columns(self) -> bool:
        return False  # remove_unused_columns is about TRL's training batches (its help)

    def __post_init__(self):
        super().__post_init__()
        check_compat(self, ASYNC_ONLY)
        if not self.async_generation:
            raise ConfigError("async_generation=False: AsyncGRPOConfig always samples ahead; use GRPOConfig for "
                              "synchronous GRPO.")
        kwargs = dict(self.model_init_kwargs or {})
        if self.dtype != "auto" and "dtype" not in kwargs and "torch_dtype" not in kwargs:
            self.model_init_kwargs = {**kwargs, "dtype": self.dtype}
