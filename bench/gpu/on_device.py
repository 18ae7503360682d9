"""Run one benchmark script on a chosen device and precision, and add what the GPU kit reports.

Usage: python bench/gpu/on_device.py --device cuda|cpu --precision bf16|fp32 [--weights bf16|fp32] SCRIPT MODEL_DIR
                                    [SCRIPT's flags]

SCRIPT is one of TRL's anchors (trl_grpo.py, trl_sft.py, trl_dpo.py of ../shared/bench, or the copies
bench/gpu/fetch_wheels.sh puts in bench/gpu/offline/anchors) or posttrain's bench/grpo_step.py, sft_step.py,
dpo_step.py. Those scripts write `use_cpu=True, bf16=False` into their configs; here the config class of the
script's library (TRL's for a `trl_*.py` script, posttrain's otherwise) is wrapped so that these two fields follow
--device and --precision, `--weights bf16` loads the weights in bf16 through TRL's own switch
(`model_init_kwargs={"dtype": "bfloat16"}`, on both sides), and output_dir is a fresh temporary folder (posttrain
locks its output_dir for the run, and the scripts name one fixed folder). Nothing else of the workload changes, and the script prints its own JSON
line as usual. After it, one more line:

    {"kit": {"device", "device_name", "precision", "weights", "distributed_type", "peak_gpu_mib",
             "peak_reserved_mib", "step_s_median", "steps_timed"}}

distributed_type: accelerate's, after the run (FSDP under the kit's FSDP2 launch);
peak_gpu_mib: torch.cuda.max_memory_allocated() in MiB, its counter reset when train() starts (None on a CPU);
peak_reserved_mib: torch.cuda.max_memory_reserved() beside it (what the caching allocator held: the GPU memory the run
really took);
step_s_median: the median time between the ends of consecutive optimizer steps (steps 2..N, so without the first
step's one-time work; CUDA synchronised at each step's end), None with fewer than 2 steps.
Under `accelerate launch` with FSDP on a CPU (the kit's --dry-run) the test-only patch tests/accelerate_on_cpu.py is
installed first: accelerate keeps FSDP only on GPUs.
"""

import argparse
import functools
import json
import os
import runpy
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KINDS = ("grpo", "sft", "dpo")
sys.path.insert(0, os.path.join(ROOT, "bench"))  # bench/step_clock.py, bench/flops.py

from step_clock import OptimizerStepClock  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this wrapper's options, [SCRIPT, its arguments...])."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--precision", choices=["bf16", "fp32"], required=True)
    ap.add_argument("--weights", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("script")
    args, rest = ap.parse_known_args(argv)
    return args, [args.script, *rest]


def library_of(script: str) -> str:
    """'trl' for TRL's anchors (trl_*.py), 'posttrain' for posttrain's bench scripts."""
    return "trl" if os.path.basename(script).startswith("trl_") else "posttrain"


def kind_of(script: str) -> str:
    """'grpo', 'sft' or 'dpo': the trainer a bench script runs, from its file name."""
    kinds = [kind for kind in KINDS if kind in os.path.basename(script)]
    if len(kinds) != 1:
        raise SystemExit(f"{script} names none of grpo, sft, dpo: on_device.py runs those bench scripts only.")
    return kinds[0]


def force_fields(cls, **fields) -> None:
    """Wrap a config dataclass's __init__ so that `fields` override whatever the caller passed."""
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        kwargs.update(fields)
        original(self, *args, **kwargs)

    cls.__init__ = init


def reset_peak_at_train(cls, device: str) -> None:
    """Wrap a trainer class's train() so that CUDA's peak-memory counter starts with it (model loading excluded)."""
    original = cls.train

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return original(self, *args, **kwargs)

    cls.train = train


def patch_matmul_rate(device: str, precision: str) -> None:
    """bench/grpo_step.py reports `matmul_gflop_per_s` from bench/flops.py's float32 CPU product: on a GPU, measure the
    same [2048 x hidden] @ [hidden x vocab] product on the GPU in the run's precision instead (the machine's own
    limit for the step's dominant shape, as the script means it)."""
    if device != "cuda":
        return
    import flops
    import torch

    def gpu_matmul_gflops(rows: int, inner: int, cols: int, repeats: int = 20) -> float:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        a = torch.randn(rows, inner, device="cuda", dtype=dtype)
        b = torch.randn(cols, inner, device="cuda", dtype=dtype)
        a @ b.T
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b.T
        torch.cuda.synchronize()
        return 2 * rows * inner * cols * repeats / (time.perf_counter() - start) / 1e9

    flops.matmul_gflops = gpu_matmul_gflops


def prepare(script: str, device: str, precision: str, output_dir: str, weights: str = "fp32") -> OptimizerStepClock:
    """Everything before the script runs: the CPU FSDP patch where needed, the config and trainer wrappers, the
    step clock."""
    if device == "cpu" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import accelerate_on_cpu

        accelerate_on_cpu.install()
    if library_of(script) == "trl":
        import trl as library
    else:
        import posttrain as library
    trainer = kind_of(script).upper()
    fields = dict(use_cpu=device == "cpu", bf16=precision == "bf16", output_dir=output_dir)
    if weights == "bf16":
        fields["model_init_kwargs"] = {"dtype": "bfloat16"}
    force_fields(getattr(library, f"{trainer}Config"), **fields)
    reset_peak_at_train(getattr(library, f"{trainer}Trainer"), device)
    patch_matmul_rate(device, precision)
    return OptimizerStepClock(synchronize_cuda=device == "cuda")


def distributed_type() -> str:
    """How accelerate set up the run that just ended: NO, MULTI_GPU, FSDP, ... ('NO' before any Accelerator)."""
    from accelerate.state import AcceleratorState

    kind = AcceleratorState._shared_state.get("distributed_type")
    return getattr(kind, "value", str(kind)) if kind is not None else "NO"


def kit_line(clock: OptimizerStepClock, device: str, precision: str, weights: str) -> dict:
    import torch

    gaps = clock.step_gaps()
    median, steps = (round(statistics.median(gaps), 4) if gaps else None), clock.steps()
    on_gpu = device == "cuda"
    return {"kit": {"device": device, "device_name": torch.cuda.get_device_name() if on_gpu else "cpu",
                    "precision": precision, "weights": weights, "distributed_type": distributed_type(),
                    "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_gpu else None,
                    "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1) if on_gpu else None,
                    "step_s_median": median, "steps_timed": steps}}


def main():
    args, script_argv = parse_args(sys.argv[1:])
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda was asked for and torch sees no CUDA device: run on a GPU machine, or "
                             "use --device cpu.")
    output_dir = tempfile.mkdtemp(prefix="kit-run-")  # the scripts share a fixed one, which a run holds locked
    clock = prepare(args.script, args.device, args.precision, output_dir, args.weights)
    sys.argv = script_argv
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(kit_line(clock, args.device, args.precision, args.weights)), flush=True)


if __name__ == "__main__":
    main()
