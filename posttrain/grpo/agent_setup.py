"""The GRPO trainer's agents at construction: the training data when an environment owns it, and the agents'
stage (posttrain/agents/rollouts.py) with its budget, from TRL 1.16's `tools=`, `environment_factory=` and
`rollout_func=`.

    train_dataset, placeholder_prompts = agent_dataset(train_dataset, agents, args)
    stage = agent_rollouts(agents, args, encoder, chat_template, context, placeholder_prompts, trainer)
"""

from posttrain.agents.environments import PLACEHOLDER_PROMPT
from posttrain.agents.loop import Budget
from posttrain.agents.rollouts import AgentRollouts, Agents, check_conversational
from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.rewards import CONVENTION_ARGS


def agent_dataset(train_dataset, agents: Agents, args):
    """The training data, and whether its prompts are placeholders: without a train_dataset, an environment owns
    the data (reset returns the prompt) and max_steps sets the length, as in TRL; rows without a prompt get TRL's
    placeholder when an environment will write it."""
    if train_dataset is None:
        if agents.environment_factory is None:
            raise DataError("GRPOTrainer needs a train_dataset with a 'prompt' column (or an environment_factory "
                            "whose reset returns the prompt).")
        if isinstance(agents.environment_factory, dict):
            raise DataError("A dict environment_factory routes each row by its `environment` column, so it needs "
                            "a train_dataset with that column: give one, or pass a single factory.")
        if args.max_steps <= 0:
            raise ConfigError("Without a train_dataset (the environment's reset returns the prompt), max_steps "
                              "sets the run's length: set max_steps to a positive number.")
        from datasets import Dataset

        prompts = [[dict(m) for m in PLACEHOLDER_PROMPT]] * args.prompts_per_generation
        return Dataset.from_dict({"prompt": prompts}), True
    columns = getattr(train_dataset, "column_names", None)
    if agents.environment_factory is not None and columns is not None and "prompt" not in columns:
        return train_dataset.map(lambda row: {"prompt": [dict(m) for m in PLACEHOLDER_PROMPT]}), True
    if agents.calls_tools and columns is not None and "prompt" in columns and hasattr(train_dataset, "__getitem__") \
            and len(train_dataset):
        check_conversational([train_dataset[0]["prompt"]], [0])  # at construction, not at the first round
    return train_dataset, False


def tool_vision(agents: Agents, processing_class, model):
    """What shows the model the images its tools return: a vision-language model's processor rows
    (sequences/images.py VisionProcessing), when the trainer calls tools with one; None otherwise (a tool's image
    is then refused in one sentence)."""
    from posttrain.models.checkpoint_classes import is_vision_language
    from posttrain.sequences.images import VisionProcessing, is_vision_processor

    if agents.calls_tools and is_vision_processor(processing_class) and is_vision_language(model):
        return VisionProcessing(processing_class)
    return None


def agent_rollouts(agents: Agents, args, encoder, chat_template: str | None, context: int | None,
                   placeholder_prompts: bool, trainer, vision=None) -> AgentRollouts | None:
    """The agents' stage, or None without tools, environments or rollout_func. `context`: the model's
    max_position_embeddings (vLLM colocate's vllm_max_model_length wins); `trainer`: what rollout_func receives;
    `vision`: the prompts' and the tools' images' processing (None: text only)."""
    if not agents:
        return None
    if agents.calls_tools and args.use_vllm and args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size > 1:
        raise ConfigError(f"Tool calling with vllm_mode='colocate' and vllm_tensor_parallel_size="
                          f"{args.vllm_tensor_parallel_size} is not supported: each process's rollouts take their "
                          f"own number of turns, while a tensor-parallel engine's generate calls must be made by "
                          f"every process of its group together; use vllm_tensor_parallel_size=1 or "
                          f"vllm_mode='server'.")
    if args.use_vllm and args.vllm_mode == "colocate" and args.vllm_max_model_length:
        context = args.vllm_max_model_length
    budget = Budget(args.max_completion_length, context or 2 ** 62, args.max_tool_calling_iterations)
    return AgentRollouts(encoder.tokenizer, encoder, agents, chat_template=chat_template,
                         chat_template_kwargs=args.chat_template_kwargs or {}, budget=budget,
                         tool_timeout=args.tool_timeout, trainer=trainer, vocab_size=encoder.vocab_size,
                         reserved=CONVENTION_ARGS | {"environments"}, placeholder_prompts=placeholder_prompts,
                         results_as_text=args.tool_results_as_text, vision=vision)
