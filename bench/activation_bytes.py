"""What autograd keeps for the backward in one GRPO training forward, with and without gradient checkpointing.

Usage: python bench/activation_bytes.py MODEL_DIR [--completion 1024] [--prompt 64] [--rows 1]
Prints one JSON line per setting: the activation tensors and MiB saved for the backward at the end of the forward
(what stays alive until the backward, parameters left out; posttrain.training.offloading.SavedBytes), and whether
the gradients equal the plain run's.
With checkpointing each decoder layer's activations are recomputed, one layer at a time, in the backward.
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models import token_logprobs
    from posttrain.models.loading import enable_checkpointing
    from posttrain.training.offloading import SavedBytes

    model = AutoModelForCausalLM.from_pretrained(args.model).train()
    model.config.use_cache = False
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(4, vocab, (args.rows, args.prompt), generator=g)
    completion = torch.randint(4, vocab, (args.rows, args.completion), generator=g)
    masks = torch.ones_like(prompt, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool)
    grads = None
    for checkpointing in (False, True):
        if checkpointing:
            enable_checkpointing(model, {"use_reentrant": False})
        model.zero_grad()
        with SavedBytes(model) as saved:  # activations: the parameters autograd also keeps are left out
            logps, _ = token_logprobs(model, prompt, masks[0], completion, masks[1])
        (-logps.mean()).backward()
        now = [p.grad.clone() for p in model.parameters()]
        same = grads is None or all(torch.equal(a, b) for a, b in zip(grads, now))
        grads = grads or now
        print(json.dumps({"checkpointing": checkpointing, "rows": args.rows, "tokens": args.prompt + args.completion,
                          "layers": model.config.num_hidden_layers, "saved_tensors": saved.tensors,
                          "saved_mib": round(saved.bytes / 2 ** 20, 2), "gradients_equal_plain": same}), flush=True)


if __name__ == "__main__":
    main()
