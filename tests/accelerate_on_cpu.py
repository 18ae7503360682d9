"""Test-only: let accelerate's own FSDP and DeepSpeed paths run on a machine without a GPU (2 gloo processes).

accelerate (pinned: 1.15) never selects FSDP or DeepSpeed for a CPU process group: with `cpu=True` it sets up
MULTI_CPU and drops the plugin (the run would silently be DDP); without, DeepSpeed is selected but every process
believes it is process 0 of 1. posttrain refuses both at start (training/sharding.check_launch). This patch, applied
by the test's launcher script before posttrain builds its Accelerator, puts back what accelerate would have set on
GPUs: the distributed type and plugin (FSDP), or the process count and indices (DeepSpeed), in the process-wide
state that every Accelerator reads. Nothing else in accelerate is changed.
"""

import os

PINNED = "1.15."


def install() -> None:
    import accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
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
        elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            import torch.distributed as dist

            world, rank = dist.get_world_size(), dist.get_rank()
            local = int(os.environ.get("LOCAL_RANK", rank))
            for shared in (PartialState._shared_state, AcceleratorState._shared_state):
                shared.update(num_processes=world, process_index=rank, local_process_index=local)

    Accelerator.__init__ = init
