"""FSDP2 (torch's fully_shard) on 2 gloo processes: the pieces a sharded GRPO step goes through
(posttrain/training/sharding.py, the weight export) give what an unsharded copy of the model gives."""

import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(__file__)


@pytest.mark.multiproc
def test_fsdp2_generation_training_and_export_equal_the_unsharded_model(tmp_path):
    """Each process generates its own prompts inside gathered_for_generation, its completions ending at another
    step than the other process's (3 against 12 tokens: no collective waits inside the decode), then trains
    (no inference-tensor error after generation) and exports whole tensors. Everything equals an unsharded copy:
    completions, log-probs, gradients (summed over both batches) and the export, to 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(TESTS, "multiproc_fsdp2.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks[0]["lengths"] == [3, 3] and ranks[1]["lengths"] == [12, 12]
    for result in ranks:
        assert result["completions_equal"] and result["export_names_equal"] and result["export_shapes_full"]
        assert result["logps_max_diff"] == 0.0 and result["grad_max_diff"] == 0.0 and result["export_max_diff"] == 0.0
