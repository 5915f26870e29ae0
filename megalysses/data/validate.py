"""Token-id validation of an indexed dataset against a vocabulary, vectorised and cached.

    check_token_ids(IndexedDataset("data/corpus_text_document"), vocab_size=32000, cache_dir="data/index_cache")

Token ids must be integers in [0, vocab_size): an id past the vocabulary crashes the embedding at
tp=1 and, worse, is silently masked by the vocab-parallel embedding at tp>1, so the model would
train on garbage. The whole `.bin` is scanned once in large chunks (numpy min/max, no Python loop
over tokens); the smallest and largest id are cached beside the sample indices, keyed by the file
sizes and modification times, so later starts pay nothing. The cached numbers are the data's own,
so changing the vocabulary never needs a rescan.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from megalysses.data.cache import cached_arrays
from megalysses.data.indexed import DatasetError, IndexedDataset

TOKEN_RANGE_VERSION = "token-range-v1"
CHUNK_TOKENS = 1 << 26


def _chunks(ds: IndexedDataset):
    total = ds.num_tokens
    for start in range(0, total, CHUNK_TOKENS):
        count = min(CHUNK_TOKENS, total - start)
        yield start, np.frombuffer(ds._bin_buffer, ds.dtype, count=count, offset=start * ds.dtype.itemsize)


def scan_token_range(ds: IndexedDataset) -> np.ndarray:
    """[smallest id, largest id] over every token of the dataset ([0, -1] when it has none)."""
    lo, hi = 0, -1
    signed = ds.dtype.kind == "i"
    for _start, chunk in _chunks(ds):
        if not len(chunk):
            continue
        chunk_hi = int(chunk.max())
        chunk_lo = int(chunk.min()) if signed else 0
        lo, hi = (chunk_lo, chunk_hi) if hi < lo else (min(lo, chunk_lo), max(hi, chunk_hi))
    return np.array([lo, hi], dtype=np.int64)


def token_range(ds: IndexedDataset, cache_dir: Optional[str] = None) -> tuple[int, int]:
    """The dataset's (smallest, largest) token id, from the cache when the files have not changed."""
    stats = [os.stat(ds.bin_file), os.stat(ds.idx_file)]
    key = {"version": TOKEN_RANGE_VERSION, "dtype": str(ds.dtype), "prefix": os.path.basename(ds.prefix),
           "files": [[s.st_size, s.st_mtime_ns] for s in stats]}
    arrays = cached_arrays(cache_dir, f"{os.path.basename(ds.prefix)}-tokens", key,
                           lambda: {"range": scan_token_range(ds)}, ["range"])
    lo, hi = (int(v) for v in arrays["range"])
    return lo, hi


def _first_outside(ds: IndexedDataset, vocab_size: int) -> tuple[int, int, int]:
    """(token id, sequence, document) of the first token outside [0, vocab_size)."""
    for start, chunk in _chunks(ds):
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size)) if ds.dtype.kind == "i" else \
            np.flatnonzero(chunk >= vocab_size)
        if len(bad):
            position = start + int(bad[0])
            sequence = int(np.searchsorted(ds.sequence_pointers, position * ds.dtype.itemsize, side="right")) - 1
            document = int(np.searchsorted(ds.document_indices, sequence, side="right")) - 1
            return int(chunk[bad[0]]), sequence, document
    raise AssertionError("no token outside the vocabulary")


def check_token_ids(ds: IndexedDataset, vocab_size: int, cache_dir: Optional[str] = None,
                    vocabulary: str = "model.vocab_size", fix: Optional[str] = None) -> None:
    """Raise DatasetError unless every token id of `ds` is an integer in [0, vocab_size).

    `vocabulary` names where vocab_size comes from and `fix` says what to do about ids past it."""
    if ds.dtype.kind not in "iu":
        raise DatasetError(f"{ds.idx_file}: token ids are stored as {ds.dtype}; token ids must be integers "
                           f"(uint16 below 65,500 ids, else int32): re-run tools/preprocess_data.py")
    lo, hi = token_range(ds, cache_dir)
    if hi < lo or (lo >= 0 and hi < vocab_size):
        return
    token, sequence, document = _first_outside(ds, vocab_size)
    if lo < 0:
        raise DatasetError(f"{ds.bin_file}: negative token id {token} (document {document}, sequence {sequence}; "
                           f"smallest id {lo}): token ids are never negative, the file is corrupt or was "
                           f"written with another dtype: rebuild it with tools/preprocess_data.py")
    fix = fix or (f"the data was tokenized with a larger vocabulary: set {vocabulary} to at least {hi + 1} "
                  f"(the size of that tokenizer), or re-tokenize the data")
    raise DatasetError(f"{ds.bin_file}: token id {token} (document {document}, sequence {sequence}; largest id "
                       f"{hi}) is outside the vocabulary of {vocab_size} ids ({vocabulary}): {fix}")


def check_dtype_holds(ds: IndexedDataset, vocab_size: int, vocabulary: str) -> None:
    """Raise DatasetError when the dataset's integer dtype cannot hold the ids of a vocabulary: such a
    file was written for a smaller vocabulary (preprocessing picks uint16 below 65,500 ids, else int32)."""
    if ds.dtype.kind in "iu" and vocab_size - 1 > np.iinfo(ds.dtype).max:
        raise DatasetError(f"{ds.idx_file}: token ids are stored as {ds.dtype}, which holds ids up to "
                           f"{np.iinfo(ds.dtype).max}, but {vocabulary} has {vocab_size} ids: the dataset was made "
                           f"with another tokenizer; set data.tokenizer to that one, or re-tokenize the data")
