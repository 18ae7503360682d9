"""Evaluation: sample G completions for every prompt of a dataset and average the rewards."""

import torch

from posttrain.data import PromptSource
from posttrain.grpo.advantages import nanmean, nanstd
from posttrain.rewards import reward_inputs, score


def evaluate_rewards(trainer, dataset) -> dict:
    """eval_reward, eval_reward_std and eval_rewards/<func>/mean over `dataset`, with the trainer's generator."""
    source = PromptSource(dataset, trainer.encoder, 1, shuffle=False, seed=trainer.args.seed)
    G, matrices = trainer.args.num_generations, []
    for _, prompt_round in zip(range(len(dataset)), source.rounds()):
        row, ids = prompt_round.rows[0], prompt_round.prompt_ids[0]
        rollouts = trainer.generator.generate([ids] * G)
        completion_ids, _, completions = reward_inputs(trainer.tokenizer, rollouts, isinstance(row["prompt"], list))
        columns = {c: [row[c]] * G for c in source.columns}
        matrices.append(score(trainer.reward_funcs, [row["prompt"]] * G, completions, completion_ids, columns,
                              trainer.state, trainer.state.global_step,
                              prompt_indices=[prompt_round.indices[0]] * G))
    rewards = torch.cat(matrices)  # [len(dataset) * G, F]
    total = (rewards * trainer.reward_weights).nansum(1)
    out = {"eval_reward": float(nanmean(total)), "eval_reward_std": float(nanstd(total))}
    for k, f in enumerate(trainer.reward_funcs):
        out[f"eval_rewards/{f.name}/mean"] = float(nanmean(rewards[:, k]))
    return out
