"""chat_template_path: a chat template from a .jinja file or from another tokenizer, checked against this
tokenizer's vocabulary (a template that emits a token the vocabulary lacks would train on its pieces instead)."""

import os
import re

from posttrain.configs import ConfigError

_SPECIAL = re.compile(r"<\|[^|<>\s]+\|>|<(?:start|end)_of_turn>|\[/?INST\]")


def _missing_tokens(template: str, tokenizer, extra_known: set) -> list[str]:
    vocab = tokenizer.get_vocab()
    found = set(_SPECIAL.findall(template))
    return sorted(t for t in found if t not in vocab and t not in extra_known)


def load_chat_template(path: str, tokenizer, trust_remote_code: bool = False) -> str:
    """The template at `path` (a .jinja file, or a tokenizer directory / hub id that has one)."""
    expanded = os.path.expanduser(path)
    if expanded.endswith((".jinja", ".j2")) or os.path.isfile(expanded):
        if not os.path.isfile(expanded):
            raise ConfigError(f"chat_template_path {path!r} does not exist: give a .jinja file or a tokenizer.")
        with open(expanded, encoding="utf-8") as f:
            template = f.read()
    else:
        from posttrain.models import load_tokenizer

        source = load_tokenizer(path, trust_remote_code)
        template = getattr(source, "chat_template", None)
        if not template:
            raise ConfigError(f"chat_template_path {path!r} names a tokenizer without a chat template: give one that "
                              "has a template, or a .jinja file.")
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
    missing = _missing_tokens(template, tokenizer, set())
    if missing:
        raise ConfigError(f"The chat template of chat_template_path {path!r} uses {', '.join(missing)}, which this "
                          "tokenizer's vocabulary lacks: add them (tokenizer.add_special_tokens, then "
                          "model.resize_token_embeddings) and pass that tokenizer, or choose a template made for it.")
    return template
