"""Build a model with Qwen2.5-0.5B's exact shape and random weights, and a byte-level BPE tokenizer, offline.

Usage: python bench/make_qwen_shape.py OUT_DIR [--layers 24] [--hidden 896] [--intermediate 4864] [--heads 14]
                                       [--kv-heads 2] [--dtype float32|bfloat16] [--seed 0]

The defaults are Qwen2.5-0.5B's config.json: hidden 896, 24 layers, 14 query heads and 2 key/value heads of 64,
intermediate 4,864, vocabulary 151,936 (the embedding padded as Qwen's), tied embeddings, q/k/v biases, RoPE theta
1e6, RMSNorm eps 1e-6, 32,768 positions: 494M parameters. The overrides build a smaller body of the same kind (the
GPU kit's --dry-run on CPU). The tokenizer (a few thousand byte-level BPE tokens trained on generated arithmetic and
common words, the chat template of ../shared/bench/make_tiny.py's models) needs no hub, so the anchors' scripts
(trl_grpo.py, trl_sft.py, trl_dpo.py and ours) run on it unchanged.
"""

import argparse
import json
import os
import random

QWEN25_05B = {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2, "vocab": 151936}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()


def corpus(rows: int = 20000, seed: int = 0):
    """Arithmetic sentences followed by common words: the text the tokenizer's merges are learnt from."""
    rng = random.Random(seed)
    for _ in range(rows):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        yield f"What is {a} + {b}? The answer is {a + b}. " + " ".join(rng.choice(WORDS) for _ in range(12))


def build_tokenizer(out: str, vocab: int = 4096):
    """A byte-level BPE tokenizer of `vocab` entries with Qwen's special tokens, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token=None)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    return hf_tok


def qwen_config(tokenizer, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int):
    """Qwen2.5-0.5B's config.json with the given body sizes and this tokenizer's special ids."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=max(len(tokenizer), vocab), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, hidden_act="silu", attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=QWEN25_05B["layers"])
    ap.add_argument("--hidden", type=int, default=QWEN25_05B["hidden"])
    ap.add_argument("--intermediate", type=int, default=QWEN25_05B["intermediate"])
    ap.add_argument("--heads", type=int, default=QWEN25_05B["heads"])
    ap.add_argument("--kv-heads", type=int, default=QWEN25_05B["kv_heads"])
    ap.add_argument("--vocab", type=int, default=QWEN25_05B["vocab"], help="embedding rows (Qwen pads to 151,936)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the saved weights' dtype")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer(args.out)
    config = qwen_config(tokenizer, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads,
                         args.vocab)
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"saved": os.path.abspath(args.out), "params_m": round(params / 1e6, 2),
                      "tokenizer": len(tokenizer), "embedding": config.vocab_size, "hidden": args.hidden,
                      "layers": args.layers, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
