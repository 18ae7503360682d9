"""TRL's anchor (../shared/bench/trl_grpo.py) with natural completion lengths: completions end at EOS.

Usage: python bench/trl_grpo_natural.py MODEL_DIR [trl_grpo.py's flags]   (SHARED: the anchor's folder)

Runs the anchor script unchanged except that `generation_kwargs` loses its `min_new_tokens`, so TRL samples as a
user's run does; use a model from bench/make_natural.py. Prints the anchor's JSON line with `completion_tok_per_s`
counted from the completions TRL generated, its completions' mean and longest length, and the share of its
matmul FLOPs spent on padding and finished rows (flops.padding_waste: TRL's generate decodes every row to the
round's longest, and its training passes project every padded completion position).
"""

import contextlib
import io
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.environ.get("SHARED", os.path.join(here, "..", "..", "shared", "bench")))


def main():
    import trl

    import trl_grpo  # the anchor script

    config_class, trainer_class, runs, rounds = trl.GRPOConfig, trl.GRPOTrainer, [], []

    def natural_config(*args, **kwargs):
        kwargs["generation_kwargs"] = {k: v for k, v in (kwargs.get("generation_kwargs") or {}).items()
                                       if k != "min_new_tokens"}
        return config_class(*args, **kwargs)

    class Recorded(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rounds.append({"prompt": out["prompt_mask"].sum(1).tolist(),
                           "completion": out["completion_mask"].sum(1).tolist(),
                           "decoded_row_steps": None})  # TRL's generate decodes every row to the longest
            return out

    trl.GRPOConfig, trl.GRPOTrainer = natural_config, Recorded
    anchor_output = io.StringIO()
    with contextlib.redirect_stdout(anchor_output):
        trl_grpo.main()
    result = json.loads(anchor_output.getvalue().strip().splitlines()[-1])
    from flops import padding_waste

    result["completion_tok_per_s"] = round(sum(sum(r["completion"]) for r in rounds) / result["wall_s"], 1)
    result.update(padding_waste(runs[-1].model.config, rounds, runs[-1].beta, head_on_real_tokens=False))
    print(json.dumps(result))

if __name__ == "__main__":
    main()
