"""Run a benchmark script with one of posttrain's fast paths off, for a same-session comparison of the path against
what runs without it.

Usage: python bench/without.py PATH SCRIPT [its arguments]   (e.g. bench/clocked.py bench/sft_step.py MODEL ...)

PATH:
    tied_rows       the tied-embedding route (models/tied_embedding.py): autograd's dense lookup gradient instead
    pair_prefixes   DPO's and ORPO's pairs with their common prefix once (sequences/prefixes.py): whole sequences
    prefix_rows     DPO's and the reward model's pairs as a row per pair and GRPO's shared prompts as a row per
                    prompt (models/prefix_rows.py): the prefixes' forward, then the continuations' against its cache,
                    or (under activation checkpointing, which turns the cache off) whole sequences

The script runs unchanged as __main__ in this process, with the path's switch turned off.
"""

import runpy
import sys


def _no_tied_rows():
    import posttrain.models.tied_embedding as tied_embedding

    tied_embedding.routable = lambda embedding: False


def _no_pair_prefixes():
    import posttrain.training.pairs as pairs

    pairs.MIN_SHARED_SAVING_FLOP = 1e30  # no micro-batch saves that many FLOPs


def _no_prefix_rows():
    import posttrain.models.logprobs as logprobs
    import posttrain.reward.trainer as reward_trainer

    logprobs.prefix_rows_work = lambda model: False
    reward_trainer.row_scores_work = lambda model: False


SWITCHES = {"tied_rows": _no_tied_rows, "pair_prefixes": _no_pair_prefixes, "prefix_rows": _no_prefix_rows}

if len(sys.argv) < 3 or sys.argv[1] not in SWITCHES:
    raise SystemExit(f"usage: python bench/without.py {{{','.join(SWITCHES)}}} SCRIPT [its arguments]")
SWITCHES[sys.argv[1]]()
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
