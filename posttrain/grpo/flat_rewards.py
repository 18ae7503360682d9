"""A warning, once per run, when the rewards stop telling completions apart: `frac_reward_zero_std` at 1 for
FLAT_BATCHES generation batches in a row.

When every completion of each prompt gets the same total reward, every advantage is 0 (whatever scale_rewards:
the group's mean is subtracted first), so the policy loss has no gradient; only a KL term (beta > 0), an entropy
bonus or a router's load-balancing loss still moves the model. Under normalize_then_sum (GDPO) each reward function
is normalised on its own, so a flat total can still hide functions that differ: the batch counts as flat only when
every function is flat within every group too. Under dynamic_sampling the batch holds only groups whose rewards
differ (the metric is about 0 by construction), and a batch it cannot fill stops the run with its own sentence: no
warning there.

FLAT_BATCHES = 10: a batch in which every group ties happens by chance early on (a model that solves none of the
prompts yet scores them all 0) and usually passes within a few batches as sampling explores; ten in a row is seldom
chance and still early in a real run of hundreds of steps. They are generation batches, one per optimizer step
with the defaults (steps_per_generation = gradient_accumulation_steps, num_iterations = 1); with more, the warning
comes after proportionally more steps.

The warning names what it finds in the config (sampling that is greedy or nearly so, few completions per prompt)
and in the rewards of the flat batches (a function that returns one value for every completion, or that scores
every completion of a prompt alike), and what to change.
"""

import math

import torch

FLAT_BATCHES = 10
NEAR_GREEDY = {"temperature": 0.1, "top_p": 0.1, "min_p": 0.9}  # at or past these, sampling keeps about one token


def _flat_groups(values: torch.Tensor, G: int) -> bool:
    """Whether, in every group of G rows of `values` [N], the values that are not NaN are all equal."""
    groups = values.view(-1, G)
    low = torch.where(torch.isnan(groups), math.inf, groups).min(1).values
    high = torch.where(torch.isnan(groups), -math.inf, groups).max(1).values
    present = ~torch.isnan(groups).all(1)
    return bool(torch.isclose(low[present], high[present]).all())


def _one_value(values: torch.Tensor) -> float | None:
    """The one value of `values` [N] that are not NaN (NaN when all are), or None when they are not all equal."""
    present = values[~torch.isnan(values)]
    if present.numel() == 0:
        return math.nan
    return float(present[0]) if bool(torch.isclose(present, present[0]).all()) else None


def _same(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and (math.isclose(a, b) or (math.isnan(a) and math.isnan(b)))


class FlatRewardWatch:
    """Counts generation batches whose rewards carry no signal; `observe` returns the warning once, on the
    FLAT_BATCHES-th in a row.

    Args:
        args: the GRPOConfig.
        sampling: the generator's SamplingParams (generation_kwargs applied).
        names: the reward functions' names, in the reward matrix's column order.
        other_gradients: what still has a gradient when every advantage is 0, each said with what it does (e.g.
            "the KL term (beta=0.04), which only pulls the model back towards the reference").
    """

    def __init__(self, args, sampling, names: list[str], other_gradients: list[str]):
        self.args, self.sampling, self.names, self.other_gradients = args, sampling, names, other_gradients
        self.enabled = not args.dynamic_sampling
        self.streak = 0
        self.constant: dict[int, float | None] = {}  # per function: its one value over the streak (None: varied)
        self.warned = False

    def observe(self, metrics: dict, rewards: torch.Tensor) -> str | None:
        """Take one generation batch: its metrics (frac_reward_zero_std, reward) and its gathered [B*G, F] rewards.
        The warning when this batch makes FLAT_BATCHES flat ones in a row and none was given yet, else None."""
        if not self.enabled or self.warned:
            return None
        if not self._flat(metrics["frac_reward_zero_std"], rewards):
            self.streak, self.constant = 0, {}
            return None
        self.streak += 1
        self._note_constants(rewards)
        if self.streak < FLAT_BATCHES:
            return None
        self.warned = True
        return self._message(rewards, metrics["reward"])

    def _flat(self, frac: float, rewards: torch.Tensor) -> bool:
        if frac < 1.0:
            return False
        if self.args.multi_objective_aggregation != "normalize_then_sum":
            return True
        G = self.args.num_generations
        return all(_flat_groups(rewards[:, k], G) for k in range(rewards.size(1)))

    def _note_constants(self, rewards: torch.Tensor) -> None:
        """Keep, per function, the one value it gave every completion of the streak's batches (NaN when it scored
        none; None once it gave two)."""
        for k in range(rewards.size(1)):
            one = _one_value(rewards[:, k])
            before = self.constant.get(k, one)
            self.constant[k] = one if _same(before, one) else None

    def _causes(self, rewards: torch.Tensor, mean_reward: float) -> tuple[list[str], list[str]]:
        """(what the config and the rewards suggest, what to change). Sampling that keeps about one token explains
        everything else (every completion of a prompt is the same), so it is named alone."""
        causes, fixes = self._greedy_sampling()
        if causes:
            return causes, fixes
        G, differ_within, by_prompt = self.args.num_generations, [], False
        for k, name in enumerate(self.names):
            value = self.constant.get(k)
            if value is not None:
                got = "None" if math.isnan(value) else f"{value:g}"
                causes.append(f"reward function {name!r} returned {got} for every completion (it does not read the "
                              "completion, or no completion earned anything else)")
                fixes.append(f"check that {name!r} scores the completion (or use prompts the model solves only "
                             "sometimes)")
            elif _flat_groups(rewards[:, k], G):
                by_prompt = True
                causes.append(f"reward function {name!r} scores every completion of a prompt alike (it may read the "
                              "prompt or a dataset column rather than the completion, or each prompt is too easy or "
                              "too hard for the model)")
                fixes.append(f"check that {name!r} scores the completion, use prompts the model solves only "
                             "sometimes, or set dynamic_sampling=True to train on the groups whose rewards differ")
            else:
                differ_within.append(name)
        if differ_within and len(self.names) > 1:
            causes.append(f"reward functions {', '.join(map(repr, differ_within))} differ within a group, yet the "
                          "weighted sum does not: they cancel out")
            fixes.append("check reward_weights")
        if not causes:  # not seen in practice: every case above covers some function
            by_prompt = True
            causes.append(f"every prompt is too hard or too easy for the model (mean reward {mean_reward:g})")
            fixes.append("use prompts the model solves only sometimes, or set dynamic_sampling=True")
        if by_prompt and G <= 4:
            causes.append(f"num_generations={G} leaves few completions per prompt to differ")
            fixes.append("raise num_generations")
        return causes, fixes

    def _greedy_sampling(self) -> tuple[list[str], list[str]]:
        s = self.sampling
        found = []
        if s.top_k == 1:
            found.append(("top_k=1 samples greedily, so every completion of a prompt is the same",
                          "set top_k=0 (off) or larger"))
        if s.temperature <= NEAR_GREEDY["temperature"]:
            found.append((f"temperature={s.temperature:g} samples almost greedily", "raise temperature towards 1.0"))
        if s.top_p <= NEAR_GREEDY["top_p"]:
            found.append((f"top_p={s.top_p:g} keeps about one token at each step", "raise top_p towards 1.0"))
        if s.min_p is not None and s.min_p >= NEAR_GREEDY["min_p"]:
            found.append((f"min_p={s.min_p:g} keeps about one token at each step", "lower min_p"))
        return [c for c, _ in found], [f for _, f in found]

    def _message(self, rewards: torch.Tensor, mean_reward: float) -> str:
        causes, fixes = self._causes(rewards, mean_reward)
        if self.other_gradients:
            left = "; and from ".join(self.other_gradients)
            effect = f"the rewards carry no signal, and the only gradient left comes from {left}"
        else:
            effect = "the policy loss has no gradient and the model learns nothing from these steps"
        return (f"frac_reward_zero_std has been 1 for {FLAT_BATCHES} generation batches in a row: every completion "
                f"of each prompt got the same reward, so every advantage is 0: {effect}. Likely: "
                f"{'; '.join(causes)}. To change: {'; '.join(fixes)}.")
