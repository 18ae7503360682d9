"""Run by the ZeRO-3 test on 2 gloo processes (torch.distributed.run): a tiny model partitioned by DeepSpeed ZeRO-3
(every parameter, `stage3_param_persistence_threshold: 0`) generates each process's own prompts (completions of
different lengths) inside the run's whole_weights, then takes a training forward and backward, and exports its
weights inside whole_weights; <out>/rank<RANK>.json holds what an unsharded copy of the same model gave for the same
work, for the test to compare."""

import json
import os
import sys
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models import token_logprobs
from posttrain.testing import tiny_model, tiny_tokenizer
from posttrain.training.sharding import Sharding
from posttrain.training.zero import is_partitioned
from posttrain.weights import export_weights

out = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
torch.manual_seed(0)
tokenizer = tiny_tokenizer()
reference, model = tiny_model(tokenizer, seed=3), tiny_model(tokenizer, seed=3)
# process 0 samples short completions (EOS made likely), process 1 long ones: their decodes end at different steps
params = SamplingParams(max_new_tokens=12 if rank else 3)
prompts = [[5, 76, 5, 84], [7, 76, 9, 84, 11]] if rank == 0 else [[6, 6, 6], [9, 8, 7, 6, 5, 4]]
keys = [2 * rank, 2 * rank + 1]

config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
assert all(is_partitioned(p) and p.numel() == 0 for p in model.parameters())  # every weight in shards
sharding = Sharding("zero", SimpleNamespace(), zero_stage=3)


def work(m, sharded):
    with sharding.whole_weights(m) if sharded else torch.no_grad():
        rollouts = TransformersGenerator(m.module if sharded else m, tokenizer, params).generate_seeded(prompts, 7,
                                                                                                          keys)
    r = rollouts
    logps, _ = token_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    loss = -(logps * r.completion_mask).sum()
    if sharded:  # DeepSpeed averages the processes' gradients: compare the sum of both
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss, scale_wrt_gas=False)
        grads = {n: safe_get_full_grad(p) * dist.get_world_size() for n, p in m.module.named_parameters()}
    else:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return r, logps, grads


r_ref, lp_ref, g_ref = work(reference, False)
r, lp, g = work(engine, True)
summed = {n: t.clone() for n, t in g_ref.items()}
for t in summed.values():
    dist.all_reduce(t)  # the unsharded reference's gradients summed over the two processes' batches
with sharding.whole_weights(engine):
    exported = {name: tensor.clone() for name, tensor in export_weights(engine)}
plain = dict(export_weights(reference))
result = {
    "completions_equal": torch.equal(r.completion_ids, r_ref.completion_ids),
    "lengths": r.completion_mask.sum(1).tolist(),
    "logps_max_diff": float((lp - lp_ref).detach().abs().max()),
    "grad_max_diff": max(float((g[n] - summed[n]).abs().max()) for n in g),
    "grad_max": max(float(summed[n].abs().max()) for n in g),
    "export_names_equal": list(exported) == list(plain),
    "export_max_diff": max(float((exported[n] - plain[n]).abs().max()) for n in plain),
    "export_shapes_full": all(exported[n].shape == plain[n].shape for n in plain),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
