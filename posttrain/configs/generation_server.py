"""GRPOConfig's fields for where completions are sampled: in the training process, by vLLM inside it (colocate), or by
a generation server the trainer pushes its weights to, and how the trainer corrects for the engine's log-probs."""

from dataclasses import dataclass
from typing import Optional

from posttrain.configs.base import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, ConfigError, Range, _help, check_choice

VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers", "auto")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class GenerationServerConfig:
    """Where completions are sampled: in the training process (the default), by vLLM inside the training process
    (colocate), or by a generation server the trainer pushes its weights to (`posttrain serve`, or `vllm serve`),
    and how the trainer corrects for the engine's log-probs differing from its own."""

    use_vllm: bool = _help(
        "Generate with an engine outside the trainer's own sampler: vLLM in this process (vllm_mode=colocate) or a "
        "generation server (vllm_mode=server: posttrain serve, CPU included, or vllm serve). False: the in-process "
        "sampler.", default=False)
    vllm_mode: str = _help(
        "colocate: a vLLM engine in every training process, its weights loaded in place before each round; server: "
        "a server at vllm_server_base_url, its weights pushed and verified before every round.", default="colocate")
    vllm_model_impl: str = _help("The model implementation vLLM uses (colocate): vllm or transformers.",
                                 default="vllm")
    vllm_enable_sleep_mode: bool = _help(
        "Colocate: put vLLM to sleep (weights and KV cache released) between rounds, so training gets the memory "
        "back.", default=False)
    vllm_server_base_url: Optional[str] = _help(
        "The server's base URL (e.g. http://10.0.0.2:8000); when set, vllm_server_host and vllm_server_port are "
        "ignored. A key the server requires is read from the POSTTRAIN_API_KEY environment variable, else "
        "VLLM_API_KEY.", default=None)
    vllm_server_host: str = _help("The server's host, when vllm_server_base_url is not set.", default="0.0.0.0")
    vllm_server_port: int = _help("The server's port, when vllm_server_base_url is not set.",
                                  range=Range(1, 65535), default=8000)
    vllm_server_timeout: float = _help(
        "Seconds to wait for the server to answer /health at start-up before stopping with one sentence.",
        range=POSITIVE, default=240.0)
    vllm_group_port: int = _help(
        "Port of the NCCL group that carries weights to a vLLM server (the trainer is its rank 0).",
        range=Range(1, 65535), default=51216)
    vllm_gpu_memory_utilization: float = _help(
        "Colocate: the share of GPU memory vLLM may take for weights and KV cache.", range=Range(0, 1, low_open=True),
        default=0.3)
    vllm_max_model_length: Optional[int] = _help(
        "Colocate: vLLM's max_model_len (prompt plus completion); None reads it from the model's config.",
        range=AT_LEAST_ONE, default=None)
    vllm_tensor_parallel_size: int = _help(
        "Colocate: the tensor-parallel size of each vLLM engine; must divide the number of processes.",
        range=AT_LEAST_ONE, default=1)
    vllm_kv_cache_dtype: str = _help(
        "Colocate: vLLM's KV-cache dtype (auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16); fp8 halves the cache.",
        default="auto")
    vllm_importance_sampling_correction: bool = _help(
        "Correct for the engine's sampling distribution differing from the trainer's: each sample is weighted by "
        "the ratio of the trainer's log-probs (over the tokens the sampler's filters kept) to the sampler's, "
        "truncated or masked by vllm_importance_sampling_mode. Applies with use_vllm, and with async_generation at "
        "max_staleness > 0 (the sampler's weights may then be older than the trainer's).", default=True)
    vllm_importance_sampling_mode: str = _help(
        "token_truncate / sequence_truncate: clamp the per-token / per-sequence ratio into [clip_min, clip_max]; "
        "token_mask / sequence_mask: zero it outside.", default="sequence_mask")
    vllm_importance_sampling_clip_max: Optional[float] = _help(
        "The upper bound C_max of the importance-sampling ratio.", range=POSITIVE, default=3.0)
    vllm_importance_sampling_clip_min: Optional[float] = _help(
        "The lower bound C_min of the importance-sampling ratio (None: no lower bound).", range=NON_NEGATIVE,
        default=None)
    vllm_importance_sampling_cap: Optional[float] = _help(
        "Deprecated (TRL 1.6): the former name of vllm_importance_sampling_clip_max; when set, it replaces it.",
        range=POSITIVE, default=None)
    request_timeout: float = _help(
        "Seconds one generation request may take before the run stops with one sentence (AsyncGRPOConfig's name).",
        range=POSITIVE, default=600.0)
    weight_sync_timeout: float = _help(
        "Seconds each weight-sync call may take before the run stops with one sentence (AsyncGRPOConfig's name).",
        range=POSITIVE, default=1800.0)

    def _check(self):
        check_choice(self, "vllm_mode", VLLM_MODES)
        check_choice(self, "vllm_model_impl", VLLM_MODEL_IMPLS)
        check_choice(self, "vllm_importance_sampling_mode", IS_MODES)
        cap = self.vllm_importance_sampling_cap
        if isinstance(cap, (int, float)) and cap > 0:  # other values: check_ranges names the field
            import warnings

            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL): use "
                          "vllm_importance_sampling_clip_max, which it now sets.", FutureWarning, stacklevel=3)
            self.vllm_importance_sampling_clip_max = cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(f"vllm_importance_sampling_clip_min={low} must be below "
                              f"vllm_importance_sampling_clip_max={high}.")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                and low is None and high is None):
            raise ConfigError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} clamps the "
                              "ratio, which needs vllm_importance_sampling_clip_min or _clip_max: set one.")

    @property
    def corrects_sampling(self) -> bool:
        """Whether the importance-sampling correction applies: with use_vllm (TRL's rule), and with async_generation
        when a round may be sampled by older weights than it trains (max_staleness > 0)."""
        may_differ = self.use_vllm or (self.async_generation and self.max_staleness > 0)
        return may_differ and self.vllm_importance_sampling_correction

    @property
    def server_url(self) -> str:
        return (self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}").rstrip("/")
