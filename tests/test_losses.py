import math

import pytest
import torch

from posttrain.grpo.losses import LOSSES, LossInputs, LossParams, StepNormalizer, get_loss, k3_kl


def _inputs(logps, old=None, ref=None, adv=(1.0,), mask=None):
    logps = torch.tensor(logps, requires_grad=True)
    mask = torch.ones_like(logps, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return LossInputs(logps=logps, old_logps=None if old is None else torch.tensor(old),
                      ref_logps=None if ref is None else torch.tensor(ref), advantages=torch.tensor(adv), mask=mask)


NORM = StepNormalizer(sequences=1, tokens=2.0, tokens_per_process=2.0)


def test_on_policy_grpo_loss_is_minus_advantage():
    # ratio 1 -> loss per token = -A; grpo: mean over tokens, / 1 sequence
    out = get_loss("grpo")(_inputs([[-1.0, -2.0]], adv=(0.5,)), LossParams(), NORM)
    assert math.isclose(out.loss.item(), -0.5, rel_tol=1e-6)


def test_clipping_hand_worked():
    # log-ratio log(1.5) for token 1 (A>0): clipped at 1.2 -> -1.2; log-ratio log(0.5) for token 2: -min(0.5, 0.8) = -0.5
    out = get_loss("bnpo")(_inputs([[math.log(1.5), math.log(0.5)]], old=[[0.0, 0.0]]), LossParams(), NORM)
    assert math.isclose(out.loss.item(), (-1.2 - 0.5) / 2, rel_tol=1e-5)
    assert float(out.stats["clip_high"]) == 1.0


def test_negative_advantage_and_delta_two_sided_clip():
    # A = -1, ratio 5: -min(5*-1, 1.2*-1) = 5; with delta=3 the ratio is capped: 3
    inp = _inputs([[math.log(5.0)]], old=[[0.0]], adv=(-1.0,))
    norm = StepNormalizer(1, 1.0, 1.0)
    assert math.isclose(get_loss("dapo")(inp, LossParams(), norm).loss.item(), 5.0, rel_tol=1e-5)
    assert math.isclose(get_loss("dapo")(inp, LossParams(delta=3.0), norm).loss.item(), 3.0, rel_tol=1e-5)


def test_normalisers_differ_as_defined():
    # two sequences, lengths 1 and 3, all per-token losses -A = -1
    inp = _inputs([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], adv=(1.0, 1.0), mask=[[True, False, False], [True, True, True]])
    norm = StepNormalizer(sequences=2, tokens=4.0, tokens_per_process=4.0)
    p = LossParams(max_completion_length=5)
    assert get_loss("grpo")(inp, p, norm).loss.item() == pytest.approx(-1.0)          # (1 + 1) / 2
    assert get_loss("bnpo")(inp, p, norm).loss.item() == pytest.approx(-1.0)          # 4 / 4
    assert get_loss("dr_grpo")(inp, p, norm).loss.item() == pytest.approx(-0.4)       # 4 / (2 * 5)
    half = StepNormalizer(sequences=2, tokens=4.0, tokens_per_process=8.0)         # other process had more tokens
    assert get_loss("dapo")(inp, p, half).loss.item() == pytest.approx(-0.5)          # 4 / 8


def test_sequence_level_ratio_gspo():
    # token log-ratios 0.2 and 0.0 -> sequence ratio exp(0.1) for both tokens
    inp = _inputs([[0.2, 0.0]], old=[[0.0, 0.0]], adv=(1.0,))
    out = get_loss("grpo")(inp, LossParams(importance_sampling_level="sequence"), NORM)
    assert math.isclose(out.loss.item(), -math.exp(0.1), rel_tol=1e-5)


def test_cispo_weight_detached_and_capped():
    # ratio exp(2) > eps_high=5? no: exp(2)=7.39 -> weight capped at 5; loss = -5 * A * logp
    inp = _inputs([[2.0]], old=[[0.0]], adv=(1.0,))
    out = get_loss("cispo")(inp, LossParams(epsilon_high=5.0), StepNormalizer(1, 1.0, 1.0))
    assert math.isclose(out.loss.item(), -10.0, rel_tol=1e-5)
    out.loss.backward()
    assert math.isclose(float(inp.logps.grad), -5.0, rel_tol=1e-5)  # gradient flows through logp only


def test_k3_kl_and_beta():
    inp = _inputs([[-1.0]], ref=[[-2.0]], adv=(0.0,))
    kl = float(k3_kl(inp).detach())
    assert math.isclose(kl, math.exp(-1) + 1 - 1, rel_tol=1e-6)  # exp(ref-logp) - (ref-logp) - 1
    out = get_loss("dapo")(inp, LossParams(beta=0.1), StepNormalizer(1, 1.0, 1.0))
    assert math.isclose(out.loss.item(), 0.1 * kl, rel_tol=1e-5)


def test_entropy_mask_drops_policy_term_only():
    base = _inputs([[-1.0, -1.0]], ref=[[-2.0, -2.0]], adv=(1.0,))
    masked = LossInputs(**{**base.__dict__, "entropy_mask": torch.tensor([[True, False]])})
    out = get_loss("bnpo")(masked, LossParams(beta=1.0), NORM)
    kl = math.exp(-1)
    assert math.isclose(out.loss.item(), (-1 + 2 * kl) / 2, rel_tol=1e-5)


def test_unknown_loss_lists_choices():
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo, cispo"):
        get_loss("ppo")
    assert set(LOSSES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo"}
