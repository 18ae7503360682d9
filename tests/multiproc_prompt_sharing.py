"""Run by tests/test_prompt_sharing.py on 2 gloo processes (torch.distributed.run):

    python -m torch.distributed.run --standalone --nproc_per_node 2 multiproc_prompt_sharing.py FIND_UNUSED OUT_DIR

A tiny model wrapped by DDP (buffers broadcast at every forward, DDP's default; find_unused_parameters as given) runs
token_logprobs with share_prompts on each process's own rollouts, three times: where both processes' rollouts repeat
their prompts ("both": rows of 2 prompts with 3 completions each, within the rows' width limit, set to 30 columns
here), where process 1's prompts are all distinct, so it has nothing to share ("one"), and where process 1's 6
rollouts repeat one prompt, whose row would pass the limit ("mixed": process 1 would run two forwards, process 0 one
row). Each time a pass without gradient (as the old-policy pass runs) then one with, and its backward.
OUT_DIR/rank<RANK>.json holds, per case, the layout of each shared pass and the differences from an unwrapped copy of
the model given the same rollouts unshared (log-probs; gradients averaged over the two processes as DDP averages
them)."""

import datetime
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from posttrain.models import logprobs, prefix_rows
from posttrain.models.logprobs import token_logprobs
from posttrain.testing import tiny_model, tiny_tokenizer

find_unused, out = sys.argv[1] == "true", sys.argv[2]
# a collective out of step would otherwise wait for the default 30 minutes
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
logprobs.MIN_SHARED_SAVING_FLOP = 0  # the tiny model saves too few FLOPs for sharing to pay otherwise
prefix_rows.row_width_limit = lambda model: 30  # rows of 2 x 11-12 prompt tokens and 3 x 5 completion tokens pass
shared_calls = []
_through = logprobs._through_shared
logprobs._through_shared = lambda model, shared, *a: shared_calls.append(
    ("grad" if torch.is_grad_enabled() else "no_grad") + (" rows" if shared.in_rows else " two")) or _through(
    model, shared, *a)

tokenizer = tiny_tokenizer()
model, reference = tiny_model(tokenizer, seed=5, hidden=32, layers=2), tiny_model(tokenizer, seed=5, hidden=32,
                                                                                 layers=2)
ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
assert ddp.broadcast_buffers and len(list(model.buffers())) > 0  # the rotary embedding's inv_freq


def rollouts(prompts: list[list[int]], seed: int):
    """Left-padded prompts and random full-length completions of 5 tokens (nothing for packing to remove)."""
    g = torch.Generator().manual_seed(seed)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    completion_ids = torch.randint(3, tokenizer.vocab_size, (len(prompts), 5), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids)


def long_prompt(start: int) -> list[int]:
    return [(start + 7 * i) % 90 + 3 for i in range(9 + start % 4)]


grouped = [long_prompt(rank)] * 3 + [long_prompt(rank + 10)] * 3  # 2 prompts, 3 completions each
distinct = [long_prompt(rank + 20 + i) for i in range(6)]
assert logprobs.prompt_sharing_works(ddp) and logprobs.prefix_rows_work(ddp)  # the one-time checks before counting
results = {}
for case, prompts in (("both", grouped), ("one", grouped if rank == 0 else distinct),
                      ("mixed", grouped if rank == 0 else [long_prompt(rank)] * 6)):
    batch = rollouts(prompts, seed=rank)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    shared_calls.clear()
    with torch.no_grad():
        no_grad_logps, _ = token_logprobs(ddp, *batch, share_prompts=True)
    logps, _ = token_logprobs(ddp, *batch, share_prompts=True)
    (-(logps * torch.arange(1, 6)).sum()).backward()  # a different weight per position: every gradient differs
    expected, _ = token_logprobs(reference, *batch, share_prompts=False)
    (-(expected * torch.arange(1, 6)).sum()).backward()
    averaged = {n: p.grad.clone() for n, p in reference.named_parameters()}
    for g in averaged.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    grads = dict(model.named_parameters())
    results[case] = {
        "shared": shared_calls[:],
        "logps_max_diff": float((logps - expected).detach().abs().max()),
        "no_grad_logps_max_diff": float((no_grad_logps - expected).detach().abs().max()),
        "grad_max_diff": max(float((grads[n].grad - g).abs().max()) for n, g in averaged.items()),
        "grad_max": max(float(g.abs().max()) for g in averaged.values()),
    }
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.barrier()
# DDP holds the process group: while it lives, destroy_process_group leaves gloo's worker threads running, and one
# still releasing a finished collective's tensors at interpreter exit aborts the process (SIGABRT). Dropped first, the
# group goes with destroy_process_group, whose destructor joins those threads while Python can still serve them.
del ddp
gc.collect()
dist.destroy_process_group()
