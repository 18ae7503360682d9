"""An SFT dataset -> its training rows: tokenized (formats.py) in blocks of BLOCK rows, then truncated or packed
(sequences/rows.py); the micro-batches are sequences/batches.py's.

Nothing is lost without a count. A row with nothing to train on whatever the length (an empty text, masks that keep
no token) is left out, and one warning gives how many and why the first had none. What max_length costs is one
warning too: the rows cut and the tokens they lost, with their shares of the dataset, and how many rows kept no
trained token and were dropped; it names what keeps those tokens (packing_strategy='bfd_split', TRL's name, or a
larger max_length). A map-style dataset is counted whole; a stream is reported at the first block that loses
anything (later blocks are not; the rows a block drops are sequences/batches.py's warning, block by block).
Warnings come from the main process only; a dataset left with no row to train on stops with one sentence saying
which cause emptied it.
"""

import logging
from dataclasses import dataclass

import numpy as np

from posttrain.data import DataError
from posttrain.sequences.batches import BLOCK, block_rows
from posttrain.sequences.rows import TokenRows, prepare, truncates, truncation_cut
from posttrain.sft.formats import RowEncoder

logger = logging.getLogger("posttrain")


@dataclass
class Losses:
    """What preparing a dataset left out, counted over the rows read so far."""

    read: int = 0  # dataset rows encoded
    untrained: int = 0  # of them, rows with nothing to train on at any length (left out)
    first_untrained: tuple = ()  # (row index, why, the fix) of the first of them
    rows: int = 0  # rows that reached truncation or packing
    tokens: int = 0  # their tokens
    truncated: int = 0  # rows longer than max_length, cut to it
    tokens_cut: int = 0  # the tokens cutting them removed
    dropped: int = 0  # rows (bfd_split: pieces; wrapped: packed rows) left with no target, and dropped


class Preparation:
    """Turns a dataset's rows into training rows with one config (its encoder, max_length, packing), counting what it
    leaves out (Losses) and saying it once (`report`; a stream's first losses at once)."""

    def __init__(self, encoder: RowEncoder, args, *, packing: bool, name: str, main_process: bool = True,
                 stream: bool = False):
        self.encoder = encoder
        self.args = args
        self.packing = packing
        self.name = name
        self.skip = args.skip_prepare_dataset
        self.main_process = main_process
        self.stream = stream
        self.losses = Losses()
        self._reported: set[str] = set()

    def sequences(self, rows: list[dict], first_index: int) -> TokenRows:
        """The rows tokenized, those with nothing to train on left out (and counted) unless they are used as given."""
        sequences = self.encoder.encode_rows(rows, first_index)
        if self.encoder.vision is not None and truncates(self.packing, self.args.packing_strategy):
            self.encoder.vision.check_cut(sequences, self.args.max_length, self.name, first_index)
        self.losses.read += len(sequences)
        if self.skip:  # already prepared by the user: used as given
            return sequences
        untrained = np.nonzero(sequences.target_counts == 0)[0]
        if len(untrained):
            if not self.losses.untrained:
                first = int(untrained[0])
                self.losses.first_untrained = (first_index + first,
                                               *self.encoder.why_untrained(int(sequences.lengths[first])))
            self.losses.untrained += len(untrained)
            sequences = sequences.select(np.nonzero(sequences.target_counts > 0)[0])
        return sequences

    concatenate = staticmethod(TokenRows.concatenate)

    def rows(self, sequences: TokenRows) -> tuple[TokenRows, int]:
        """(training rows, how many were dropped with no target left after the cut, split or wrap)."""
        if self.skip:  # already prepared by the user: used as given
            return sequences, 0
        args, losses = self.args, self.losses
        losses.rows += len(sequences)
        losses.tokens += len(sequences.tokens)
        if truncates(self.packing, args.packing_strategy):
            truncated, cut = truncation_cut(sequences.lengths, args.max_length)
            losses.truncated += truncated
            losses.tokens_cut += cut
        rows, dropped = prepare(sequences, args.max_length, args.truncation_mode, self.packing, args.packing_strategy)
        losses.dropped += dropped
        if self.stream:
            self.report()
        return rows, dropped

    def report(self) -> None:
        """Each kind of loss counted so far, in one warning, once (main process only)."""
        for kind, message in (("untrained", self._untrained_message()), ("length", self._length_message())):
            if message and kind not in self._reported:
                self._reported.add(kind)
                if self.main_process:
                    stream = " (over the stream's rows read so far; later blocks are not reported)"
                    logger.warning("%s%s.", message, stream if self.stream else "")

    def _untrained_message(self) -> str:
        losses = self.losses
        if not losses.untrained:
            return ""
        index, why, fix = losses.first_untrained
        return (f"{self.name}: {losses.untrained} of {losses.read} rows had nothing to train on and were left out "
                f"(row {index}: {why}; {fix})")

    def _length_message(self) -> str:
        losses, args = self.losses, self.args
        dropped = 0 if self.stream else losses.dropped  # a stream's batcher reports them block by block
        if losses.truncated:
            kept = "first" if args.truncation_mode == "keep_start" else "last"
            also = f", and {dropped} of them kept no trained token and were dropped" if dropped else ""
            keeps = ("packing_strategy='bfd_split' keeps them, splitting long rows into pieces of max_length" if
                     self.packing else "raise max_length to keep them, or pack with packing_strategy='bfd_split', "
                     "which splits long rows into pieces instead")
            return (f"{self.name}: {losses.truncated} of {losses.rows} rows ({losses.truncated / losses.rows:.1%}) "
                    f"were longer than max_length={args.max_length} and cut to their {kept} {args.max_length} "
                    f"tokens, losing {losses.tokens_cut} of {losses.tokens} tokens "
                    f"({losses.tokens_cut / max(losses.tokens, 1):.1%}){also}; {keeps}")
        if not dropped:
            return ""
        if self.packing and args.packing_strategy == "bfd_split":
            return (f"{self.name}: {dropped} pieces of rows split at max_length={args.max_length} held no trained "
                    "token and were dropped")
        if self.packing and args.packing_strategy == "wrapped":
            return (f"{self.name}: {dropped} packed rows held no trained token (their sequences' trained tokens "
                    "fell in the neighbouring rows) and were dropped")
        return f"{self.name}: {dropped} of {losses.rows} rows had no trained token and were dropped"


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
    rows, _ = preparation.rows(sequences)
    _report(preparation, len(dataset), rows)
    return rows


def _report(preparation: Preparation, n: int, rows: TokenRows) -> None:
    args, name = preparation.args, preparation.name
    if len(rows) == 0:
        raise DataError(_nothing_left(preparation))
    preparation.report()
    kind = f"packed ({args.packing_strategy}) into" if preparation.packing else "as"
    logger.info("%s: %d rows %s %d training rows, %d tokens, %d of them targets.", name, n, kind, len(rows),
                len(rows.tokens), int(rows.target_counts.sum()))


def _nothing_left(preparation: Preparation) -> str:
    """The sentence for a dataset left with no training row: the cause that emptied it (the rows' own, the length's,
    or both)."""
    losses, name, max_length = preparation.losses, preparation.name, preparation.args.max_length
    if losses.untrained:
        index, why, fix = losses.first_untrained
        if losses.untrained == losses.read:
            return f"{name} has nothing to train on: no row has a token to train on (row {index}: {why}); {fix}."
        return (f"{name} has no token left to train on: {losses.untrained} rows had nothing to train on (row {index}: "
                f"{why}) and the other {losses.read - losses.untrained} lost every trained token to truncation to "
                f"max_length={max_length}; {fix}, and raise max_length or shorten the prompts.")
    return (f"{name} has no token left to train on after truncation to max_length={max_length}: every row's trained "
            "tokens (completion or assistant turns) lie beyond it; raise max_length or shorten the prompts.")
