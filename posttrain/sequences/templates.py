"""Chat templates for SFT and the reward model: chat_template_path (a .jinja file, or another tokenizer's template
with the tokens it needs), and which template SFT's assistant_only_loss renders with (TRL's training version: sequences/chat.py trl_training_template).

chat_template_path, as TRL takes it:
- a .jinja (or .j2) file replaces the template's text; a special token it uses that the vocabulary lacks is refused
  (TRL takes it silently, and the token then trains as its pieces);
- a tokenizer directory or hub id is cloned as TRL's `clone_chat_template` does: its template, the added tokens the
  vocabulary lacks, its EOS token (on the model's config and generation config too), the embeddings resized to the
  new vocabulary rounded up to a multiple of 64, and `<extra_id_N>` tokens added until the vocabulary fills them.

assistant_only_loss needs to know which tokens are the assistant's. A template with `{% generation %}` markers says
so itself. For one without, TRL 1.16 swaps in its bundled training version of the template (`*_training.jinja`:
Qwen2.5/3, Llama 3, Gemma, Phi-3, GPT-OSS, DeepSeek, ... about 25 families, matched by the template's exact text);
when TRL is installed, posttrain renders with the same one, so the masks are TRL's. Otherwise (TRL absent, or a
template it does not know) the assistant turns are found by rendering the conversation turn by turn
(sft/formats.py), which works for any template that renders earlier turns unchanged.
"""

import logging
import os
import re

from posttrain.configs import ConfigError

logger = logging.getLogger("posttrain")

_SPECIAL = re.compile(r"<\|[^|<>\s]+\|>|<(?:start|end)_of_turn>|\[/?INST\]")
EMBEDDING_MULTIPLE = 64  # TRL's clone_chat_template rounds the resized vocabulary up to this


def _missing_tokens(template: str, tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab()
    return sorted(t for t in set(_SPECIAL.findall(template)) if t not in vocab)


def _is_template_file(path: str) -> bool:
    expanded = os.path.expanduser(path)
    return expanded.endswith((".jinja", ".j2")) or os.path.isfile(expanded)


def _template_of(source, path: str) -> str:
    template = getattr(source, "chat_template", None)
    if not template:
        raise ConfigError(f"chat_template_path {path!r} names a tokenizer without a chat template: give one that "
                          "has a template, or a .jinja file.")
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()))
    return template


def apply_chat_template_path(path: str, model, tokenizer, trust_remote_code: bool = False) -> list[int]:
    """Set `tokenizer`'s chat template from `path` (module docstring), adapting `model` to new tokens. Call it before
    adapters wrap the model. Returns the ids of the tokens added to the vocabulary."""
    if _is_template_file(path):
        expanded = os.path.expanduser(path)
        if not os.path.isfile(expanded):
            raise ConfigError(f"chat_template_path {path!r} does not exist: give a .jinja file or a tokenizer.")
        with open(expanded, encoding="utf-8") as f:
            template = f.read()
        missing = _missing_tokens(template, tokenizer)
        if missing:
            raise ConfigError(f"The chat template of chat_template_path {path!r} uses {', '.join(missing)}, which this "
                              "tokenizer's vocabulary lacks: give the tokenizer directory the template comes from as "
                              "chat_template_path (its tokens are then added and the embeddings resized), or add "
                              "them to the tokenizer yourself.")
        tokenizer.chat_template = template
        return []
    from posttrain.models import load_tokenizer

    source = load_tokenizer(path, trust_remote_code)
    tokenizer.chat_template = _template_of(source, path)
    vocab = tokenizer.get_vocab()
    added = [token for token in source.added_tokens_decoder.values() if token.content not in vocab]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    _set_eos(model, tokenizer.eos_token_id)
    model.resize_token_embeddings(len(tokenizer.get_vocab()), pad_to_multiple_of=EMBEDDING_MULTIPLE)
    names = [token.content for token in added]
    index = 0
    while model.get_input_embeddings().num_embeddings > len(tokenizer.get_vocab()):
        name = f"<extra_id_{index}>"
        index += 1
        if tokenizer.add_tokens(name) == 1:
            names.append(name)
    return tokenizer.convert_tokens_to_ids(names)


def train_added_tokens(peft_config, token_ids: list[int], tied: bool) -> None:
    """With adapters, the embeddings of tokens chat_template_path added train too (peft's trainable_token_indices),
    and the output layer is saved whole (modules_to_save), as TRL sets them, with its warning. With `tied` output and
    input embeddings the trainable tokens cover both, and lm_head stays out of modules_to_save (peft cannot wrap a
    module twice; TRL adds it and peft stops)."""
    if peft_config is None or not token_ids:
        return
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = {"embed_tokens": list(token_ids)}
    elif isinstance(indices, dict):
        indices.setdefault("embed_tokens", []).extend(token_ids)
    else:  # a plain list means the embedding layer's
        peft_config.trainable_token_indices = list(indices) + list(token_ids)
    if not tied and (peft_config.modules_to_save is None or "lm_head" not in peft_config.modules_to_save):
        logger.warning("chat_template_path added tokens, so lm_head is added to the adapters' modules_to_save: "
                       "without it the model could not learn to produce them. Put it there yourself to silence this.")
        peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]


def _set_eos(model, eos_id: int) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.eos_token_id = eos_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.eos_token_id = eos_id
