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
# the same ChatML, carrying tools (a system turn listing them), an assistant's tool calls (Qwen's <tool_call> JSON) and
# tool results (<tool_response>): what a tool-calling model's template does, for save_tiny's models
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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
    """Build a tiny model and tokenizer and save both to `path` (safetensors), for trying things offline: the docs'
    examples run on it with only the model name changed. Its context is 4,096 positions (max_positions) unless given,
    so that TRL's default lengths fit; a tokenizer not given is tiny_tokenizer() with TOOL_CHAT_TEMPLATE, which
    carries tools. Quiet: no progress bars, no DeepSpeed notice on a machine without a GPU. Returns `path`."""
    import os

    import torch
    from transformers.utils import logging as hf_logging

    if tokenizer is None:
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    config_kwargs.setdefault("max_positions", 4096)
    if not torch.accelerator.is_available():  # DeepSpeed, which transformers imports where installed, would say so
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = tiny_model(tokenizer, seed=seed, **config_kwargs)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards"
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    return path


# transformers' text architectures a tiny model is built of by tiny_architecture: pure attention (Qwen2, Llama),
# sliding-window attention (Gemma 3), and hybrids whose recurrent or convolutional layers carry state along a row:
# Gated DeltaNet (Qwen3.5, Qwen3-Next), short convolutions (LFM2), Mamba-2 (Granite 4's GraniteMoeHybrid)
ARCHITECTURES = ("qwen2", "llama", "gemma3", "qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid")
_LINEAR_ATTENTION = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=2)
_FAMILIES = {  # family: (config class, model class, the family's own config fields)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _LINEAR_ATTENTION),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, decoder_sparse_step=1)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, conv_L_cache=3)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(_MAMBA2, layer_types=["mamba", "attention"], num_local_experts=0)),
    # beyond ARCHITECTURES' matrix, for the paths that hit its cache: a Mamba-2 layer (its cache layer cannot drop
    # rows), an attention layer and an MLP
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(layers_block_type=["linear_attention", "full_attention", "mlp"], ssm_state_size=8,
                        mamba_num_heads=4, mamba_head_dim=8, n_groups=1, mamba_chunk_size=4, n_routed_experts=2,
                        num_experts_per_tok=1, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)),
}


def tiny_architecture(family: str, tokenizer=None, seed: int = 0, classifier: bool = False):
    """A randomly initialised tiny causal LM of one of ARCHITECTURES, or "nemotron_h" (seeded, float32), from
    transformers' own config and model classes: hidden size 32, 4 attention heads (2 key/value) of 8, 2 layers unless
    the family's layer kinds take more (Qwen3.5 and Qwen3-Next: 3 Gated DeltaNet layers and an attention layer; LFM2:
    two short-convolution layers around an attention layer; GraniteMoeHybrid: a Mamba-2 layer and an attention layer;
    NemotronH: a Mamba-2 layer, an attention layer and an MLP; Gemma 3: a sliding-window layer of window 4 and a
    global one). With `classifier`, the family's one-label sequence
    classifier (AutoModelForSequenceClassification; LFM2 and GraniteMoeHybrid have none)."""
    import torch
    import transformers

    tokenizer = tokenizer or tiny_tokenizer()
    config_class, model_class, fields = _FAMILIES[family]
    config = getattr(transformers, config_class)(**{
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None, **fields})
    torch.manual_seed(seed)
    if classifier:
        config.num_labels = 1
        return transformers.AutoModelForSequenceClassification.from_config(config)
    model = getattr(transformers, model_class)(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


FLASH_RULES = "flash_attention_rules_on_cpu"  # "flash" in the name: transformers' models take their flash branches


def use_flash_rules(model):
    """Run `model`'s attention by flash attention's rules, on any device (there is no CPU flash kernel): registered
    with transformers' attention and mask interfaces under FLASH_RULES and set on the model's configs. Returns it.

    The rules, as transformers' flash path applies them (modeling_flash_attention_utils._flash_attention_forward):
    with a 2-D padding mask, each row is one sequence of its real tokens; else, given `cu_seq_lens_q` and
    `max_length_q`, the batch flattened is cut at those boundaries; else, when the batch is one row whose position
    ids restart, they mark its sequences; else each row is one causal sequence (a second packed row is not told
    apart). Causal, bottom-right aligned when there are fewer queries than keys; sliding window and soft-capping as
    the layer gives them; the exact softmax (no tiling), so only which keys each query sees differs from sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FLASH_RULES, _flash_rules_attention)
    AttentionMaskInterface.register(FLASH_RULES, flash_attention_mask)
    config = model.config
    for sub in [config] + [getattr(config, name) for name in getattr(config, "sub_configs", {})]:
        if sub is not None:
            sub._attn_implementation = FLASH_RULES  # set directly: set_attn_implementation would look for a kernel
    return model


def _flash_rules_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, softcap=None, **kwargs):
    """query [B, h, Lq, D], key and value [B, hk, Lk, D] -> ([B, Lq, h, D], None), by flash attention's rules."""
    import torch

    batch, heads, lq, dim = query.shape
    lk = key.shape[2]
    key = key.repeat_interleave(heads // key.shape[1], 1)
    value = value.repeat_interleave(heads // value.shape[1], 1)
    segments, flat = _flash_rules_segments(batch, lq, lk, attention_mask, kwargs, query.device)
    if flat:  # the batch as one sequence of batch * L positions, cut at cu_seq_lens
        query, key, value = (t.transpose(0, 1).reshape(1, heads, batch * lq, dim) for t in (query, key, value))
        lq = lk = batch * lq
    q_index = torch.arange(lq, device=query.device) + (lk - lq)
    k_index = torch.arange(lk, device=query.device)
    seen = (q_index[:, None] >= k_index[None, :]) & (segments[:, -lq:, None] == segments[:, None, :])  # [B', Lq, Lk]
    if sliding_window is not None:
        seen &= (q_index[:, None] - k_index[None, :]) < sliding_window
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else dim ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.nan_to_num(scores.masked_fill(~seen[:, None], float("-inf")).softmax(-1))
    out = weights.to(value.dtype) @ value  # [B', h, Lq, D]
    if flat:
        out = out.reshape(heads, batch, -1, dim).transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


def _flash_rules_segments(batch: int, lq: int, lk: int, attention_mask, kwargs: dict, device):
    """([B', Lk] the sequence each key position belongs to (a padding position its own), whether the batch runs
    flattened as one row cut at cu_seq_lens_q)."""
    import torch

    index = torch.arange(lk, device=device)
    if attention_mask is not None:
        return torch.where(attention_mask[:, -lk:].bool(), 0, -1 - index), False
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and longest is not None and lq == lk:
        flat = torch.arange(batch * lk, device=device)
        return torch.bucketize(flat, cu[1:].to(device=device, dtype=torch.long), right=True)[None], True
    positions = kwargs.get("position_ids")
    if positions is not None and batch == 1 and lq == lk and lk > 1:
        return (positions.reshape(1, -1)[:, -lk:] == 0).cumsum(-1), False
    return torch.zeros((batch, lk), dtype=torch.long, device=device), False


VISION_LANGUAGE = ("qwen3_5", "gemma3", "llava", "qwen2_5_vl")  # tiny_vision_language's families


def tiny_vision_language(family: str, tokenizer=None, seed: int = 0):
    """A randomly initialised tiny vision-language model (seeded, float32) of one of VISION_LANGUAGE, as transformers'
    image-text-to-text class: Qwen3.5's (Gated DeltaNet and attention), Gemma 3's (sliding window), LLaVA's (a Llama
    with a CLIP tower), Qwen2.5-VL's (multimodal rotary positions). Its language model is tiny_architecture's size;
    its vision tower one layer of width 16. For loading such checkpoints by path and training them on text."""
    import torch
    import transformers

    tokenizer = tokenizer or tiny_tokenizer()
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "max_position_embeddings": 512,
            "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None}
    qwen_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2)
    special = dict(image_token_id=len(tokenizer) - 3, video_token_id=len(tokenizer) - 2)
    if family == "qwen3_5":
        config = transformers.Qwen3_5Config(text_config=dict(text, **_LINEAR_ATTENTION),
                                            vision_config=dict(qwen_vision, in_channels=3), tie_word_embeddings=True,
                                            vision_start_token_id=len(tokenizer) - 1,
                                            vision_end_token_id=len(tokenizer) - 4, **special)
    elif family == "qwen2_5_vl":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        config = transformers.Qwen2_5_VLConfig(text_config=dict(text, rope_parameters=rope),
                                               vision_config=dict(qwen_vision, in_chans=3, fullatt_block_indexes=[0],
                                                                  window_size=8),
                                               vision_start_token_id=len(tokenizer) - 1, **special)
    elif family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=dict(text, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=4),
            mm_tokens_per_image=4, image_token_index=special["image_token_id"], boi_token_index=len(tokenizer) - 2,
            eoi_token_index=len(tokenizer) - 1)
    else:
        config = transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**text),
            vision_config=transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=16, patch_size=4),
            image_token_index=special["image_token_id"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# each family's image tokens, added to tiny_tokenizer so that tiny_vision_language's ids (the last three: image,
# video or begin-of-image, vision start or end-of-image) are theirs, and LLaVA's end of turn (its EOS, "</s>", which
# its template writes); and its real chat template, as TRL ships it
_VISION_TOKENS = {"llava": ["</s>", "<image>", "<|unused_0|>", "<|unused_1|>"],
                  "gemma3": ["<start_of_turn>", "<end_of_turn>", "<image_soft_token>", "<start_of_image>",
                             "<end_of_image>"],
                  "qwen3_5": ["<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>"],
                  "qwen2_5_vl": ["<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>"]}
_VISION_TEMPLATES = {"llava": "llava_next.jinja", "qwen2_5_vl": "qwen2_5_vl.jinja", "gemma3": "gemma3.jinja",
                     "qwen3_5": "qwen3_5_nothink.jinja"}
# each family's end of turn, its EOS (what its template ends an assistant turn with)
_VISION_EOS = {"llava": "</s>", "gemma3": "<end_of_turn>"}
VISION_PROCESSORS = tuple(_VISION_TOKENS)  # tiny_vision_processor's families


def tiny_vision_processor(family: str, seed: int = 0):
    """(a tiny vision-language model of `family`, its processor), built offline: tiny_tokenizer with the family's
    image tokens and TRL's copy of the family's chat template, and a PIL image processor (no torchvision) sized for
    tiny images. LLaVA: 16x16 pixels in patches of 4 -> 16 image tokens; Qwen2.5-VL and Qwen3.5: up to 16x16 pixels in
    patches of 4 merged 2x2 (a 16x16 image -> 4 image tokens), `pixel_values` [patches, 96] and `image_grid_thw`
    [images, 3]; Gemma 3: 16x16 pixels pooled to 4 image tokens between its begin and end of image, `token_type_ids`
    marking them (its bidirectional image attention)."""
    import os

    import trl

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _VISION_TOKENS[family]})
    if family in _VISION_EOS:
        tokenizer.eos_token = _VISION_EOS[family]
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", _VISION_TEMPLATES[family])) as f:
        template = f.read()
    tokenizer.chat_template = template  # as a checkpoint ships it: its tokenizer's template is its processor's
    model = tiny_vision_language(family, tokenizer, seed)
    if family == "llava":
        from transformers import LlavaProcessor
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        images = LlavaImageProcessorPil(size={"height": 16, "width": 16}, do_center_crop=False)
        return model, LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                     vision_feature_select_strategy="default", chat_template=template,
                                     image_token="<image>", num_additional_image_tokens=1)
    if family == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        for name, token in (("image_token", "<image_soft_token>"), ("boi_token", "<start_of_image>"),
                            ("eoi_token", "<end_of_image>")):
            setattr(tokenizer, name, token)
            setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(token))
        images = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        return model, Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template,
                                      image_seq_length=4)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                      max_pixels=16 * 16)
    return model, _image_only_qwen_vl_processor(family)(images, tokenizer, chat_template=template)


def save_tiny_vision(path: str, seed: int = 0) -> str:
    """A tiny LLaVA and its processor (tiny_vision_processor) saved to `path`, loadable offline by path with
    AutoProcessor and a trainer, as a hub checkpoint is: the docs' vision-language examples run on it with only the
    model name changed. Returns `path`."""
    model, processor = tiny_vision_processor("llava", seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _image_only_qwen_vl_processor(family: str):
    """Qwen2.5-VL's (or Qwen3.5's, Qwen3-VL's) processor without its video processor (which imports torchvision):
    images and text only."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    base = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen3VLProcessor

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)

    ImageOnlyProcessor.__name__ = f"ImageOnly{base.__name__}"
    return ImageOnlyProcessor
