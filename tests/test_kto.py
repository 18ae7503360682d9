"""KTO so far (issue 36): its data preparation (posttrain/kto/data.py) and its losses (kto/losses.py) against TRL
1.16's own code. KTOTrainer._prepare_dataset called on the same rows with the same tokenizer gives the same
prompt_ids, completion_ids and labels, in the same order, for every format; the rows a long prompt drops; the errors a
user can cause; TRL's class-balance advice. KTOTrainer._compute_loss called on the same log-probs gives the same loss,
gradient, KL estimate and rewards, for both loss types."""

import copy
import types

import numpy as np
import pytest
from datasets import Dataset

from posttrain.data import DataError
from posttrain.kto.data import KTOEncoder, balance_advice, kl_completions, prepare_unpaired

PROMPTS = [f"{a}+{b * 11}=" for a in range(3) for b in range(3)]  # of 4 and 5 tokens
UNPAIRED = {"prompt": PROMPTS, "completion": [str(i) * (1 + i % 3) for i in range(9)],
            "label": [i % 3 != 0 for i in range(9)]}
PAIRED = {"prompt": PROMPTS, "chosen": [str(i) for i in range(9)], "rejected": [str(i + 1) + "x" * (i % 2)
                                                                                 for i in range(9)]}


def _conversational(columns: dict) -> dict:
    out = {"prompt": [[{"role": "user", "content": p}] for p in columns["prompt"]]}
    for name in ("completion", "chosen", "rejected"):
        if name in columns:
            out[name] = [[{"role": "assistant", "content": t}] for t in columns[name]]
    if "label" in columns:
        out["label"] = columns["label"]
    return out


def _implicit(columns: dict) -> dict:
    return {c: [p + t for p, t in zip(columns["prompt"], columns[c])] for c in ("chosen", "rejected")}


def _trls(tokenizer, columns: dict, max_length=None) -> list[tuple]:
    """TRL's KTOTrainer._prepare_dataset on the rows, called with a stand-in for the trainer (the attributes the
    method reads; the KL completions are not asked for: posttrain pairs them per micro-batch)."""
    trl = pytest.importorskip("trl")
    stand_in = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False, desirable_weight=1.0,
                                     undesirable_weight=1.0)
    args = trl.KTOConfig(output_dir="unused", max_length=max_length, report_to="none", use_cpu=True, bf16=False)
    prepared = trl.KTOTrainer._prepare_dataset(stand_in, Dataset.from_dict(columns), tokenizer, args, "eval")
    return [(list(r["prompt_ids"]), list(r["completion_ids"]), bool(r["label"])) for r in prepared]


def _ours(tokenizer, columns: dict, max_length=None, block: int = 1000) -> list[tuple]:
    dataset = Dataset.from_dict(columns)
    examples = prepare_unpaired(dataset, KTOEncoder(tokenizer, dataset[0]), max_length, block=block)
    rows = examples.rows
    out = []
    for i in range(len(examples)):
        tokens, labels = rows.tokens[rows.row(i)], rows.labels[rows.row(i)]
        out.append((tokens[~labels].tolist(), tokens[labels].tolist(), bool(examples.desirable[i])))
    return out


@pytest.mark.parametrize("fmt", ["unpaired", "unpaired_conversational", "paired", "paired_implicit",
                                 "paired_conversational", "max_length"])
def test_prepared_examples_equal_trls(tokenizer, fmt):
    columns = {"unpaired": UNPAIRED, "unpaired_conversational": _conversational(UNPAIRED), "paired": PAIRED,
               "paired_implicit": _implicit(PAIRED), "paired_conversational": _conversational(PAIRED),
               "max_length": UNPAIRED}[fmt]
    max_length = 5 if fmt == "max_length" else None  # prompts of 4 and 5 tokens: those of 5 are dropped
    theirs, ours = _trls(tokenizer, columns, max_length), _ours(tokenizer, columns, max_length)
    assert ours == theirs
    if fmt == "max_length":
        assert 0 < len(ours) < len(UNPAIRED["label"])
    if fmt.startswith("paired"):  # chosen completions first, then the rejected ones, as TRL unpairs a map batch
        assert [label for _, _, label in ours] == [True] * 9 + [False] * 9


@pytest.mark.parametrize("batch_size", [4, 9, 1])
def test_the_kl_completions_are_trls(tokenizer, batch_size):
    """TRL pairs each prompt with the completion before it in its block of per_device_train_batch_size examples
    (the first with the block's last): its KL_completion_ids against ours, the last block short (9 = 4 + 4 + 1), where
    posttrain differs by design for an example alone in its block."""
    trl = pytest.importorskip("trl")
    stand_in = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=True, desirable_weight=1.0,
                                     undesirable_weight=1.0)
    args = trl.KTOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False,
                         per_device_train_batch_size=batch_size)
    prepared = trl.KTOTrainer._prepare_dataset(stand_in, Dataset.from_dict(UNPAIRED), tokenizer, args, "eval")
    dataset = Dataset.from_dict(UNPAIRED)
    examples = prepare_unpaired(dataset, KTOEncoder(tokenizer, dataset[0]), None)
    rows = kl_completions(examples, batch_size)
    n = len(prepared)
    for i, expected in enumerate(prepared):
        tokens, labels = rows.tokens[rows.row(i)], rows.labels[rows.row(i)]
        assert tokens[~labels].tolist() == expected["prompt_ids"]
        if batch_size == 1 or (i == n - 1 and n % batch_size == 1):
            # by design: an example alone in its block is paired in TRL with its own completion (KL's reference
            # point is then the policy itself); in posttrain with the example before it
            assert expected["KL_completion_ids"] == expected["completion_ids"]
            assert tokens[labels].tolist() == prepared[(i - 1) % n]["completion_ids"], i
        else:
            assert tokens[labels].tolist() == expected["KL_completion_ids"], i


def test_pairs_unpair_a_block_at_a_time_with_their_dataset_index(tokenizer):
    """Blocks of 4 pairs: each block's chosen completions, then its rejected ones; the index is the row in the
    unpaired dataset (TRL's map batches are 1000 pairs: the order within a block is TRL's)."""
    dataset = Dataset.from_dict(PAIRED)
    examples = prepare_unpaired(dataset, KTOEncoder(tokenizer, dataset[0]), None, block=4)
    assert examples.index.tolist() == list(range(18))
    assert examples.desirable.tolist() == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4 + [True, False]


def test_the_eos_is_appended_once_and_the_rows_label_their_completion(tokenizer):
    eos = tokenizer.eos_token
    columns = {"prompt": ["1+1=", "2+2="], "completion": ["2", "4" + eos], "label": [True, False]}
    ours = _ours(tokenizer, columns)
    assert all(completion[-1] == tokenizer.eos_token_id for _, completion, _ in ours)
    assert all(tokenizer.eos_token_id not in completion[:-1] for _, completion, _ in ours)


@pytest.mark.parametrize("columns, message", [
    ({"prompt": ["a"], "completion": ["b"]}, "KTO needs prompt + completion + label"),
    ({"prompt": ["a"], "chosen": ["b"]}, "it has no 'rejected' column"),
    ({"prompt": ["a", "b"], "completion": ["c", "d"], "label": [True, 2]}, "Row 1 of train_dataset has label 2"),
    ({"prompt": ["a", "b"], "completion": ["c", ["d"]], "label": [True, False]}, "every row must be in the same"),
])
def test_bad_rows_are_one_sentence(tokenizer, columns, message):
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    with pytest.raises(DataError) as err:
        encoder = KTOEncoder(tokenizer, rows[0])
        encoder.encode(rows, 0)
    assert message in str(err.value) and str(err.value).count(". ") == 0


def test_a_prompt_that_fills_max_length_everywhere_is_one_sentence(tokenizer):
    with pytest.raises(DataError, match="has no example left: the prompt of every one of its 9 examples"):
        _ours(tokenizer, UNPAIRED, max_length=2)


def test_the_class_balance_advice_is_trls():
    """TRL 1.16 warns when the classes differ in size and neither weight is in Eq. (8)'s range: the same ranges."""
    assert balance_advice(10, 10, 1.0, 1.0) is None
    assert balance_advice(30, 10, 1.0, 1.0) == (
        "The data has 30 desirable and 10 undesirable examples, and neither weight is in the range the KTO paper "
        "recommends for that balance: set desirable_weight in [0.33, 0.44] or undesirable_weight in [2.26, 3.0] "
        "(not both).")
    assert balance_advice(30, 10, 0.4, 1.0) is None and balance_advice(30, 10, 1.0, 2.5) is None


def test_a_missing_class_is_said_as_missing():
    """Every label True (or False): no weight makes up for the class that is not there (TRL's advice counts it as 1)."""
    assert balance_advice(12, 0, 1.0, 1.0) == (
        "The data has 12 desirable examples and no undesirable one: KTO learns from both kinds, and no weight makes up "
        "for one that is missing; add undesirable examples (label False).")
    assert balance_advice(0, 3, 1.0, 1.0).endswith("add desirable examples (label True).")


@pytest.mark.parametrize("n, size, accumulation", [(5, 2, 1), (3, 2, 1), (7, 2, 3), (1, 1, 1)])
def test_each_example_gets_another_for_its_kl_reference_point(n, size, accumulation):
    """An example's KL completion is the one before it in its optimizer step; a step of one example (an epoch's last,
    alone) takes the example before it in the epoch, never its own completion (which holds KL's reference point at
    the policy itself: loss 0.5 for ever)."""
    from posttrain.sequences.batches import predecessor_positions
    from posttrain.sequences.rows import EpochPlan

    plan = EpochPlan(np.ones(n, dtype=np.int64), size, num_processes=1, accumulation=accumulation)
    before = predecessor_positions(plan, n)
    assert (before != np.arange(n)).all() or n == 1
    for step in range(-(-n // (size * accumulation))):
        first, end = step * size * accumulation, min((step + 1) * size * accumulation, n)
        if end - first > 1:  # within its step, rotated by one (TRL's shift)
            assert sorted(before[first:end]) == list(range(first, end))


def test_the_tokenizer_is_not_changed(tokenizer):
    before = copy.deepcopy(tokenizer)
    _ours(tokenizer, _conversational(UNPAIRED))
    assert tokenizer.get_vocab() == before.get_vocab() and np.array_equal(
        tokenizer("1+1=2")["input_ids"], before("1+1=2")["input_ids"])


# ---------------------------------------------------------------------- the loss against TRL's own


def _trl_loss(policy_logps, ref_logps, labels, kl_logps, ref_kl_logps, **options):
    """TRL 1.16's KTOTrainer._compute_loss on these log-probs: a stand-in trainer (the attributes the method reads,
    reference log-probs precomputed, its KL log-probs given) and a stand-in model whose per-token log-probs sum to
    `policy_logps`. Returns (loss, TRL's logged metrics)."""
    import collections

    import torch
    trl = pytest.importorskip("trl")
    n = len(labels)

    class Model(torch.nn.Module):
        def forward(self, **kwargs):
            per_token = torch.zeros(n, 3).index_put((torch.arange(n), torch.zeros(n, dtype=torch.long)), policy_logps)
            return types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros(n, 3), mean_logits=torch.zeros(n, 3))

    model = Model().train()
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    stand_in = types.SimpleNamespace(model=model, accelerator=accelerator, calculate_KL=True, precompute_ref_logps=True,
                                     aux_loss_enabled=False, _metrics={"train": collections.defaultdict(list)},
                                     _total_train_tokens=0, _tp_size=1, **options)
    stand_in._compute_kl_logps = lambda model, batch: kl_logps
    ones = torch.ones(n, 4, dtype=torch.long)
    batch = {"label": torch.tensor(labels), "input_ids": ones, "attention_mask": ones, "completion_mask": ones,
             "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    loss = trl.KTOTrainer._compute_loss(stand_in, model, batch, return_outputs=False)
    return loss, {k: v[-1] for k, v in stand_in._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.3, 0.7)])
@pytest.mark.parametrize("kl_shift", [0.4, -3.0])  # a positive KL estimate, and a negative one (clamped at 0)
@pytest.mark.parametrize("labels", [[True, False, True, True, False], [True, True, True]])
def test_the_loss_and_its_gradient_equal_trls(loss_type, weights, kl_shift, labels):
    import torch

    from posttrain.kto.losses import example_losses, kl_reference_point

    g = torch.Generator().manual_seed(len(labels))
    n = len(labels)
    ref = -5 - torch.rand(n, generator=g) * 3
    policy = (ref + torch.randn(n, generator=g)).requires_grad_()
    ref_kl = -6 - torch.rand(n, generator=g)
    kl_logps = ref_kl + kl_shift + 0.1 * torch.randn(n, generator=g)
    options = dict(loss_type=loss_type, beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    theirs, metrics = _trl_loss(policy, ref, labels, kl_logps, ref_kl, **options)
    (their_grad,) = torch.autograd.grad(theirs, policy)

    kl = kl_reference_point((kl_logps - ref_kl).sum(), torch.tensor(float(n)))
    desirable = torch.tensor(labels)
    losses, rewards = example_losses(policy, ref, desirable, kl, **options)
    ours = losses.mean()
    (our_grad,) = torch.autograd.grad(ours, policy)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert torch.allclose(our_grad, their_grad, rtol=1e-5, atol=1e-8)
    assert float(kl) == pytest.approx(metrics["kl"], rel=1e-6, abs=1e-7)
    assert float(rewards[desirable].mean()) == pytest.approx(metrics["rewards/chosen"], rel=1e-5)
    if not all(labels):
        assert float(rewards[~desirable].mean()) == pytest.approx(metrics["rewards/rejected"], rel=1e-5)
        assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"])
