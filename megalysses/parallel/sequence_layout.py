"""Which positions of a sample each sequence-parallel rank holds, and the padding that lets any length fit.

sp = ulysses x ring (u x r). The sample, padded to a multiple of `SequenceLayout.multiple`, is cut into
2r chunks of S/(2r); ring rank i holds chunks i and 2r-1-i (zigzag: every ring rank gets the same share
of the causal triangle). Inside a ring rank's S/r positions the u Ulysses ranks hold consecutive slices of
S/sp, so one Ulysses all-to-all gathers exactly the ring rank's block. sp rank = ring_rank * u + ulysses_rank
(Ulysses varies fastest, as in the grid). With r = 1 this is the plain contiguous split.

    layout = SequenceLayout(Degrees(sp=4, ring=2))        # u = 2
    S = layout.padded_len(250)                            # 252: a multiple of lcm(sp, 2r) = 4
    layout.positions(S, sp_rank=1)                        # the 63 global positions sp rank 1 holds
    shard = shard_sample(layout, sp_rank, inputs, labels, positions, doc_ids, pad_id=eod)

For sp=4, ring=2, S=16: chunks of 4; ring rank 0 holds chunks 0 and 3 (positions 0-3, 12-15), ring rank 1
chunks 1 and 2 (4-11); sp ranks 0, 1 hold 0-3 and 12-15, sp ranks 2, 3 hold 4-7 and 8-11.

Padding positions (past seq_len) get the pad token, label -100 (never counted in the loss or the token
count), the next document id (they are a document of their own) and positions that continue the sample's;
they sit at the end of the sequence, so causal attention never lets a real token see them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megalysses.degrees import Degrees

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SequenceLayout:
    """The sequence split of a run's degrees: sp ranks = ulysses x ring, and with TP sequence sharding tp more
    pieces of each sp rank's tokens (tp_shard)."""

    degrees: Degrees = Degrees()
    tp_sequence_parallel: bool = False

    @property
    def tp_shard(self) -> int:
        return self.degrees.tp if self.tp_sequence_parallel else 1

    def record(self) -> dict[str, int]:
        """The split as plain data (runtime.json): sp, ring and tp_shard."""
        return {"sp": self.degrees.sp, "ring": self.degrees.ring, "tp_shard": self.tp_shard}

    @property
    def multiple(self) -> int:
        """Padded lengths are multiples of this: sp * tp_shard tokens split evenly, and with a ring also 2r
        equal zigzag chunks."""
        d = self.degrees
        base = d.sp * self.tp_shard
        return math.lcm(base, 2 * d.ring) if d.ring > 1 else base

    def padded_len(self, seq_len: int) -> int:
        return -(-seq_len // self.multiple) * self.multiple

    def ring_positions(self, padded: int, ring_rank: int) -> np.ndarray:
        """Global positions of ring rank `ring_rank`'s block, in order: chunk i, then chunk 2r-1-i."""
        self._check(padded)
        r = self.degrees.ring
        if r == 1:
            return np.arange(padded)
        c = padded // (2 * r)
        i = ring_rank
        return np.concatenate([np.arange(i * c, (i + 1) * c), np.arange((2 * r - 1 - i) * c, (2 * r - i) * c)])

    def positions(self, padded: int, sp_rank: int) -> np.ndarray:
        """Global positions held by sp rank `sp_rank` (its residual-stream tokens, in order)."""
        d = self.degrees
        if not 0 <= sp_rank < d.sp:
            raise ValueError(f"sp_rank={sp_rank} outside [0, {d.sp})")
        ring_rank, ulysses_rank = divmod(sp_rank, d.ulysses)
        local = padded // d.sp
        return self.ring_positions(padded, ring_rank)[ulysses_rank * local:(ulysses_rank + 1) * local]

    def _check(self, padded: int) -> None:
        if padded % self.multiple:
            raise ValueError(f"sequence length {padded} is not a multiple of {self.multiple} (sp={self.degrees.sp}, "
                             f"ring={self.degrees.ring}, tp_shard={self.tp_shard}): pad it with padded_len()")


def shard_sample(layout: SequenceLayout, sp_rank: int, inputs: np.ndarray, labels: np.ndarray,
                 positions: np.ndarray, doc_ids: Optional[np.ndarray], pad_id: int,
                 loss_weights: Optional[np.ndarray] = None) -> dict[str, np.ndarray]:
    """This sp rank's tokens of full samples: pad (B, seq_len) arrays to the layout's multiple, then keep
    the rank's positions. doc_ids, when given, stay full-length (B, padded): every rank builds the
    attention masks from them, nothing is gathered. loss_weights, when given, go with the labels (0 on
    padding)."""
    batch, seq_len = inputs.shape
    padded = layout.padded_len(seq_len)
    extra = padded - seq_len
    if extra:
        inputs = np.concatenate([inputs, np.full((batch, extra), pad_id, dtype=inputs.dtype)], axis=1)
        labels = np.concatenate([labels, np.full((batch, extra), IGNORE_INDEX, dtype=labels.dtype)], axis=1)
        tail = positions[:, -1:] + 1 + np.arange(extra)
        positions = np.concatenate([positions, tail.astype(positions.dtype)], axis=1)
        if doc_ids is not None:
            pad_doc = np.repeat(doc_ids[:, -1:] + 1, extra, axis=1)
            doc_ids = np.concatenate([doc_ids, pad_doc.astype(doc_ids.dtype)], axis=1)
        if loss_weights is not None:
            loss_weights = np.concatenate([loss_weights, np.zeros((batch, extra), loss_weights.dtype)], axis=1)
    keep = layout.positions(padded, sp_rank)
    out = {"input_ids": np.ascontiguousarray(inputs[:, keep]),
           "labels": np.ascontiguousarray(labels[:, keep]),
           "position_ids": np.ascontiguousarray(positions[:, keep], dtype=np.int64)}
    if doc_ids is not None:
        out["doc_ids"] = np.ascontiguousarray(doc_ids)
    if loss_weights is not None:
        out["loss_weights"] = np.ascontiguousarray(loss_weights[:, keep])
    return out
