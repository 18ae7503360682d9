"""Every bad input of issue 5 gets its one-line message (catalogue: tests/bad_inputs.py), and the table of
docs/reliability.md is exactly what the cases produce."""

import re

import pytest
from bad_inputs import CASES, CATEGORIES, DOC, generated_section, observe
from conftest import tiny_config

from posttrain.errors import UserError


@pytest.fixture(scope="module")
def message_of(tmp_path_factory):
    """message_of(case): the case's normalised message, run once per module (the docs test reuses it)."""
    seen = {}

    def get(case):
        if case.name not in seen:
            seen[case.name] = observe(case, tmp_path_factory.mktemp(case.name))
        return seen[case.name]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_message(case, message_of):
    if case.requires:
        pytest.importorskip(case.requires)
    message = message_of(case)  # raises unless the right error (or one warning) matches case.match
    assert "\n" not in message and message.endswith((".", "?")), message
    assert len(re.findall(r"[.?!](?:\s|$)", message)) <= 3, f"not one or two short sentences: {message}"
    if case.raises is not None:
        assert issubclass(case.raises, UserError)  # so the command line prints it as one line, exit code 2


def test_every_category_of_the_issue_is_covered():
    assert {c.category for c in CASES} == set(CATEGORIES)
    assert len({c.name for c in CASES}) == len(CASES)


def test_docs_table_is_current(message_of):
    for package in {c.requires for c in CASES if c.requires}:
        pytest.importorskip(package)
    section = generated_section({c.name: message_of(c) for c in CASES})
    assert section in DOC.read_text(), (
        "The bad-inputs table in docs/reliability.md is out of date: run `python tests/bad_inputs.py --write`.")


def test_reward_error_in_training_names_the_prompt_and_keeps_the_last_checkpoint(tokenizer, addition_dataset,
                                                                                 tmp_path):
    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.rewards import RewardError
    from posttrain.testing import tiny_model
    from posttrain.training.checkpoint import checkpoints

    def odd_sums_fail_at_step_2(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1 and any(_sum(p) % 2 for p in prompts):
            raise ValueError("cannot score odd sums")
        return [len(c) / 10 for c in completions]

    config = tiny_config(tmp_path, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), odd_sums_fail_at_step_2, config,
                          train_dataset=addition_dataset, processing_class=tokenizer)
    with pytest.raises(RewardError, match=r"'odd_sums_fail_at_step_2' raised ValueError at step 2 on completion "
                                          r"(\d+) \(prompt (\d+) of the dataset\): cannot score odd sums\.") as info:
        trainer.train()
    completion, prompt = map(int, re.search(r"completion (\d+) \(prompt (\d+)", str(info.value)).groups())
    assert _sum(addition_dataset[prompt]["prompt"]) % 2 == 1  # the row named is one that fails
    assert completion % config.num_generations == 0  # the first completion of that prompt's group
    out = tmp_path / "out"
    assert [step for step, _ in checkpoints(out)] == [1] and not (out / "checkpoint-2.tmp").exists()


def _sum(prompt: str) -> int:
    """The sum asked by a prompt "a+b="."""
    return sum(int(x) for x in prompt.rstrip("=").split("+"))


@pytest.mark.parametrize("name, function, raised", [("formatting_func_raises", "question_answer", KeyError),
                                                    ("compute_metrics_raises", "exact_match", ValueError),
                                                    ("dynamic_sampling_filter_raises", "by_column", IndexError)])
def test_a_user_function_that_raised_is_reported_after_its_own_traceback(name, function, raised, tmp_path, capsys):
    """As a reward function that raises: one sentence naming the function, after the traceback of what it raised."""
    from posttrain.cli import _report_error
    from posttrain.errors import UserFunctionError

    case = next(c for c in CASES if c.name == name)
    with pytest.raises(UserFunctionError) as info:
        case.trigger(tmp_path)
    assert type(info.value.__cause__) is raised
    assert _report_error(info.value) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("Traceback") and f", in {function}\n" in printed
    assert printed.endswith(f"posttrain: error: {info.value}\n")


def test_signatures_are_checked_for_every_kind_of_callable():
    """A partial counts its bound arguments, a callable object its __call__ (a class its __init__), a bound method
    leaves out self; a builtin without a signature (math.log, max) is taken as it is, to be called."""
    import functools
    import math

    from posttrain.errors import described, function_name, signature_mismatch

    def keep(rewards, num_generations):
        return True

    class Filter:
        def __call__(self, rewards):
            return True

        def method(self, rewards):
            return True

    assert signature_mismatch(keep, "r") == "missing a required argument: 'num_generations'"
    assert signature_mismatch(functools.partial(keep, num_generations=4), "r") is None
    assert signature_mismatch(Filter(), "r") is None and signature_mismatch(Filter().method, "r") is None
    assert signature_mismatch(Filter, "r") == "too many positional arguments"
    assert signature_mismatch(math.log, "r") is None and signature_mismatch(max, "r") is None
    assert function_name(functools.partial(keep, num_generations=4)) == "keep"
    assert function_name(Filter()) == "Filter" and function_name(Filter().method) == "Filter.method"
    assert described(keep) == "keep(rewards, num_generations)" and described(max) == "max"
