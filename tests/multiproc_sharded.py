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

if os.environ.get("POSTTRAIN_TEST_SHARED_LOG"):  # share prompts on the tiny model, and say where they were shared
    import torch

    from posttrain.models import logprobs

    logprobs.MIN_SHARED_SAVING_FLOP = 0
    _hidden = logprobs._shared_prompt_hidden

    def _recorded(model, shared, *args):
        path = os.path.join(os.environ["POSTTRAIN_TEST_SHARED_LOG"], f"rank{os.environ['RANK']}.txt")
        with open(path, "a") as f:
            f.write(f"{len(shared.source)} {int(torch.is_grad_enabled())}\n")
        return _hidden(model, shared, *args)

    logprobs._shared_prompt_hidden = _recorded

if os.environ.get("POSTTRAIN_TEST_PATH_LOG"):  # a line per log-prob computation: the chunked output layer or logits
    from posttrain.models import logprobs as _logprobs

    def _recording(name, fn):
        def run(*args, **kwargs):
            with open(os.path.join(os.environ["POSTTRAIN_TEST_PATH_LOG"], f"rank{os.environ['RANK']}.txt"), "a") as f:
                f.write(name + "\n")
            return fn(*args, **kwargs)

        return run

    _logprobs.chunked_token_logprobs = _recording("chunked", _logprobs.chunked_token_logprobs)
    _logprobs._logits_logprobs = _recording("logits", _logprobs._logits_logprobs)
    _logprobs._packed_logprobs = _recording("packed", _logprobs._packed_logprobs)
    from posttrain.generation import lean_decoder as _lean_decoder

    _supports = _lean_decoder.supports

    def _recorded_supports(model):
        lean = _supports(model)
        with open(os.path.join(os.environ["POSTTRAIN_TEST_PATH_LOG"], f"rank{os.environ['RANK']}.txt"), "a") as f:
            f.write("lean-decoder\n" if lean else "model-forward-decode\n")
        return lean

    _lean_decoder.supports = _recorded_supports

from posttrain import cli  # noqa: E402

sys.exit(cli.main(sys.argv[1:]))
