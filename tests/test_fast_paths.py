"""The fast-path decisions live beside the model, not on it, and `fast_paths: false` turns every one off: the plain
forward with whole logits, padded rows, the model's own decode forward; the numbers agree with the fast paths'."""

import gc
import weakref

import pytest
import torch
from datasets import Dataset
from test_sft_trainer import TEXTS, sft_config

from posttrain.generation import lean_decoder
from posttrain.models import fast_paths, token_logprobs
from posttrain.models.chunked_check import fast_path_available
from posttrain.models.packed_layouts import packed_layouts
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model


def test_decisions_are_kept_beside_the_model_and_go_with_it(tokenizer):
    model = tiny_model(tokenizer, hidden=32, layers=1)
    assert fast_path_available(model) and packed_layouts(model).rows and lean_decoder.supports(model)
    assert not [name for name in vars(model) if name.startswith("_posttrain")]  # nothing written onto the model
    assert model in fast_paths._DECISIONS
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None  # the registry does not keep a model alive: its entry goes with it


def test_turned_off_every_decision_is_no_and_the_log_probs_agree(tokenizer):
    fast, plain = tiny_model(tokenizer, hidden=32, layers=2), tiny_model(tokenizer, hidden=32, layers=2)
    fast_paths.turn_off(plain)
    assert not (fast_path_available(plain) or packed_layouts(plain).one_row or lean_decoder.supports(plain))
    assert fast_path_available(fast) and packed_layouts(fast).rows
    torch.manual_seed(0)
    prompt_ids, completion_ids = torch.randint(5, 90, (4, 6)), torch.randint(5, 90, (4, 7))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0
    completion_mask[2, 5:] = 0
    with torch.no_grad():
        a, ea = token_logprobs(fast, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, with_entropy=True)
        b, eb = token_logprobs(plain, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7,
                               with_entropy=True)
    real = completion_mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-5) and torch.allclose(ea[real], eb[real], atol=1e-5)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_trains_the_same_with_the_fast_paths_off(tokenizer, tmp_path, packing):
    runs = {}
    for on in (True, False):
        trainer = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1),
                             args=sft_config(tmp_path / str(on), fast_paths=on, packing=packing, max_length=24),
                             train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer)
        trainer.train()
        assert fast_path_available(trainer.model) is on
        runs[on] = ([h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h],
                    {n: p.detach() for n, p in trainer.policy.named_parameters()})
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    for name, value in runs[True][1].items():
        assert torch.allclose(value, runs[False][1][name], atol=1e-5), name


def test_grpo_runs_with_the_fast_paths_off(tokenizer, addition_dataset, tmp_path):
    import math

    from conftest import length_reward, tiny_config

    from posttrain.grpo.trainer import GRPOTrainer

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                          tiny_config(tmp_path, max_steps=1, fast_paths=False), train_dataset=addition_dataset,
                          processing_class=tokenizer)
    trainer.train()
    assert not lean_decoder.supports(trainer.policy) and not fast_path_available(trainer.model)
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_a_reference_copied_from_the_policy_shares_its_decisions_and_trains_the_same(tokenizer, addition_dataset,
                                                                                      tmp_path, monkeypatch):
    """beta > 0 on one process: the reference, a deep copy of the policy, takes the policy's fast-path decisions (one
    entry for both), so each check runs once, not once a model; the run's losses and KL are those of a run whose
    reference decides apart."""
    from conftest import length_reward, tiny_config

    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.models import chunked_check
    from posttrain.models.keywords import unwrap

    checked = []
    decide = chunked_check._decide_fast_path
    monkeypatch.setattr(chunked_check, "_decide_fast_path", lambda model: checked.append(model) or decide(model))
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(fast_paths, "share_with_source", lambda model: False)
        checked.clear()
        torch.manual_seed(0)
        trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                              tiny_config(tmp_path / str(shared), max_steps=2, beta=0.1),
                              train_dataset=addition_dataset, processing_class=tokenizer)
        trainer.train()
        same = fast_paths._entry(trainer.ref_model) is fast_paths._entry(trainer.policy)
        assert same is shared and unwrap(trainer.ref_model) is not unwrap(trainer.policy)
        assert len(checked) == (1 if shared else 2)
        logged = [h for h in trainer.state.log_history if "kl" in h and "loss" in h]
        runs[shared] = [h[key] for h in logged for key in ("loss", "kl")]
    assert len(runs[True]) == 4 and runs[True][-1] > 0  # the second step's KL: the policy moved from the reference
    assert runs[True] == pytest.approx(runs[False], rel=1e-6)
