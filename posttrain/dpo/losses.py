"""DPO's losses, one function per TRL loss_type, on the sequence log-probs of a micro-batch's pairs.

Notation, per pair (all [P]):
    pi_c, pi_r      policy log-prob of the chosen / rejected completion (LD-weighted with ld_alpha)
    ref_c, ref_r    the reference's
    lr_c, lr_r      log-ratios pi - ref
    s_c, s_r        scores: f'(ratio) of the f-divergence (reverse_kl: the log-ratios themselves)
    D               s_c - s_r;  b = beta;  e = label_smoothing;  n_c, n_r completion lengths

    sigmoid       -(1-e) log s(bD) - e log s(-bD)               (cDPO; e = 0 is DPO)
    hinge         relu(1 - bD)                                   (SLiC)
    ipo           (s_c/n_c - s_r/n_r - 1/(2b))^2
    exo_pair      s(bD) (log s(bD) - log(1-e)) + s(-bD) (log s(-bD) - log e)
    nca_pair      -log s(b lr_c) - log s(-b lr_c)/2 - log s(-b lr_r)/2
    robust        (-(1-e) log s(bD) + e log s(-bD)) / (1 - 2e)
    bco_pair      -log s(b lr_c) - log s(-b lr_r)
    sppo_hard     (lr_c - 1/(2b))^2 + (lr_r + 1/(2b))^2
    aot           d = sort(pi_c - pi_r) - sort(ref_c - ref_r) over the micro-batch: -(1-e) log s(bd) - e log s(-bd)
    aot_unpaired  d = sort(lr_c) - sort(lr_r): as aot
    apo_zero      1 - s(b lr_c) + s(b lr_r)
    apo_down      s(b lr_c) + 1 - s(b (lr_c - lr_r))
    discopop      m = s(bD / tau): -log s(bD) (1 - m) + exp(-bD) m
    sigmoid_norm  -log s(b (s_c/n_c - s_r/n_r))
    sft           -log-prob of the chosen completion's tokens (normalised by chosen tokens, not pairs: the trainer)

Each function returns the per-pair loss [P]; the trainer sums them over the optimizer step's pairs and divides by the
step's pair count, so micro-batches and processes split the step without changing the update (aot and aot_unpaired
excepted: their sort pairs up completions of different prompts within a micro-batch, so they depend on its make-up).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PairTerms:
    """The per-pair quantities every loss is written in (all [P] float32)."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # completion lengths (ipo, sigmoid_norm)
    rejected_tokens: torch.Tensor
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5

    @property
    def chosen_logratios(self) -> torch.Tensor:
        return self.chosen_logps - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:
        return self.rejected_logps - self.ref_rejected

    def scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """f'(policy / reference) of chosen and rejected for the configured f-divergence."""
        c, r = self.chosen_logratios, self.rejected_logratios
        kind = self.f_divergence_type
        if kind == "forward_kl":  # f'(t) = 1 - 1/t
            return 1 - torch.exp(-c), 1 - torch.exp(-r)
        if kind == "js_divergence":  # f'(t) = log(2t / (t + 1))
            return math.log(2) + F.logsigmoid(c), math.log(2) + F.logsigmoid(r)
        if kind == "alpha_divergence":  # f'(t) = (t^(a-1) - 1) / (a - 1); a -> 1 is reverse KL
            a = self.f_alpha_divergence_coef
            if abs(a - 1.0) < 1e-6:
                return c, r
            return (torch.exp(((a - 1) * c).clamp(max=80.0)) - 1) / (a - 1), \
                (torch.exp(((a - 1) * r).clamp(max=80.0)) - 1) / (a - 1)
        return c, r

    def delta(self) -> torch.Tensor:
        c, r = self.scores()
        return c - r


def _smoothed_sigmoid(x: torch.Tensor, e: float) -> torch.Tensor:
    loss = -F.logsigmoid(x)
    return loss if e == 0.0 else (1 - e) * loss - e * F.logsigmoid(-x)


def sigmoid(t: PairTerms) -> torch.Tensor:
    return _smoothed_sigmoid(t.beta * t.delta(), t.label_smoothing)


def hinge(t: PairTerms) -> torch.Tensor:
    return torch.relu(1 - t.beta * t.delta())


def ipo(t: PairTerms) -> torch.Tensor:
    c, r = t.scores()
    margin = c / t.chosen_tokens.clamp(min=1) - r / t.rejected_tokens.clamp(min=1)
    return (margin - 1 / (2 * t.beta)) ** 2


def exo_pair(t: PairTerms) -> torch.Tensor:
    x, e = t.beta * t.delta(), t.label_smoothing
    return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-e))
            + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(e)))


def nca_pair(t: PairTerms) -> torch.Tensor:
    c, r = t.beta * t.chosen_logratios, t.beta * t.rejected_logratios
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


def robust(t: PairTerms) -> torch.Tensor:
    x, e = t.beta * t.delta(), t.label_smoothing
    return (-(1 - e) * F.logsigmoid(x) + e * F.logsigmoid(-x)) / (1 - 2 * e)


def bco_pair(t: PairTerms) -> torch.Tensor:
    return -F.logsigmoid(t.beta * t.chosen_logratios) - F.logsigmoid(-t.beta * t.rejected_logratios)


def sppo_hard(t: PairTerms) -> torch.Tensor:
    return (t.chosen_logratios - 0.5 / t.beta) ** 2 + (t.rejected_logratios + 0.5 / t.beta) ** 2


def aot(t: PairTerms) -> torch.Tensor:
    gap = torch.sort(t.chosen_logps - t.rejected_logps).values - torch.sort(t.ref_chosen - t.ref_rejected).values
    return _smoothed_sigmoid(t.beta * gap, t.label_smoothing)


def aot_unpaired(t: PairTerms) -> torch.Tensor:
    gap = torch.sort(t.chosen_logratios).values - torch.sort(t.rejected_logratios).values
    return _smoothed_sigmoid(t.beta * gap, t.label_smoothing)


def apo_zero(t: PairTerms) -> torch.Tensor:
    return 1 - torch.sigmoid(t.beta * t.chosen_logratios) + torch.sigmoid(t.beta * t.rejected_logratios)


def apo_down(t: PairTerms) -> torch.Tensor:
    c, r = t.chosen_logratios, t.rejected_logratios
    return torch.sigmoid(t.beta * c) + 1 - torch.sigmoid(t.beta * (c - r))


def discopop(t: PairTerms) -> torch.Tensor:
    x = t.beta * t.delta()
    m = torch.sigmoid(x / t.discopop_tau)
    return -F.logsigmoid(x) * (1 - m) + torch.exp(-x) * m


def sigmoid_norm(t: PairTerms) -> torch.Tensor:
    c, r = t.scores()
    return -F.logsigmoid(t.beta * (c / t.chosen_tokens.clamp(min=1) - r / t.rejected_tokens.clamp(min=1)))


PAIR_LOSSES = {f.__name__: f for f in (sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot,
                                       aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm)}
