"""A lean prefill/decode for Llama-family models (Qwen2, Llama and their likes) with a preallocated KV cache.

transformers' forward spends several milliseconds per call on mask building, cache objects, output
dataclasses and hooks. For the small policies GRPO is often run with, that is most of a decode step on a
CPU. This decoder calls the model's own modules (embedding, norms, projections, MLP, rotary embedding,
output layer; LoRA-wrapped modules work as they are) with the attention written out: keys and values go
into a cache allocated once for prompt + completion, and `scaled_dot_product_attention` reads it.

For a small model a decode step is mostly per-call overhead, so the decoder also trims calls (each layer's parts
bound once per decode: generation/bound_parts.py): float32 Linear/RMSNorm/SiLU parts become direct calls, q/k/v and
gate/up each become one product on weights concatenated once per decode (while the copies take at most
FUSED_COPY_BUDGET), the residual adds go inside `addmm`, cos/sin come from a table, queries and keys are rotated
together, and rows with identical prompts (GRPO's num_generations copies) are prefilled once. On a CPU the float32
products go through oneDNN's linear on weights packed once per decode, 2-4x faster than torch's GEMM for a decode
step's few rows. Rows that have finished can leave the batch (`keep_rows`). docs/performance.md has what each saves.

It is used only for models whose structure it knows and, checked once per model object, whose logits it
reproduces (`supports`); anything else decodes through the model's own forward.

Shapes: N rows, P prompt width (left-padded), S = P + max_new_tokens cache positions, H hidden size,
h query heads, k key/value heads, D head size.
"""

import torch
import torch.nn.functional as F

from posttrain.generation.bound_parts import (BoundLayer, Packer, direct, fused_bytes, linear_class, plain_linear,
                                              rotate_half_matrix)
from posttrain.models import fast_paths
from posttrain.models.keywords import unwrap
from posttrain.models.loading import CHECK_ERRORS, check_raised
from posttrain.models.onednn import linear_op

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


FUSED_COPY_BUDGET = 64 << 20  # bytes: the most that fused copies of q/k/v and gate/up weights may take per decode
PACKED_COPY_BUDGET = 1 << 30  # bytes: the most that oneDNN-packed copies of the weights may take per decode
# packing reads and writes every weight once, about what 3 decode tokens take: a decode of fewer new tokens than
# this (a short server request, the decoder's own check) reads the weights in place instead
PACK_MIN_NEW_TOKENS = 16


# rotary types whose cos/sin at a position do not depend on the other positions (others are recomputed per call)
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


# at fixed shapes outside a CUDA graph, attention reads the filled cache positions rounded up to a multiple of this
ATTEND_BUCKET = 64
# keep_rows gathers the kept rows' filled keys (then values) at once while that temporary takes at most this many bytes
# (a row at a time took 0.8 ms a compaction on the demo's model, 3% of its step); above, it moves them a row at a time
GATHER_BUDGET = 16 << 20

# devices where SDPA's enable_gqa with a mask takes the math kernel, which repeats the keys and values per query head
# (CUDA): there the query heads are grouped by kv head instead (LeanDecoder._grouped_attention)
GROUPED_QUERY_DEVICES = {"cuda"}


class LeanDecoder:
    """Prefill, then one token per call, for a batch of left-padded prompts.

    Rows with identical prompts (GRPO's num_generations copies) are prefilled once and their keys and values
    copied to every copy.

    Fixed shapes (`fixed_shape`, cache_implementation="static"): every step reads and writes tensors of the same
    shapes at the same addresses and makes no host sync, so that it can be captured in a CUDA graph
    (generation/graphed_step.py): attention runs over the whole preallocated cache (zeroed, so that the positions
    not yet written are finite) under the key mask, the new keys and values go in at a cursor held on the device, the
    logits into one buffer, and rows never leave the batch (`keep_rows` declines). Outside a graph, attention reads
    the filled positions rounded up to ATTEND_BUCKET (`attend_bucket`): the shapes then change once a bucket, and
    the step reads no more of the cache than the growing decode's does.

    Args:
        model: the causal LM (possibly DDP- or PEFT-wrapped); must pass `supports`.
        prompt_mask: [N, P] bool, True on real prompt tokens.
        max_new_tokens: completion positions to reserve in the cache.
        fixed_shape: decode at fixed shapes, as above.
        compute_dtype: the dtype the decode computes and caches in (None: the weights'); another one (a bf16 run's
            bf16 over float32 weights) runs the products under that autocast and keeps the KV cache in it.
    """

    def __init__(self, model, prompt_mask: torch.Tensor, max_new_tokens: int, *, fixed_shape: bool = False,
                 compute_dtype: torch.dtype | None = None):
        plain = unwrap(model)
        self.body, self.head = plain.model, plain.lm_head
        attn = self.body.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        n, p = prompt_mask.shape
        config, device = plain.config, prompt_mask.device
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.q_heads = config.num_attention_heads
        weight_dtype = self.body.embed_tokens.weight.dtype
        dtype = compute_dtype or weight_dtype
        self.autocast = dtype != weight_dtype  # the products under an autocast to `dtype`
        self.fixed_shape = fixed_shape
        shape = (len(self.body.layers), n, self.kv_heads, p + max_new_tokens, self.head_dim)
        allocate = torch.zeros if fixed_shape else torch.empty  # fixed: attention reads every position
        self.keys = allocate(shape, dtype=dtype, device=device)
        self.values = allocate(shape, dtype=dtype, device=device)
        self.key_mask = torch.zeros((n, 1, 1, p + max_new_tokens), dtype=torch.bool, device=device)
        self.key_mask[:, 0, 0, :p] = prompt_mask
        self.cursor = torch.full((1,), p, dtype=torch.long, device=device)  # fixed shapes: the next position written
        # fixed shapes: attention reads the filled positions rounded up to this many (shapes change once a bucket:
        # the CPU reads no more than the growing decode does), or the whole cache (None: what a CUDA graph captures)
        self.attend_bucket = ATTEND_BUCKET
        fuse = fused_bytes(self.body.layers) <= FUSED_COPY_BUDGET
        packer = None
        if device.type == "cpu" and linear_op() is not None and not self.autocast:
            packer = Packer(n, PACKED_COPY_BUDGET if max_new_tokens >= PACK_MIN_NEW_TOKENS else 0)
        self.layers = [BoundLayer(layer, fuse, packer, fuse_add=not self.autocast) for layer in self.body.layers]
        self.final_norm = direct(self.body.norm)
        self.rotate_half = rotate_half_matrix(self.head_dim, weight_dtype, device)
        self.rope_table = None
        if getattr(self.body.rotary_emb, "rope_type", None) in _STATIC_ROPE:
            # positions never exceed p - 1 + max_new_tokens; cos/sin [S, D] each, looked up per call
            at = torch.arange(p + max_new_tokens, device=device).unsqueeze(0)
            like = torch.zeros((1, 1), dtype=weight_dtype, device=device)
            self.rope_table = tuple(t[0] for t in self.body.rotary_emb(like, at))
        self.length = 0  # cache positions filled
        # the next-token logits of a plain float32 output layer go into one [N, V] buffer: a fresh one per token
        # costs page faults (about 2 ms per token at V = 151,936 here)
        plain_head = linear_class(self.head) and self.head.bias is None and not self.autocast
        self.logits = (torch.empty((n, self.head.weight.size(0)), dtype=torch.float32, device=device)
                       if plain_head and self.head.weight.dtype == torch.float32 and packer is None else None)
        # with oneDNN the output layer's product is its own (2-3x faster for a decode step's rows than `torch.mm`)
        self.project = direct(self.head, packer) if packer is not None and plain_linear(self.head) else None

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the prompts ([N, P] ids and positions); return the next-token logits [N, V] float32.

        The logits returned by `prefill` and `step` may be one buffer that the next call overwrites.
        """
        p = prompt_ids.size(1)
        prompt_mask = self.key_mask[:, 0, 0, :p]
        rows = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
        unique, copies = torch.unique(rows, dim=0, return_inverse=True)  # [M, 2P], [N]
        if unique.size(0) < rows.size(0):
            first = torch.full((unique.size(0),), rows.size(0), dtype=torch.long, device=rows.device)
            first.scatter_reduce_(0, copies, torch.arange(rows.size(0), device=rows.device), "amin")
            return self._prefill(prompt_ids[first], positions[first], self.key_mask[first], copies)[copies]
        return self._prefill(prompt_ids, positions, self.key_mask)

    def _prefill(self, prompt_ids, positions, key_mask, copies=None) -> torch.Tensor:
        """Prefill M distinct prompts; `copies` [N] maps each cache row to its prompt (None: the rows themselves)."""
        p = prompt_ids.size(1)
        causal = torch.ones((p, p), dtype=torch.bool, device=prompt_ids.device).tril_()
        # padded query rows see themselves too: a row that sees nothing would give NaN (its output is unused)
        mask = (causal & key_mask[:, :, :, :p]) | torch.eye(p, dtype=torch.bool, device=prompt_ids.device)
        return self._forward(prompt_ids, positions, mask, copies)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row ([N] ids, [N, 1] positions); return the next-token logits [N, V] float32."""
        if self.fixed_shape:  # the cursor's position, on the device: the same shapes and no host value every step
            self.key_mask.index_fill_(3, self.cursor, True)
            width = self.key_mask.size(-1)
            if self.attend_bucket is not None:  # the filled positions rounded up to the bucket: fixed within it
                width = min(width, -(-(self.length + 1) // self.attend_bucket) * self.attend_bucket)
            logits = self._forward(token_ids.unsqueeze(1), positions, self.key_mask[..., :width], at=self.cursor)
            self.cursor.add_(1)
            if self.attend_bucket is not None:  # the host's count, for the bucket (a captured step reads none)
                self.length += 1
            return logits
        self.key_mask[:, 0, 0, self.length] = True
        return self._forward(token_ids.unsqueeze(1), positions, self.key_mask[:, :, :, :self.length + 1])

    def keep_rows(self, rows: torch.Tensor) -> bool:
        """Keep only these rows ([n'] ascending indices) of the batch: their keys and values move to the front of the
        same cache, in place (the filled positions only: gathered at once while that temporary takes at most
        GATHER_BUDGET, else one row at a time), and the cache becomes a view of its first n' rows; the key mask and the
        logits buffer shrink to n' rows. No second cache is made: at compaction the memory stays that of the one cache
        (a copy would hold both, up to 3x the cache with the gather's temporary).
        At fixed shapes it declines (False): the rows stay."""
        if self.fixed_shape:
            return False
        n, filled = rows.numel(), self.length
        if self.keys[:, :n, :, :filled].nbytes <= GATHER_BUDGET:  # a small temporary: one gather, not a row at a time
            for cache in (self.keys, self.values):
                cache[:, :n, :, :filled] = cache[:, rows, :, :filled]  # the index reads into a copy first
        else:
            for i, r in enumerate(rows.tolist()):  # ascending: row r >= i, so no row is overwritten before it moves
                if r != i:
                    self.keys[:, i, :, :filled].copy_(self.keys[:, r, :, :filled])
                    self.values[:, i, :, :filled].copy_(self.values[:, r, :, :filled])
        self.keys, self.values, self.key_mask = self.keys[:, :n], self.values[:, :n], self.key_mask[rows]
        if self.logits is not None:
            self.logits = self.logits[:n]
        return True

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, copies=None,
                 at=None) -> torch.Tensor:
        """Run L new tokens per row; `at` ([1] long, fixed shapes): the cache position they go to, else
        self.length's."""
        with torch.autocast(ids.device.type, dtype=self.keys.dtype, enabled=self.autocast):
            return self._layers(ids, positions, mask, copies, at)

    def _layers(self, ids, positions, mask, copies, at) -> torch.Tensor:
        x = self.body.embed_tokens(ids)  # [N, L, H]
        if self.rope_table is not None:
            cos, sin = (F.embedding(positions, table) for table in self.rope_table)  # [N, L, D]
        else:
            cos, sin = self.body.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, L, 1, D]
        start, end = self.length, self.length + ids.size(1)
        for i, layer in enumerate(self.layers):
            x = layer.o_plus(x, self._attention(i, layer, layer.norm_in(x), cos, sin, mask, start, end, copies, at))
            gate, up = layer.gate_up(layer.norm_mid(x)).chunk(2, dim=-1)
            x = layer.down_plus(x, layer.act(gate) * up)
        if at is None:
            self.length = end
        last = self.final_norm(x[:, -1])  # [N, H]
        if self.project is not None:
            return self.project(last)
        if self.logits is not None and copies is None:  # the buffer has a row per row of the batch
            return torch.mm(last, self.head.weight.T, out=self.logits)
        return self.head(last).float()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half convention): x [N, L, heads, D], cos/sin [N, L, 1, D]."""
        return torch.addcmul(x * cos, torch.matmul(x, self.rotate_half), sin)

    def _attention(self, i, layer: BoundLayer, x, cos, sin, mask, start, end, copies=None, at=None) -> torch.Tensor:
        """Attention of x [N, L, H] over the cache; returns [N, L, h * D] before the output projection. With
        `copies` (a prefill of M distinct prompts), x is [M, L, H] and the keys and values go to every copy; with
        `at` (one step at fixed shapes) they go to that position and attention reads the whole cache."""
        n, length, _ = x.shape
        h, k = self.q_heads, self.kv_heads
        qkv = layer.qkv(x).view(n, length, h + 2 * k, self.head_dim)
        if layer.q_norm is None:
            qk = self._rotate(qkv[:, :, :h + k], cos, sin)  # queries and keys rotated together
            q, key = qk[:, :, :h], qk[:, :, h:]
        else:
            q = self._rotate(layer.q_norm(qkv[:, :, :h]), cos, sin)
            key = self._rotate(layer.k_norm(qkv[:, :, h:h + k]), cos, sin)
        value = qkv[:, :, h + k:]
        if at is not None:
            self.keys[i].index_copy_(2, at, key.transpose(1, 2).to(self.keys.dtype))
            self.values[i].index_copy_(2, at, value.transpose(1, 2).to(self.values.dtype))
            width = mask.size(-1)  # the whole cache, or the attended bucket of it
            out = self._grouped_attention(q.transpose(1, 2), self.keys[i][:, :, :width], self.values[i][:, :, :width],
                                          mask)
            return out.transpose(1, 2).reshape(n, length, -1)
        rows = slice(None) if copies is None else copies
        self.keys[i, :, :, start:end] = key.transpose(1, 2)[rows]
        self.values[i, :, :, start:end] = value.transpose(1, 2)[rows]
        if copies is None:
            keys, values = self.keys[i, :, :, :end], self.values[i, :, :, :end]
        else:
            keys, values = key.transpose(1, 2), value.transpose(1, 2)
        return self._grouped_attention(q.transpose(1, 2), keys, values, mask).transpose(1, 2).reshape(n, length, -1)

    def _grouped_attention(self, q, keys, values, mask) -> torch.Tensor:
        """SDPA of q [N, h, L, D] over keys and values [N, k, T, D] (query head j reads kv head j // (h / k)), with a
        [N, 1, L, T] mask -> [N, h, L, D]. Each kv head's h / k query heads attend as one batch row of (h / k) * L
        queries, so the keys and values are never repeated per query head (SDPA's enable_gqa with a mask takes its
        math kernel on CUDA, which expands them: every layer, every token); only the mask is repeated, L * T bools a
        head. On a device outside GROUPED_QUERY_DEVICES (the CPU) SDPA's own grouped-query kernel runs."""
        n, h, length, d = q.shape
        k = keys.size(1)
        if h == k or q.device.type not in GROUPED_QUERY_DEVICES:  # the CPU's kernel reads the heads grouped itself
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=h != k)
        g = h // k
        grouped = q.reshape(n, k, g * length, d)  # [N, k, g * L, D]
        mask = mask.unsqueeze(2).expand(mask.size(0), 1, g, length, mask.size(-1)).reshape(mask.size(0), 1,
                                                                                             g * length, -1)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling)
        return out.view(n, h, length, d)


def supports(model) -> bool:
    """Whether `LeanDecoder` reproduces this model's logits; decided once per model object and cached."""
    return fast_paths.decided(model, "lean_decoder",
                              lambda: _known_structure(unwrap(model)) and _reproduces_logits(model))


def reads_no_training_flag(model) -> bool:
    """Whether this decoder's output for `model` (which passes `supports`) is the same in train and eval mode: every
    module it calls (the embedding, the norms, the rotary embedding, each layer's projections and activation, the
    output layer) is a leaf whose forward never reads `training` (a Linear, an Embedding, an RMSNorm, an activation).
    A LoRA-wrapped projection (its dropout, DoRA's cache) or any other module makes it False: that decode needs eval
    mode."""
    plain = unwrap(model)
    body = plain.model
    parts = [body.embed_tokens, body.norm, body.rotary_emb, plain.lm_head]
    parts += [layer.get_submodule(dotted) for layer in body.layers for dotted in _LAYER_PARTS]
    parts += [getattr(layer.self_attn, name) for layer in body.layers for name in ("q_norm", "k_norm")
              if getattr(layer.self_attn, name, None) is not None]
    return all(_mode_free(module) for module in parts)


def _mode_free(module) -> bool:
    if next(module.children(), None) is not None:
        return False
    kind = type(module)
    if linear_class(module) or kind in (torch.nn.Embedding, torch.nn.Identity, torch.nn.SiLU):
        return True
    return kind.__module__ == "transformers.activations" or kind.__name__.endswith(("RMSNorm", "RotaryEmbedding"))


def _reproduces_logits(model) -> bool:
    """Prefill two left-padded prompts of different lengths and decode three tokens; compare every step's logits
    with the model's own forward over the whole sequence."""
    from posttrain.models.forwards import positions_from_mask

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
    except CHECK_ERRORS as err:
        return check_raised(unwrap(model), "its decodes run through its own forward, not the lean decoder", err)
    finally:
        model.train(was_training)
