"""Run by tests/test_sharding.py on 2 gloo processes (torch.distributed.run):

    python -m torch.distributed.run --standalone --nproc_per_node 2 multiproc_sharding.py fsdp1|fsdp2|zero3 OUT_DIR

A tiny model sharded with torch's FullyShardedDataParallel (fsdp1: each decoder layer a unit, the rest the root's,
use_orig_params as accelerate sets it), with fully_shard (fsdp2), or partitioned by DeepSpeed ZeRO-3 (zero3: every
parameter, `stage3_param_persistence_threshold: 0`) generates each process's own prompts (completions of different lengths)
inside the run's whole_weights, then takes a training forward and backward, and exports its weights whole; OUT_DIR/
rank<RANK>.json holds the differences from an unsharded copy of the same model given the same work."""

import gc
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models import token_logprobs
from posttrain.testing import tiny_model, tiny_tokenizer
from posttrain.training.sharding import full_tensor, is_sharded, mark_output_layer, sharding_named
from posttrain.training.zero import is_partitioned
from posttrain.weights import export_weights

strategy, out = sys.argv[1], sys.argv[2]
if strategy == "zero3":
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
tokenizer = tiny_tokenizer()
reference, model = tiny_model(tokenizer, seed=3), tiny_model(tokenizer, seed=3)
# process 0 samples short completions (EOS made likely), process 1 long ones: their decodes end at different steps
params = SamplingParams(max_new_tokens=12 if rank else 3)
prompts = [[5, 76, 5, 84], [7, 76, 9, 84, 11]] if rank == 0 else [[6, 6, 6], [9, 8, 7, 6, 5, 4]]
keys = [2 * rank, 2 * rank + 1]

if strategy == "zero3":
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    sharded, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=config)
    assert all(is_partitioned(p) and p.numel() == 0 for p in model.parameters())  # every weight in shards
    sharding = sharding_named("zero", SimpleNamespace(), zero_stage=3)
elif strategy == "fsdp1":
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    layer_class = type(model.model.layers[0])
    sharded = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                             transformer_layer_cls={layer_class}),
                   use_orig_params=True, device_id=torch.device("cpu"))
    mark_output_layer(sharded)  # as Fsdp1Sharding.prepare does
    assert model.model.embed_tokens.weight.dim() == 1  # the root unit's weights in flat shards
    sharding = sharding_named("fsdp1")
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    sharded = fully_shard(model, mesh=mesh)
    assert is_sharded(model) and not is_sharded(reference)
    sharding = sharding_named("none")  # a model sharded outside accelerate: whole_weights finds its units itself


def work(m, sharded_run):
    with sharding.whole_weights(m) if sharded_run else torch.no_grad():
        r = TransformersGenerator(model if sharded_run else m, tokenizer, params).generate_seeded(prompts, 7, keys)
    logps, _ = token_logprobs(m, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    loss = -(logps * r.completion_mask).sum()
    if not sharded_run:
        loss.backward()
        return r, logps, {n: p.grad.clone() for n, p in m.named_parameters()}
    if strategy == "zero3":
        m.set_gradient_accumulation_boundary(True)
        m.backward(loss, scale_wrt_gas=False)
        grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
    elif strategy == "fsdp1":
        loss.backward()
        with FSDP.summon_full_params(m, with_grads=True):
            grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    else:
        loss.backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    # the processes' gradients are averaged: compare the sum of both
    return r, logps, {n: g * dist.get_world_size() for n, g in grads.items()}


r_ref, lp_ref, g_ref = work(reference, False)
r, lp, g = work(sharded, True)
summed = {n: t.clone() for n, t in g_ref.items()}
for t in summed.values():
    dist.all_reduce(t)  # the unsharded reference's gradients summed over the two processes' batches
with sharding.whole_weights(sharded):
    exported = {name: tensor.clone() for name, tensor in export_weights(sharded)}
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
# the sharded model (its FSDP units, DeepSpeed's engine, the mesh) holds the process group, as DDP does: while it lives,
# destroy_process_group leaves gloo's worker threads running, and one still releasing a collective's tensors at
# interpreter exit aborts the process (SIGABRT, "terminate called without an active exception"); dropped first, the
# group's threads are joined by destroy_process_group (tests/multiproc_prompt_sharing.py does the same for DDP)
del sharded, model, lp, g, r, exported
globals().pop("mesh", None)
gc.collect()
dist.destroy_process_group()
