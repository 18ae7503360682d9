"""posttrain's side of the multi-turn GRPO-with-tools benchmark: posttrain's GRPOTrainer with tools=[lookup] on CPU.

Usage: python bench/grpo_tools_step.py MODEL_DIR [--steps 4] [--gens 8] [--batch 16] [--completion 256] [--turn 32]
                                                 [--tool-calls 2] [--prompt 8] [--beta 0.04] [--threads 2]
                                                 [--gradient-checkpointing] [--chat-template PATH]
Same flags, workload and JSON keys as bench/trl_grpo_tools.py (TRL's side); the workload is bench/tools_workload.py.
The tool calls are scripted through posttrain's own override, `response_template=` a function (turn text, prefix
text) -> assistant message (tools_workload.scripted_turn_function); generation, the tool, the tool results' ids
(agents/chat_templates.py ToolSuffix) and the step are posttrain's. The batch statistics are read from each
micro-batch `_step_loss` receives (before posttrain drops rows whose advantage is 0; `rows_with_gradient` counts
the rows it then trained on).
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/tools_workload.py

import tools_workload as w


def main():
    args = w.parse_args()
    tok, shape = w.prepare(args)
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    stats = w.BatchStats()
    with_gradient = []

    class Recorded(GRPOTrainer):
        def _step_loss(self, mb, *rest, **kwargs):
            r = mb.rollouts
            stats.add(r.completion_mask, r.tool_mask, r.prompt_mask)
            with_gradient.append(len(self._rows_with_gradient(mb)) if self.skip_zero_advantage_rows else len(mb))
            return super()._step_loss(mb, *rest, **kwargs)

    cfg = GRPOConfig(**w.config_values(args, "/tmp/posttrain-bench-tools-out"),
                     plot_on_end=False)  # a one-off end-of-run cost, not a step
    ds = Dataset.from_dict(w.make_rows(64, args.prompt))
    with contextlib.redirect_stdout(sys.stderr):
        trainer = Recorded(model=args.model, reward_funcs=w.reward_text, args=cfg, train_dataset=ds,
                           processing_class=tok, tools=[w.lookup],
                           response_template=w.scripted_turn_function(args.tool_calls))
        wall, cpu = w.timed_train(trainer)
    print(json.dumps(w.result("posttrain", args, wall, cpu, stats, shape, rows_with_gradient=sum(with_gradient))))


if __name__ == "__main__":
    main()
