"""transformers' override points in every trainer, as a TRL user's subclass uses them: compute_loss (each
micro-batch's loss, which training_step backpropagates), and the DataLoader getters."""

import pytest
import torch
from conftest import capture_gradients
from datasets import Dataset

import posttrain
from posttrain.errors import UserError
from posttrain.testing import tiny_model, tiny_reward_model

TRAINERS = ["SFT", "DPO", "KTO", "Reward", "GRPO", "RLOO", "Distillation"]
PROMPTS = {"prompt": [f"{a}+{b}=" for a in range(2) for b in range(2)]}
PAIRS = {"prompt": ["1+1=", "2+2=", "3+3=", "4+4="], "chosen": ["2", "4", "6", "8"], "rejected": ["3", "5", "7", "9"]}


def _digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _build(kind: str, tokenizer, tmp_path, cls=None):
    """A trainer of `kind` (or its subclass `cls`): one step of two micro-batches of two rows, no clipping, so that
    the gradient is linear in the loss."""
    common = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_grad_norm=0.0, logging_steps=1, save_strategy="no", use_cpu=True, report_to="none", seed=0,
                  gradient_checkpointing=False)
    cls = cls or getattr(posttrain, f"{kind}Trainer")
    config = getattr(posttrain, f"{kind}Config")
    model = tiny_model(tokenizer, hidden=32, layers=1)
    if kind == "SFT":
        data = Dataset.from_dict({"text": [f"{a}+{a}={2 * a}" for a in range(4)]})
        return cls(model, args=config(**common), train_dataset=data, processing_class=tokenizer)
    if kind == "DPO":
        return cls(model, args=config(**common), train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    if kind == "KTO":
        data = {"prompt": PAIRS["prompt"], "completion": PAIRS["chosen"], "label": [True, False, True, False]}
        return cls(model, args=config(**common), train_dataset=Dataset.from_dict(data), processing_class=tokenizer)
    if kind == "Reward":
        return cls(tiny_reward_model(tokenizer, hidden=32, layers=1), args=config(**common),
                   train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    sampling = dict(max_completion_length=4, **({} if kind == "Distillation" else {"num_generations": 2}))
    if kind == "Distillation":
        return cls(model, tiny_model(tokenizer, seed=7, hidden=32, layers=1), args=config(**common, **sampling),
                   train_dataset=Dataset.from_dict(PROMPTS), processing_class=tokenizer)
    return cls(model, _digits, args=config(**common, **sampling), train_dataset=Dataset.from_dict(PROMPTS),
               processing_class=tokenizer)


def _run(kind, tokenizer, tmp_path, cls=None):
    trainer = _build(kind, tokenizer, tmp_path, cls)
    grads = capture_gradients(trainer)
    trainer.train()
    record = next(h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h)
    dense = {n: (g.to_dense() if g.is_sparse else g) for n, g in grads[0].items()}
    return trainer, record["loss"], dense


@pytest.mark.parametrize("kind", TRAINERS)
def test_compute_loss_is_each_micro_batchs_loss_and_an_override_changes_what_trains(kind, tokenizer, tmp_path):
    """A subclass's compute_loss (TRL's signature) is called once per micro-batch with the batch posttrain built and
    num_items_in_batch as documented; what it returns is what is backpropagated and logged: doubling super()'s loss
    doubles the step's gradient and its logged loss. With return_outputs, super() gives (loss, statistics)."""
    calls = []

    class Doubled(getattr(posttrain, f"{kind}Trainer")):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            calls.append((model is self.model, num_items_in_batch, outputs is not None))
            return 2 * loss

    _, loss, grads = _run(kind, tokenizer, tmp_path / "plain")
    trainer, doubled_loss, doubled_grads = _run(kind, tokenizer, tmp_path / "doubled", Doubled)
    assert len(calls) == 2 and all(own and outputs for own, _, outputs in calls)
    assert calls[0][1] == calls[1][1] > 0  # the step's count, the same for both micro-batches
    assert doubled_loss == pytest.approx(2 * loss, rel=1e-5)
    assert grads.keys() == doubled_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(doubled_grads[name], 2 * grad, rtol=1e-4, atol=1e-7), name


def test_num_items_in_batch_is_what_the_step_is_normalised_over(tokenizer, tmp_path):
    """SFT passes the step's target tokens (transformers' count of labelled tokens), DPO the step's pairs."""
    seen = {}

    def recording(kind):
        class Recording(getattr(posttrain, f"{kind}Trainer")):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                seen.setdefault(kind, []).append((num_items_in_batch, inputs))
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return Recording

    for kind in ("SFT", "DPO"):
        _build(kind, tokenizer, tmp_path / kind, recording(kind)).train()
    assert {n for n, _ in seen["SFT"]} == {sum(batch.num_targets for _, batch in seen["SFT"])}
    assert {n for n, _ in seen["DPO"]} == {4}


def test_a_compute_loss_that_does_not_train_as_posttrain_trains_is_one_sentence(tokenizer, tmp_path):
    class Detached(posttrain.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs).detach()

    class Own(posttrain.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return sum(p.sum() for p in model.parameters()) * 0.0

    with pytest.raises(UserError, match=r"^Detached\.compute_loss returned Tensor without a gradient, where the "
                                        r"micro-batch's loss is a tensor connected to the model's parameters"):
        _build("SFT", tokenizer, tmp_path / "a", Detached).train()
    with pytest.raises(UserError, match=r"^Own\.compute_loss returned without calling super\(\)\.compute_loss\(\.\.\.\)"):
        _build("SFT", tokenizer, tmp_path / "b", Own).train()


def _same(a, b) -> bool:
    """Whether two collated batches (dataclasses of tensors, possibly nested) hold the same values; KTO's `ref`, the
    reference's log-probs the step itself computes onto its batches, aside."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if hasattr(a, "__dict__"):  # a batch class, a dataclass or not
        return type(a) is type(b) and all(_same(value, getattr(b, f)) for f, value in vars(a).items() if f != "ref")
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["SFT", "DPO", "KTO", "Reward"])
def test_the_train_dataloader_gives_the_micro_batches_training_step_receives(kind, tokenizer, tmp_path):
    """get_train_dataloader(): one epoch of this process's micro-batches, the objects training_step receives, in
    training's order; len() their number; reading it does not move the run (TRL users inspect it, or loop over it)."""
    received = []

    class Recording(getattr(posttrain, f"{kind}Trainer")):
        def training_step(self, model, inputs, num_items_in_batch=None):
            received.append(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = _build(kind, tokenizer, tmp_path, Recording)
    loader = trainer.get_train_dataloader()
    batches = list(loader)
    assert len(loader) == len(batches) == 2 and list(loader) and _same(list(loader), batches)  # read again afresh
    trainer.train()  # one step of two micro-batches: the epoch
    assert _same([batch.to("cpu") if hasattr(batch, "to") else batch for batch in received], batches)
    evaluated = list(trainer.get_eval_dataloader(trainer._train_source))
    assert evaluated and all(type(batch) is type(batches[0]) for batch in evaluated)


@pytest.mark.parametrize("kind", ["GRPO", "RLOO", "Distillation"])
def test_the_train_dataloader_gives_the_prompts_of_the_rounds_in_trls_repeated_order(kind, tokenizer, tmp_path):
    """GRPO's family: lists of rows, one generation batch's prompts each repeated num_generations times in a row
    (TRL's RepeatSampler order), the rounds training draws; for evaluation, every eval prompt once."""
    seen = []

    def recording(completions, prompts, **kwargs):
        seen.extend(prompts)
        return _digits(completions)

    trainer = _build(kind, tokenizer, tmp_path)
    loader = trainer.get_train_dataloader()
    rounds = list(loader)
    repeat = 1 if kind == "Distillation" else 2
    assert len(loader) == len(rounds) and all(len(r) == trainer.args.prompts_per_generation * repeat for r in rounds)
    assert all(r[i]["prompt"] == r[i - i % repeat]["prompt"] for r in rounds for i in range(len(r)))
    assert sorted(row["prompt"] for r in rounds for row in r[::repeat]) == sorted(PROMPTS["prompt"])
    if kind != "Distillation":  # the prompts the first round's rewards are computed on
        trainer.reward_funcs[0].fn = recording
        trainer.train()
        assert seen[:len(rounds[0])] == [row["prompt"] for row in rounds[0]]
    evaluated = [row["prompt"] for r in trainer.get_eval_dataloader(Dataset.from_dict(PROMPTS)) for row in r]
    assert evaluated == [p for p in PROMPTS["prompt"] for _ in range(repeat)]


def test_the_eval_dataloader_of_a_dict_of_datasets_is_named(tokenizer, tmp_path):
    trainer = _build("SFT", tokenizer, tmp_path)
    with pytest.raises(UserError, match=r"^SFTTrainer has no eval_dataset: pass one to get_eval_dataloader\.$"):
        trainer.get_eval_dataloader()
    data = Dataset.from_dict({"text": ["1+1=2", "2+2=4", "3+3=6"]})
    trainer.eval_dataset = {"a": data, "b": data}
    with pytest.raises(UserError, match=r"^eval_dataset is a dict of datasets \(a, b\): pass the name of one"):
        trainer.get_eval_dataloader()
    assert sum(len(batch.input_ids) for batch in trainer.get_eval_dataloader("b")) == 3
