"""RLOOTrainer against TRL 1.16's RLOOTrainer: the advantages (leave-one-out baseline, reward clipping, the KL
penalty, normalisation, unscorable completions) from TRL's own `_generate_and_score_completions`, and the loss, its
gradient and metrics from TRL's own `_compute_loss`, on the same tensors; the update is the same for any split of the
batch; a run trains, logs TRL's metrics and refuses GRPO-only fields."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.grpo.advantages import leave_one_out_advantages
from posttrain.grpo.losses import LossInputs, LossParams, StepNormalizer, get_loss, micro_batch_loss
from posttrain.grpo.metrics import loss_metrics, reward_metrics
from posttrain.testing import tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")

G = 2
# 3 prompts x 2 completions, 2 reward functions; row 3: every function returned None (unscorable)
REWARDS = torch.tensor([[1.0, 0.5], [0.0, float("nan")], [2.0, 1.0], [float("nan"), float("nan")],
                        [-1.0, 0.25], [3.0, -0.5]])
LENGTHS = [4, 2, 3, 4, 1, 3]


class OneProcess:
    """The accelerator methods TRL's code calls, for a single process."""

    num_processes, process_index, sync_gradients = 1, 0, True
    device = torch.device("cpu")

    def gather(self, x):
        return x.reshape(-1) if x.dim() == 0 else x

    def reduce(self, x, reduction="sum"):
        return x


def _mask() -> torch.Tensor:
    return torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]  # [6, 4]


def _trl_scored(tmp_path, old, ref, **config):
    """TRL's RLOOTrainer._generate_and_score_completions on 6 fixed completions: its generation, log-prob passes
    and reward functions replaced by the fixed tensors. Returns its advantages and metrics."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    tokenizer = tiny_tokenizer()
    args = RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=G, max_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no", max_completion_length=4, **config)
    from posttrain.testing import save_tiny

    path = save_tiny(str(tmp_path / "model"), tokenizer, hidden=32, layers=1)  # TRL loads its reference from it
    trainer = RLOOTrainer(model=path, reward_funcs=[_zero, _zero], args=args,
                          processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["a"] * 6}))
    ids = [[5] * n for n in LENGTHS]
    trainer._generate = lambda prompts: ([[7, 8]] * 6, ids, ["x"] * 6)
    passes = iter([old, ref])
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (next(passes), None, None)
    trainer._calculate_rewards = lambda *a: REWARDS.clone()
    trainer.model.train()  # TRL logs under "train" only while the model is in training mode
    out = trainer._generate_and_score_completions([{"prompt": "a"}] * 6)
    return out["advantages"], {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("config", [dict(beta=0.0), dict(beta=0.05), dict(beta=0.3, reward_clip_range=(-0.5, 1.5)),
                                    dict(beta=0.05, normalize_advantages=True)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_advantages_and_reward_metrics_equal_trls(tmp_path, config):
    torch.manual_seed(0)
    mask = _mask()
    old, ref = -torch.rand(6, 4) * 2, -torch.rand(6, 4) * 2
    trl_adv, trl_metrics = _trl_scored(tmp_path, old, ref, **config)
    beta = config["beta"]
    kl = ((old - ref) * mask).sum(-1) if beta else None
    adv = leave_one_out_advantages(REWARDS, torch.ones(2), G, kl, beta, config.get("reward_clip_range"),
                                   config.get("normalize_advantages", False))
    assert torch.allclose(adv.advantages, trl_adv, rtol=1e-5, atol=1e-6)
    assert adv.advantages[3] == 0 and adv.advantages[2] == 0  # unscorable, and the sole scorable one of its group
    ours = reward_metrics(REWARDS, adv, ["_zero", "_zero_1"])
    for name in ("reward", "reward_std"):
        assert math.isclose(ours[name], trl_metrics[name], rel_tol=1e-5, abs_tol=1e-6), name
    # by design (docs/grpo.md): a group with fewer than two scored completions (the second, here) has no spread to
    # learn from and counts as zero-std in posttrain, as in GRPO; TRL's NaN std counts as not zero
    assert math.isclose(ours["frac_reward_zero_std"], trl_metrics["frac_reward_zero_std"] + 1 / 3, rel_tol=1e-5)
    if beta:  # the KL is a reward penalty, logged per token as TRL logs it
        per_token = float(((old - ref) * mask).sum() / mask.sum())
        assert math.isclose(per_token, trl_metrics["kl"], rel_tol=1e-5)


def _trl_loss(logps, entropy, old_seq, adv, mask, eps_low, eps_high):
    from trl import RLOOTrainer as TRLTrainer

    stand_in = SimpleNamespace(epsilon_low=eps_low, epsilon_high=eps_high, aux_loss_enabled=False,
                               accelerator=OneProcess(), model=SimpleNamespace(training=True),
                               _metrics={"train": defaultdict(list)},
                               _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None))
    inputs = {"prompt_ids": torch.zeros(adv.size(0), 1, dtype=torch.long),
              "prompt_mask": torch.ones(adv.size(0), 1, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
              "old_logps": old_seq, "advantages": adv}
    loss = TRLTrainer._compute_loss(stand_in, None, inputs)
    return loss, {k: v[0] for k, v in stand_in._metrics["train"].items()}


def _params(eps_low=0.2, eps_high=0.2) -> LossParams:
    return LossParams(epsilon_low=eps_low, epsilon_high=eps_high, importance_sampling_level="sequence_sum")


def _ours(logps, entropy, old, adv, mask, params, norm=None):
    norm = norm or StepNormalizer(sequences=adv.size(0), tokens=float(mask.sum()), tokens_per_process=float(mask.sum()))
    out = micro_batch_loss(get_loss("rloo"), params, LossInputs(logps, old, None, adv, mask), entropy, norm)
    return out.loss, out.stats


@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.28)])
def test_loss_gradient_and_metrics_equal_trls(on_policy, eps):
    torch.manual_seed(0)
    mask = _mask()
    base = -torch.rand(6, 4) * 2
    # off-policy: row 0 (A > 0) far above the clip range, row 1 (A < 0) far below it, the rest near 1
    shift = torch.tensor([-0.2, 0.2, 0.0, 0.0, 0.0, 0.0])[:, None]
    old = None if on_policy else base + shift + 0.02 * torch.randn(6, 4)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    entropy = torch.rand(6, 4) * 3
    results = []
    for side in ("trl", "posttrain"):
        logps = base.clone().requires_grad_()
        if side == "trl":
            old_seq = ((base if old is None else old) * mask).sum(1)
            loss, metrics = _trl_loss(logps, entropy, old_seq, adv, mask, *eps)
        else:
            loss, stats = _ours(logps, entropy, old, adv, mask, _params(*eps))
            metrics = loss_metrics([stats], OneProcess())
        loss.backward()
        results.append((loss.item(), logps.grad * mask, metrics))
    (trl_loss, trl_grad, trl_metrics), (loss, grad, metrics) = results
    assert math.isclose(loss, trl_loss, rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(grad, trl_grad, rtol=1e-5, atol=1e-7)
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                 "clip_ratio/high_max", "clip_ratio/region_mean"):
        assert math.isclose(metrics[name], trl_metrics[name], rel_tol=1e-5, abs_tol=1e-7), name
    if not on_policy:
        assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0  # both clip


def test_the_update_is_the_same_for_any_split_of_the_step():
    torch.manual_seed(1)
    mask = _mask()
    base, old = -torch.rand(6, 4) * 2, -torch.rand(6, 4) * 2
    adv = torch.randn(6)
    norm = StepNormalizer(sequences=6, tokens=float(mask.sum()), tokens_per_process=float(mask.sum()))
    grads = []
    for split in ([6], [3, 3], [1, 2, 3]):
        logps = base.clone().requires_grad_()
        start = 0
        for size in split:
            rows = slice(start, start + size)
            loss, _ = _ours(logps[rows], torch.zeros(size, 4), old[rows], adv[rows], mask[rows], _params(), norm)
            loss.backward()
            start += size
        grads.append(logps.grad.clone())
    assert all(torch.allclose(grads[0], g, atol=1e-7) for g in grads[1:])


def _rloo(tmp_path, **overrides):
    from conftest import length_reward, tiny_config
    from datasets import Dataset

    from posttrain import RLOOConfig, RLOOTrainer

    values = {k: v for k, v in tiny_config(tmp_path).__dict__.items() if k in (
        "output_dir", "max_steps", "per_device_train_batch_size", "max_completion_length", "learning_rate",
        "logging_steps", "save_strategy", "gradient_checkpointing", "use_cpu", "seed")}
    config = RLOOConfig(**{**values, "num_generations": 4, **overrides})
    return RLOOTrainer(tiny_model(tiny_tokenizer(), hidden=32, layers=1), reward_funcs=length_reward, args=config,
                       train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
                       processing_class=tiny_tokenizer())


def test_a_run_trains_and_logs_trls_rloo_metrics(tmp_path):
    trainer = _rloo(tmp_path, max_steps=2, reward_clip_range=(0.0, 0.5))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:
        assert {"reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/region_mean",
                "clip_ratio/low_min", "completions/mean_length"} <= set(h)
        assert math.isfinite(h["kl"]) and math.isfinite(h["loss"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())
    assert trainer.ref_model is not None or trainer.reference_adapter is not None  # beta 0.05 by default


def test_grpo_only_fields_and_the_other_trainers_config_are_refused(tmp_path):
    from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig
    from posttrain.configs import ConfigError

    with pytest.raises(ConfigError, match=r"^loss_type='grpo' is a GRPOConfig field that TRL's RLOOConfig does not "
                                          r"have, and RLOO has no use for it .*: remove loss_type, or use GRPOConfig "
                                          r"and GRPOTrainer\.$"):
        RLOOConfig(output_dir=str(tmp_path), loss_type="grpo")
    with pytest.raises(ConfigError, match=r"reward_clip_range=\(2, 1\) has its low end above its high end"):
        RLOOConfig(output_dir=str(tmp_path), reward_clip_range=(2, 1))
    config = RLOOConfig(output_dir=str(tmp_path))
    assert (config.num_generations, config.beta, config.normalize_advantages) == (2, 0.05, False)
    with pytest.raises(ConfigError, match=r"^args is a RLOOConfig, which configures another trainer: give the GRPO "
                                          r"trainer a GRPOConfig\.$"):
        GRPOTrainer(tiny_model(tiny_tokenizer(), hidden=32, layers=1), reward_funcs=_zero, args=config)
    assert isinstance(GRPOConfig(output_dir=str(tmp_path)), GRPOConfig)


def test_posttrain_rloo_from_yaml_and_flags(tmp_path, tiny_model_dir, capfd):
    """`posttrain rloo` as TRL's `trl rloo`: YAML plus flags, RLOO's defaults, its metrics and model written."""
    import json

    import yaml
    from conftest import run_posttrain

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(4) for b in range(4)))
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data}\nreward_funcs: [length]\n"
                      "per_device_train_batch_size: 4\nmax_completion_length: 4\ngradient_checkpointing: false\n"
                      "use_cpu: true\nreward_clip_range: [-5, 5]\n")
    run = run_posttrain(["rloo", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                         "--logging_steps", "1", "--normalize_advantages"], capfd)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and all("kl" in r and "reward" in r for r in records)
    written = yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())
    assert (written["num_generations"], written["beta"], written["reward_clip_range"],
            written["normalize_advantages"]) == (2, 0.05, [-5.0, 5.0], True)
    assert (tmp_path / "out" / "model.safetensors").exists()
    from posttrain.cli import parse_command

    again = parse_command("rloo", ["--config", str(tmp_path / "out" / "posttrain_config.yaml")])[2]
    assert again.reward_clip_range == (-5.0, 5.0)  # the written config reads back as the same config
    from posttrain.report.run import read_config, trainer_of

    assert trainer_of(read_config(str(tmp_path / "out"), []), set()) == "RLOO"  # the report names the trainer
