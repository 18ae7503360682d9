"""A CPU run sets torch's intra-op threads at each step to the cores the machine's other processes leave free
(posttrain/training/threads.py), and gives the run's own count back at the end."""

import sys

import pytest
import torch
from datasets import Dataset

from posttrain.configs import SFTConfig
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model
from posttrain.training import threads
from posttrain.training.threads import IntraOpThreads, Usage, cores_used_by_others, read_usage, threads_for


@pytest.mark.parametrize("most, cores, others, expected", [
    (2, 2, 0.0, 2),  # quiet
    (2, 2, 0.2, 2),  # a core the others touch now and then is still free
    (2, 2, 0.67, 1),  # one busy process beside two threads of ours (it gets 2/3 of a core)
    (2, 2, 1.0, 1),
    (2, 2, 3.5, 1),  # never fewer than one
    (16, 16, 4.0, 12),
    (8, 16, 0.0, 8),  # never more than the run's own count
])
def test_the_threads_are_the_cores_the_others_leave(most, cores, others, expected):
    assert threads_for(most, cores, others) == expected


def test_the_others_use_is_the_machines_busy_time_less_this_process():
    before, after = Usage(wall=10.0, machine_busy=100.0, own=5.0), Usage(wall=12.0, machine_busy=104.5, own=7.5)
    assert cores_used_by_others(before, after) == pytest.approx(1.0)  # 4.5 s busy, 2.5 of them ours, over 2 s
    assert cores_used_by_others(before, Usage(wall=12.0, machine_busy=101.0, own=7.5)) == 0.0  # tick rounding


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_machines_usage_is_read_from_proc_stat():
    first = second = read_usage()
    while second.own <= first.own and second.wall - first.wall < 5:  # processor time of our own, a tick at least
        sum(i * i for i in range(100_000))
        second = read_usage()
    assert second.wall > first.wall and second.own > first.own
    assert second.machine_busy >= first.machine_busy


class Machine:
    """A reader of usage that a test drives: each read advances the clock by `window` seconds, over which the other
    processes kept `others` cores busy (as set before the read) and this process one."""

    def __init__(self, window: float = 1.0):
        self.others, self.window, self.now = 0.0, window, Usage(0.0, 0.0, 0.0)

    def __call__(self) -> Usage:
        now = self.now
        self.now = Usage(now.wall + self.window, now.machine_busy + self.window * (self.others + 1),
                         now.own + self.window)
        return self.now


@pytest.fixture
def two_threads(monkeypatch):
    for name in threads.USER_SETTINGS:  # the tests' conftest fixes OMP_NUM_THREADS=1
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_busy_machine_gets_one_thread_and_a_quiet_one_its_threads_back(two_threads):
    machine = Machine()
    chooser = IntraOpThreads("cpu", fast_paths=True, read=machine)
    chooser.adjust()
    assert torch.get_num_threads() == 2
    machine.others = 1.0
    chooser.adjust()
    assert torch.get_num_threads() == 1
    machine.others = 0.05
    chooser.adjust()
    assert torch.get_num_threads() == 2
    machine.others = 1.0
    chooser.adjust()
    chooser.restore()
    assert torch.get_num_threads() == 2


def test_a_window_shorter_than_the_kernels_ticks_can_count_changes_nothing(two_threads):
    machine = Machine(window=threads.LOOK_EVERY_S / 3)
    machine.others = 1.0
    chooser = IntraOpThreads("cpu", fast_paths=True, read=machine)
    chooser.adjust()
    assert torch.get_num_threads() == 2
    chooser.adjust(), chooser.adjust()  # now a whole window has passed
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("case", ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "cuda", "fast_paths off", "one thread"])
def test_the_users_count_a_gpu_run_and_fast_paths_off_are_left_alone(two_threads, monkeypatch, case):
    if case.endswith("NUM_THREADS"):
        monkeypatch.setenv(case, "2")
    if case == "one thread":
        torch.set_num_threads(1)
    machine = Machine()
    machine.others = 1.0
    chooser = IntraOpThreads("cuda" if case == "cuda" else "cpu", fast_paths=case != "fast_paths off", read=machine)
    chooser.adjust(), chooser.adjust()
    assert torch.get_num_threads() == (1 if case == "one thread" else 2)


def test_a_run_beside_a_busy_process_trains_on_one_thread_and_ends_with_its_own(two_threads, tokenizer, tmp_path,
                                                                                monkeypatch):
    machine = Machine()
    machine.others = 1.0
    monkeypatch.setattr(threads, "read_usage", machine)
    seen = []
    step = SFTTrainer._optimizer_step
    monkeypatch.setattr(SFTTrainer, "_optimizer_step", lambda self: seen.append(torch.get_num_threads()) or step(self))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                     save_strategy="no", use_cpu=True, report_to="none")
    trainer = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                         train_dataset=Dataset.from_dict({"text": ["ab cd"] * 12}), processing_class=tokenizer)
    trainer.train()
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == 2
