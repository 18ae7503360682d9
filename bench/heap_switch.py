"""Run a bench script with the kept heap (training/heap.py) forced on or off, whatever the model's size.

Usage: python bench/heap_switch.py keep|default SCRIPT [ARGS...]
  keep     the heap kept for any model (HEAP_PAYS_FROM set to 0; still only with fast paths on, checkpointing off)
  default  glibc's default allocator for any model (setup.keep_freed_host_memory replaced by a no-op)
Used for docs/performance.md, "The heap", e.g.
  python bench/heap_switch.py keep bench/dpo_step.py /tmp/bench-models/v152k
"""

import runpy
import sys

from posttrain.training import heap, setup

mode, script = sys.argv[1], sys.argv[2]
if mode == "keep":
    heap.HEAP_PAYS_FROM = 0  # what heap_pays reads
elif mode == "default":
    setup.keep_freed_host_memory = lambda: False
else:
    raise SystemExit(f"the first argument is keep or default, not {mode!r}")
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
