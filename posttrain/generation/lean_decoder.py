"""A lean prefill/decode for Llama-family models (Qwen2, Llama and their likes) with a preallocated KV cache.

transformers' forward spends several milliseconds per call on mask building, cache objects, output
dataclasses and hooks. For the small policies GRPO is often run with, that is most of a decode step on a
CPU. This decoder calls the model's own modules (embedding, norms, projections, MLP, rotary embedding,
output layer; LoRA-wrapped modules work as they are) with the attention written out: keys and values go
into a cache allocated once for prompt + completion, and `scaled_dot_product_attention` reads it.

It is used only for models whose structure it knows and, checked once per model object, whose logits it
reproduces (`supports`); anything else decodes through the model's own forward.

Shapes: N rows, P prompt width (left-padded), S = P + max_new_tokens cache positions, H hidden size,
h query heads, k key/value heads, D head size.
"""

import torch
import torch.nn.functional as F

from posttrain.models.loading import unwrap

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn")


def _has(module, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _known_structure(plain) -> bool:
    """Llama-style blocks, one rotary embedding at the model level, full attention in every layer."""
    body, config = getattr(plain, "model", None), plain.config
    if body is None or not all(_has(body, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if getattr(plain, "lm_head", None) is None or len(body.layers) == 0:
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    layer = body.layers[0]
    return all(_has(layer, part) for part in _LAYER_PARTS) and _has(layer, "self_attn.scaling")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention): x [N, heads, L, D], cos/sin [N, 1, L, D]."""
    half = x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """Prefill, then one token per call, for a batch of left-padded prompts.

    Args:
        model: the causal LM (possibly DDP- or PEFT-wrapped); must pass `supports`.
        prompt_mask: [N, P] bool, True on real prompt tokens.
        max_new_tokens: completion positions to reserve in the cache.
    """

    def __init__(self, model, prompt_mask: torch.Tensor, max_new_tokens: int):
        plain = unwrap(model)
        self.body, self.head = plain.model, plain.lm_head
        attn = self.body.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        n, p = prompt_mask.shape
        config = plain.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = self.body.embed_tokens.weight.dtype
        shape = (len(self.body.layers), n, kv_heads, p + max_new_tokens, self.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=prompt_mask.device)
        self.values = torch.empty_like(self.keys)
        self.key_mask = torch.zeros((n, 1, 1, p + max_new_tokens), dtype=torch.bool, device=prompt_mask.device)
        self.key_mask[:, 0, 0, :p] = prompt_mask
        self.length = 0  # cache positions filled
        self.gqa = kv_heads != config.num_attention_heads
        # the next-token logits of a plain float32 output layer go into one [N, V] buffer: a fresh one per token
        # costs page faults (about 2 ms per token at V = 151,936 here)
        plain_head = type(self.head) is torch.nn.Linear and self.head.bias is None
        self.logits = (torch.empty((n, self.head.weight.size(0)), dtype=torch.float32, device=prompt_mask.device)
                       if plain_head and self.head.weight.dtype == torch.float32 else None)

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the prompts ([N, P] ids and positions); return the next-token logits [N, V] float32.

        The logits returned by `prefill` and `step` may be one buffer that the next call overwrites.
        """
        p = prompt_ids.size(1)
        causal = torch.ones((p, p), dtype=torch.bool, device=prompt_ids.device).tril_()
        # padded query rows see themselves too: a row that sees nothing would give NaN (its output is unused)
        mask = (causal & self.key_mask[:, :, :, :p]) | torch.eye(p, dtype=torch.bool, device=prompt_ids.device)
        return self._forward(prompt_ids, positions, mask)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row ([N] ids, [N, 1] positions); return the next-token logits [N, V] float32."""
        self.key_mask[:, 0, 0, self.length] = True
        return self._forward(token_ids.unsqueeze(1), positions, self.key_mask[:, :, :, :self.length + 1])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.body.embed_tokens(ids)  # [N, L, H]
        cos, sin = self.body.rotary_emb(x, positions)  # [N, L, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        start, end = self.length, self.length + ids.size(1)
        for i, layer in enumerate(self.body.layers):
            x = x + self._attention(i, layer.self_attn, layer.input_layernorm(x), cos, sin, mask, start, end)
            mlp = layer.mlp
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
        self.length = end
        last = self.body.norm(x[:, -1])  # [N, H]
        if self.logits is not None:
            return torch.mm(last, self.head.weight.T, out=self.logits)
        return self.head(last).float()

    def _attention(self, i, attn, x, cos, sin, mask, start, end) -> torch.Tensor:
        n, length, _ = x.shape
        q = attn.q_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)  # [N, h, L, D]
        k = attn.k_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)  # [N, k, L, D]
        v = attn.v_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        self.keys[i, :, :, start:end] = _rotate(k, cos, sin)
        self.values[i, :, :, start:end] = v
        out = F.scaled_dot_product_attention(_rotate(q, cos, sin), self.keys[i, :, :, :end], self.values[i, :, :, :end],
                                             attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa)
        return attn.o_proj(out.transpose(1, 2).reshape(n, length, -1))


def supports(model) -> bool:
    """Whether `LeanDecoder` reproduces this model's logits; decided once per model object and cached."""
    plain = unwrap(model)
    cached = getattr(plain, "_posttrain_lean_decoder", None)
    if cached is None:
        cached = _known_structure(plain) and _reproduces_logits(model)
        plain._posttrain_lean_decoder = cached
    return cached


def _reproduces_logits(model) -> bool:
    """Prefill two left-padded prompts of different lengths and decode three tokens; compare every step's logits
    with the model's own forward over the whole sequence."""
    from posttrain.models.logprobs import positions_from_mask

    device = next(model.parameters()).device
    vocab = unwrap(model).lm_head.weight.size(0)
    ids = (torch.arange(14, device=device).view(2, 7) * 7 + 3) % vocab  # [2, 4 prompt + 3 new]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False  # the second prompt is 2 tokens shorter, left-padded
    positions = positions_from_mask(mask)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            decoder = LeanDecoder(model, mask[:, :4], 3)
            ours = [decoder.prefill(ids[:, :4], positions[:, :4]).clone()]
            ours += [decoder.step(ids[:, t], positions[:, t:t + 1]).clone() for t in range(4, 6)]
            theirs = model(input_ids=ids[:, :6], attention_mask=mask[:, :6].long(), position_ids=positions[:, :6],
                           use_cache=False).logits[:, 3:6].float()
        tol = 1e-4 if unwrap(model).lm_head.weight.dtype == torch.float32 else 3e-2
        scale = theirs.abs().max().clamp(min=1.0)
        return bool(torch.allclose(torch.stack(ours, 1), theirs, atol=tol * scale, rtol=0))
    except (TypeError, AttributeError, IndexError, RuntimeError, ValueError):
        return False
    finally:
        model.train(was_training)
