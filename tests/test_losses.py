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
    assert float(out.stats.clip_high) == 1.0


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
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"):
        get_loss("ppo")
    # every loss_type of TRL 1.16's GRPOTrainer, which GRPOConfig offers, and RLOOTrainer's own loss
    from posttrain.configs.grpo import LOSS_TYPES

    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}
    assert set(LOSSES) == set(LOSS_TYPES) | {"rloo"}


def test_sapo_soft_gate_hand_worked():
    # on-policy r = 1: gate sigmoid(0) * 4 / t = 2 / t; A > 0 uses t_pos = 1, A <= 0 uses t_neg = 1.05
    p = LossParams()
    out = get_loss("sapo")(_inputs([[-1.0, -2.0]], adv=(0.5,)), p, NORM)
    assert math.isclose(out.loss.item(), -2 * 0.5, rel_tol=1e-6)
    out = get_loss("sapo")(_inputs([[-1.0, -2.0]], adv=(-0.5,)), p, NORM)
    assert math.isclose(out.loss.item(), (2 / 1.05) * 0.5, rel_tol=1e-6)
    # the gate's slope at r = 1 is 1, so on-policy the gradient is GRPO's: -A / tokens per token
    inp = _inputs([[-1.0, -2.0]], adv=(0.5,))
    get_loss("sapo")(inp, p, NORM).loss.backward()
    assert torch.allclose(inp.logps.grad, torch.tensor([[-0.25, -0.25]]))
    # r = 2, A = 1: -sigmoid(1) * 4
    out = get_loss("sapo")(_inputs([[math.log(2.0)]], old=[[0.0]]), p, StepNormalizer(1, 1.0, 1.0))
    assert math.isclose(out.loss.item(), -4 / (1 + math.exp(-1)), rel_tol=1e-6)


def test_luspo_scales_each_sequence_by_its_length():
    # sequences of 1 and 3 tokens, per-token loss -1: luspo sums each sequence, then averages: (-1 - 3) / 2
    inp = _inputs([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], adv=(1.0, 1.0), mask=[[True, False, False], [True, True, True]])
    norm = StepNormalizer(sequences=2, tokens=4.0, tokens_per_process=4.0)
    p = LossParams(importance_sampling_level="sequence")
    assert get_loss("luspo")(inp, p, norm).loss.item() == pytest.approx(-2.0)
    assert get_loss("grpo")(inp, p, norm).loss.item() == pytest.approx(-1.0)


def test_vespo_gamma_weight_hand_worked():
    # on-policy the weight is 1: loss = -A * logp per token, over the tokens: -(−1 − 2) / 2
    p = LossParams()
    assert get_loss("vespo")(_inputs([[-1.0, -2.0]]), p, NORM).loss.item() == pytest.approx(1.5)
    # sequence log-ratio 0.1 + 0.2 = 0.3, A >= 0 (k=2, lambda=3): phi = exp(3 + 2*0.3 - 3*exp(0.3)) = 0.63793
    phi = math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))
    inp = _inputs([[0.1, 0.2]], old=[[0.0, 0.0]])
    out = get_loss("vespo")(inp, p, NORM)
    assert math.isclose(out.loss.item(), -phi * 0.3 / 2, rel_tol=1e-5)
    out.loss.backward()  # phi is a detached weight: d/dlogp = -phi * A / tokens
    assert torch.allclose(inp.logps.grad, torch.full((1, 2), -phi / 2), rtol=1e-5)
    assert math.isclose(float(out.stats.phi_sum), phi, rel_tol=1e-5)
    # A < 0 uses k=3, lambda=2
    neg = get_loss("vespo")(_inputs([[0.1, 0.2]], old=[[0.0, 0.0]], adv=(-1.0,)), p, NORM)
    assert math.isclose(float(neg.stats.phi_sum), math.exp(2 + 3 * 0.3 - 2 * math.exp(0.3)), rel_tol=1e-5)


def test_bias_corrected_kl_gradient():
    # logp = -1, ref = -2, A = 0: kl = e^-1; d kl / d logp = 1 - e^-1. Weighted by the ratio (value 1), the
    # gradient gains kl * d r / d logp = e^-1: exactly 1 (TRL's use_bias_correction_kl, its default)
    for corrected, grad in ((True, 1.0), (False, 1 - math.exp(-1))):
        inp = _inputs([[-1.0]], ref=[[-2.0]], adv=(0.0,))
        out = get_loss("dapo")(inp, LossParams(beta=1.0, use_bias_correction_kl=corrected), StepNormalizer(1, 1.0, 1.0))
        assert math.isclose(out.loss.item(), math.exp(-1), rel_tol=1e-6)  # same value either way
        out.loss.backward()
        assert math.isclose(float(inp.logps.grad), grad, rel_tol=1e-5), corrected


def test_off_policy_sequence_mask_hand_worked():
    # both A < 0; sequence 1: mean(old - logp) = 1 > 0.5 -> masked; sequence 2: 0.1 <= 0.5 -> kept,
    # r = e^-0.1, -min(r * -1, clip(r) * -1) = r. bnpo over 2 tokens: r / 2
    inp = _inputs([[-1.0], [-0.1]], old=[[0.0], [0.0]], adv=(-1.0, -1.0))
    norm = StepNormalizer(sequences=2, tokens=2.0, tokens_per_process=2.0)
    out = get_loss("bnpo")(inp, LossParams(off_policy_mask_threshold=0.5), norm)
    assert math.isclose(out.loss.item(), math.exp(-0.1) / 2, rel_tol=1e-5)
    # a positive advantage is never masked, however far off-policy
    pos = get_loss("bnpo")(_inputs([[-1.0]], old=[[0.0]], adv=(1.0,)), LossParams(off_policy_mask_threshold=0.5),
                           StepNormalizer(1, 1.0, 1.0))
    assert math.isclose(pos.loss.item(), -math.exp(-1), rel_tol=1e-5)  # r = e^-1, A = 1: -min(r, clip(r) = 0.8)


def test_cispo_counts_clipped_tokens_as_trl():
    # ratio e^2 > eps_high = 5 is counted only where the advantage is positive (TRL's cispo_clip_ratio)
    p = LossParams(epsilon_high=5.0)
    one = StepNormalizer(1, 1.0, 1.0)
    assert float(get_loss("cispo")(_inputs([[2.0]], old=[[0.0]], adv=(1.0,)), p, one).stats.cispo_clip) == 1.0
    assert float(get_loss("cispo")(_inputs([[2.0]], old=[[0.0]], adv=(-1.0,)), p, one).stats.cispo_clip) == 0.0


def test_entropy_bonus_and_its_adaptive_coefficient():
    from posttrain.grpo.entropy import EntropyControl
    from posttrain.grpo.losses import entropy_bonus

    # the step's mean per-token entropy: (1 + 2) / 2 tokens per process
    bonus = entropy_bonus(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, True]]), NORM)
    assert bonus.item() == pytest.approx(1.5)
    control = EntropyControl(coef=0.1, adaptive=True, coef_min=0.0, coef_max=0.12, delta=0.05, target=0.2)
    assert control.applied() == 0.0  # nothing measured yet: inf > target
    control.update(0.1)  # at or below the target: up by delta, capped at coef_max
    assert control.coef == pytest.approx(0.12) and control.applied() == pytest.approx(0.12)
    control.update(0.5)  # above: down by delta; the bonus is off until entropy falls to the target again
    assert control.coef == pytest.approx(0.07) and control.applied() == 0.0
    fixed = EntropyControl(coef=0.3, adaptive=False, coef_min=0.0, coef_max=1.0, delta=0.05, target=0.2)
    fixed.update(5.0)
    assert fixed.applied() == 0.3 and fixed.enabled
