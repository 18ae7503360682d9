"""Every DPO loss_type against numbers worked by hand (docs/dpo.md has the formulas), and TRL's _compute_loss
formulas where TRL is installed."""

import math

import pytest
import torch

from posttrain.dpo.losses import PAIR_LOSSES, PairTerms

# one pair: policy log-probs -1 / -2, reference -1.5 / -1.5, so the log-ratios are +0.5 and -0.5 and D = 1;
# completion lengths 2 and 4; beta 0.5 (b D = 0.5), label smoothing 0.1
B, E = 0.5, 0.1
LC, LR = 0.5, -0.5


def ls(x):  # log sigmoid
    return -math.log1p(math.exp(-x))


def s(x):
    return 1 / (1 + math.exp(-x))


HAND = {
    "sigmoid": -(1 - E) * ls(0.5) - E * ls(-0.5),
    "hinge": 1 - 0.5,
    "ipo": (LC / 2 - LR / 4 - 1 / (2 * B)) ** 2,
    "exo_pair": s(0.5) * (ls(0.5) - math.log(1 - E)) + s(-0.5) * (ls(-0.5) - math.log(E)),
    "nca_pair": -ls(B * LC) - 0.5 * ls(-B * LC) - 0.5 * ls(-B * LR),
    "robust": (-(1 - E) * ls(0.5) + E * ls(-0.5)) / (1 - 2 * E),
    "bco_pair": -ls(B * LC) - ls(-B * LR),
    "sppo_hard": (LC - 1 / (2 * B)) ** 2 + (LR + 1 / (2 * B)) ** 2,
    "aot": -(1 - E) * ls(B * (1.0 - 0.0)) - E * ls(-B * (1.0 - 0.0)),  # one pair: the sort changes nothing
    "aot_unpaired": -(1 - E) * ls(0.5) - E * ls(-0.5),
    "apo_zero": 1 - s(B * LC) + s(B * LR),
    "apo_down": s(B * LC) + 1 - s(B * (LC - LR)),
    "discopop": -ls(0.5) * (1 - s(0.5 / 0.05)) + math.exp(-0.5) * s(0.5 / 0.05),
    "sigmoid_norm": -ls(B * (LC / 2 - LR / 4)),
}


def _terms(**kw):
    t = dict(chosen_logps=torch.tensor([-1.0]), rejected_logps=torch.tensor([-2.0]), ref_chosen=torch.tensor([-1.5]),
             ref_rejected=torch.tensor([-1.5]), chosen_tokens=torch.tensor([2.0]), rejected_tokens=torch.tensor([4.0]),
             beta=B, label_smoothing=E)
    t.update(kw)
    return PairTerms(**t)


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_each_loss_matches_the_hand_worked_pair(name):
    assert sorted(HAND) == sorted(PAIR_LOSSES)
    got = float(PAIR_LOSSES[name](_terms()))
    assert got == pytest.approx(HAND[name], rel=1e-6), name


def test_sigmoid_without_smoothing_is_dpo_and_with_it_is_cdpo():
    plain = float(PAIR_LOSSES["sigmoid"](_terms(label_smoothing=0.0)))
    assert plain == pytest.approx(-ls(0.5), rel=1e-6)
    assert float(PAIR_LOSSES["sigmoid"](_terms())) != pytest.approx(plain)  # never silently ignored


def test_f_divergence_scores():
    c, r = LC, LR
    cases = {"forward_kl": (1 - math.exp(-c), 1 - math.exp(-r)),
             "js_divergence": (math.log(2) + ls(c), math.log(2) + ls(r)),
             "alpha_divergence": ((math.exp(-0.5 * c) - 1) / -0.5, (math.exp(-0.5 * r) - 1) / -0.5),
             "reverse_kl": (c, r)}
    for kind, (sc, sr) in cases.items():
        got = _terms(f_divergence_type=kind).scores()
        assert (float(got[0]), float(got[1])) == pytest.approx((sc, sr), rel=1e-6), kind
        loss = float(PAIR_LOSSES["sigmoid"](_terms(f_divergence_type=kind, label_smoothing=0.0)))
        assert loss == pytest.approx(-ls(B * (sc - sr)), rel=1e-6), kind


def test_aot_sorts_within_the_batch():
    t = _terms(chosen_logps=torch.tensor([-1.0, -3.0]), rejected_logps=torch.tensor([-2.0, -1.0]),
               ref_chosen=torch.tensor([-1.0, -1.0]), ref_rejected=torch.tensor([-1.0, -2.0]),
               chosen_tokens=torch.ones(2), rejected_tokens=torch.ones(2), label_smoothing=0.0)
    # policy gaps (1, -2) sorted (-2, 1); reference gaps (0, 1) sorted (0, 1): gaps -2 and 0
    assert PAIR_LOSSES["aot"](t).tolist() == pytest.approx([-ls(B * -2), -ls(0.0)], rel=1e-6)
    # log-ratios chosen (0, -2) sorted (-2, 0), rejected (-1, 1) sorted (-1, 1): gaps -1, -1
    assert PAIR_LOSSES["aot_unpaired"](t).tolist() == pytest.approx([-ls(-B), -ls(-B)], rel=1e-6)


def test_the_losses_match_trls_formulas():
    """TRL 1.16's DPOTrainer._compute_loss, fed the same sequence log-probs through a stub model, gives the same
    loss for every loss type where the definitions agree (all but sigmoid with label smoothing, which TRL ignores)."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl.trainer.dpo_trainer import DPOTrainer as TRLDPOTrainer

    # 2 pairs, completions of 3 tokens each, prompt 1 token: [chosen x 2; rejected x 2] rows of 4 positions
    torch.manual_seed(0)
    per_token = -torch.rand(4, 3)  # policy log-probs of the completion tokens
    ref_seq = -torch.rand(4) * 3
    mask = torch.tensor([[0, 1, 1, 1]] * 4)
    for name in sorted(PAIR_LOSSES):
        smoothing = 0.1 if name in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
        trainer = TRLDPOTrainer.__new__(TRLDPOTrainer)
        logps = torch.cat([torch.zeros(4, 1), per_token], 1)[:, 1:]  # positions 1.. of the shifted mask
        outputs = SimpleNamespace(log_probs=logps, entropy=torch.zeros(4, 3), mean_logits=torch.zeros(4, 3),
                                  is_top1=torch.zeros(4, 3, dtype=torch.bool))
        trainer.model = SimpleNamespace(training=True)
        trainer.accelerator = SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
        trainer.args = SimpleNamespace(discopop_tau=0.05)
        trainer.ld_alpha, trainer.beta, trainer.label_smoothing = None, B, smoothing
        trainer.loss_types, trainer.loss_weights, trainer.use_weighting = [name], [1.0], False
        trainer.f_divergence_type, trainer.f_alpha_divergence_coef = "reverse_kl", 0.5
        trainer.precompute_ref_logps, trainer.aux_loss_enabled, trainer._tp_size = True, False, 1
        trainer._metrics = {"train": __import__("collections").defaultdict(list)}
        trainer._total_train_tokens = 0
        inputs = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "attention_mask": torch.ones(4, 4),
                  "completion_mask": mask, "ref_chosen_logps": ref_seq[:2], "ref_rejected_logps": ref_seq[2:]}
        theirs = float(trainer._compute_loss(lambda **kw: outputs, inputs, False))
        seq = per_token.sum(1)
        ours = PAIR_LOSSES[name](PairTerms(seq[:2], seq[2:], ref_seq[:2], ref_seq[2:], torch.full((2,), 3.0),
                                           torch.full((2,), 3.0), B, smoothing)).mean()
        assert float(ours) == pytest.approx(theirs, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES) + ["sft"])
def test_beta_zero_is_refused_exactly_where_it_leaves_nothing_to_learn(name):
    """With beta=0 each loss is either undefined (ipo, sppo_hard divide by it) or a constant of the log-probs (no
    gradient), worked out here from the loss itself; the config refuses exactly those, and sft (no beta) trains."""
    from posttrain.configs import ConfigError, DPOConfig

    if name == "sft":
        assert DPOConfig(output_dir="unused", beta=0.0, loss_type="sft").beta == 0.0
        return
    chosen, rejected = torch.tensor([-1.0, -3.0], requires_grad=True), torch.tensor([-2.0, -0.5], requires_grad=True)
    terms = _terms(chosen_logps=chosen, rejected_logps=rejected, ref_chosen=torch.tensor([-1.5, -1]),
                   ref_rejected=torch.tensor([-1.5, -2]), chosen_tokens=torch.tensor([2.0, 3.0]),
                   rejected_tokens=torch.tensor([4.0, 1.0]), beta=0.0)
    try:
        loss = PAIR_LOSSES[name](terms).sum()
    except ZeroDivisionError:
        loss = torch.tensor(math.inf)
    if torch.isfinite(loss):
        loss.backward()
        assert float(chosen.grad.abs().sum() + rejected.grad.abs().sum()) == 0.0
        expected = rf"beta=0 makes the {name} loss a constant with no gradient"
    else:
        expected = rf"beta=0 divides by zero in the {name} loss"
    with pytest.raises(ConfigError, match=expected):
        DPOConfig(output_dir="unused", beta=0.0, loss_type=[name, "sft"], label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"beta=-0.1 must be >= 0"):
        DPOConfig(output_dir="unused", beta=-0.1, loss_type=name, label_smoothing=0.1)
