"""Conversations packed whole into sequences: the samples of a dataset that has a loss mask.

    ds, mask = IndexedDataset("data/chat_text_document"), IndexedDataset("data/chat_text_document_loss_mask")
    packed = PackedConversations(MaskedDataset(ds, mask), (0, len(ds)), seq_len=8192, seed=1234, num_samples=1000,
                                 packing=Packing("ffd", "drop", lengths=(2048, 8192)))
    packed.rows(0, 2048)      # sample 0 at length 2048: 4 PackedRows of up to 2048 tokens
    packed.summary()          # per length: conversations, sequences, fill, what was too long

A conversation never crosses a sequence: at each length L (one per curriculum phase) the conversations of
each epoch (the split's conversations in a seeded order, the same order at every length) are packed into
sequences of at most L tokens, first-fit decreasing (`ffd`: the longest first, each into the first sequence
with room, then the sequences of the epoch shuffled) or one per sequence (`none`, in the epoch's order).
Sample i at length L is sequences [i * seq_len / L, (i + 1) * seq_len / L) of that packing, so a step holds
the tokens it holds without a curriculum. A conversation longer than L is dropped, truncated to its first L
tokens (dropped when none of those carries the loss) or refused (DatasetError), as `too_long` says, and
counted. The indices are built in numpy and cached beside the data (cache.py), so every rank and every
resume reads the same sequences; beside them, the labels that carry the loss in each sequence, so a step's
count is known on the host before it runs (`labels_of`), and a dataset with none at a length is refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from megalysses.data.cache import cached_arrays
from megalysses.data.indexed import DatasetError, IndexedDataset

PACK_VERSION = "packed-conversations-v2"
PACK_MODES = ("ffd", "none")
TOO_LONG = ("drop", "truncate", "error")


@dataclass(frozen=True)
class Packing:
    mode: str = "ffd"                    # "ffd" (first-fit decreasing) or "none" (one conversation per sequence)
    too_long: str = "drop"               # a conversation longer than the sequence: "drop", "truncate" or "error"
    lengths: tuple[int, ...] = field(default=())   # the lengths samples are read at (curriculum phases)


class MaskedDataset(NamedTuple):
    """A dataset of conversations and its loss mask beside it (open_loss_mask): one 0/1 byte per token."""

    indexed: IndexedDataset
    mask: IndexedDataset


@dataclass
class PackedRow:
    """One sequence of whole documents: their tokens back to back, whether each token is a label that carries
    the loss (it is predicted from the token before it, in its document), and the documents' lengths."""

    tokens: np.ndarray
    loss: np.ndarray
    doc_lengths: np.ndarray


def sample_rows(dataset: Any, i: int, seq_len: int, length: int) -> list:
    """Sample i of `dataset` read at `length` (a divisor of seq_len): seq_len / length PackedRows of a packed
    dataset, else the window of seq_len + 1 tokens cut into pieces of length + 1 (loader.cut_samples)."""
    rows = getattr(dataset, "rows", None)
    if rows is not None:
        return rows(i, length)
    sample = dataset[i]
    return [sample] if length == seq_len else cut_window(sample, seq_len, length)


def cut_window(sample: np.ndarray, seq_len: int, length: int) -> list[np.ndarray]:
    """A window of (up to) seq_len + 1 tokens as seq_len // length windows of length + 1: piece k holds tokens
    [k * length, (k + 1) * length], so consecutive pieces overlap by one token and keep the window's labels."""
    return [sample[k * length:(k + 1) * length + 1] for k in range(seq_len // length)]


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item when items are placed in the given order, each into the first bin with room
    (bins of `capacity`; every size <= capacity). A max-tree over the bins' free room finds the first bin with
    room for an item in log(bins) steps; bins not yet opened have all their room, so they are found last."""
    n = len(sizes)
    leaves = 1 << max(0, (n - 1).bit_length())
    room = [capacity] * (2 * leaves)
    out = np.empty(n, dtype=np.int64)
    for k, size in enumerate(sizes.tolist()):
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        out[k] = node - leaves
        room[node] -= size
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return out


def pack_epoch(order: np.ndarray, lengths: np.ndarray, capacity: int, mode: str,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(items, their lengths, bin starts [bins + 1]) of one epoch: conversations `order` (ids) of `lengths`
    (each <= capacity) packed by `mode`."""
    if mode == "none" or not len(order):
        return order, lengths, np.arange(len(order) + 1, dtype=np.int64)
    by_size = np.argsort(-lengths, kind="stable")
    bins = first_fit(lengths[by_size], capacity)
    count = int(bins.max()) + 1
    rank = rng.permutation(count)[bins]                      # the epoch's sequences in a random order
    place = by_size[np.lexsort((np.arange(len(bins)), rank))]
    starts = np.concatenate([[0], np.cumsum(np.bincount(rank, minlength=count))]).astype(np.int64)
    return order[place], lengths[place], starts


class PackedConversations:
    """Samples of seq_len tokens of whole conversations from sequences [start, end) of `data.indexed`, whose
    loss mask is `data.mask`, readable at each of packing.lengths (default: seq_len alone)."""

    packed = True

    def __init__(self, data: MaskedDataset, documents: tuple[int, int], seq_len: int, seed: int,
                 num_samples: Optional[int] = None, cache_dir: Optional[str] = None, name: str = "train",
                 packing: Optional[Packing] = None) -> None:
        indexed, mask = data
        start, end = documents
        packing = packing or Packing()
        if not 0 <= start < end <= len(indexed):
            raise ValueError(f"{indexed.prefix}: document range [{start}, {end}) is empty or outside "
                             f"[0, {len(indexed)})")
        if packing.mode not in PACK_MODES or packing.too_long not in TOO_LONG:
            raise ValueError(f"packing {packing}: mode is one of {PACK_MODES}, too_long one of {TOO_LONG}")
        self.indexed, self.mask, self.seq_len, self.name = indexed, mask, seq_len, name
        self.packing = packing
        lengths = np.asarray(indexed.sequence_lengths[start:end], dtype=np.int64)
        self._index: dict[int, dict[str, np.ndarray]] = {}
        self._counts: dict[int, dict[str, int]] = {}
        for length in sorted(set(packing.lengths) | {seq_len}):
            if seq_len % length:
                raise ValueError(f"length {length} does not divide seq_len={seq_len}")
            need = None if num_samples is None else num_samples * (seq_len // length)
            usable, counts = self._usable(lengths, start, length)
            key = {"version": PACK_VERSION, "lengths": usable, "documents": [start, end], "length": length,
                   "seed": seed, "need": need, "mode": packing.mode, "prefix": os.path.basename(indexed.prefix)}
            self._index[length] = cached_arrays(
                cache_dir, f"{os.path.basename(indexed.prefix)}-{name}-packed{length}", key,
                lambda u=usable, n=need, L=length: self._build(u, start, L, seed, n),
                ["items", "sizes", "bins", "labels"])
            bins = len(self._index[length]["bins"]) - 1
            counts.update(sequences=bins, samples=bins // (seq_len // length))
            self._counts[length] = counts
        for length, c in self._counts.items():
            if c["empty"] and c["empty"] == c["conversations"]:
                raise DatasetError(self._nothing_to_train(length))
        if min(c["samples"] for c in self._counts.values()) < 1:
            raise ValueError(f"{indexed.prefix} ({name}): its conversations fill no sample of {seq_len} tokens "
                             f"at every length {sorted(self._counts)}")
        for length, index in self._index.items():
            if not index["labels"].any():
                raise DatasetError(self._nothing_to_train(length))
        self._per_sample: dict[int, np.ndarray] = {}

    def _usable(self, lengths: np.ndarray, start: int, length: int) -> tuple[np.ndarray, dict[str, int]]:
        """Each conversation's tokens at `length` (0: left out) and the counts of what was left out or cut."""
        long = np.flatnonzero(lengths > length)
        usable = np.where(lengths > length, 0, lengths)
        counts = {"conversations": int((lengths > 0).sum()), "dropped": 0, "truncated": 0, "empty": 0}
        if len(long) and self.packing.too_long == "error":
            raise DatasetError(
                f"{self.indexed.prefix} ({self.name}): {len(long)} of {len(lengths)} conversations are longer than "
                f"the sequences of {length} tokens they are packed into (the longest: {int(lengths.max())} tokens): "
                f"set data.too_long to drop or truncate them, or train at a longer data.seq_len")
        if self.packing.too_long == "truncate":
            answered = np.array([bool(self.mask.get(start + int(i), 0, length)[1:].any()) for i in long], dtype=bool)
            usable[long[answered]] = length
            counts["truncated"], counts["empty"] = int(answered.sum()), int((~answered).sum())
        else:
            counts["dropped"] = len(long)
        return usable, counts

    def _nothing_to_train(self, length: int) -> str:
        """The message for a dataset whose sequences at `length` hold no label that carries the loss."""
        cut = (f" in the first {length} tokens of each (data.too_long=truncate cuts the rest away)"
               if self.packing.too_long == "truncate" else
               f" in those of at most {length} tokens (data.too_long=drop leaves out the longer)"
               if length < self.seq_len or self._counts[length]["dropped"] else "")
        return (f"{self.indexed.prefix} ({self.name}): no token of its conversations carries the loss{cut}: "
                f"{os.path.basename(self.mask.prefix)} marks none, so there is nothing to train on; write the data "
                f"with tools/preprocess_data.py --chat from conversations with assistant turns (prompt and "
                f"completion: a completion), or train at a longer data.seq_len")

    def _labels(self, usable: np.ndarray, start: int) -> np.ndarray:
        """Per conversation, the labels that carry the loss in its first usable tokens (its first token is no
        label: nothing predicts it within the conversation)."""
        out = np.zeros(len(usable), dtype=np.int64)
        for i in np.flatnonzero(usable > 1).tolist():
            out[i] = np.count_nonzero(self.mask.get(start + i, 1, int(usable[i]) - 1))
        return out

    def _build(self, usable: np.ndarray, start: int, length: int, seed: int,
               need: Optional[int]) -> dict[str, np.ndarray]:
        kept = np.flatnonzero(usable > 0)
        if not len(kept):
            return {"items": np.zeros(0, np.int64), "sizes": np.zeros(0, np.int32), "bins": np.zeros(1, np.int64),
                    "labels": np.zeros(0, np.int64)}
        per_conversation = self._labels(usable, start)
        items, sizes, bins, total, epoch = [], [], [np.zeros(1, np.int64)], 0, 0
        while True:
            order = np.random.default_rng([seed, epoch]).permutation(len(usable))
            order = order[usable[order] > 0]
            got = pack_epoch(order + start, usable[order], length, self.packing.mode,
                             np.random.default_rng([seed, epoch, length]))
            items.append(got[0])
            sizes.append(got[1].astype(np.int32))
            bins.append(got[2][1:] + sum(map(len, items[:-1])))
            total += len(got[2]) - 1
            epoch += 1
            if need is None or total >= need:
                break
        items, bins = np.concatenate(items), np.concatenate(bins)
        labels = np.add.reduceat(per_conversation[items - start], bins[:-1]) if len(items) else np.zeros(0, np.int64)
        return {"items": items, "sizes": np.concatenate(sizes), "bins": bins, "labels": labels}

    def __len__(self) -> int:
        return min(c["samples"] for c in self._counts.values())

    def rows(self, i: int, length: int) -> list[PackedRow]:
        """Sample i at `length`: its seq_len / length sequences."""
        if length not in self._index:
            raise ValueError(f"{self.indexed.prefix}: samples at length {length} were not built (only at "
                             f"{sorted(self._index)})")
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside [0, {len(self)})")
        k = self.seq_len // length
        index = self._index[length]
        return [self._row(index, b) for b in range(i * k, (i + 1) * k)]

    def labels_of(self, samples: np.ndarray, length: int) -> int:
        """The labels that carry the loss in `samples` (sample indices) read at `length`, from the index alone."""
        if length not in self._per_sample:
            k = self.seq_len // length
            self._per_sample[length] = self._index[length]["labels"][:len(self) * k].reshape(len(self), k).sum(1)
        return int(self._per_sample[length][samples].sum())

    def sequences(self, length: int) -> list[PackedRow]:
        """Every sequence packed at `length`, in order (samples take them seq_len / length at a time)."""
        index = self._index[length]
        return [self._row(index, b) for b in range(len(index["bins"]) - 1)]

    def _row(self, index: dict[str, np.ndarray], b: int) -> PackedRow:
        lo, hi = int(index["bins"][b]), int(index["bins"][b + 1])
        docs, sizes = index["items"][lo:hi], index["sizes"][lo:hi]
        tokens = [self.indexed.get(int(d), 0, int(n)) for d, n in zip(docs, sizes)]
        loss = [self.mask.get(int(d), 0, int(n)) for d, n in zip(docs, sizes)]
        return PackedRow(np.concatenate(tokens), np.concatenate(loss).astype(bool), np.asarray(sizes, np.int64))

    def __getitem__(self, i: int) -> PackedRow:
        return self.rows(i, self.seq_len)[0]

    def summary(self) -> list[str]:
        """What packing did at each length, in words (the start-up summary)."""
        out = []
        for length, c in sorted(self._counts.items()):
            index = self._index[length]
            per_epoch = c["conversations"] - c["dropped"] - c["empty"]
            epochs = len(index["items"]) // max(per_epoch, 1)
            fill = float(index["sizes"].sum(dtype=np.int64)) / max(1, (len(index["bins"]) - 1) * length)
            cut = (f"{c['truncated']} truncated to {length} tokens" +
                   (f", {c['empty']} dropped: no answer in their first {length} tokens" if c["empty"] else "")
                   if self.packing.too_long == "truncate" else f"{c['dropped']} longer dropped")
            out.append(f"{self.name} at {length} tokens: {per_epoch} of the {c['conversations']} conversations of "
                       f"{os.path.basename(self.indexed.prefix)} per epoch ({cut}); {epochs} epoch"
                       f"{'s' if epochs != 1 else ''} packed {self.packing.mode} into {c['sequences']} sequences, "
                       f"{100 * fill:.1f}% filled")
        return out


def open_loss_mask(indexed: IndexedDataset, prefix: str) -> IndexedDataset:
    """The loss mask dataset `prefix` of `indexed`, checked to hold one 0/1 byte per token of it."""
    mask = IndexedDataset(prefix)
    if mask.dtype != np.uint8:
        raise DatasetError(f"{mask.idx_file}: a loss mask holds uint8, not {mask.dtype} (docs/DATA_FORMAT.md)")
    if len(mask) != len(indexed) or not np.array_equal(mask.sequence_lengths, indexed.sequence_lengths) \
            or not np.array_equal(mask.document_indices, indexed.document_indices):
        raise DatasetError(f"{mask.idx_file}: the loss mask does not match {indexed.idx_file} ({len(mask)} and "
                           f"{len(indexed)} sequences, not of the same lengths): write both with one run of "
                           f"tools/preprocess_data.py --chat")
    return mask


def describe(datasets: Sequence[Any]) -> list[str]:
    """The packing summaries of the packed datasets among `datasets` (blends opened)."""
    out = []
    for d in datasets:
        if d is None:
            continue
        members = getattr(d, "datasets", [d])
        out += [line for m in members if getattr(m, "packed", False) for line in m.summary()]
    return out
