"""Run a benchmark script with posttrain's tied-embedding route off (models/tied_embedding.py), for a same-session
comparison of the route against autograd's dense lookup gradient.

Usage: python bench/without_tied_rows.py SCRIPT [its arguments]   (e.g. bench/clocked.py bench/sft_step.py MODEL ...)

The script runs unchanged as __main__ in this process, with `routable` answering no for every embedding.
"""

import runpy
import sys

import posttrain.models.tied_embedding as tied_embedding

tied_embedding.routable = lambda embedding: False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
