"""Per-row extra forward inputs (`model_inputs`): what a row feeds the model besides its token ids and masks, such as
a vision-language model's `pixel_values` and `image_grid_thw`. The seam the batches carry them through: GRPO's
Rollouts (generation/protocol.py) and training buffer (grpo/batch.py), the token rows and their collation
(sequences/rows.py, sequences/collate.py).

    inputs = ModelInputs.from_rows([{"pixel_values": [p0, d], "image_grid_thw": [1, 3]}, {}, ...])   N rows
    inputs.select(index)             rows `index`, in that order (also `inputs[index]`)
    ModelInputs.concatenate(parts)   rows after rows
    inputs.batched(device)           {name: tensor} for one forward: every row's tensor of that name concatenated
                                     along dim 0 in row order (a row without it adds nothing), the way transformers'
                                     vision-language models take them (Qwen2-VL's pixel_values [patches, dim] and
                                     image_grid_thw [images, 3]; LLaVA's pixel_values [images, C, H, W])
    inputs.batched(device, input_ids)  the same, with the per-token input `token_types` derives from the forward's
                                     ids (Qwen2.5-VL's mm_token_type_ids, Gemma 3's token_type_ids: [B, L], the
                                     processor's modality of each token), so it follows any padding or truncation
    inputs.tensors(prefix) / ModelInputs.from_tensors(tensors, prefix, n)    a checkpoint's flat name -> tensor form

A row is an immutable {name: tensor}, or a deferred row (anything with `names`, `resolve()` -> {name: tensor} and
`fingerprint()` -> bytes: sequences/images.py RowPixels, a prepared dataset's row whose pixels are processed when a
batch takes it, so that preparing a large image dataset keeps ids, not pixels); nothing here reads a model. Where the
rows are laid out in ways these inputs cannot follow (several rows packed into one, a row split in pieces, a prompt
shared by several rows) the layout is refused or not taken, and `CANNOT_CARRY` names it; the chunked output layer
carries them (it sees only the hidden states of the model's own forward with its inputs).
"""

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

# The layouts that cannot carry a row's model_inputs: what runs instead, or why it is refused.
CANNOT_CARRY = {
    "packing": "rows packed into one are refused (a row's image tokens and its pixel values must stay together): "
               "set packing=False",
    "padding_free": "the padding-free layout is refused (its one row has no per-row inputs): set padding_free=False",
    "split": "a sequence split in pieces (bfd_split) is refused: use truncation or packing_strategy='bfd'",
    "rollout packing": "GRPO's packed log-prob forward is not taken: the rows run padded",
    "prompt sharing": "GRPO's shared-prompt forward is not taken: each row runs its own prompt",
}


@dataclass(frozen=True)
class TokenTypes:
    """A per-token input that is a function of the token ids: `name` is `types[id]` at a token whose id has a type
    (1 an image token, 2 a video token, as transformers' processors number them), 0 elsewhere (text, padding)."""

    name: str  # "mm_token_type_ids" (Qwen-VL) or "token_type_ids" (Gemma 3)
    types: tuple[tuple[int, int], ...]  # (token id, its type)

    def of(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] int64 types of `input_ids` [B, L]."""
        out = torch.zeros_like(input_ids, dtype=torch.long)
        for token, kind in self.types:
            out[input_ids == token] = kind
        return out

    def tensor(self) -> torch.Tensor:
        """[T, 2] (id, type) pairs, for a checkpoint."""
        return torch.tensor(self.types, dtype=torch.long).reshape(-1, 2)

    @classmethod
    def from_tensor(cls, name: str, pairs: torch.Tensor) -> "TokenTypes":
        return cls(name, tuple((int(t), int(k)) for t, k in pairs.tolist()))


class ModelInputsError(ValueError):
    """A row's model_inputs cannot be carried where they were asked to go."""


def refuse(layout: str) -> None:
    """Raise the one sentence for `layout` (a CANNOT_CARRY key) taking rows with model_inputs."""
    raise ModelInputsError(f"Rows with model_inputs (a vision-language model's pixel_values, for instance): "
                           f"{CANNOT_CARRY[layout]}.")


@dataclass(frozen=True)
class ModelInputs:
    """N rows' extra forward inputs, each row a {name: tensor} ({} for a row without any), and the per-token input
    derived from the ids (`token_types`), where the model takes one."""

    rows: tuple[Mapping[str, torch.Tensor], ...]
    token_types: TokenTypes | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, torch.Tensor] | None],
                  token_types: TokenTypes | None = None) -> "ModelInputs":
        checked = []
        for i, row in enumerate(rows):
            if _deferred(row):
                checked.append(row)
                continue
            row = dict(row or {})
            for name, value in row.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    raise ModelInputsError(f"model_inputs of row {i}: {name!r} is {type(value).__name__}"
                                           f"{'' if not isinstance(value, torch.Tensor) else ' of 0 dimensions'}; "
                                           "each input is a tensor whose first dimension the rows are concatenated "
                                           "along.")
            checked.append(row)
        return cls(tuple(checked), token_types)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def names(self) -> list[str]:
        """Every input name any row has, sorted."""
        return sorted({name for row in self.rows for name in (row.names if _deferred(row) else row)})

    def resolved(self) -> "ModelInputs":
        """These rows with every deferred one's tensors made (each distinct row once)."""
        made = {}
        for row in self.rows:
            if _deferred(row) and id(row) not in made:
                made[id(row)] = row.resolve()
        return ModelInputs(tuple(made[id(row)] if _deferred(row) else row for row in self.rows), self.token_types)

    def select(self, index) -> "ModelInputs":
        """Rows `index` (a sequence or 1-d tensor of row numbers, or a bool mask), in that order."""
        if isinstance(index, torch.Tensor):
            index = index.nonzero().flatten() if index.dtype == torch.bool else index.flatten()
            index = index.tolist()
        return ModelInputs(tuple(self.rows[int(i)] for i in index), self.token_types)

    __getitem__ = select

    @classmethod
    def concatenate(cls, parts: Sequence["ModelInputs | None"], sizes: Sequence[int]) -> "ModelInputs | None":
        """`parts` rows after rows (`sizes`: each part's row count, for a part that is None: rows without inputs);
        None when no part has any."""
        if all(p is None for p in parts):
            return None
        rows = []
        for part, size in zip(parts, sizes, strict=True):
            rows.extend(part.rows if part is not None else [{}] * size)
        types = next((p.token_types for p in parts if p is not None and p.token_types is not None), None)
        return cls(tuple(rows), types)

    def batched(self, device=None, input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """{name: every row's tensor concatenated along dim 0, in row order}, moved to `device`; with the forward's
        `input_ids` [B, L] (these rows, in this order), the token types too."""
        out = {}
        if self.token_types is not None and input_ids is not None:
            out[self.token_types.name] = self.token_types.of(input_ids)
        rows = self.resolved().rows
        for name in self.names:
            values = [row[name] for row in rows if name in row]
            out[name] = torch.cat(values, 0) if len(values) > 1 else values[0]
            if device is not None:
                out[name] = out[name].to(device)
        return out

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """A flat {f"{prefix}{row}.{name}": tensor} (and f"{prefix}types.{name}") for a safetensors file. A tensor
        several rows share (a prompt's pixels, repeated for each of its completions) is written once: the later rows
        hold f"{prefix}{row}.{name}@", the number of the row that has it."""
        out, first = {}, {}
        for r, row in enumerate(self.resolved().rows):
            for name, value in row.items():
                owner = first.setdefault((name, id(value)), r)
                if owner == r:
                    out[f"{prefix}{r}.{name}"] = value.contiguous().cpu()
                else:
                    out[f"{prefix}{r}.{name}@"] = torch.tensor([owner])
        if self.token_types is not None:
            out[f"{prefix}types.{self.token_types.name}"] = self.token_types.tensor()
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str, n: int,
                     device=None) -> "ModelInputs | None":
        """The rows `tensors(prefix)` wrote (`n` rows), on `device`; None when none was written."""
        rows = [{} for _ in range(n)]
        found, types, shared = False, None, []
        for key, value in tensors.items():
            if key.startswith(prefix):
                r, name = key[len(prefix):].split(".", 1)
                if r == "types":
                    types = TokenTypes.from_tensor(name, value)
                elif name.endswith("@"):
                    shared.append((int(r), name[:-1], int(value[0])))
                else:
                    rows[int(r)][name] = value if device is None else value.to(device)
                found = True
        for r, name, owner in shared:
            rows[r][name] = rows[owner][name]
        return cls(tuple(rows), types) if found else None

    def fingerprint_bytes(self) -> bytes:
        """The rows' names, shapes, dtypes and values, for a data fingerprint."""
        parts = [repr(self.token_types).encode()] if self.token_types is not None else []
        for r, row in enumerate(self.rows):
            if _deferred(row):
                parts.append(f"{r}:".encode() + row.fingerprint())
                continue
            for name in sorted(row):
                value = row[name].detach().cpu().contiguous()
                parts.append(f"{r}.{name}:{tuple(value.shape)}:{value.dtype}".encode())
                parts.append(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        return b"".join(parts)


def _deferred(row) -> bool:
    """A row whose tensors are made when a batch takes it."""
    return callable(getattr(row, "resolve", None))
