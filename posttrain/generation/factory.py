"""`make_generator`: the generation backend a config asks for. The backends are imported inside it, when chosen, so
importing the protocol (posttrain.generation) loads no engine."""

from posttrain.generation.protocol import Generator, SamplingParams


def make_generator(config, policy, tokenizer, seed: int = 0, process_index: int = 0, run_id: str = "run",
                   num_processes: int = 1, local_process_index: int = 0, image_token_ids: tuple = (),
                   mixed_precision: str = "no") -> Generator:
    """The generation backend for `config`: with use_vllm and vllm_mode="server", the server at the configured URL
    (process 0 pushes the weights, every process generates its own share); with vllm_mode="colocate", a vLLM engine
    in this process; otherwise the in-process transformers sampler, sampling from `policy` itself (from a copy of it,
    loaded at each sync, with async_generation). `image_token_ids`: a vision-language model's image tokens, never
    sampled in process or by posttrain serve (as TRL suppresses them in transformers' generate; TRL's vLLM paths
    leave them to vLLM, and so do ours), and where a vLLM server places a prompt's image features. `mixed_precision`:
    accelerate's ("bf16", "fp16" or "no"): a bf16 or fp16 run's autocast dtype is the in-process decode's on CUDA (its
    KV cache's too); with cache_implementation="static" it decodes at fixed shapes (TransformersGenerator)."""
    from posttrain.generation.transformers_backend import TransformersGenerator, eos_token_ids

    params = SamplingParams.from_config(config)
    if getattr(config, "use_vllm", False) and config.vllm_mode == "colocate":
        params.check_no_bans("a colocated vLLM")
        from posttrain.generation.vllm_colocate import ColocateGenerator

        max_num_seqs = (config.per_device_train_batch_size * config.vllm_tensor_parallel_size
                        * config.steps_per_generation)
        return ColocateGenerator(config, policy, tokenizer, params, eos_ids=eos_token_ids(policy, tokenizer), seed=seed,
                                 process_index=process_index, local_process_index=local_process_index,
                                 num_processes=num_processes, max_num_seqs=max_num_seqs)
    if getattr(config, "use_vllm", False) and config.vllm_mode == "server":
        from posttrain.generation.server import ServerClient, api_key_from_env
        from posttrain.generation.server_generator import ServerGenerator
        from posttrain.weights import export_weights
        from posttrain.wire import fingerprint

        client = ServerClient(config.server_url, api_key=api_key_from_env(),
                              connect_timeout=config.vllm_server_timeout, request_timeout=config.request_timeout,
                              sync_timeout=config.weight_sync_timeout)
        max_length = (config.max_prompt_length + params.max_new_tokens) if config.max_prompt_length else None
        return ServerGenerator(client, params, pad_id=tokenizer.pad_token_id, eos_ids=eos_token_ids(policy, tokenizer),
                               seed=seed,
                               model_fingerprint=fingerprint(export_weights(policy)),
                               pushes=process_index == 0, run_id=run_id, device=next(policy.parameters()).device,
                               max_length=max_length, needs_processed_logprobs=config.corrects_sampling,
                               group_port=config.vllm_group_port,
                               versions_advance=getattr(config, "async_generation", False),
                               image_token_ids=image_token_ids)
    params = params.banning(image_token_ids)
    import torch

    decode = dict(fixed_shape=getattr(config, "cache_implementation", None) == "static",
                  compute_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision))
    if getattr(config, "async_generation", False):  # sampling while the policy trains: a copy of its own
        from posttrain.generation.transformers_backend import generation_copy

        return TransformersGenerator(generation_copy(policy), tokenizer, params, seed=seed, shares_policy=False,
                                     **decode)
    return TransformersGenerator(policy, tokenizer, params, seed=seed, **decode)
