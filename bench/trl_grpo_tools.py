"""TRL's side of the multi-turn GRPO-with-tools benchmark: TRL's GRPOTrainer with tools=[lookup] on CPU.

Usage: python bench/trl_grpo_tools.py MODEL_DIR [--steps 4] [--gens 8] [--batch 16] [--completion 256] [--turn 32]
                                                [--tool-calls 2] [--prompt 8] [--beta 0.04] [--threads 2]
                                                [--gradient-checkpointing] [--chat-template PATH]
The workload (data, tool, scripted parsing, reward, flags) is bench/tools_workload.py's, shared with posttrain's
bench/grpo_tools_step.py. The tool calls are scripted by replacing `trl.trainer.grpo_trainer.parse_response` (what
TRL's `_generate` and `_tool_call_loop` read every turn with) by tools_workload.scripted_turn_function on the decoded
turn and prefix; generation, the tool, the tool results' ids (TRL's `_get_tool_suffix_ids`) and the step are TRL's.
Prints one JSON line on stdout (TRL's logs go to stderr): wall_s (of train()), s_per_step, completion_tok_per_s
(the model's tokens, tool results not counted), peak_rss_mib, cpu_s, tool_calls_per_step, and from the batches
`_compute_loss` received (tools_workload.BatchStats): tool_token_fraction and padding_fraction of the completion
tensor's positions, prompt_padding_fraction, the completion width, the model's and the tool results' tokens per row.
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

    import trl.trainer.grpo_trainer as grpo_module
    from trl import GRPOConfig, GRPOTrainer

    scripted = w.scripted_turn_function(args.tool_calls)

    def parse_response(tokenizer, ids, prefix=None, tools=None):
        return scripted(tokenizer.decode(ids), tokenizer.decode(prefix or []))

    grpo_module.parse_response = parse_response
    stats = w.BatchStats()

    class Recorded(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            stats.add(inputs["completion_mask"], inputs["tool_mask"], inputs["prompt_mask"])
            return super()._compute_loss(model, inputs)

    cfg = GRPOConfig(**w.config_values(args, "/tmp/trl-bench-tools-out"), dataloader_num_workers=0)
    ds = Dataset.from_dict(w.make_rows(64, args.prompt))
    with contextlib.redirect_stdout(sys.stderr):
        trainer = Recorded(model=args.model, reward_funcs=w.reward_text, args=cfg, train_dataset=ds,
                           processing_class=tok, tools=[w.lookup])
        wall, cpu = w.timed_train(trainer)
    print(json.dumps(w.result("trl", args, wall, cpu, stats, shape)))


if __name__ == "__main__":
    main()
