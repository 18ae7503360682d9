"""`posttrain <command> ...` as a user runs it under `accelerate launch --config_file <fsdp2|zero2|zero3>`, with the
test-only patch that lets accelerate's FSDP and DeepSpeed paths run on CPU (tests/accelerate_on_cpu.py). With
POSTTRAIN_TEST_SHARED_LOG=DIR, prompts are shared on the tiny test model too (no FLOP floor), and DIR/rank<RANK>.txt
gets a line per shared pass: its rollouts and whether it had a gradient. With POSTTRAIN_TEST_PATH_LOG=DIR,
DIR/rank<RANK>.txt gets a line per log-prob computation: "chunked" (the output layer in chunks, models/chunked.py)
or "logits" (the model's whole logits, GRPO's fallback), "packed" before GRPO's passes over packed rows, and
"lean-decoder" or "model-forward-decode" for each decode.

    accelerate launch --config_file CONFIG tests/multiproc_sharded.py grpo --model_name_or_path ... 
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import accelerate_on_cpu  # noqa: E402

accelerate_on_cpu.install()


def _recorded(fn, variable: str, line):
    """`fn`, appending `line(args, result)` to $variable/rank<RANK>.txt after every call."""
    def run(*args, **kwargs):
        result = fn(*args, **kwargs)
        with open(os.path.join(os.environ[variable], f"rank{os.environ['RANK']}.txt"), "a") as f:
            f.write(line(args, result) + "\n")
        return result

    return run


if os.environ.get("POSTTRAIN_TEST_SHARED_LOG"):  # share prompts on the tiny model, and say where they were shared
    import torch

    from posttrain.models import logprobs

    logprobs.MIN_SHARED_SAVING_FLOP = 0
    logprobs._shared_prompt_hidden = _recorded(
        logprobs._shared_prompt_hidden, "POSTTRAIN_TEST_SHARED_LOG",
        lambda args, result: f"{len(args[1].source)} {int(torch.is_grad_enabled())}")

if os.environ.get("POSTTRAIN_TEST_PATH_LOG"):  # a line per log-prob computation and per decode: the path it took
    from posttrain.generation import lean_decoder
    from posttrain.models import logprobs

    for name, function in (("chunked", "chunked_token_logprobs"), ("logits", "_logits_logprobs"),
                           ("packed", "_packed_logprobs")):
        setattr(logprobs, function, _recorded(getattr(logprobs, function), "POSTTRAIN_TEST_PATH_LOG",
                                              lambda args, result, name=name: name))
    lean_decoder.supports = _recorded(
        lean_decoder.supports, "POSTTRAIN_TEST_PATH_LOG",
        lambda args, lean: "lean-decoder" if lean else "model-forward-decode")

from posttrain import cli  # noqa: E402

sys.exit(cli.main(sys.argv[1:]))
