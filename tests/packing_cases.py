"""Each trainer's packed or padding-free batch against its sequences run alone: the largest |difference| of the
per-token log-probs (the reward model's scores) between the trainer's own batch, as it collates and runs it, and each
sequence through the model's own forward by itself, [1, L] with no mask. Used by tests/test_packed_layouts.py and by
bench/packing_table.py (the per-architecture table in docs/packing.md)."""

import torch
from datasets import Dataset

from posttrain import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RewardConfig,
                       RewardTrainer, SFTConfig, SFTTrainer)
from posttrain.generation.protocol import Rollouts
from posttrain.models.logprobs import next_token_logprobs

# texts of 6 to 31 characters (one token each): packed rows of 64 hold two to five of them
TEXTS = [("The quick brown fox jumps over"[:n]) for n in (6, 19, 11, 27, 8, 23, 14, 31, 9, 16, 12, 25)]
PROMPTS = ["ab", "Say hi", "12+30=", "x", "hello w", "The"]
ANSWERS = [" one", " two words", " three more words", " 4", " five", " sixty six"]


def _common(tmp_path, **fields) -> dict:
    return dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0, report_to="none", **fields)


def _log_softmax_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[L - 1] log-probs of ids[1:] from [L, V] logits."""
    return logits[:-1].float().log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def _sequences(batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sequence of a collated batch (sequences/collate.py SequenceBatch), in order."""
    spans = []
    for r in range(batch.input_ids.size(0)):
        if batch.attention_mask is not None:  # padded: a row is one sequence, its real tokens first
            spans.append((r, 0, int(batch.attention_mask[r].sum())))
            continue
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [batch.input_ids.size(1)]
        spans += [(r, a, b) for a, b in zip(starts, starts[1:])]
    return spans


def alone_target_logps(model, batch) -> torch.Tensor:
    """[M] the batch's target log-probs, each sequence run alone through the model's own forward."""
    pieces = []
    for r, a, b in _sequences(batch):
        ids = batch.input_ids[r, a:b]
        logps = _log_softmax_at(model(input_ids=ids[None]).logits[0], ids)
        pieces.append(logps[batch.source_mask[r, a:b - 1]])
    return torch.cat(pieces)


def batch_target_logps(model, batch) -> torch.Tensor:
    """[M] the target log-probs of the trainers' pass over a collated batch (models/logprobs.py)."""
    return next_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.source_mask,
                               batch.targets, boundaries=batch.boundaries)[0]


def sequences_per_row(batch) -> int:
    """The most sequences a row of the batch holds (1: padded)."""
    spans = _sequences(batch)
    return max(sum(1 for r, _, _ in spans if r == row) for row in range(batch.input_ids.size(0)))


def _gap(model, batch) -> float:
    return float((batch_target_logps(model, batch) - alone_target_logps(model, batch)).abs().max())


def sft_case(model, tokenizer, tmp_path) -> tuple[float, int]:
    """(gap, sequences per row) of SFT's first micro-batch with packing=True."""
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_dict({"text": TEXTS}),
                         args=SFTConfig(**_common(tmp_path, packing=True, max_length=64)))
    batch = trainer._collate(trainer.batches.next_step()[0], trainer.padding_free)
    with torch.no_grad():
        return _gap(trainer.model, batch), sequences_per_row(batch)


def dpo_case(model, tokenizer, tmp_path) -> tuple[float, int]:
    """(gap of the policy's and the reference's target log-probs, sequences per row) of DPO's first micro-batch with
    padding_free=True."""
    data = Dataset.from_dict({"prompt": PROMPTS, "chosen": ANSWERS, "rejected": ANSWERS[::-1]})
    trainer = DPOTrainer(model=model, processing_class=tokenizer, train_dataset=data,
                         args=DPOConfig(**_common(tmp_path, padding_free=True, max_length=32)))
    batch = trainer._collate(trainer.batches.next_step()[0])
    with torch.no_grad():
        gap = max(_gap(m, batch.sequences) for m in (trainer.model, trainer.ref_model))
    return gap, sequences_per_row(batch.sequences)


def kto_case(model, tokenizer, tmp_path) -> tuple[float, int]:
    """(gap over the examples' and their KL pairs' target log-probs, sequences per row) of KTO's first micro-batch
    (KTO's rows are always padded, as TRL's)."""
    data = Dataset.from_dict({"prompt": PROMPTS, "completion": ANSWERS, "label": [True, False] * 3})
    trainer = KTOTrainer(model=model, processing_class=tokenizer, train_dataset=data,
                         args=KTOConfig(**_common(tmp_path, max_length=32)))
    shares = trainer.batches.next_step()
    batch = trainer._collate(shares[0], trainer.batches.step_predecessors()[0])
    with torch.no_grad():
        return max(_gap(trainer.model, batch.examples), _gap(trainer.model, batch.kl)), \
            sequences_per_row(batch.examples)


def reward_case(classifier, tokenizer, tmp_path) -> tuple[float, int]:
    """(gap of the scores, sequences per row) of the reward trainer's first micro-batch with padding_free=True."""
    data = Dataset.from_dict({"chosen": [p + a for p, a in zip(PROMPTS, ANSWERS)],
                              "rejected": [p + a for p, a in zip(PROMPTS, ANSWERS[::-1])]})
    trainer = RewardTrainer(model=classifier, processing_class=tokenizer, train_dataset=data,
                            args=RewardConfig(**_common(tmp_path, padding_free=True, max_length=32)))
    batch = trainer._collate(trainer.batches.next_step()[0])
    with torch.no_grad():
        scores = trainer._scores(trainer.model, batch)
        alone = torch.stack([trainer.model(input_ids=batch.sequences.input_ids[r, a:b][None]).logits[0, 0]
                             for r, a, b in _sequences(batch.sequences)])
    return float((scores - alone.float()).abs().max()), sequences_per_row(batch.sequences)


def grpo_case(model, tokenizer, tmp_path) -> tuple[float, int]:
    """(gap of the policy's and the reference's completion log-probs, sequences per row) of GRPO's log-prob pass
    over six rollouts of natural lengths (prompts of 1 to 7 tokens, completions of 1 to 17)."""
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=lambda completions, **kw: [0.0] *
                          len(completions), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          args=GRPOConfig(**_common(tmp_path, num_generations=2, beta=0.04,
                                                    max_completion_length=17)))
    rollouts = _rollouts([3, 7, 1, 5, 2, 6], [17, 2, 9, 5, 1, 12], len(tokenizer))
    with torch.no_grad():
        for m in (trainer.model, trainer.ref_model):
            trainer.rollout.policy_logps(m, rollouts)  # the one-time checks' forwards, before the hook below
    rows = []
    hook = trainer.policy.get_input_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].size(0)))
    with torch.no_grad():
        gaps = [_rollout_gap(trainer, m, rollouts) for m in (trainer.model, trainer.ref_model)]
    hook.remove()
    return max(gaps), -(-len(rollouts.prompt_ids) // rows[0])


def random_rollouts(prompt_lengths, completion_lengths, prompt_width, completion_width, vocab, seed=0):
    """Left-padded prompts and right-padded completions of these lengths, random tokens (pad id 0): ([N, P] ids, [N, P]
    mask, [N, C] ids, [N, C] mask), masks long."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lengths)
    prompt_ids = torch.zeros((n, prompt_width), dtype=torch.long)
    prompt_mask = torch.zeros((n, prompt_width), dtype=torch.long)
    completion_ids = torch.zeros((n, completion_width), dtype=torch.long)
    completion_mask = torch.zeros((n, completion_width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_ids[i, prompt_width - p:] = torch.randint(1, vocab, (p,), generator=g)
        prompt_mask[i, prompt_width - p:] = 1
        completion_ids[i, :c] = torch.randint(1, vocab, (c,), generator=g)
        completion_mask[i, :c] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _rollouts(prompt_lengths, completion_lengths, vocab) -> Rollouts:
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_rollouts(
        prompt_lengths, completion_lengths, max(prompt_lengths), max(completion_lengths), vocab)
    completion_mask = completion_mask.bool()
    return Rollouts(prompt_ids, prompt_mask.bool(), completion_ids, completion_mask, completion_mask.any(1),
                    torch.zeros(completion_ids.shape))


def _rollout_gap(trainer, model, rollouts: Rollouts) -> float:
    logps, _ = trainer.rollout.policy_logps(model, rollouts)
    gap = 0.0
    for i in range(len(rollouts.prompt_ids)):
        ids = torch.cat([rollouts.prompt_ids[i][rollouts.prompt_mask[i]],
                         rollouts.completion_ids[i][rollouts.completion_mask[i]]])
        p, c = int(rollouts.prompt_mask[i].sum()), int(rollouts.completion_mask[i].sum())
        alone = _log_softmax_at(model(input_ids=ids[None]).logits[0] / trainer.args.temperature, ids)[p - 1:]
        gap = max(gap, float((logps[i, :c] - alone).abs().max()))
    return gap


CASES = {"SFT": sft_case, "DPO": dpo_case, "KTO": kto_case, "Reward": reward_case, "GRPO": grpo_case}
