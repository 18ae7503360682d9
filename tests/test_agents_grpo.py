"""GRPOTrainer with tools, environments and rollout_func, end to end, against TRL 1.16's GRPOTrainer on the same
scripted model outputs (tests/agent_script.py): TRL's own `_generate` (its prompt rendering, parse_response, its
`_tool_call_loop` with its budget and rollback, its metrics) with its `_generate_single_turn` replaced by the script,
and posttrain's agents stage with a scripted engine. Prompt ids, completion ids, tool masks, sampler log-probs, the
completions the reward functions receive and tools/call_frequency / tools/failure_frequency must be equal."""

import copy
import math
import json
from pathlib import Path

import pytest
import torch

from agent_script import LOGPROB, TOOLS, Script, ScriptedEngine, trl_generate_single_turn
from posttrain.testing import tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
MAX_COMPLETION = 1000


class _GenerationReached(Exception):
    pass


def _tokenizer(template: str):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


def _rows(cases: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Please help. case:{case}"}]} for case in cases]


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(package, out, tokenizer, rows, max_iterations, model=None, processor=None, **kwargs):
    """`package`'s GRPOTrainer (TRL's or posttrain's) on `rows`, with the same arguments (`model` and `processor`: a
    vision-language model's, else a tiny text model and `tokenizer`)."""
    from datasets import Dataset

    args = package.GRPOConfig(output_dir=str(out), per_device_train_batch_size=len(rows), num_generations=2,
                              max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                              max_completion_length=MAX_COMPLETION, max_tool_calling_iterations=max_iterations)
    model = model if model is not None else tiny_model(tokenizer, hidden=32, layers=1, max_positions=4096)
    return package.GRPOTrainer(model=model, args=args, processing_class=processor or tokenizer, reward_funcs=[_zero],
                               train_dataset=Dataset.from_list(rows), **kwargs)


def _trl(tmp_path, tokenizer, rows, max_iterations=None, **kwargs):
    """TRL's _generate on `rows` with the scripted model: (prompt ids, completion ids, tool masks, completions,
    log-probs, its metrics); with a vision-language model, also its images and the turns it sampled with pixels."""
    import trl

    trainer = _trainer(trl, tmp_path / "trl", tokenizer, rows, max_iterations, **kwargs)
    generate = trainer._generate

    def reached(prompts):
        raise _GenerationReached(prompts)

    trainer._generate = reached  # up to generation: environments drawn and reset, tool dicts built
    with pytest.raises(_GenerationReached) as got:
        trainer._generate_and_score_completions(copy.deepcopy(rows))
    trainer._generate = generate
    single_turn = trl_generate_single_turn(Script(tokenizer, trainer.chat_template), MAX_COMPLETION)
    trainer._generate_single_turn = single_turn
    trainer.model.train()
    out = trainer._generate(got.value.args[0])
    prompt_ids, completion_ids, tool_mask, completions, logprobs = out[:5]
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("tools/")}
    return prompt_ids, completion_ids, tool_mask, completions, logprobs, metrics, out[6], single_turn.pixel_calls


def _posttrain(tmp_path, tokenizer, rows, max_iterations=None, **kwargs):
    """posttrain's agents stage on `rows` with the scripted engine: the same six things, and the trainer."""
    import posttrain
    from posttrain.agents.chat_templates import tool_chat_template
    from posttrain.grpo.metrics import tool_metrics

    trainer = _trainer(posttrain, tmp_path / "pt", tokenizer, rows, max_iterations, **kwargs)
    engine = ScriptedEngine(Script(tokenizer, tool_chat_template(tokenizer)), tokenizer.pad_token_id,
                            [tokenizer.eos_token_id], MAX_COMPLETION)
    sampled = trainer.agents.sample(copy.deepcopy(rows), list(range(len(rows))), list(range(len(rows))), engine, "cpu")
    r = sampled.rollouts
    prompt_ids = [ids[mask].tolist() for ids, mask in zip(r.prompt_ids, r.prompt_mask)]
    completion_ids = [ids[mask].tolist() for ids, mask in zip(r.completion_ids, r.completion_mask)]
    tool_mask = [m[mask].int().tolist() for m, mask in zip(r.tool_mask, r.completion_mask)]
    logprobs = [lp[mask].tolist() for lp, mask in zip(r.sampler_logprobs, r.completion_mask)]
    metrics = tool_metrics(sampled.counts, trainer.accelerator)
    return prompt_ids, completion_ids, tool_mask, sampled.completions, logprobs, metrics, trainer, engine


def _same(trl_out, ours) -> None:
    names = ("prompt ids", "completion ids", "tool mask", "completions", "log-probs", "metrics")
    for name, theirs, mine in zip(names, trl_out, ours):
        if name == "completions":
            theirs, mine = json.dumps(theirs, sort_keys=True), json.dumps(mine, sort_keys=True)
        if name == "metrics":
            assert mine == pytest.approx(theirs), name
        else:
            assert mine == theirs, name


CASES = ["none", "one", "parallel", "overflow", "malformed", "iterate"]


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_the_tool_loop_equals_trls(tmp_path, template):
    """Every case at once (rows of one round take different numbers of turns): no call, one call then an answer,
    parallel calls (a failing one and an unknown one among them) then another round, a result past the completion
    budget (rolled back), a malformed call (text, no call), and a model that never stops calling (cut by
    max_tool_calling_iterations). Qwen3's template is not prefix-preserving: both render with TRL's training one."""
    tokenizer = _tokenizer(template)
    rows = _rows(CASES)
    theirs = _trl(tmp_path, tokenizer, rows, max_iterations=3, tools=[t for t in TOOLS if t.__name__ != "mul"])
    ours = _posttrain(tmp_path, tokenizer, rows, max_iterations=3, tools=[t for t in TOOLS if t.__name__ != "mul"])
    _same(theirs[:6], ours[:6])
    prompt_ids, completion_ids, tool_mask = ours[:3]
    assert sum(tool_mask[CASES.index("one")]) < len(completion_ids[CASES.index("one")])  # a result was masked out
    assert all(m == 1 for m in tool_mask[CASES.index("overflow")])  # rolled back: the calling turn alone
    # calls: one 1, parallel 4 + 1 (mul is not among these tools: "not found"), overflow 1 (rolled back, still
    # made), iterate 3; failures: mul, fail, nope
    assert ours[5] == pytest.approx({"tools/call_frequency": 10 / 6, "tools/failure_frequency": 3 / 10})
    assert [m["role"] for m in ours[3][CASES.index("parallel")]] == ["assistant"] + ["tool"] * 4 + [
        "assistant", "tool", "assistant"]


def test_later_turns_are_sampled_within_the_round_from_exactly_the_joined_ids(tmp_path):
    """The engine sees each later turn as prompt + every earlier turn and result in order, with the row's key plus
    the turn's stride, and no new round seed."""
    from posttrain.agents.loop import TURN_KEY_STRIDE

    tokenizer = _tokenizer("qwen2_5")
    *_, trainer, engine = _posttrain(tmp_path, tokenizer, _rows(["one", "none"]), tools=TOOLS)
    (first, keys0, new0), (second, keys1, new1) = engine.calls
    assert new0 and not new1 and keys0 == [0, 1] and keys1 == [TURN_KEY_STRIDE]
    turn = engine.script.next_turn(first[0])
    assert second[0][:len(first[0]) + len(turn)] == first[0] + turn


def test_async_tools_run_together_and_their_results_keep_the_calls_order(tmp_path):
    """By design: a turn calling a sync tool, an async one and a failing sync one gets its results in call order (the
    order templates without call ids match results to calls by); TRL 1.16 appends the async results after every sync
    one. Everything else (ids before the results, counts) is equal."""
    tokenizer = _tokenizer("qwen2_5")
    rows = _rows(["parallel_mixed", "none"])
    import agent_script

    agent_script.CASES["parallel_mixed"] = [[("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": 4}),
                                             ("fail", {"reason": "x"})], "Done."]
    try:
        theirs = _trl(tmp_path, tokenizer, rows, tools=TOOLS)
        ours = _posttrain(tmp_path, tokenizer, rows, tools=TOOLS)
    finally:
        del agent_script.CASES["parallel_mixed"]
    ours_tools = [m["name"] for m in ours[3][0] if m["role"] == "tool"]
    trl_tools = [m["name"] for m in theirs[3][0] if m["role"] == "tool"]
    assert ours_tools == ["add", "mul", "fail"] and trl_tools == ["add", "fail", "mul"]
    assert ours[5] == pytest.approx(theirs[5])
    assert ours[0] == theirs[0]  # the same prompt


def test_the_sampler_log_probs_are_the_engines_on_the_model_tokens_and_zero_on_the_results(tmp_path):
    tokenizer = _tokenizer("qwen2_5")
    _, completion_ids, tool_mask, _, logprobs, *_ = _posttrain(tmp_path, tokenizer, _rows(["one", "none"]), tools=TOOLS)
    assert [lp for lp, m in zip(logprobs[0], tool_mask[0]) if m] == [LOGPROB] * sum(tool_mask[0])
    assert all(lp == 0.0 for lp, m in zip(logprobs[0], tool_mask[0]) if not m)
    assert torch.tensor(tool_mask[0]).eq(0).sum() > 0


# ------------------------------------------------------------------ environments and rollout_func, against TRL


class Adder:
    """An environment the model adds with; its reward is how many additions it made."""

    def __init__(self):
        self.additions = 0

    def reset(self, case: str = "none", **kwargs) -> str:
        self.additions = 0
        return f" case:{case}"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.additions += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.additions)


def _env_rows(cases: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": "Please help."}], "case": case} for case in cases]


def test_an_environment_loop_equals_trls_and_its_reward_is_a_reward_source(tmp_path):
    """reset's text is appended to the prompt, the environment's methods are the row's tools, the loop equals TRL's;
    get_reward is a reward of weight 1 named after the class, and reward functions receive `environments`."""
    tokenizer = _tokenizer("qwen2_5")
    rows = _env_rows(["one", "none", "iterate", "one"])
    theirs = _trl(tmp_path, tokenizer, rows, max_iterations=2, environment_factory=Adder)
    ours = _posttrain(tmp_path, tokenizer, rows, max_iterations=2, environment_factory=Adder)
    _same(theirs[:6], ours[:6])
    trainer = ours[6]
    assert [f.name for f in trainer.reward_funcs] == ["_zero", "Adder"] and trainer.reward_weights.tolist() == [1, 1]
    sampled = trainer.agents.sample(copy.deepcopy(rows), [0, 1, 2, 3], [0, 1, 2, 3], ours[7], "cpu")
    envs = sampled.columns["environments"]
    assert [type(e) for e in envs] == [Adder] * 4 and len({id(e) for e in envs}) == 4
    assert trainer.reward_funcs[1].fn(environments=envs) == [1.0, 0.0, 2.0, 1.0]


def _rollout_func(prompts, trainer):
    """A white-box rollout: a fixed completion per prompt, the environment's part masked out, an extra column."""
    tokenizer = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "difficulty": []}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        turn, observation = tokenizer("ab", add_special_tokens=False)["input_ids"], [5, 6, 7]
        end = [tokenizer.eos_token_id]
        out["prompt_ids"].append(list(ids))
        out["completion_ids"].append(turn + observation + turn + end)
        out["logprobs"].append([-0.5] * len(turn) + [0.0] * 3 + [-0.5] * (len(turn) + 1))
        out["env_mask"].append([1] * len(turn) + [0] * 3 + [1] * (len(turn) + 1))
        out["difficulty"].append(i)
    return out


def test_a_rollout_func_is_read_as_trl_reads_it(tmp_path):
    """Its ids and log-probs as returned, env_mask as the tool mask, its extra keys columns for the reward
    functions, completions decoded as TRL decodes them."""
    tokenizer = _tokenizer("qwen2_5")
    rows = _rows(["none", "one"])
    theirs = _trl(tmp_path, tokenizer, rows, rollout_func=_rollout_func)
    ours = _posttrain(tmp_path, tokenizer, rows, rollout_func=_rollout_func)
    _same(theirs[:5], ours[:5])
    sampled = ours[6].agents.sample(copy.deepcopy(rows), [0, 1], [0, 1], ours[7], "cpu")
    assert sampled.columns == {"difficulty": [0, 1]}
    assert sampled.rollouts.model_tokens.sum(1).tolist() == [5, 5]  # two turns of 2 and the EOS; 3 masked out


# ------------------------------------------------------------------ training with tools


def _tool_reward(completions, **kwargs):
    """Each tool result that is not an error, and the last answer's length (a group's completions differ in it)."""
    return [sum(m["role"] == "tool" and "error" not in str(m["content"]) for m in c) + len(c[-1]["content"]) / 100
            for c in completions]


def _tool_trainer(tmp, tokenizer, callbacks=None, **overrides):
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    prompts = [r["prompt"] for r in _rows(["one", "none", "parallel", "iterate"] * 2)]
    values = dict(output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                  generation_batch_size=8, max_completion_length=MAX_COMPLETION, learning_rate=1e-2, logging_steps=1,
                  save_strategy="steps", save_steps=1, use_cpu=True, seed=0, beta=0.04, report_to="none",
                  max_tool_calling_iterations=2)
    values.update(overrides)
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1, max_positions=4096), [_tool_reward],
                          GRPOConfig(**values), train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer, tools=TOOLS, callbacks=callbacks)
    trainer.generator = ScriptedEngine(Script(tokenizer), tokenizer.pad_token_id, [tokenizer.eos_token_id],
                                       MAX_COMPLETION, vary=True)
    return trainer


def test_training_with_tools_masks_the_results_and_logs_trls_tool_metrics(tmp_path):
    tokenizer = _tokenizer("qwen2_5")
    trainer = _tool_trainer(tmp_path, tokenizer, save_strategy="no", max_steps=1, shuffle_dataset=False)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    scored = trainer.rollout.scored_batch(trainer.rounds, 1)
    batch = scored.batch
    assert batch.rollouts.tool_mask is not None and not torch.equal(batch.loss_mask, batch.rollouts.completion_mask)
    assert torch.equal(batch.loss_mask, batch.rollouts.completion_mask & batch.rollouts.tool_mask)
    # calls per completion: one 1, none 0, parallel 4 + 1, iterate 2 (max_tool_calling_iterations); failures 2 of 8
    assert scored.metrics["tools/call_frequency"] == pytest.approx(8 / 4)
    assert scored.metrics["tools/failure_frequency"] == pytest.approx(2 / 8)
    model_tokens = batch.rollouts.model_tokens.sum(1).float()
    assert scored.metrics["completions/mean_length"] == pytest.approx(float(model_tokens.mean()))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] > 0 and "tools/failure_frequency" in logged and math.isfinite(logged["loss"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())


def test_resume_in_the_middle_of_a_buffer_of_multi_turn_rollouts_is_exact(tmp_path):
    """8 rows per generation, 4 per step: the checkpoint at step 1 holds half a batch of multi-turn rollouts, their
    tool masks included; the resumed run ends with the straight run's weights and logs."""
    from conftest import StopAt

    tokenizer = _tokenizer("qwen2_5")
    straight = _tool_trainer(tmp_path / "a", tokenizer, save_strategy="no")
    straight.train()
    first = _tool_trainer(tmp_path / "b", tokenizer, callbacks=[StopAt(1)])
    first.train()
    from safetensors.torch import load_file

    buffered = load_file(tmp_path / "b" / "out" / "checkpoint-1" / "buffer_0.safetensors")
    assert any("tool_mask" in key for key in buffered)
    resumed = _tool_trainer(tmp_path / "b", tokenizer)
    resumed.train(resume_from_checkpoint=True)
    a = dict(straight.policy.named_parameters())
    assert all(torch.equal(a[n], p) for n, p in resumed.policy.named_parameters())
    assert [r.get("loss") for r in resumed.state.log_history] == [r.get("loss") for r in straight.state.log_history]


def _images_shown(completions: list) -> str:
    """The completions as JSON, each image as its mode, size and colour (the tools' images are new objects on each
    side)."""
    def plain(value):
        if hasattr(value, "getpixel"):
            return f"image {value.mode} {value.size} {value.getpixel((0, 0))}"
        raise TypeError(type(value))

    return json.dumps(completions, sort_keys=True, default=plain)


@pytest.mark.parametrize("prompt_images", [False, True], ids=["text-prompts", "image-prompts"])
def test_a_tool_that_returns_an_image_joins_it_to_the_next_turn_as_trl_does(tmp_path, prompt_images):
    """TRL's test_train_with_tools_multimodal_response, on a tiny Qwen3.5 built offline: a tool returns an image and
    a caption; its image tokens are expanded in the tool suffix (masked out of the loss), its pixels join the row's
    for the next turn's sampling and every later forward, and a second image round adds its pixels after the first.
    Prompt ids, completion ids, tool mask, completions and log-probs equal TRL's `_generate` on the same scripted
    model, each turn sampled with TRL's pixels, and the rows' pixels are TRL's image processor's on the same images;
    the completion log-probs training reads equal the model's own forward with those pixels."""
    from agent_script import picture
    from posttrain.models.logprobs import token_logprobs
    from posttrain.testing import tiny_vision_processor

    model, processor = tiny_vision_processor("qwen3_5")
    model.config.get_text_config().max_position_embeddings = 4096  # the prompt shows the tool: room for two images
    rows = _rows(["picture", "none"])
    if prompt_images:  # a vision dataset: the prompt's image comes before the tools'
        from PIL import Image

        rows = [dict(row, images=[Image.new("RGB", (16, 16), "green")]) for row in rows]
    theirs = _trl(tmp_path, processor.tokenizer, rows, max_iterations=3, tools=[picture], model=copy.deepcopy(model),
                  processor=processor)
    ours = _posttrain(tmp_path, processor.tokenizer, rows, max_iterations=3, tools=[picture], model=model,
                      processor=processor)
    _same([theirs[i] for i in (0, 1, 2, 4, 5)], [ours[i] for i in (0, 1, 2, 4, 5)])
    assert _images_shown(ours[3]) == _images_shown(theirs[3])
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    completion, mask = ours[1][0], ours[2][0]
    assert completion.count(image_token) == 2 * 4 and all(not m for t, m in zip(completion, mask) if t == image_token)
    # the turns sampled with pixels: after the first image (1 image), after the second (2), as TRL's were
    trainer, engine = ours[6], ours[7]
    trl_turns = [call for call in theirs[7] if "pixel_values" in call[1]]  # its first turn's: token types alone
    shown = 1 if prompt_images else 0
    assert [len(images[0]) for _, _, images in engine.pixel_calls][-2:] == [shown + 1, shown + 2]
    assert len(trl_turns) == len(engine.pixel_calls) == 2 + shown
    for (_, inputs, _), (_, fields, _) in zip(engine.pixel_calls, trl_turns):
        batched = inputs.batched()
        torch.testing.assert_close(batched["pixel_values"], torch.as_tensor(fields["pixel_values"]))
        assert torch.equal(batched["image_grid_thw"], torch.as_tensor(fields["image_grid_thw"]))
    # the finished rows: the picture row carries its images' pixels (the prompt's first), the other its prompt's
    r = trainer.agents.sample(copy.deepcopy(rows), [0, 1], [0, 1], engine, "cpu").rollouts
    images = theirs[6]
    expected = processor.image_processor(images=images[0], return_tensors="pt")
    got = r.model_inputs.select([0]).batched()
    torch.testing.assert_close(got["pixel_values"], expected["pixel_values"])
    assert r.model_inputs.rows[1] == {} if not prompt_images else len(r.model_inputs.rows[1]["image_grid_thw"]) == 1
    # the log-probs training reads: the model's own forward over the row's ids with TRL's pixels and token types
    first = r.select([0])
    ids = torch.cat([first.prompt_ids, first.completion_ids], 1)
    attention = torch.cat([first.prompt_mask, first.completion_mask], 1).long()
    with torch.no_grad():
        ours_logps, _ = token_logprobs(trainer.model, first.prompt_ids, first.prompt_mask, first.completion_ids,
                                       first.completion_mask, model_inputs=first.forward_inputs())
        logits = trainer.model(input_ids=ids, attention_mask=attention, pixel_values=expected["pixel_values"],
                               image_grid_thw=expected["image_grid_thw"],
                               mm_token_type_ids=(ids == image_token).long()).logits
    width = first.completion_ids.size(1)
    reference = torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(-1, first.completion_ids[..., None])
    m = first.completion_mask.bool()
    torch.testing.assert_close(ours_logps[m], reference[..., 0][m], atol=1e-5, rtol=1e-5)
    # and a step trains on such rows: the loss's forward reads both images' pixels
    import posttrain

    step = _trainer(posttrain, tmp_path / "step", processor.tokenizer, rows[:1] * 2, 3, model=trainer.model,
                    processor=processor, tools=[picture])
    step.generator = engine
    step.train()
    logged = [e for e in step.state.log_history if "loss" in e]
    assert logged and math.isfinite(logged[0]["loss"]) and logged[0]["tools/call_frequency"] == 2.0
