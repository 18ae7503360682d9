"""`posttrain <command> ...` as a user runs it under `accelerate launch --config_file <fsdp2|zero2|zero3>`, with the
test-only patch that lets accelerate's FSDP and DeepSpeed paths run on CPU (tests/accelerate_on_cpu.py).

    accelerate launch --config_file CONFIG tests/multiproc_sharded.py grpo --model_name_or_path ... 
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import accelerate_on_cpu  # noqa: E402

accelerate_on_cpu.install()

from posttrain import cli  # noqa: E402

sys.exit(cli.main(sys.argv[1:]))
