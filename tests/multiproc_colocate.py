"""Run by the tensor-parallel colocate test on 2 processes: both build one vLLM engine (the double) as a TP group of
2, generate their own share, and write their rows to <out>/rank<RANK>.json."""

import json
import os
import sys

import torch
from accelerate import PartialState

sys.path.insert(0, os.path.dirname(__file__))
from vllm_double import fake_vllm  # noqa: E402

from posttrain.configs import GRPOConfig  # noqa: E402
from posttrain.generation import make_generator  # noqa: E402
from posttrain.testing import tiny_model, tiny_tokenizer  # noqa: E402

out = sys.argv[1]
state = PartialState(cpu=True)
tokenizer = tiny_tokenizer()
prompts = [[5, 76, 5, 84]] * 2 + [[7, 76, 9, 84, 11]] * 2 + [[6, 6]] * 2 + [[9, 8, 7]] * 2
keys = list(range(8))
share = slice(4 * state.process_index, 4 * state.process_index + 4)
config = GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2, per_device_train_batch_size=4,
                    num_generations=2, max_completion_length=4, use_cpu=True)
with fake_vllm(model=tiny_model(tokenizer)) as double:
    generator = make_generator(config, tiny_model(tokenizer), tokenizer, seed=3, process_index=state.process_index,
                               num_processes=2, local_process_index=state.local_process_index)
    rollouts = generator.generate(prompts[share], keys[share])
    seeds = sorted(params.seed for name, args in double.log if name == "LLM.generate"
                   for params in args["sampling_params"])
with open(os.path.join(out, f"rank{state.process_index}.json"), "w") as f:
    json.dump({"completions": rollouts.completion_ids.tolist(), "prompts": rollouts.prompt_ids.tolist(),
               "seeds": seeds}, f)
torch.distributed.barrier()
