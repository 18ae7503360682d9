"""An SFT dataset -> its training rows: tokenized (formats.py) in blocks of BLOCK rows, then truncated or packed
(sequences/rows.py); the micro-batches are sequences/batches.py's."""

import logging

import numpy as np

from posttrain.data import DataError
from posttrain.sequences.batches import BLOCK, block_rows
from posttrain.sequences.rows import TokenRows, prepare
from posttrain.sft.formats import RowEncoder

logger = logging.getLogger("posttrain")


class Preparation:
    """Turns a dataset's rows into training rows with one config (its encoder, max_length, packing)."""

    def __init__(self, encoder: RowEncoder, args, packing: bool, name: str):
        self.encoder = encoder
        self.args = args
        self.packing = packing
        self.name = name
        self.skip = args.skip_prepare_dataset

    def sequences(self, rows: list[dict], first_index: int) -> TokenRows:
        return TokenRows.from_sequences(self.encoder.encode(rows, first_index))

    concatenate = staticmethod(TokenRows.concatenate)

    def rows(self, sequences: TokenRows) -> tuple[TokenRows, int]:
        """(training rows, sequences dropped with no target left)."""
        if self.skip:  # already prepared by the user: used as given
            return sequences, 0
        return prepare(sequences, self.args.max_length, self.args.truncation_mode, self.packing,
                       self.args.packing_strategy)


def prepare_map_dataset(dataset, preparation: Preparation, seed: int) -> TokenRows:
    """Every row of a map-style dataset, tokenized, then truncated or packed."""
    if len(dataset) == 0:
        raise DataError(f"{preparation.name} is empty: it needs at least one row.")
    parts = []
    for start in range(0, len(dataset), BLOCK):
        parts.append(preparation.sequences(block_rows(dataset[start:start + BLOCK]), start))
    sequences = TokenRows.concatenate(parts)
    if preparation.args.shuffle_dataset:  # TRL's meaning: once, before packing
        sequences = sequences.select(np.random.default_rng(seed).permutation(len(sequences)))
    rows, dropped = preparation.rows(sequences)
    _report(preparation, len(dataset), rows, dropped)
    return rows


def _report(preparation: Preparation, n: int, rows: TokenRows, dropped: int) -> None:
    args, name = preparation.args, preparation.name
    if len(rows) == 0:
        raise DataError(f"{name} has no token left to train on after truncation to max_length={args.max_length}: "
                        f"every row's trained tokens (completion or assistant turns) lie beyond it; raise max_length "
                        "or shorten the prompts.")
    if dropped:
        logger.warning("%s: %d of %d rows had no trained token within max_length=%s and were dropped.", name, dropped,
                       n, args.max_length)
    kind = f"packed ({args.packing_strategy}) into" if preparation.packing else "as"
    logger.info("%s: %d rows %s %d training rows, %d tokens, %d of them targets.", name, n, kind, len(rows),
                len(rows.tokens), int(rows.target_counts.sum()))
