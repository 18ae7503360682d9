"""Training on a CPU keeps freed memory in the heap (posttrain/training/heap.py): a block freed and asked for again
is reused, without a new page fault per 4 KiB."""

import json
import subprocess
import sys

import pytest
import torch

from posttrain.configs import SFTConfig
from posttrain.training import setup
from posttrain.training.heap import HEAP_PAYS_FROM, _glibc
from posttrain.training.optim import make_adam_states

# A fresh interpreter (no torch: posttrain.training.heap imports only ctypes) writes and frees a block of the given
# MiB twice and asks for it again, counting the page faults of writing it the third time.
REUSE = """
import ctypes, json, sys
from posttrain.training.heap import _glibc, keep_freed_host_memory, return_freed_host_memory
mode, size = sys.argv[1], int(sys.argv[2]) << 20
kept = keep_freed_host_memory() if mode == "keep" else return_freed_host_memory() if mode == "return" else False
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
for _ in range(2):  # (twice: glibc's default maps the first block and, having raised its threshold, heaps the second)
    block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
before = faults()
block = libc.malloc(size); ctypes.memset(block, 1, size)
print(json.dumps({"kept": kept, "faults": faults() - before}))
"""


def _second_write_faults(mode: str, mib: int = 64) -> dict:
    out = subprocess.run([sys.executable, "-c", REUSE, mode, str(mib)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


LINUX_GLIBC = pytest.mark.skipif(_glibc() is None or not sys.platform.startswith("linux"), reason="needs Linux, glibc")


@LINUX_GLIBC
def test_a_freed_block_is_reused_without_page_faults():
    kept, default = _second_write_faults("keep"), _second_write_faults("default")
    assert kept["kept"] is True
    assert default["faults"] >= (64 << 20) // 4096 // 2  # glibc's default: a fresh mapping, faulted page by page
    assert kept["faults"] < 100  # the same pages, already there


@LINUX_GLIBC
def test_with_checkpointing_a_freed_block_of_a_mib_or_more_goes_back_to_the_system():
    """A 16 MiB block, below the 32 MiB that glibc's own threshold rises to: glibc's default keeps it in the heap once
    a freed mapping raised the threshold (its pages reused); with the fixed threshold it is unmapped at every free."""
    returned, default = _second_write_faults("return", 16), _second_write_faults("default", 16)
    assert returned["kept"] is True
    assert default["faults"] < 100
    assert returned["faults"] >= (16 << 20) // 4096 // 2


@pytest.mark.parametrize("fast_paths", [True, False])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("weights_mib", [78, 2048])
def test_a_cpu_run_keeps_the_heap_only_for_a_large_model_with_fast_paths_and_without_checkpointing(
        tmp_path, monkeypatch, fast_paths, gradient_checkpointing, weights_mib):
    # checkpointing says memory matters more than time: the heap's holes would raise the peak that checkpointing
    # lowers; a small model's peak is mostly not its states, and the holes weigh more there than the faults they save
    calls, states, returned = [], [], []
    monkeypatch.setattr(setup, "keep_freed_host_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(setup, "return_freed_host_memory", lambda: returned.append(1) or True)
    monkeypatch.setattr(setup, "make_adam_states", states.append)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, fast_paths=fast_paths,
                     gradient_checkpointing=gradient_checkpointing, report_to="none")
    accelerator = setup.make_accelerator(args, "no")
    model = torch.nn.Linear(1024, weights_mib * 256, bias=False, device="meta")  # 4 bytes x 1024 a row
    setup.prepare_host_memory(accelerator, args, model, "the optimizer")
    kept = fast_paths and not gradient_checkpointing and weights_mib * 2**20 >= HEAP_PAYS_FROM
    assert calls == ([1] if kept else [])
    assert states == (["the optimizer"] if kept else [])  # its states made before the first step, where kept
    assert returned == ([1] if fast_paths and gradient_checkpointing else [])  # large freed blocks unmapped at once


@pytest.mark.parametrize("options", [dict(fused=True), dict(fused=False, foreach=False),
                                     dict(fused=False, amsgrad=True), dict(fused=False, foreach=True)])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_adam_states_made_up_front_are_those_its_first_step_makes(cls, options):
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    models[1][1].weight.requires_grad_(False)  # a frozen parameter gets no state either way
    models[0][1].weight.requires_grad_(False)
    optimizers = [cls([p for p in m.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01, **options)
                  for m in models]
    make_adam_states(optimizers[1])
    assert len(optimizers[1].state) == 5 and len(optimizers[0].state) == 0
    x = torch.randn(4, 6)
    for _ in range(2):
        for model, optimizer in zip(models, optimizers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    lazy, early = (o.state_dict() for o in optimizers)
    assert lazy["param_groups"] == early["param_groups"]
    assert lazy["state"].keys() == early["state"].keys()
    for index, state in lazy["state"].items():
        assert state.keys() == early["state"][index].keys()
        for key, value in state.items():
            other = early["state"][index][key]
            assert (value.dtype, value.device, value.shape) == (other.dtype, other.device, other.shape), key
            assert torch.equal(value, other), key
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_other_optimizers_are_left_as_they_are():
    model = torch.nn.Linear(3, 2)
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      type("MyAdamW", (torch.optim.AdamW,), {})(model.parameters())):
        make_adam_states(optimizer)
        assert len(optimizer.state) == 0
