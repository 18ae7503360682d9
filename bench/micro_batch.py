"""The GRPO-like micro-batch the log-prob micro benchmarks run (onednn_passes_micro.py, prompt_sharing_micro.py,
passes_micro.py): `rows` rollouts, `gens` of each distinct prompt, random token ids in 3 .. 999, every position real."""

import torch


def rollout_batch(rows: int, gens: int, prompt: int, completion: int) -> tuple[tuple, torch.Tensor, int]:
    """((prompt_ids [N, P], prompt_mask [N, P], completion_ids [N, C], completion_mask [N, C]), loss weights [N, C]
    scaled by 1 / (N C), the number of distinct prompts), drawn from torch's global generator in that order."""
    prompt_of_row = torch.arange(rows) // gens
    distinct = int(prompt_of_row.max()) + 1
    prompt_ids = torch.randint(3, 1000, (distinct, prompt))[prompt_of_row]
    completion_ids = torch.randint(3, 1000, (rows, completion))
    batch = (prompt_ids, torch.ones(rows, prompt, dtype=torch.long), completion_ids,
             torch.ones(rows, completion, dtype=torch.long))
    return batch, torch.randn(rows, completion) / (rows * completion), distinct
