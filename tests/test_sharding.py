"""FSDP2 (torch's fully_shard) on 2 gloo processes: the pieces a sharded GRPO step goes through
(posttrain/training/sharding.py, the weight export) give what an unsharded copy of the model gives; and the
strategies the trainers do not run yet are refused in one sentence."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

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


@pytest.mark.parametrize("state, name", [
    ({"distributed_type": "DEEPSPEED", "deepspeed_plugin": SimpleNamespace(zero_stage=3)}, "DeepSpeed ZeRO-3"),
    ({"distributed_type": "FSDP", "fsdp_plugin": SimpleNamespace(fsdp_version=1)}, "FSDP1"),
])
def test_strategies_the_trainers_do_not_run_are_refused_in_one_sentence(state, name):
    from accelerate.utils import DistributedType

    from posttrain.configs import ConfigError
    from posttrain.training.sharding import check_supported

    state = dict(state, distributed_type=DistributedType[state["distributed_type"]])
    with pytest.raises(ConfigError) as err:
        check_supported(SimpleNamespace(state=SimpleNamespace(**state)))
    assert str(err.value) == (f"This run was launched with {name}, which posttrain does not train with yet: launch "
                              "with FSDP2 (accelerate_config fsdp2) to shard the model, or with DDP (accelerate_config "
                              "multi_gpu).")
    check_supported(SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP,
                                                          fsdp_plugin=SimpleNamespace(fsdp_version=2))))
