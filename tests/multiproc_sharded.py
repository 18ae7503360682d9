"""`posttrain <command> ...` as a user runs it under `accelerate launch --config_file <fsdp2|zero2|zero3>`, with the
test-only patch that lets accelerate's FSDP and DeepSpeed paths run on CPU (tests/accelerate_on_cpu.py).

    accelerate launch --config_file CONFIG tests/multiproc_sharded.py grpo --model_name_or_path ...
    accelerate launch --config_file CONFIG tests/multiproc_sharded.py --runs RUNS.json

With --runs, the runs of RUNS.json (tests/run_commands.py) run one after another in the same two processes, each
with its own environment variables. With POSTTRAIN_TEST_SHARED_LOG=DIR, prompts are shared on the tiny test model too
(no FLOP floor), and DIR/rank<RANK>.txt gets a line per shared pass: its rollouts and whether it had a gradient. With
POSTTRAIN_TEST_PATH_LOG=DIR, DIR/rank<RANK>.txt gets a line per log-prob computation: "chunked" (the output layer in
chunks, models/chunked.py) or "logits" (the model's whole logits, GRPO's fallback), "packed" before GRPO's passes over
packed rows, "lean-decoder" or "model-forward-decode" for each decode, "passes-<count>" for the passes each training
micro-batch of GRPO, RLOO and distillation runs as, "divergence" for each of distillation's passes
through both output layers in chunks (models/divergence.py), and "prefix-rows" or "prefix-shared" for each
reward-model pass that runs its pairs' common prefixes once, as a row per pair or through a cache (which these
processes do on the tiny model too: no FLOP floor). Without
the variable nothing is written.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import accelerate_on_cpu  # noqa: E402
import run_commands  # noqa: E402

accelerate_on_cpu.install()

import torch  # noqa: E402

from posttrain.generation import lean_decoder  # noqa: E402
from posttrain.grpo.batch import TrainingBatch  # noqa: E402
from posttrain.models import logprobs, teacher  # noqa: E402
from posttrain.reward import trainer as reward_trainer  # noqa: E402

SHARED_LOG, PATH_LOG = "POSTTRAIN_TEST_SHARED_LOG", "POSTTRAIN_TEST_PATH_LOG"
MIN_SHARED_SAVING_FLOP = logprobs.MIN_SHARED_SAVING_FLOP


def _recorded(fn, variable: str, line):
    """`fn`, appending `line(args, result)` to $variable/rank<RANK>.txt after every call while $variable is set."""
    def run(*args, **kwargs):
        result = fn(*args, **kwargs)
        if os.environ.get(variable):
            with open(os.path.join(os.environ[variable], f"rank{os.environ['RANK']}.txt"), "a") as f:
                f.write(line(args, result) + "\n")
        return result

    return run


logprobs._shared_prompt_hidden = _recorded(
    logprobs._shared_prompt_hidden, SHARED_LOG,
    lambda args, result: f"{len(args[1].source)} {int(torch.is_grad_enabled())}")
for name, function in (("chunked", "chunked_token_logprobs"), ("logits", "_logits_logprobs"),
                       ("packed", "_packed_logprobs")):
    setattr(logprobs, function, _recorded(getattr(logprobs, function), PATH_LOG,
                                          lambda args, result, name=name: name))
teacher.chunked_divergence = _recorded(teacher.chunked_divergence, PATH_LOG, lambda args, result: "divergence")
reward_trainer.prefix_shared_scores = _recorded(reward_trainer.prefix_shared_scores, PATH_LOG,
                                                lambda args, result: "prefix-shared")
reward_trainer.prefix_row_scores = _recorded(reward_trainer.prefix_row_scores, PATH_LOG,
                                             lambda args, result: "prefix-rows")
reward_trainer.MIN_PREFIX_SAVING_FLOP = 0  # the one-process reference runs its pairs whole: the two layouts compared
TrainingBatch.in_passes = _recorded(TrainingBatch.in_passes, PATH_LOG, lambda args, result: f"passes-{len(result)}")
lean_decoder.supports = _recorded(lean_decoder.supports, PATH_LOG,
                                  lambda args, lean: "lean-decoder" if lean else "model-forward-decode")


def _share_on_the_tiny_model(env: dict) -> None:
    """With the shared log asked for, prompts are shared on the tiny model (no FLOP floor); else the floor stands."""
    logprobs.MIN_SHARED_SAVING_FLOP = 0 if env.get(SHARED_LOG) else MIN_SHARED_SAVING_FLOP


if __name__ == "__main__":
    if sys.argv[1:2] == ["--runs"]:
        sys.exit(run_commands.run_each(run_commands.read_runs(sys.argv[2]), before=_share_on_the_tiny_model))
    _share_on_the_tiny_model(os.environ)
    from posttrain import cli

    sys.exit(cli.main(sys.argv[1:]))
