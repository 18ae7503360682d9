import os
import re

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process, set before torch is imported: the README runs the suite with a worker per core
# (pytest-xdist), and the tests' launches start two processes each; with torch's default of a thread per core, their
# OpenMP threads spin against each other and the in-process tests run about 4x slower. The tests' tiny models gain
# nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _no_plots_at_the_end_of_runs(request, monkeypatch):
    """The hundreds of tiny in-process runs skip plot_on_end's drawing (about a second each); tests marked `plots`
    run it, and runs in subprocesses draw as a user's do."""
    if request.node.get_closest_marker("plots") is None:
        from posttrain.training.trainer import Trainer

        monkeypatch.setattr(Trainer, "_write_plots", lambda self: None)


@pytest.fixture(autouse=True)
def _fallbacks_said_anew():
    """A fast path's fallback is said once per process for a model class (models/loading.py fallback_said): each
    test starts with none said, so that a test reading the warnings sees them whatever ran before it."""
    from posttrain.models.loading import forget_fallbacks_said

    forget_fallbacks_said()


@pytest.fixture(scope="session")
def tokenizer():
    from posttrain.testing import tiny_tokenizer

    # the printable ASCII alphabet only (100 tokens): the byte-level tokens of the rest would make every tiny model's
    # output layer 2.6x larger and its completions longer (tests/test_data.py round-trips the full one)
    return tiny_tokenizer(all_bytes=False)


@pytest.fixture
def model(tokenizer):
    from posttrain.testing import tiny_model

    return tiny_model(tokenizer, hidden=32, layers=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from posttrain.testing import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny")), tokenizer, hidden=32, layers=1)


@pytest.fixture
def addition_dataset():
    from datasets import Dataset

    pairs = [(a, b) for a in range(4) for b in range(4)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def variable_length_model(tokenizer, **kwargs):
    """A tiny model that ends completions at varied lengths (EOS logit raised by 3: ~17% per token).

    Tests of loss normalisation need completions of different lengths, or grpo, bnpo and dapo coincide.
    """
    from transformers import Qwen2ForCausalLM

    from posttrain.testing import tiny_model

    eos = tokenizer.eos_token_id

    class VariableLength(Qwen2ForCausalLM):
        def forward(self, *args, **kw):
            out = super().forward(*args, **kw)
            out.logits[..., eos] += 3.0
            return out

    return tiny_model(tokenizer, model_class=VariableLength, **{"hidden": 32, "layers": 1, **kwargs})


def variable_length_fast_model(tokenizer, **kwargs):
    """Like `variable_length_model`, but the EOS push is a bias of a plain `nn.Linear` output layer, so the model
    takes the chunked log-prob path (models/logprobs.py) rather than the logits path."""
    import torch

    from posttrain.testing import tiny_model

    model = tiny_model(tokenizer, **{"hidden": 32, "layers": 1, **kwargs})
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 3.0
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model


def length_reward(completions, **kwargs):
    """A deterministic reward with spread: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def tiny_config(tmp_path, **overrides):
    from posttrain.configs import GRPOConfig

    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                  gradient_checkpointing=False, use_cpu=True, seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


class StopAt:
    """A callback that stops training once `step` optimizer steps are done (to cut a run, then resume it)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def use_sgd(trainer) -> None:
    """Swap the trainer's AdamW for plain SGD at its learning rate, whose update is linear in the gradient (Adam turns
    noise-level gradients, 1e-12 of either sign, into full +-lr steps, so its updates cannot be compared to
    tolerance); the schedule follows the optimizer that steps (else torch warns that it ran ahead of it)."""
    import torch

    from posttrain.training.optim import make_scheduler

    sgd = torch.optim.SGD([p for p in trainer.policy.parameters() if p.requires_grad], lr=trainer.args.learning_rate)
    trainer.optimizer.optimizer = sgd
    trainer.scheduler.scheduler = make_scheduler(sgd, trainer.args, trainer.total_steps)


def capture_gradients(trainer) -> list:
    """Record, at every optimizer step, a copy of each parameter's gradient (one dict per step)."""
    steps = []
    step = trainer.optimizer.step

    def capturing_step(*args, **kwargs):
        steps.append({n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing_step
    return steps


def train_recording_passes(trainer) -> tuple[list, tuple]:
    """Train with plain SGD (use_sgd), recording the rows of every training_step call. Returns (those row counts,
    (the trained parameters, the first step's gradients)), the latter as assert_same_updates takes them."""
    use_sgd(trainer)
    grads = capture_gradients(trainer)
    rows, step = [], trainer.training_step
    trainer.training_step = lambda model, batch, n=None: rows.append(len(batch)) or step(model, batch, n)
    trainer.train()
    return rows, ({n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads[0])


def assert_any_split_gives_the_same_update(train, directory, **options) -> None:
    """One optimizer step over 8 rows as 1 x 8, 2 x 4 or 8 x 1 micro-batches (plain SGD, rows in order) gives the
    same gradient and update, and a gradient that is not 0. `train(out, **config)` runs a trainer test's tiny run and
    returns (trainer, parameters, captured gradients). Returns the 8 x 1 gradients."""
    results = {}
    for micro, accum in ((8, 1), (4, 2), (1, 8)):
        _, params, grads = train(directory / f"{micro}x{accum}", capture=True, sgd=True, max_steps=1,
                                 per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                 train_sampling_strategy="sequential", **options)
        results[(micro, accum)] = (params, grads[0])
    return assert_same_updates(results)


def assert_same_updates(results: dict) -> dict:
    """{(micro, accumulation): (parameters, gradients)} of one step split several ways: every split's gradients and
    update equal the 8 x 1 split's, and some gradient is not 0. Returns the 8 x 1 gradients."""
    import torch

    ref_params, ref_grads = results[(8, 1)]
    for split, (params, grads) in results.items():
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), (split, name)
            assert torch.allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-7), (split, name)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())
    return ref_grads


def assert_same_run(records, records_shared, keys, params, params_shared, evaluated=None,
                    evaluated_shared=None) -> None:
    """A run through a shared layout (a pair's prefix once) against the same run without it: every step's `keys`, the
    evaluation's metrics (timings aside) and the final weights agree within float32 rounding. The two sum in other
    orders, whose rounding through two AdamW steps differs with the CPU's kernels (1.25e-6 on weights of up to 0.08
    on an AVX2-only CPU)."""
    import torch

    for a, b in zip(records, records_shared, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for key, value in (evaluated or {}).items():
        if not key.endswith(("runtime", "per_second")):
            assert evaluated_shared[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name in params:
        torch.testing.assert_close(params_shared[name], params[name], rtol=1e-5, atol=1e-5, msg=name)


def last_train_record(trainer) -> dict:
    """The last training-step record of log_history (after it comes the end-of-training summary, as in
    transformers)."""
    return [r for r in trainer.state.log_history if "loss" in r][-1]


def run_posttrain(argv: list[str], capfd):
    """`posttrain ARGV` run in this process (cli.main, as the console script calls it), its environment restored
    after (a YAML's `env:` sets variables): .returncode, .stdout, .stderr. For what a run prints and leaves behind; a
    new process pays seconds of imports, so only the tests about processes, launching and signals start one."""
    from types import SimpleNamespace

    from posttrain import cli

    environment = dict(os.environ)
    capfd.readouterr()
    try:
        code = cli.main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(environment)
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def two_gloo_processes(script: str, *args: str):
    """`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/<script> ARGS...` (1 thread each, the
    tests directory importable), asserted to exit 0."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(tests, script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def run_together(nodeid: str) -> str:
    """The tests that run on one pytest-xdist worker: each test file's, with its module's fixtures, except the
    sharded matrix (tests/test_sharded.py), whose runs share a launch per configuration: there a group is a launch
    configuration's name up to its first '-' or '.' (`fsdp1-cpu` and `fsdp1.yaml` are fsdp1, `zero3-all` and
    `zero3.yaml` zero3), so that the workers share the matrix."""
    file, _, test = nodeid.partition("::")
    if file.endswith("test_sharded.py") and test.endswith("]"):
        return file + "::" + re.split(r"[-.]", test[test.index("[") + 1:-1])[0]
    return file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README runs the suite on every core (`-n auto`): tests are sent to the workers in groups (run_together),
    in the order collected (pytest_collection_modifyitems: the longest first), not xdist's by number of tests."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class TogetherScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return run_together(nodeid)

    return TogetherScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Files with multi-process tests first (the sharded matrix before the rest), so that under pytest-xdist the
    longest groups do not start last; within a file the order is as written."""
    rank = {}
    for item in items:
        kind = 0 if item.get_closest_marker("sharded") else 1 if item.get_closest_marker("multiproc") else 2
        rank[_file(item.nodeid)] = min(rank.get(_file(item.nodeid), 2), kind)
    items.sort(key=lambda item: rank[_file(item.nodeid)])  # stable: each file's own order is kept
