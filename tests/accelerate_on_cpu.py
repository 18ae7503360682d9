"""Test-only: let accelerate's own FSDP path run on a machine without a GPU (2 gloo processes).

accelerate (pinned: 1.15) never selects FSDP for a CPU process group: with `cpu=True` it sets up MULTI_CPU and drops
the plugin (the run would silently be DDP), which posttrain refuses at start (training/sharding.check_launch). This
patch, applied by the test's launcher script (tests/multiproc_sharded.py) before posttrain builds its Accelerator,
puts back what accelerate sets on GPUs: the distributed type, and the plugin read from the launcher's FSDP_*
variables, in the process-wide state that every Accelerator reads. Nothing else in accelerate is changed.
"""

import os

PINNED = "1.15."


def install() -> None:
    import accelerate
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not accelerate.__version__.startswith(PINNED):
        raise RuntimeError(f"tests/accelerate_on_cpu.py patches accelerate {PINNED}x private state; this is "
                           f"{accelerate.__version__}: check the patch against it and update PINNED.")
    original = Accelerator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate does
            if self.state.mixed_precision != "no":
                plugin.set_mixed_precision(self.state.mixed_precision)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin

    Accelerator.__init__ = init
