"""GPT samples: windows of seq_len + 1 tokens over shuffled, concatenated documents.

    ds = IndexedDataset("data/stdlib_text_document")
    (train_docs, _, _) = split_ranges("969,30,1", len(ds))
    train = GPTDataset(ds, train_docs, seq_len=1024, seed=1234, num_samples=80_000, cache_dir="data/index_cache")
    train[0]            # int array of 1025 tokens; consecutive samples overlap by one token

Three indices, built with vectorised numpy and cached (see cache.py):
- document index: the split's document ids, one seeded permutation per epoch, epochs concatenated,
  as many epochs as `num_samples` needs (one epoch when it is None);
- sample index [n + 1, 2]: (position in the document index, token offset in that document) of the
  first token of each sample; sample i runs from row i to row i + 1 inclusive, so the stream of
  samples in index order is the document stream cut every seq_len tokens;
- shuffle index: a seeded permutation of the samples inside each epoch, epochs kept in order (a
  sample belongs to the epoch where it starts), so no token repeats before a full pass.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from megalysses.config.values import parse_split
from megalysses.data.cache import cached_arrays
from megalysses.data.indexed import IndexedDataset

INDEX_VERSION = "gpt-indices-v1"


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Document [start, end) of train, valid and test, rounded as Megatron does."""
    bounds = [0]
    for weight in parse_split(split):
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [min(max(b - excess, 0), num_documents) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def num_epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: Optional[int]) -> int:
    """Epochs needed for num_samples windows of seq_len + 1 tokens (1 when num_samples is None)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset split has no tokens")
    if num_samples is None:
        return 1
    needed = num_samples * seq_len + 1
    return max(1, -(-needed // tokens_per_epoch))


def shuffled_documents(lengths: np.ndarray, first_document: int, num_epochs: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(document index, lengths in stream order): the ids first_document + arange(len(lengths)), one
    `rng.permuted` shuffle per epoch over an (epochs, documents) array, epochs concatenated."""
    num_docs = len(lengths)
    if first_document + num_docs < 2**31:
        # (document id, length) int32 pairs shuffled as single 8-byte items: the permutation is the one
        # the ids alone would get (it depends only on the array's shape and the generator), and the
        # lengths come out in stream order without a random-access gather.
        pairs = np.empty((num_epochs, num_docs, 2), dtype=np.int32)
        pairs[:, :, 0] = np.arange(first_document, first_document + num_docs, dtype=np.int32)
        pairs[:, :, 1] = lengths
        items = pairs.view(np.int64)[:, :, 0]
        rng.permuted(items, axis=1, out=items)
        return np.ascontiguousarray(pairs[:, :, 0]).reshape(-1), np.ascontiguousarray(pairs[:, :, 1]).reshape(-1)
    doc = np.empty((num_epochs, num_docs), dtype=np.int64)
    doc[:] = np.arange(first_document, first_document + num_docs, dtype=np.int64)
    rng.permuted(doc, axis=1, out=doc)
    doc = doc.reshape(-1)
    return doc, np.take(lengths, doc - first_document)


def sample_index(stream_lengths: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2]: (position in the document stream, token offset in that document) where each
    sample starts, given the lengths of the documents in stream order; the same rows as Megatron-LM's
    build_sample_idx (helpers.cpp), by a cumulative sum and a counting pass instead of a loop."""
    ends = np.cumsum(stream_lengths, dtype=np.int64)  # token position where each stream entry ends
    # sample k starts in the first entry that ends after token k * seq_len: its position is the number
    # of entries ending at or before it, i.e. of entries with ceil(end / seq_len) <= k
    first_sample_after = -(-ends // seq_len)
    position = np.cumsum(np.bincount(first_sample_after, minlength=num_samples + 1)[:num_samples + 1])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    sample = np.empty((num_samples + 1, 2), dtype=np.int32 if len(ends) < 2**31 else np.int64)
    sample[:, 0] = position
    sample[:, 1] = starts - ends[position] + stream_lengths[position]
    return sample


def stable_order(draws: np.ndarray) -> np.ndarray:
    """np.argsort(draws, kind="stable") for draws of Generator.random (multiples of 2**-53 in [0, 1)),
    about 5x faster: one value sort of 64-bit keys (the draw's leading bits above the item's index),
    then the few runs whose leading bits tie are put in order by the whole draw, then the index."""
    n = len(draws)
    index_bits = max(1, (n - 1).bit_length())
    units = (draws * 2.0**53).astype(np.uint64)              # exact: the draw's 53 random bits
    shift = np.uint64(max(0, 53 - (64 - index_bits)))
    keys = np.sort(((units >> shift) << np.uint64(index_bits)) | np.arange(n, dtype=np.uint64))
    order = (keys & np.uint64((1 << index_bits) - 1)).astype(np.int64)
    tie = (keys[1:] >> np.uint64(index_bits)) == (keys[:-1] >> np.uint64(index_bits))
    if tie.any():
        in_run = np.zeros(n, dtype=bool)
        in_run[1:] |= tie
        in_run[:-1] |= tie
        where = np.flatnonzero(in_run)
        run = np.concatenate([[0], np.cumsum(~tie)])[where]
        items = order[where]
        order[where] = items[np.lexsort((items, units[items], run))]
    return order


def shuffle_samples(num_samples: int, seq_len: int, tokens_per_epoch: int, num_epochs: int,
                    rng: np.random.Generator) -> np.ndarray:
    """The samples ordered inside their epoch (sample k starts at token k * seq_len, in the epoch where
    that token is) by one uniform draw each, stable on equal draws; epochs kept in order."""
    random = rng.random(num_samples)
    shuffle = np.empty(num_samples, dtype=np.uint32 if num_samples < 2**32 - 1 else np.int64)
    bounds = [min(-(-e * tokens_per_epoch // seq_len), num_samples) for e in range(num_epochs + 1)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        shuffle[a:b] = stable_order(random[a:b]) + a
    return shuffle


def build_gpt_indices(lengths: np.ndarray, first_document: int, seq_len: int, seed: int,
                      num_epochs: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices for documents first_document + arange(len(lengths)).

    Pure numpy, no Python loop over documents or samples (one short loop over epochs); the draws of
    one generator seeded with `seed`: the document shuffle, then the sample order.
    """
    lengths = np.asarray(lengths)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    rng = np.random.default_rng(seed)
    doc, stream = shuffled_documents(lengths, first_document, num_epochs, rng)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_len
    sample = sample_index(stream, seq_len, num_samples)
    del stream
    shuffle = shuffle_samples(num_samples, seq_len, tokens_per_epoch, num_epochs, rng)
    return {"doc": doc, "sample": sample, "shuffle": shuffle}


class GPTDataset:
    """Samples of seq_len + 1 tokens from documents [start, end) of an IndexedDataset.

    len() covers every full sample of the epochs built (at least num_samples); item i is the
    shuffled sample shuffle[i]. Indices are cached in `cache_dir` (None = not cached).
    """

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], seq_len: int, seed: int,
                 num_samples: Optional[int] = None, cache_dir: Optional[str] = None, name: str = "train") -> None:
        start, end = documents
        if not 0 <= start < end <= len(indexed):
            raise ValueError(f"{indexed.prefix}: document range [{start}, {end}) is empty or outside "
                             f"[0, {len(indexed)})")
        self.indexed, self.seq_len, self.name = indexed, seq_len, name
        lengths = np.asarray(indexed.sequence_lengths[start:end])
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        if self.tokens_per_epoch <= seq_len:
            raise ValueError(f"{indexed.prefix} ({name}): {self.tokens_per_epoch} tokens in documents "
                             f"[{start}, {end}) cannot fill one sample of {seq_len + 1} tokens")
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, seq_len, num_samples)
        key = {"version": INDEX_VERSION, "lengths": lengths, "documents": [start, end], "seq_len": seq_len,
               "seed": seed, "num_epochs": self.num_epochs, "prefix": os.path.basename(indexed.prefix)}
        stem = f"{os.path.basename(indexed.prefix)}-{name}"
        arrays = cached_arrays(cache_dir, stem, key,
                               lambda: build_gpt_indices(lengths, start, seq_len, seed, self.num_epochs),
                               ["doc", "sample", "shuffle"])
        self.document_index, self.sample_index = arrays["doc"], arrays["sample"]
        self.shuffle_index = arrays["shuffle"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def unshuffled(self, i: int) -> np.ndarray:
        """Sample i in stream order (before the shuffle)."""
        (p0, o0), (p1, o1) = self.sample_index[i], self.sample_index[i + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        doc, get = self.document_index, self.indexed.get
        if p0 == p1:
            return get(int(doc[p0]), o0, o1 - o0 + 1)
        pieces = [get(int(doc[p0]), o0)]
        pieces += [get(int(d)) for d in doc[p0 + 1:p1]]
        pieces.append(get(int(doc[p1]), 0, o1 + 1))
        return np.concatenate(pieces)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside [0, {len(self)})")
        return self.unshuffled(int(self.shuffle_index[i]))


class MockGPTDataset:
    """Deterministic synthetic samples: documents of arithmetic token sequences (learnable) with
    EOD after each; sample i depends only on (seed, i), so any rank can draw any sample."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, eod_id: int, seed: int = 1234) -> None:
        if vocab_size < 3 or not 0 <= eod_id < vocab_size:
            raise ValueError(f"mock data needs vocab_size >= 3 and 0 <= eod_id < vocab_size "
                             f"(got {vocab_size}, {eod_id})")
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.eod_id, self.seed = eod_id, seed
        self.min_doc = max(1, min(16, seq_len // 8))
        self.max_doc = max(self.min_doc, seq_len // 2)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_len + 1
        max_docs = n // (self.min_doc + 1) + 1
        lengths = rng.integers(self.min_doc, self.max_doc + 1, size=max_docs) + 1  # + 1 for the EOD
        start = rng.integers(0, self.vocab_size - 1, size=max_docs)
        step = rng.integers(1, 8, size=max_docs)
        doc = np.repeat(np.arange(max_docs), lengths)[:n]
        pos = np.arange(n) - (np.cumsum(lengths) - lengths)[doc]
        tokens = (start[doc] + step[doc] * pos) % (self.vocab_size - 1)
        tokens += tokens >= self.eod_id  # skip the EOD id
        tokens[pos == lengths[doc] - 1] = self.eod_id
        return tokens.astype(np.int64)
