"""The GPU kit's dry run (bench/gpu/run.sh --call 1|2 --dry-run): both calls run every part on this CPU, small and in
float32, within their deadline, and print their tables with a figure or a one-line reason in every row.

About two minutes of two processes: CI's first phase runs it (POSTTRAIN_KIT_DRY_RUN=1, at the floors of the libraries,
which are what the kit carries to the GPU machine); elsewhere it skips unless that variable is set.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.environ.get("POSTTRAIN_KIT_DRY_RUN") != "1",
                                reason="the GPU kit's dry run (two minutes) runs in CI's first phase: set "
                                       "POSTTRAIN_KIT_DRY_RUN=1 to run it here")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("kit")


def _call(call: int, work: Path) -> tuple[str, float]:
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/run.sh"), "--call", str(call), "--dry-run", "--work",
                           str(work)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    elapsed = float(re.search(r"Kit time: (\d+) s of a (\d+) s deadline", done.stdout).group(1))
    return done.stdout, elapsed


def _no_result(stdout: str) -> list[tuple[str, str]]:
    """Every part that gave no result, as the kit says it while running ('PART: no result: REASON'), but those that
    cannot run here for a reason outside the checkout: the wheels folder (bench/gpu/fetch_wheels.sh fetches it), and
    where TRL's anchor scripts (../shared/bench) are not beside the checkout, the rows that read them."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import kit

    anchors = kit.anchors_dir() is not None
    return [(part, reason) for part, reason in re.findall(r"\] ([\w-]+): no result: (.*)", stdout)
            if not (part == "wheels" and "fetch_wheels.sh" in reason)
            and not (not anchors and "anchor" in reason and "were not found" in reason)]


def test_call_1_generation_and_the_three_trainers_beside_trl(work):
    stdout, elapsed = _call(1, work)
    assert elapsed < 290
    missing = _no_result(stdout)
    assert not missing, missing
    for row in ("posttrain (lean decoder, growing shapes)", "cache_implementation=static",
                "transformers generate (TRL's in-process path)", "One decode step under the profiler"):
        assert row in stdout
    for kind in ("GRPO", "SFT", "DPO"):
        rows = re.findall(rf"\| {kind} [^\n]*\n\|  \| posttrain \| ([\d.]+) \|", stdout)
        if kind == "GRPO" or "were not found" not in stdout:  # SFT's and DPO's rows come from TRL's anchors
            assert rows and float(rows[0]) > 0, kind


def test_call_2_tests_fsdp2_packed_rows_and_the_longest_completion(work):
    stdout, elapsed = _call(2, work)
    assert elapsed < 290
    missing = _no_result(stdout)
    assert not missing, missing
    assert re.search(r"Tests \(tests/test_gpu.py[^)]*\): \d+ passed", stdout) and "failed" not in stdout
    assert "| posttrain (FSDP2) | " in stdout
    packed = re.findall(r"\| (eager|sdpa) \| rows, one_row \| 4: packed, ([\d.e+-]+) \|", stdout)
    assert {kernel for kernel, _ in packed} == {"eager", "sdpa"}
    assert all(float(diff) < 1e-4 for _, diff in packed)  # float32: each packed sequence got what it gets alone
    assert re.search(r"\| posttrain \| 32 \| 16: trained", stdout)
