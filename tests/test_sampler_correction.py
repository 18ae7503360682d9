"""The importance-sampling correction between an engine's samples and the trainer (TRL's
vllm_importance_sampling_*): TRL's four modes, the trainer's log-probs over the sampler's support, and the metrics."""

import math

import pytest
import torch

from posttrain.configs import ConfigError, GRPOConfig
from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.grpo.sampler_correction import local_stats, reduce_stats, sampling_ratio, trainer_logps
from posttrain.models import token_logprobs
from posttrain.testing import tiny_model

TRAINER = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.1, 0.0, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.2, -1.3, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


# Worked by hand from TRL 1.16's definition (grpo_trainer.py, _generate_and_score_completions; inline there, so not
# callable on its own): trainer - sampler over the real tokens is [0.5, -1.0, 0.0] and [0.0, 1.2]; a token mode takes
# e^diff per token, a sequence mode e^(sum) per sequence (e^-0.5 and e^1.2 = 3.32); truncate clamps to the bounds,
# mask sets a ratio outside them to 0. The real tokens' ratios, row-major:
E = math.exp
HAND_WORKED = {
    ("token_truncate", (None, 3.0)): [E(0.5), E(-1.0), 1.0, 1.0, 3.0],
    ("token_mask", (None, 3.0)): [E(0.5), E(-1.0), 1.0, 1.0, 0.0],
    ("sequence_truncate", (None, 3.0)): [E(-0.5)] * 3 + [3.0] * 2,
    ("sequence_mask", (None, 3.0)): [E(-0.5)] * 3 + [0.0] * 2,
    ("token_truncate", (0.5, 2.0)): [E(0.5), 0.5, 1.0, 1.0, 2.0],
    ("token_mask", (0.5, 2.0)): [E(0.5), 0.0, 1.0, 1.0, 0.0],
    ("sequence_truncate", (0.5, 2.0)): [E(-0.5)] * 3 + [2.0] * 2,
    ("sequence_mask", (0.5, 2.0)): [E(-0.5)] * 3 + [0.0] * 2,
}


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0)])
def test_the_four_modes_give_trls_ratios(mode, bounds):
    ratio = sampling_ratio(TRAINER, SAMPLER, MASK, mode, *bounds)
    assert ratio[MASK].tolist() == pytest.approx(HAND_WORKED[(mode, bounds)], rel=1e-6)
    assert (ratio[~MASK] == 1).all()


def test_metrics_use_trl_names_and_pool_processes():
    ratio = sampling_ratio(TRAINER, SAMPLER, MASK, "token_truncate", None, 3.0)
    one = local_stats(TRAINER, SAMPLER, MASK, ratio, sequence_level=False)
    both = reduce_stats(torch.stack([one, local_stats(TRAINER[:1], SAMPLER[:1], MASK[:1], ratio[:1], False)]))
    alone = reduce_stats(one)
    assert alone["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0 + 0 + 1.2) / 5)
    assert alone["sampling/sampling_logp_difference/max"] == pytest.approx(1.2)
    assert alone["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)  # e^1.2 truncated
    assert alone["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1.0))
    assert both["sampling/sampling_logp_difference/mean"] == pytest.approx((2.7 + 1.5) / 8)


@pytest.mark.parametrize("fast", [True, False])  # the chunked output layer, and a model's own logits
@pytest.mark.parametrize("filters", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.2), dict(min_new_tokens=6),
                                     dict(suppress_tokens=(3, 9), begin_suppress_tokens=(5,), min_new_tokens=2),
                                     dict(top_k=7, top_p=0.9, suppress_tokens=(3,), min_new_tokens=2)])
def test_the_trainer_over_the_samplers_support_equals_the_sampler(tokenizer, filters, fast, monkeypatch):
    """The in-process sampler is the trainer's own distribution, so over its support the trainer's log-probs equal
    the sampler's: the ratio is 1. Over the full vocabulary they differ by the kept mass (TRL #6789)."""
    model = tiny_model(tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, **filters)
    gen = TransformersGenerator(model, tokenizer, params)
    r = gen.generate_seeded([[5, 76, 5, 84]] * 4 + [[7, 76, 9, 84, 11]] * 4, 3)
    with torch.no_grad():
        reference, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.7)
        if not fast:
            monkeypatch.setattr("posttrain.models.logprobs.fast_path_available", lambda m: False)
        full, support = trainer_logps(model, r, params, 0.7, gen.eos_ids)
    mask = r.completion_mask
    assert torch.allclose(full, reference, atol=1e-5)  # the old log-probs, from the same forward
    assert ((support - full)[mask] > 1e-4).any() and ((support - full)[mask] >= -1e-6).all()
    assert torch.allclose(support[mask], r.sampler_logprobs[mask], atol=2e-5)
    assert not torch.allclose(full[mask], r.sampler_logprobs[mask], atol=1e-4)
    ratio = sampling_ratio(support, r.sampler_logprobs, mask, "token_mask", None, 3.0)
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)


def test_config_checks_as_trl():
    assert GRPOConfig().vllm_importance_sampling_mode == "sequence_mask"
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        assert GRPOConfig(vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0
    with pytest.raises(ConfigError, match="clip_min=2.0 must be below vllm_importance_sampling_clip_max=1.5"):
        GRPOConfig(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5)
    with pytest.raises(ConfigError, match="needs vllm_importance_sampling_clip_min or _clip_max"):
        GRPOConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)
    with pytest.raises(ConfigError, match="vespo.*token_truncate"):
        GRPOConfig(loss_type="vespo", use_vllm=True, vllm_mode="server")
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode"):
        GRPOConfig(vllm_importance_sampling_mode="tokens")
