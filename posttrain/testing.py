"""Tiny models and tokenizers built in-process, offline, for tests and the demo.

The tokenizer is byte-level with no merges (one token per byte, the characters of a fixed alphabet first, plus a
few special tokens) with a ChatML-style chat template, so prompts of either format work. Models are small
Qwen2-architecture causal LMs with random, seeded weights.
"""

import string

DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(chars: str = DEFAULT_CHARS, all_bytes: bool = True):
    """A character-level `PreTrainedTokenizerFast`: pad `<|pad|>`, EOS `<|im_end|>`, no BOS.

    Tokens are byte-level symbols (GPT-2's byte-to-unicode map, as Qwen2's tokenizer uses), one per byte: the
    characters of `chars` first, in order, then (with `all_bytes`) every other byte, so any text round-trips. Saved
    beside a Qwen2 model, transformers 5 reloads it as a Qwen2Tokenizer, which rebuilds a byte-level pipeline: with
    byte-level symbols that pipeline gives the same ids (a raw " " or "\n" token would be dropped).

    Args:
        chars: the alphabet whose characters get the first ids.
        all_bytes: add the remaining byte symbols; without them, other characters become `<|endoftext|>` (unk) in
            this tokenizer and are dropped by a reloaded one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbol = bytes_to_unicode()  # byte -> printable unicode character
    alphabet = [symbol[b] for c in chars for b in c.encode()]
    if all_bytes:
        alphabet += [symbol[b] for b in range(256)]
    alphabet = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    # A BPE model without merges splits any text into single bytes.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", unk_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_config(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                vocab_size: int = 0, max_positions: int = 512):
    """A Qwen2 config sized for CPU tests; `vocab_size` > len(tokenizer) pads the embedding as Qwen does."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=max(len(tokenizer), vocab_size), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


def tiny_model(tokenizer=None, seed: int = 0, model_class=None, **config_kwargs):
    """A randomly initialised tiny causal LM (seeded), float32, with generation config set for `tokenizer`."""
    return _tiny(tokenizer, seed, model_class, config_kwargs)


def tiny_reward_model(tokenizer=None, seed: int = 0, **config_kwargs):
    """A randomly initialised tiny reward model (seeded): a Qwen2 sequence classifier with one label, float32."""
    from transformers import Qwen2ForSequenceClassification

    return _tiny(tokenizer, seed, Qwen2ForSequenceClassification, config_kwargs, num_labels=1)


def _tiny(tokenizer, seed: int, model_class, config_kwargs: dict, **config_fields):
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = tiny_config(tokenizer, **config_kwargs)
    for name, value in config_fields.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = (model_class or Qwen2ForCausalLM)(config)
    if getattr(model, "generation_config", None) is not None:  # a sequence classifier generates nothing
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tiny_moe_model(tokenizer=None, seed: int = 0, hidden: int = 32, layers: int = 1, experts: int = 4,
                   experts_per_token: int = 2, **config_kwargs):
    """A randomly initialised tiny Qwen3-MoE causal LM (seeded), float32: a router over `experts` experts per layer,
    with the config's own router_aux_loss_coef (0.001) unless `config_kwargs` says otherwise."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=experts_per_token, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, **config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(path: str, tokenizer=None, seed: int = 0, **config_kwargs) -> str:
    """Build a tiny model and tokenizer and save both to `path` (safetensors). Returns `path`."""
    tokenizer = tokenizer or tiny_tokenizer()
    model = tiny_model(tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
