"""Run by tests/test_sharding.py on 2 gloo processes (torch.distributed.run):

    python -m torch.distributed.run --standalone --nproc_per_node 2 multiproc_zero3_mix.py OUT_DIR

A reference and a policy partitioned by DeepSpeed ZeRO-3 with its default persistence threshold (the tiny model's
small parameters stay whole between forwards: "persistent"). The reference runs a forward, is mixed toward the
policy (sync_ref_model's update), and runs the same forward again; OUT_DIR/rank<RANK>.json holds how far its
logits are from those of an unsharded model holding the mixed weights, and how many parameters were persistent."""

import gc
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

from posttrain.models.preparation import mix_reference
from posttrain.testing import tiny_model, tiny_tokenizer
from posttrain.training.zero import frozen_engine

out = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
tokenizer = tiny_tokenizer()
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
ref, policy = frozen_engine(tiny_model(tokenizer, seed=3), config), frozen_engine(tiny_model(tokenizer, seed=4), config)
expected, policy_plain = tiny_model(tokenizer, seed=3), tiny_model(tokenizer, seed=4)
ids = torch.tensor([[5, 76, 5, 84, 9, 8]])
with torch.no_grad():
    for _ in range(3):  # once DeepSpeed has traced the module order, persistent parameters stay whole
        ref(input_ids=ids)
    mix_reference(ref, policy, 0.6)
    mixed = ref(input_ids=ids).logits
    policy(input_ids=ids)
    mix_reference(expected, policy_plain, 0.6)
    want = expected(input_ids=ids).logits
result = {"persistent": sum(bool(getattr(p, "ds_persist", False)) for p in ref.module.parameters()),
          "max_diff": float((mixed - want).abs().max()), "max_logit": float(want.abs().max())}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
del ref, policy, mixed  # DeepSpeed's engines hold the process group: dropped before it (tests/multiproc_sharding.py)
gc.collect()
dist.destroy_process_group()
