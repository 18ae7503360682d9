"""Training on a CPU keeps freed memory in the heap (posttrain/training/heap.py): a block freed and asked for again
is reused, without a new page fault per 4 KiB."""

import json
import subprocess
import sys

import pytest

from posttrain.configs import SFTConfig
from posttrain.training import setup
from posttrain.training.heap import _glibc

# A fresh interpreter (no torch: posttrain.training.heap imports only ctypes) frees a 64 MiB block and asks for it
# again, counting the page faults of writing it the second time.
REUSE = """
import ctypes, json, sys
from posttrain.training.heap import _glibc, keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
before = faults()
block = libc.malloc(size); ctypes.memset(block, 1, size)
print(json.dumps({"kept": kept, "faults": faults() - before}))
"""


def _second_write_faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(_glibc() is None or not sys.platform.startswith("linux"), reason="needs Linux with glibc")
def test_a_freed_block_is_reused_without_page_faults():
    kept, default = _second_write_faults("keep"), _second_write_faults("default")
    assert kept["kept"] is True
    assert default["faults"] >= (64 << 20) // 4096 // 2  # glibc's default: a fresh mapping, faulted page by page
    assert kept["faults"] < 100  # the same pages, already there


@pytest.mark.parametrize("fast_paths", [True, False])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_a_cpu_run_keeps_the_heap_unless_fast_paths_are_off_or_memory_comes_first(
        tmp_path, monkeypatch, fast_paths, gradient_checkpointing):
    # checkpointing says memory matters more than time: the heap's holes would raise the peak that checkpointing lowers
    calls = []
    monkeypatch.setattr(setup, "keep_freed_host_memory", lambda: calls.append(1) or True)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, fast_paths=fast_paths,
                     gradient_checkpointing=gradient_checkpointing, report_to="none")
    accelerator = setup.make_accelerator(args, "no")
    assert accelerator.device.type == "cpu"
    assert calls == ([1] if fast_paths and not gradient_checkpointing else [])
