"""Faults on one of two processes, for tests/test_multiproc_faults.py.

    python multiproc_faults.py FAULT OUT_DIR -- <posttrain grpo arguments>

patches one place to fail on one process only, writes the time of the fault to OUT_DIR/fault_time, then runs the
command line as a user would. FAULT is reward (rank 1's reward function raises at step 2), generation (rank 1's
generator at its second round), data (rank 1's prompt stream breaks after its first round), saving (the main
process cannot write checkpoint-1), nonfinite (rank 1's loss turns NaN at step 2), nonfinite_grad (rank 1's
gradient turns NaN at step 2 while its loss stays finite: under DeepSpeed the engine's own step meets it),
interrupt (both processes' reward functions never return at step 2; once both wait, rank 0 sends the launcher
SIGINT, as a Ctrl-C in the terminal reaches it), reset (the run has an environment_factory, Counter, whose reset
raises on rank 1 at step 2), tool (the run has the tool `tally`, called on every rollout's first turn through a
response_template function; on rank 1 at step 2 it returns a list, which is not a tool result: the tool machinery
fails outside the model's turn, where an exception inside the tool would have been the model's error message). Each process writes its exit code to OUT_DIR/exit_<rank>.
With PT_ACCELERATE_ON_CPU=1 the test-only patch of tests/accelerate_on_cpu.py is applied first (FSDP and DeepSpeed
launches on CPU).
"""

import os
import signal
import sys
import threading
import time

FAULT, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("RANK", "0"))


def _mark():
    with open(os.path.join(OUT, "fault_time"), "w") as f:
        f.write(repr(time.time()))


def faulty_reward(completions, trainer_state, **kwargs):
    """Scores by length; on rank 1 at step 2 it raises, as a reward function with a bad row would."""
    if FAULT == "reward" and RANK == 1 and trainer_state.global_step == 1:
        _mark()
        raise ValueError("rank 1 cannot score this completion")
    if FAULT == "interrupt" and trainer_state.global_step == 1:
        waiting = os.path.join(OUT, "rank1_waits")
        if RANK == 1:
            open(waiting, "w").close()
        else:
            while not os.path.exists(waiting):
                time.sleep(0.05)
            _mark()
            os.kill(os.getppid(), signal.SIGINT)  # the launcher, which passes it on to every process
        threading.Event().wait(60)  # never returns (within the test's time)
    return [float(len(c)) for c in completions]


def _step1_done() -> bool:
    return os.path.exists(os.path.join(OUT, "step1_done"))


class Counter:
    """An environment for the reset fault: a running count the model adds to."""

    def reset(self, **row):
        if FAULT == "reset" and RANK == 1 and _step1_done():
            _mark()
            raise RuntimeError("rank 1 cannot reach its environment")
        self.count = 0

    def add(self, n: int) -> str:
        """Add to the count.

        Args:
            n: How much to add.
        """
        self.count += n
        return str(self.count)


def tally(n: int) -> str:
    """Count to n.

    Args:
        n: Where to stop.
    """
    if FAULT == "tool" and RANK == 1 and _step1_done():
        _mark()
        return list(range(n))
    return str(n)


def call_on_first_turn(text: str, prefix: str) -> dict:
    """The turns as read for the tool fault: the first turn of a rollout calls tally(3), later turns nothing."""
    if "<tool_response>" in prefix:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text,
            "tool_calls": [{"type": "function", "function": {"name": "tally", "arguments": {"n": 3}}}]}


AGENTS = {"reset": {"environment_factory": Counter},
          "tool": {"tools": [tally], "response_template": call_on_first_turn}}


def _patch():
    if FAULT == "generation" and RANK == 1:
        from posttrain.generation.transformers_backend import TransformersGenerator

        original, calls = TransformersGenerator.generate, []

        def generate(self, prompts, row_keys=None):
            calls.append(1)
            if len(calls) == 2:
                _mark()
                raise RuntimeError("CUDA out of memory (simulated) while generating")
            return original(self, prompts, row_keys)

        TransformersGenerator.generate = generate
    elif FAULT == "data" and RANK == 1:
        from posttrain.data import DataError, PromptSource

        original = PromptSource.rounds

        def rounds(self):
            stream = original(self)
            yield next(stream)
            _mark()
            raise DataError("row 17 of the prompt stream could not be read")

        PromptSource.rounds = rounds
    elif FAULT == "saving" and RANK == 0:
        from posttrain.training import checkpoint

        original = checkpoint.save_policy if hasattr(checkpoint, "save_policy") else None
        import posttrain.training.saving as saving

        real = saving.save_policy

        def save_policy(policy, tokenizer, config, output_dir, state_dict=None):
            if "checkpoint-1" in output_dir:
                _mark()
                raise OSError(28, "No space left on device", output_dir)
            return real(policy, tokenizer, config, output_dir, state_dict)

        saving.save_policy = save_policy
        del original
    elif FAULT == "nonfinite" and RANK == 1:
        from posttrain.grpo import losses

        original = losses.Loss.__call__

        def call(self, inputs, params, norm):
            out = original(self, inputs, params, norm)
            if inputs.logps.requires_grad and os.path.exists(os.path.join(OUT, "step1_done")):
                _mark()
                return losses.LossOutputs(out.loss * float("nan"), out.stats)
            return out

        losses.Loss.__call__ = call
    elif FAULT == "nonfinite_grad" and RANK == 1:
        import torch

        from posttrain.grpo import losses

        original = losses.Loss.__call__

        def call(self, inputs, params, norm):
            out = original(self, inputs, params, norm)
            if inputs.logps.requires_grad and os.path.exists(os.path.join(OUT, "step1_done")):
                _mark()  # 0 * sqrt(0 * x): the value 0, the gradient 0 * inf = NaN
                return losses.LossOutputs(out.loss + 0 * torch.sqrt(0 * inputs.logps.sum()), out.stats)
            return out

        losses.Loss.__call__ = call


if __name__ == "__main__":
    if os.environ.get("PT_ACCELERATE_ON_CPU") == "1":
        import accelerate_on_cpu

        accelerate_on_cpu.install()
    _patch()
    from transformers import TrainerCallback

    from posttrain import cli

    class MarkSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            open(os.path.join(OUT, "step1_done"), "w").close()

    from posttrain.grpo import trainer as grpo_trainer

    real_init = grpo_trainer.GRPOTrainer.__init__

    def init(self, *args, **kwargs):
        kwargs["callbacks"] = [MarkSteps()]
        kwargs.update(AGENTS.get(FAULT, {}))
        real_init(self, *args, **kwargs)

    grpo_trainer.GRPOTrainer.__init__ = init
    code = cli.main(["grpo", *sys.argv[sys.argv.index("--") + 1:]])
    with open(os.path.join(OUT, f"exit_{RANK}"), "w") as f:
        f.write(str(code))
    sys.exit(code)
