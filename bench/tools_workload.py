"""The multi-turn GRPO-with-tools workload that bench/trl_grpo_tools.py (TRL's GRPOTrainer) and
bench/grpo_tools_step.py (posttrain's) both import, so that the two sides run the same data, tool, scripted parsing,
reward, flags and batch accounting. Importable without torch or TRL.

A random-weight model never writes a tool call, so the parsing is scripted, identically on both sides: a turn is
read as an assistant message calling `lookup` while the text before it (the prompt and the earlier turns and tool
results) holds fewer than --tool-calls tool results, and as a plain message afterwards (`scripted_turn`). TRL's side
puts it in place of `trl.trainer.grpo_trainer.parse_response`; posttrain's passes it as `response_template=`. The
rest is real: the model samples every turn, `lookup` runs (a plain function returning a fixed RESULT), the tool
results' ids come from each side's own template path, and the step trains.

Every turn has exactly --turn tokens (generation_kwargs min_new_tokens = max_new_tokens = --turn: TRL's transformers
path and posttrain's sampler both apply them to each turn's generate), every prompt the same length (words that are
single tokens, as the anchors' make_rows()), so each rollout is turn + results + turn + results + turn (with
--tool-calls 2) of one fixed length, on both sides; `check_budget` refuses flags whose rollout would not fit
--completion (TRL rolls back tool results that overflow it, which would make the work depend on the flags' fit).
"""

import argparse
import importlib.util
import os
import random
import resource
import threading

WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()
RESULT_WORDS = 24
# what `lookup` returns: a fixed string (RESULT_WORDS words, about as many tokens); the scripted parser counts the
# tool results before a turn by counting it in the turn's prefix
RESULT = "record: " + " ".join(WORDS[i % len(WORDS)] for i in range(RESULT_WORDS))
TOOL_NAME = "lookup"


def make_rows(rows: int, prompt_words: int, seed: int = 0) -> dict:
    """Dataset columns: `rows` conversational prompts of `prompt_words` single-token words each."""
    rng = random.Random(seed)
    return {"prompt": [[{"role": "user", "content": "".join(" " + rng.choice(WORDS) for _ in range(prompt_words))}]
                       for _ in range(rows)]}


_calls = 0
_calls_lock = threading.Lock()


def lookup(key: str) -> str:
    """Look up the record stored under a key.

    Args:
        key: the key of the record to look up.
    """
    global _calls
    with _calls_lock:
        _calls += 1
    return RESULT


def tool_calls_made() -> int:
    """How many times `lookup` ran in this process."""
    return _calls


def scripted_turn_function(tool_calls: int):
    """(turn text, prefix text) -> the assistant message of the turn: a call of `lookup` while the prefix holds fewer
    than `tool_calls` tool results, else the text alone."""
    def scripted_turn(text: str, prefix: str) -> dict:
        if prefix.count(RESULT) < tool_calls:
            return {"role": "assistant", "content": text,
                    "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"key": "row"}}}]}
        return {"role": "assistant", "content": text}

    return scripted_turn


def reward_text(completions, **kwargs) -> list[float]:
    """The assistant turns' decoded length / 100 plus their share of vowels: varies between rollouts (on the
    152k-vocabulary model most sampled ids lie past the tokenizer's and decode to nothing), so advantages are not 0
    and posttrain drops no rows for a zero advantage."""
    out = []
    for messages in completions:
        text = "".join(m.get("content") or "" for m in messages if m.get("role") == "assistant")
        out.append(len(text) / 100 + sum(ch in "aeiou" for ch in text) / max(1, len(text)))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--completion", type=int, default=256,
                    help="max_completion_length: the whole multi-turn completion's budget (turns and tool results)")
    ap.add_argument("--turn", type=int, default=32, help="tokens of every model turn (min = max new tokens)")
    ap.add_argument("--tool-calls", type=int, default=2,
                    help="tool calls per rollout (one per turn but the last), and max_tool_calling_iterations")
    ap.add_argument("--prompt", type=int, default=8, help="words of the user message (each one token)")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="off unless asked, as in trl_grpo.py")
    ap.add_argument("--chat-template", default=None,
                    help="the jinja file set on the tokenizer (default: qwen2_5.jinja of the installed TRL)")
    return ap.parse_args(argv)


def chat_template(path: str | None) -> str:
    """The chat template's text: `path`, else qwen2_5.jinja from the installed TRL's chat_templates folder (found
    without importing TRL)."""
    if path is None:
        spec = importlib.util.find_spec("trl")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("TRL is not installed here: pass --chat-template PATH (qwen2_5.jinja of TRL's "
                             "chat_templates folder)")
        path = os.path.join(list(spec.submodule_search_locations)[0], "chat_templates", "qwen2_5.jinja")
    with open(path, encoding="utf-8") as f:
        return f.read()


def tokenizer(args):
    """The model's tokenizer with the workload's chat template, checked (single-token words, one-token EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.chat_template = chat_template(args.chat_template)
    bad = [w for w in WORDS if len(tok(" " + w)["input_ids"]) != 1]
    if bad:
        raise SystemExit(f"words that are not single tokens in this tokenizer: {bad}")
    if tok.eos_token is None or len(tok(tok.eos_token)["input_ids"]) != 1:
        raise SystemExit("the tokenizer needs an EOS token that encodes to one id")
    return tok


def result_suffix_length(tok) -> int:
    """Tokens the template puts between a model turn and the next for one `lookup` result (the next turn's header
    included): [user, assistant calling lookup] cut after its last EOS, against the same with the tool message and
    the generation prompt."""
    call = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": TOOL_NAME, "arguments": {}}}]}]
    alone = tok.apply_chat_template(call, tokenize=True, return_dict=False)
    cut = max(i for i, t in enumerate(alone) if t == tok.eos_token_id) + 1
    whole = tok.apply_chat_template(call + [{"role": "tool", "name": TOOL_NAME, "content": RESULT}], tokenize=True,
                                    return_dict=False, add_generation_prompt=True)
    assert whole[:cut] == alone[:cut], "the chat template is not prefix-preserving"
    return len(whole) - cut


def check_budget(tok, args, max_positions: int) -> dict:
    """The rollout's exact shape, or SystemExit when it would not fit --completion or the model's context (TRL and
    posttrain would then roll back a round of tool results)."""
    suffix = result_suffix_length(tok)
    rollout = (args.tool_calls + 1) * args.turn + args.tool_calls * suffix
    if rollout > args.completion:
        raise SystemExit(f"a rollout is {args.tool_calls + 1} turns of {args.turn} + {args.tool_calls} tool results of "
                         f"{suffix} = {rollout} tokens, over --completion {args.completion}: raise --completion to "
                         f"{rollout} or lower --turn / --tool-calls")
    prompt = len(tok.apply_chat_template(make_rows(1, args.prompt)["prompt"][0], tools=[lookup], tokenize=True,
                                         return_dict=False, add_generation_prompt=True))
    if prompt + rollout >= max_positions:
        raise SystemExit(f"prompt {prompt} + rollout {rollout} tokens reach the model's {max_positions} positions")
    return {"prompt_tokens": prompt, "rollout_tokens": rollout, "result_suffix_tokens": suffix}


class BatchStats:
    """What the training steps ran on, summed over every loss call: positions of the completion tensor [rows, width],
    its tool-result tokens (completion_mask 1, tool mask 0) and its padding (completion_mask 0); the prompt tensor's
    padding (prompt_mask 0). Tool masks in TRL's convention: 1 on the model's tokens and on padding, 0 on tool
    results (posttrain's Rollouts.tool_mask is the same)."""

    def __init__(self):
        self.completion_positions = self.tool = self.padding = self.model = 0
        self.prompt_positions = self.prompt_padding = self.rows = 0
        self.widths, self.tool_per_row, self.model_per_row = set(), set(), set()

    def add(self, completion_mask, tool_mask, prompt_mask) -> None:
        real = completion_mask.bool()
        tool = real & ~tool_mask.bool()
        self.rows += real.size(0)
        self.completion_positions += real.numel()
        self.widths.add(real.size(1))
        self.tool += int(tool.sum())
        self.padding += int((~real).sum())
        self.model += int((real & tool_mask.bool()).sum())
        self.tool_per_row.update(tool.sum(1).tolist())
        self.model_per_row.update((real & tool_mask.bool()).sum(1).tolist())
        self.prompt_positions += prompt_mask.numel()
        self.prompt_padding += int((~prompt_mask.bool()).sum())

    def summary(self) -> dict:
        def span(values):
            return sorted(values)[0] if len(values) == 1 else [min(values), max(values)] if values else None

        n = max(1, self.completion_positions)
        return {"tool_token_fraction": round(self.tool / n, 4), "padding_fraction": round(self.padding / n, 4),
                "prompt_padding_fraction": round(self.prompt_padding / max(1, self.prompt_positions), 4),
                "trained_rows": self.rows, "completion_width": span(self.widths),
                "model_tokens_per_row": span(self.model_per_row), "tool_tokens_per_row": span(self.tool_per_row)}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def config_values(args, output_dir: str) -> dict:
    """The GRPOConfig keywords both sides run with (each side adds its own few)."""
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=args.steps, num_generations=args.gens,
                per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                max_completion_length=args.completion, beta=args.beta, learning_rate=1e-5, logging_steps=1,
                report_to="none", save_strategy="no", seed=0,
                generation_kwargs={"min_new_tokens": args.turn, "max_new_tokens": args.turn},
                max_tool_calling_iterations=args.tool_calls, gradient_checkpointing=args.gradient_checkpointing)


def timed_train(trainer) -> tuple[float, float]:
    """trainer.train(), its (wall seconds, CPU seconds)."""
    import time

    cpu, start = cpu_seconds(), time.perf_counter()
    trainer.train()
    return time.perf_counter() - start, cpu_seconds() - cpu


def result(impl: str, args, wall: float, cpu: float, stats, shape: dict, **extra) -> dict:
    """The JSON line both sides print."""
    return {"impl": impl, "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
            "completion_tok_per_s": round(stats.model / wall, 1), "peak_rss_mib": peak_rss_mib(),
            "cpu_s": round(cpu, 1), "tool_calls_per_step": tool_calls_made() / args.steps, **stats.summary(),
            **extra, **shape}


def prepare(args) -> tuple:
    """torch's threads set, the tokenizer with the template, and the rollout's shape checked against the budget:
    (tokenizer, shape)."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(args.threads)
    tok = tokenizer(args)
    return tok, check_budget(tok, args, AutoConfig.from_pretrained(args.model).max_position_embeddings)
