"""Give a `make_tiny.py` model natural completion lengths: completions that end at EOS after a spread of lengths.

Usage: python bench/make_natural.py SRC_MODEL_DIR OUT_DIR [--eos-scale 4.0] [--completion 128]
       python bench/make_natural.py SRC_MODEL_DIR OUT_DIR --eos-rate 0.02 [--completion 128]

A random tiny model almost never samples EOS (one token in 151,936). This copies the model and sets the output
layer's EOS row along the mean final hidden state, so the EOS logit follows each position's projection on that
direction: it depends on the prompt and on what was sampled so far, and a completion ends after a few tokens or
runs to the cap. Two ways to set it:
- `--eos-scale S` (the 152k natural row): the mean over random-token contexts, row = S x its unit vector;
- `--eos-rate R` (wide models, whose generated contexts sit far from random ones): the mean over the final hidden
  states of completions sampled from the model, scaled so that at the median sampled position EOS has probability
  R (its logit = that position's log-sum-exp of the other logits + log(R / (1 - R))).
The model is tied (the EOS row is also EOS's input embedding, which no prompt uses). Everything else is unchanged.
It then samples 4 completions for each of the 64 benchmark prompts (bench/grpo_step.py's) and prints the length
distribution.
"""

import argparse
import json
import math
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--eos-scale", type=float, default=4.0)
    ap.add_argument("--eos-rate", type=float, default=None, help="EOS probability at the median sampled position")
    ap.add_argument("--completion", type=int, default=128)
    args = ap.parse_args()
    shutil.copytree(args.src, args.out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.src)
    tok = AutoTokenizer.from_pretrained(args.src)
    from posttrain.generation import SamplingParams
    from posttrain.generation.transformers_backend import TransformersGenerator

    prompts = [tok(f"What is {a} + {b}?")["input_ids"] for a, b in zip(range(10, 74), range(100, 164))]
    with torch.no_grad():
        if args.eos_rate is None:
            ids = torch.randint(3, len(tok), (16, 64), generator=torch.Generator().manual_seed(0))
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
            mean = hidden.reshape(-1, hidden.size(-1)).mean(0)
            model.lm_head.weight[tok.eos_token_id] = args.eos_scale * mean / mean.norm()
        else:
            sampled = TransformersGenerator(model, tok, SamplingParams(max_new_tokens=64, min_new_tokens=64),
                                            seed=1).generate(prompts[:16])
            ids = torch.cat([sampled.prompt_ids, sampled.completion_ids], 1)
            mask = torch.cat([sampled.prompt_mask, sampled.completion_mask], 1).long()
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1][:, -64:]
            hidden = hidden.reshape(-1, hidden.size(-1))  # [16 x 64, H] at sampled positions
            mean = hidden.mean(0)
            unit = mean / mean.norm()
            projection = hidden @ unit
            median = projection.median(0).indices
            others = model.lm_head(hidden[median]).index_fill(0, torch.tensor([tok.eos_token_id]), float("-inf"))
            target = torch.logsumexp(others, 0) + math.log(args.eos_rate / (1 - args.eos_rate))
            model.lm_head.weight[tok.eos_token_id] = target / projection[median] * unit
    model.save_pretrained(args.out)

    generator = TransformersGenerator(model, tok, SamplingParams(max_new_tokens=args.completion), seed=0)
    lengths = torch.cat([generator.generate(prompts).completion_mask.sum(1) for _ in range(4)])
    q = torch.quantile(lengths.float(), torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]))
    print(json.dumps({"model": args.out, "eos_scale": args.eos_scale, "eos_rate": args.eos_rate, "completions": lengths.numel(),
                      "mean": round(lengths.float().mean().item(), 1), "min": lengths.min().item(),
                      "max": lengths.max().item(), "deciles_10_25_50_75_90": [round(x, 1) for x in q.tolist()],
                      "at_cap": round((lengths == args.completion).float().mean().item(), 3)}))


if __name__ == "__main__":
    main()
