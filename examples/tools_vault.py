"""A tiny model learns to use a tool, on CPU in a few minutes: `python examples/tools_vault.py`.

Each prompt asks for a vault to be opened ("Open vault 3."). Only the environment's tool, `open_vault()`, opens
it; calling it again once the vault is open raises (the error becomes the tool message the model reads, and counts
in tools/failure_frequency). The environment's reward (its `get_reward`, a reward source of weight 1, as in TRL) is
1 once the vault is open, else 0: the model is paid for acting through the tool, which it can only do with a
well-formed call that the template's format reads back.

Stage 1, SFT (about 20 s): a random 2-layer, 64-wide model with a character vocabulary learns the chat format
from 64 rows, of which `--call-share` (half) show the call; the rest answer without one ("I cannot open it."). It
then writes a well-formed call about half the time, and garbles or skips it otherwise. Stage 2, GRPO with
`environment_factory=Vault` (TRL 1.16's API): every turn is sampled by the policy, calls are parsed from its tokens
with the template's Qwen2.5 format, run, their results' ids appended from the template and masked out of the
loss. The well-formed call rate, and with it the reward, rises (about 0.5 to 0.9 over 80 steps, in about a minute
on 2 cores); the script prints both over the first and the last 5 steps and plots the run (tools_vault.png).

    python examples/tools_vault.py [--output-dir tools-vault] [--steps 80] [--sft-steps 250]
"""

import argparse
import os
import random

# A compact Qwen2.5-style template: the tools' schemas in a system turn, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn. Earlier turns render the same whatever follows (prefix-preserving).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VAULTS = 10


class Vault:
    """One rollout's vault: reset with the row, opened only through its tool."""

    def reset(self, vault: int, **row) -> None:
        self.vault, self.opened = vault, False

    def open_vault(self) -> str:
        """Open your vault with your key."""
        if self.opened:
            raise ValueError(f"vault {self.vault} is already open")
        self.opened = True
        return f"Vault {self.vault} is open."

    def get_reward(self) -> float:
        return 1.0 if self.opened else 0.0


def tokenizer_and_model(path: str):
    """A character-level tokenizer with Qwen's tool markers as single tokens, and a random tiny Qwen2 model."""
    from posttrain.testing import save_tiny, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>", "<tool_response>",
                                                                "</tool_response>"]})
    tokenizer.chat_template = TEMPLATE
    save_tiny(path, tokenizer, seed=0, hidden=64, layers=2, max_positions=512)
    return path


def schema() -> list:
    from transformers.utils import get_json_schema

    return [get_json_schema(Vault().open_vault)]


def sft_rows(call_share: float, n: int = 64) -> list[dict]:
    """Prompt-completion rows with the tools column: a call on `call_share` of them, a refusal on the rest."""
    calling = set(random.Random(0).sample(range(n), round(call_share * n)))
    rows = []
    for i in range(n):
        vault = i % VAULTS
        calls = i in calling
        answer = ({"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "open_vault",
                                                                    "arguments": {}}}]}
                  if calls else {"role": "assistant", "content": "I cannot open it."})
        rows.append({"prompt": [{"role": "user", "content": f"Open vault {vault}."}], "completion": [answer],
                     "tools": schema()})
    return rows


def grpo_rows() -> dict:
    return {"prompt": [[{"role": "user", "content": f"Open vault {v}."}] for v in range(VAULTS)] * 4,
            "vault": list(range(VAULTS)) * 4}


def summary(history: list[dict], first: bool) -> str:
    logged = [h for h in history if "tools/call_frequency" in h]
    part = logged[:5] if first else logged[-5:]
    mean = lambda key: sum(h[key] for h in part) / len(part)  # noqa: E731
    return (f"reward {mean('reward'):.2f}, tool calls per completion {mean('tools/call_frequency'):.2f}, "
            f"failed calls {mean('tools/failure_frequency'):.0%}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="tools-vault")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--call-share", type=float, default=0.5)
    args = parser.parse_args(argv)
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from posttrain.plotting import plot_runs

    out = os.path.abspath(args.output_dir)
    base = tokenizer_and_model(os.path.join(out, "base"))
    sft = SFTTrainer(base, args=SFTConfig(output_dir=os.path.join(out, "sft"), max_steps=args.sft_steps,
                                          per_device_train_batch_size=16, learning_rate=1e-2, logging_steps=10,
                                          save_strategy="no", use_cpu=True, report_to="none", seed=0),
                     train_dataset=Dataset.from_list(sft_rows(args.call_share)))
    sft.train()
    sft.save_model()
    config = GRPOConfig(output_dir=os.path.join(out, "grpo"), max_steps=args.steps, per_device_train_batch_size=16,
                        num_generations=8, max_completion_length=96, max_tool_calling_iterations=2,
                        learning_rate=1e-3, logging_steps=1, save_strategy="no", use_cpu=True, report_to="none",
                        seed=0, beta=0.0)
    trainer = GRPOTrainer(os.path.join(out, "sft"), args=config, processing_class=AutoTokenizer.from_pretrained(
        os.path.join(out, "sft")), train_dataset=Dataset.from_dict(grpo_rows()), environment_factory=Vault)
    trainer.train()
    history = trainer.state.log_history
    before, after = summary(history, first=True), summary(history, first=False)
    plot = plot_runs([os.path.join(out, "grpo")], os.path.join(out, "tools_vault.png"))
    print(f"first 5 steps: {before}\nlast 5 steps:  {after}\nplot: {plot}")
    return {"before": before, "after": after, "history": history}


if __name__ == "__main__":
    main()
