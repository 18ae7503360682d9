"""Tool calling over every generation engine, with real sampling: the in-process sampler (the lean decoder and the
model's own forward), `posttrain serve`, and vLLM colocate and server (the double). A random model writes no tool
call, so the turns are read by a response_template function that declares one call on a rollout's first turn; the
engine samples every turn, the tool runs, its result's ids come from the template, and the later turn is sampled
within the round from exactly prompt + first turn + result (the engines' answers are checked for that on every
turn). The same seed gives the same multi-turn rows in-process (either forward) and through a server."""

import copy
from pathlib import Path

import pytest
import torch

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.testing import tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")
TURN = 5  # tokens per turn (generation_kwargs max_new_tokens)
BUDGET = 160  # max_completion_length: two turns and the tool result fit
ROWS = [{"prompt": [{"role": "user", "content": f"What is {a} + 2?"}]} for a in range(2) for _ in range(2)]


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


def first_turn_calls_add(text: str, prefix: str) -> dict:
    """posttrain's response_template override: the first turn of a rollout calls add(1, 2), later turns call
    nothing."""
    if "<tool_response>" in prefix:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}


def _tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


def _spread(completions, **kwargs):
    """A reward with spread over the rows: the length of each completion's last message."""
    return [len(c[-1]["content"]) / 10.0 for c in completions]


def _trainer(tmp_path, tokenizer, **overrides):
    from conftest import tiny_config
    from datasets import Dataset

    from posttrain import GRPOTrainer

    config = tiny_config(tmp_path, **{"per_device_train_batch_size": 4, "num_generations": 2, "max_steps": 1,
                                      "max_completion_length": BUDGET, "generation_kwargs": {"max_new_tokens": TURN},
                                      "max_tool_calling_iterations": 1, **overrides})
    model = tiny_model(tokenizer, hidden=32, layers=1, max_positions=2048)
    return GRPOTrainer(model, reward_funcs=_spread, args=config,
                       train_dataset=Dataset.from_dict({"prompt": [r["prompt"] for r in ROWS]}),
                       processing_class=tokenizer, tools=[add], response_template=first_turn_calls_add)


def _sample(trainer, generator) -> list[tuple[list[int], list[int], list[bool]]]:
    """(prompt ids, completion ids, tool mask) of each row of ROWS sampled through `generator`."""
    sampled = trainer.agents.sample(copy.deepcopy(ROWS), [0, 0, 1, 1], [0, 1, 2, 3], generator, "cpu")
    r = sampled.rollouts
    assert sampled.counts.tolist() == [4, 4, 0]  # every row called add once, and it never failed
    return [(p[pm].tolist(), c[cm].tolist(), t[cm].tolist())
            for p, pm, c, cm, t in zip(r.prompt_ids, r.prompt_mask.bool(), r.completion_ids, r.completion_mask.bool(),
                                       r.tool_mask)]


def _check_rows(trainer, tokenizer, rows) -> None:
    """Each row is a first turn, the tool result's ids as the template renders them, and a second turn."""
    for _, ids, mask in rows:
        first = mask.index(False)
        result = first + mask[first:].index(True)
        assert not any(mask[first:result]) and all(mask[result:]) and all(mask[:first])
        assert 1 <= first <= TURN and 1 <= len(ids) - result <= TURN
        assert "<tool_response>\n3\n</tool_response>" in tokenizer.decode(ids[first:result])
        assert ids[first:result] == trainer.agents.suffix([{"role": "tool", "name": "add", "content": "3"}])


def test_in_process_lean_and_plain_forward_and_posttrain_serve_sample_the_same_multi_turn_rows(tmp_path):
    pytest.importorskip("uvicorn")
    from test_serve import running

    from posttrain.generation.server import ServerClient
    from posttrain.generation.server_generator import ServerGenerator
    from posttrain.serving.engine import TransformersEngine

    tokenizer = _tokenizer()
    trainer = _trainer(tmp_path, tokenizer)
    params = SamplingParams(max_new_tokens=TURN)
    lean = TransformersGenerator(trainer.policy, tokenizer, params, seed=7, lean=True)
    plain = TransformersGenerator(trainer.policy, tokenizer, params, seed=7, lean=False)
    in_process = _sample(trainer, lean)
    _check_rows(trainer, tokenizer, in_process)
    assert _sample(trainer, plain) == in_process
    engine = TransformersEngine(copy.deepcopy(trainer.policy), tokenizer, max_model_len=2048, name="tiny")
    with running(engine) as url:
        client = ServerClient(url, connect_timeout=10, request_timeout=30, sync_timeout=30)
        served = ServerGenerator(client, params, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id],
                                 seed=7)
        assert _sample(trainer, served) == in_process
    trainer.close()


@pytest.fixture
def _restore_environment(monkeypatch):
    """Colocate sets RANK, WORLD_SIZE, MASTER_PORT... for vLLM's external launcher, as TRL does: keep them out of the
    other tests (their subprocesses would join a process group)."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_vllm_colocate_and_server_run_the_tool_loop(tmp_path, _restore_environment):
    pytest.importorskip("fastapi")
    from test_vllm_adapters import FakeVLLMServer, serving
    from vllm_double import fake_vllm

    from posttrain.generation import make_generator
    from posttrain.generation.server import ServerClient
    from posttrain.generation.server_generator import ServerGenerator
    from posttrain.weights import export_weights

    tokenizer = _tokenizer()
    trainer = _trainer(tmp_path, tokenizer)
    with fake_vllm(model=tiny_model(tokenizer, hidden=32, layers=1, seed=3, max_positions=2048)) as double:
        generator = make_generator(_colocate(trainer.args), trainer.policy, tokenizer, seed=4)
        generator.sync_weights(export_weights(trainer.policy))
        rows = _sample(trainer, generator)
        generated = [args for name, args in double.log if name == "LLM.generate"]
    _check_rows(trainer, tokenizer, rows)
    assert len(generated) == 2  # the first turns, then every row's second turn in one call
    fake = FakeVLLMServer(max_model_len=2048)
    with fake_vllm(), serving(fake) as url:
        client = ServerClient(url, connect_timeout=5, request_timeout=5, sync_timeout=10)
        generator = ServerGenerator(client, SamplingParams(max_new_tokens=TURN), pad_id=tokenizer.pad_token_id,
                                    eos_ids=[tokenizer.eos_token_id], group_port=51998)
        generator.sync_weights(export_weights(trainer.policy))
        rows = _sample(trainer, generator)
    _check_rows(trainer, tokenizer, rows)
    requests = [body for path, body in fake.calls if path == "/v1/completions"]
    later = [body for body in requests if all(len(p) > len(rows[0][0]) for p in body["prompt"])]
    assert len(later) == 4  # one request per row's second turn (the rows' joined ids all differ)
    for prompt, ids, mask in rows:  # each later request was exactly the row's prompt, first turn and result
        sent = prompt + ids[:len(mask) - mask[::-1].index(False)]
        assert any(body["prompt"] == [sent] for body in later)
    trainer.close()


def _colocate(args):
    values = {k: getattr(args, k) for k in ("per_device_train_batch_size", "num_generations",
                                            "max_completion_length", "generation_kwargs", "use_cpu")}
    from posttrain.configs import GRPOConfig

    return GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=2048, **values)


def test_training_with_tools_on_the_in_process_sampler(tmp_path):
    """A real run: every turn sampled by the policy, the tool run, the results out of the loss."""
    tokenizer = _tokenizer()
    trainer = _trainer(tmp_path, tokenizer, max_steps=2, beta=0.04)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["tools/call_frequency"] == 1.0 and h["tools/failure_frequency"] == 0.0
                                    for h in logged)
    assert all(h["completions/max_length"] <= 2 * TURN for h in logged)  # model tokens only, the results not counted
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())


class _Truncating:
    """An engine that samples a later turn from the ids sent less their first (as one truncating prompts from the
    left to fit its context would): the rollout would not be what the model saw."""

    def __init__(self, inner):
        self.inner, self.eos_ids = inner, inner.eos_ids

    def generate(self, prompts, row_keys=None, new_round=True):
        return self.inner.generate(prompts if new_round else [p[1:] for p in prompts], row_keys, new_round)


def test_an_engine_that_samples_from_other_ids_than_those_sent_stops_the_run(tmp_path):
    from posttrain.generation import GenerationError

    tokenizer = _tokenizer()
    trainer = _trainer(tmp_path, tokenizer)
    engine = _Truncating(TransformersGenerator(trainer.policy, tokenizer, SamplingParams(max_new_tokens=TURN)))
    with pytest.raises(GenerationError, match=r"^The generation engine sampled a multi-turn rollout's next turn from "
                                              r"ids that differ from those sent \(row 0 of the turn, from position 0: "
                                              r"\d+ ids sent, \d+ used\), so the rollout would not be the tokens the "
                                              r"model saw: check that the engine takes token ids as given"):
        trainer.agents.sample(copy.deepcopy(ROWS), [0, 0, 1, 1], [0, 1, 2, 3], engine, "cpu")
    trainer.close()


def test_the_tools_example_runs_end_to_end(tmp_path):
    """examples/tools_vault.py, shortened: SFT, then GRPO with its environment, the tool metrics logged every step,
    the plot written (docs/tools.md shows a full run)."""
    import importlib.util

    path = Path(__file__).parent.parent / "examples" / "tools_vault.py"
    spec = importlib.util.spec_from_file_location("tools_vault", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert sum("tool_calls" in r["completion"][0] for r in example.sft_rows(0.5)) == 32
    out = example.main(["--output-dir", str(tmp_path / "vault"), "--steps", "3", "--sft-steps", "4"])
    logged = [h for h in out["history"] if "loss" in h]
    assert len(logged) == 3 and all("tools/call_frequency" in h and "rewards/Vault/mean" in h for h in logged)
    assert (tmp_path / "vault" / "tools_vault.png").stat().st_size > 0
