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
    inputs.tensors(prefix) / ModelInputs.from_tensors(tensors, prefix, n)    a checkpoint's flat name -> tensor form

A row is an immutable {name: tensor}; nothing here reads a model. Where the rows are laid out in ways these inputs
cannot follow (several rows packed into one, a row split in pieces, a prompt shared by several rows) the layout is
refused or not taken, and `CANNOT_CARRY` names it; the chunked output layer carries them (it sees only the hidden
states of the model's own forward with its inputs).
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
    "teacher pass": "distillation's teacher and student passes do not take them: distil text-only rows",
}


class ModelInputsError(ValueError):
    """A row's model_inputs cannot be carried where they were asked to go."""


def refuse(layout: str) -> None:
    """Raise the one sentence for `layout` (a CANNOT_CARRY key) taking rows with model_inputs."""
    raise ModelInputsError(f"Rows with model_inputs (a vision-language model's pixel_values, for instance): "
                           f"{CANNOT_CARRY[layout]}.")


@dataclass(frozen=True)
class ModelInputs:
    """N rows' extra forward inputs, each row a {name: tensor} ({} for a row without any)."""

    rows: tuple[Mapping[str, torch.Tensor], ...]

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, torch.Tensor] | None]) -> "ModelInputs":
        checked = []
        for i, row in enumerate(rows):
            row = dict(row or {})
            for name, value in row.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    raise ModelInputsError(f"model_inputs of row {i}: {name!r} is {type(value).__name__}"
                                           f"{'' if not isinstance(value, torch.Tensor) else ' of 0 dimensions'}; "
                                           "each input is a tensor whose first dimension the rows are concatenated "
                                           "along.")
            checked.append(row)
        return cls(tuple(checked))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def names(self) -> list[str]:
        """Every input name any row has, sorted."""
        return sorted({name for row in self.rows for name in row})

    def select(self, index) -> "ModelInputs":
        """Rows `index` (a sequence or 1-d tensor of row numbers, or a bool mask), in that order."""
        if isinstance(index, torch.Tensor):
            index = index.nonzero().flatten() if index.dtype == torch.bool else index.flatten()
            index = index.tolist()
        return ModelInputs(tuple(self.rows[int(i)] for i in index))

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
        return cls(tuple(rows))

    def batched(self, device=None) -> dict[str, torch.Tensor]:
        """{name: every row's tensor concatenated along dim 0, in row order}, moved to `device`."""
        out = {}
        for name in self.names:
            values = [row[name] for row in self.rows if name in row]
            out[name] = torch.cat(values, 0) if len(values) > 1 else values[0]
            if device is not None:
                out[name] = out[name].to(device)
        return out

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """A flat {f"{prefix}{row}.{name}": tensor} for a safetensors file."""
        return {f"{prefix}{r}.{name}": value.contiguous().cpu() for r, row in enumerate(self.rows)
                for name, value in row.items()}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str, n: int,
                     device=None) -> "ModelInputs | None":
        """The rows `tensors(prefix)` wrote (`n` rows), on `device`; None when none was written."""
        rows = [{} for _ in range(n)]
        found = False
        for key, value in tensors.items():
            if key.startswith(prefix):
                r, name = key[len(prefix):].split(".", 1)
                rows[int(r)][name] = value if device is None else value.to(device)
                found = True
        return cls(tuple(rows)) if found else None

    def fingerprint_bytes(self) -> bytes:
        """The rows' names, shapes, dtypes and values, for a data fingerprint."""
        parts = []
        for r, row in enumerate(self.rows):
            for name in sorted(row):
                value = row[name].detach().cpu().contiguous()
                parts.append(f"{r}.{name}:{tuple(value.shape)}:{value.dtype}".encode())
                parts.append(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        return b"".join(parts)
