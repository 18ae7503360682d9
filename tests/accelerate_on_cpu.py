"""Test-only: let accelerate's own FSDP and DeepSpeed paths run on a machine without a GPU (2 gloo processes).

accelerate (1.10 to 1.15, the range pyproject.toml declares and the tests run) never selects FSDP or DeepSpeed for a CPU process group: with `cpu=True` it sets up
MULTI_CPU and drops the plugin (the run would silently be DDP), which posttrain refuses at start
(training/sharding.check_launch). This patch, applied by the test's launcher script (tests/multiproc_sharded.py)
before posttrain builds its Accelerator, puts back what accelerate sets on GPUs, in the process-wide state that every
Accelerator reads:
  - FSDP: the distributed type, and the plugin read from the launcher's FSDP_* variables; for FSDP1 the device as
    torch's FSDP1 names a CPU (`cpu`; accelerate's `cpu:0` fails its device check);
  - DeepSpeed (from the launcher, or a `deepspeed` field's plugin): the Accelerator is built with cpu=False (accelerate then selects DEEPSPEED and DeepSpeed starts its
    gloo process group on its CPU accelerator), and the process count and ranks, which accelerate leaves at 1 and 0
    when it finds no GPU, are read from the process group.
Nothing else in accelerate is changed. DeepSpeed's shared-memory allreduce for CPUs, a C++ extension it compiles on
first use (half a minute of both cores on a fresh machine), is marked unavailable, so its collectives go through the
gloo process group, as they do wherever the extension cannot build.
"""

import os

import torch


def install() -> None:
    import accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # the private state the patch writes: checked by name rather than by version, so that a release which keeps it
    # runs the sharded tests and one which changes it stops them with this sentence
    missing = [name for owner, name in ((PartialState, "_shared_state"), (AcceleratorState, "_shared_state"),
                                        (FullyShardedDataParallelPlugin, "set_mixed_precision"),
                                        (DistributedType, "FSDP"))
               if not hasattr(owner, name)]
    if missing or "fsdp_version" not in FullyShardedDataParallelPlugin.__dataclass_fields__:
        raise RuntimeError(f"tests/accelerate_on_cpu.py patches accelerate's private state, and accelerate "
                           f"{accelerate.__version__} lacks {missing or ['FullyShardedDataParallelPlugin.fsdp_version']}: "
                           "adapt the patch to it.")
    _skip_deepspeed_shm_build()
    original = Accelerator.__init__

    def init(self, *args, **kwargs):
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" or kwargs.get("deepspeed_plugin"):
            kwargs["cpu"] = False
            original(self, *args, **kwargs)
            import torch.distributed as dist

            ranks = {"num_processes": dist.get_world_size(), "process_index": dist.get_rank(),
                     "local_process_index": int(os.environ["LOCAL_RANK"])}
            PartialState._shared_state.update(ranks)
            AcceleratorState._shared_state.update(ranks)
            return
        original(self, *args, **kwargs)
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate does
            if plugin.fsdp_version == 1:  # FSDP1 takes `cpu` for a CPU device, not accelerate's `cpu:0`
                PartialState._shared_state["device"] = AcceleratorState._shared_state["device"] = torch.device("cpu")
            if self.state.mixed_precision != "no":
                plugin.set_mixed_precision(self.state.mixed_precision)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin

    Accelerator.__init__ = init


def _skip_deepspeed_shm_build() -> None:
    try:
        import deepspeed.ops
    except ImportError:  # no DeepSpeed: nothing to skip
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
