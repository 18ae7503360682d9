"""Run by the FSDP2 test on 2 gloo processes (torch.distributed.run): a tiny model sharded with fully_shard
generates each process's own prompts (completions of different lengths) inside gathered_for_generation, then takes a
training forward and backward, and exports its weights; <out>/rank<RANK>.json holds what an unsharded copy of the
same model gave for the same work, for the test to compare."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models import token_logprobs
from posttrain.testing import tiny_model, tiny_tokenizer
from posttrain.training.sharding import full_tensor, gathered_for_generation, is_sharded
from posttrain.weights import export_weights

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
tokenizer = tiny_tokenizer()
reference, model = tiny_model(tokenizer, seed=3), tiny_model(tokenizer, seed=3)
# process 0 samples short completions (EOS made likely), process 1 long ones: their decodes end at different steps
params = SamplingParams(max_new_tokens=12 if rank else 3)
prompts = [[5, 76, 5, 84], [7, 76, 9, 84, 11]] if rank == 0 else [[6, 6, 6], [9, 8, 7, 6, 5, 4]]
keys = [2 * rank, 2 * rank + 1]

mesh = init_device_mesh("cpu", (2,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
assert is_sharded(model) and not is_sharded(reference)


def work(m, sharded):
    with gathered_for_generation(m):
        rollouts = TransformersGenerator(m, tokenizer, params).generate_seeded(prompts, 7, keys)
    r = rollouts
    logps, _ = token_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    (-(logps * r.completion_mask).sum()).backward()
    grads = {n: full_tensor(p.grad).clone() for n, p in m.named_parameters()}
    if sharded:  # the other process's gradient is in the sharded one (FSDP2 averages): compare the sum of both
        grads = {n: g * dist.get_world_size() for n, g in grads.items()}
    return r, logps, grads


r_ref, lp_ref, g_ref = work(reference, False)
r, lp, g = work(model, True)
summed = {n: t.clone() for n, t in g_ref.items()}
for t in summed.values():
    dist.all_reduce(t)  # the unsharded reference's gradients summed over the two processes' batches
exported = dict(export_weights(model))
plain = dict(export_weights(reference))
result = {
    "completions_equal": torch.equal(r.completion_ids, r_ref.completion_ids),
    "lengths": r.completion_mask.sum(1).tolist(),
    "logps_max_diff": float((lp - lp_ref).detach().abs().max()),
    "grad_max_diff": max(float((g[n] - summed[n]).abs().max()) for n in g),
    "export_names_equal": list(exported) == list(plain),
    "export_max_diff": max(float((exported[n] - plain[n]).abs().max()) for n in plain),
    "export_shapes_full": all(exported[n].shape == plain[n].shape for n in plain),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
