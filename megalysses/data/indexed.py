"""Megatron-compatible indexed dataset: a `.bin` of concatenated token ids and an `.idx` index.

    builder = IndexedDatasetBuilder("corpus_text_document.bin", dtype=optimal_dtype(vocab_size))
    builder.add_document([1, 2, 3, 2])
    builder.finalize("corpus_text_document.idx")
    ds = IndexedDataset("corpus_text_document")
    ds[0]                 # array([1, 2, 3, 2], dtype=uint16), a read-only view on the mmap
    ds.get(0, offset=1, length=2)

The byte layout is documented in docs/DATA_FORMAT.md and matches Megatron-LM's
`indexed_dataset.py` in both directions. Every structural problem with a file pair raises
`DatasetError` naming the file and what is wrong with it; the index is checked whole when it is
opened (vectorised: lengths, pointers, document boundaries, the .bin size), so a corrupt pair never
reaches training.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8
CHECK_CHUNK = 1 << 24  # index entries checked per vectorised step when a dataset is opened

DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DatasetError(ValueError):
    """A missing, corrupt or mismatched dataset file; the message names the file and the problem."""


def optimal_dtype(vocab_size: int) -> type:
    """uint16 when every token id fits comfortably (vocab < 65,500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype: type | np.dtype) -> int:
    """The `.idx` code of a numpy dtype (raises DatasetError for dtypes the format cannot hold)."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise DatasetError(f"dtype {np.dtype(dtype)} has no code in the indexed-dataset format") from None


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """The dataset beside `prefix` that says which of its tokens carry the loss (docs/DATA_FORMAT.md)."""
    return f"{os.fspath(prefix)}_loss_mask"


def write_index(path: str | os.PathLike, dtype: type | np.dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray) -> None:
    """Write an `.idx` for sequences stored back to back (pointers are derived from the lengths)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class IndexedDataset:
    """Read-only mmap view of `{prefix}.bin` / `{prefix}.idx`.

    `len(ds)` is the number of sequences (= documents when preprocessing does not split
    sentences); `ds[i]` is sequence i; `document_indices` maps documents to sequences.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_file, self.bin_file = idx_path(prefix), bin_path(prefix)
        for path in (self.idx_file, self.bin_file):
            if not os.path.isfile(path):
                stem, ext = os.path.splitext(self.prefix)
                hint = (f": give the prefix without .bin/.idx ({stem!r})"
                        if ext in (".bin", ".idx") and os.path.isfile(idx_path(stem)) else "")
                raise DatasetError(f"{path}: file not found (dataset prefix {self.prefix!r}){hint}")
        self._read_index()
        self._check_bin()

    def _read_index(self) -> None:
        path = self.idx_file
        size = os.path.getsize(path)
        if size < HEADER_BYTES:
            raise DatasetError(f"{path}: truncated index: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:9] != INDEX_MAGIC:
            raise DatasetError(f"{path}: bad magic {header[:9]!r}, expected {INDEX_MAGIC!r}: "
                               "not a Megatron indexed-dataset index")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise DatasetError(f"{path}: unsupported index version {version} (only version {INDEX_VERSION} exists)")
        code = header[17]
        if code not in DTYPE_CODES:
            raise DatasetError(f"{path}: unknown dtype code {code} (valid codes: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n, d = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + n * 4 + n * 8 + d * 8
        if size < expected:
            raise DatasetError(f"{path}: truncated index: {size} bytes, but {n} sequences and {d} document "
                               f"boundaries need {expected} bytes")
        if size not in (expected, expected + n):
            raise DatasetError(f"{path}: index is {size} bytes, expected {expected} (or {expected + n} with "
                               "sequence modes): the header does not match the arrays")
        buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._index_buffer = buf
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, count=n, offset=off)
        off += n * 4
        self.sequence_pointers = np.frombuffer(buf, np.int64, count=n, offset=off)
        off += n * 8
        self.document_indices = np.frombuffer(buf, np.int64, count=d, offset=off)
        off += d * 8
        self.sequence_modes = np.frombuffer(buf, np.int8, count=n, offset=off) if size > expected else None
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DatasetError(f"{path}: corrupt document index: it must start at 0 and end at the "
                               f"sequence count {n}")
        self._check_arrays()

    def _check_arrays(self) -> None:
        """Lengths >= 0, sequences stored back to back (as every Megatron writer stores them), and
        document boundaries that never go backwards. Vectorised over chunks, so memory stays bounded."""
        path, lengths, docs = self.idx_file, self.sequence_lengths, self.document_indices
        end = 0   # where the sequences before the chunk end, in bytes
        for start in range(0, len(lengths), CHECK_CHUNK):
            chunk = lengths[start:start + CHECK_CHUNK]
            bad = np.flatnonzero(chunk < 0)
            if len(bad):
                i = start + int(bad[0])
                raise DatasetError(f"{path}: corrupt index: sequence {i} has a negative length {int(lengths[i])}; "
                                   f"rebuild the dataset with tools/preprocess_data.py")
            expected = np.cumsum(chunk, dtype=np.int64) * self.dtype.itemsize
            expected -= chunk.astype(np.int64) * self.dtype.itemsize
            expected += end
            bad = np.flatnonzero(self.sequence_pointers[start:start + CHECK_CHUNK] != expected)
            if len(bad):
                i = start + int(bad[0])
                raise DatasetError(f"{path}: corrupt index: sequence {i} points at byte "
                                   f"{int(self.sequence_pointers[i])} of the .bin but the sequences before it end "
                                   f"at byte {int(expected[bad[0]])} (pointers disagree with the lengths); "
                                   f"rebuild the dataset")
            end = int(expected[-1]) + int(chunk[-1]) * self.dtype.itemsize
        for start in range(0, len(docs) - 1, CHECK_CHUNK):
            bad = np.flatnonzero(np.diff(docs[start:start + CHECK_CHUNK + 1]) < 0)
            if len(bad):
                i = start + int(bad[0])
                raise DatasetError(f"{path}: corrupt document index: document {i} ends at sequence "
                                   f"{int(docs[i + 1])}, before it starts at sequence {int(docs[i])}; rebuild the "
                                   f"dataset")

    def _check_bin(self) -> None:
        n = len(self.sequence_lengths)
        need = self.num_tokens * self.dtype.itemsize
        size = os.path.getsize(self.bin_file)
        if size < need:
            raise DatasetError(f"{self.bin_file}: .bin is {size} bytes but {self.idx_file} says its "
                               f"{n} sequences need {need} bytes (truncated .bin, or mismatched .idx)")
        if size > need:
            raise DatasetError(f"{self.bin_file}: .bin is {size} bytes but {self.idx_file} accounts for only "
                               f"{need} bytes (the .idx belongs to another .bin)")
        self._bin_buffer = np.memmap(self.bin_file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        seq_len = int(self.sequence_lengths[index])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {index} "
                             f"of length {seq_len}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, self.dtype, count=length, offset=start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(int(index))


class IndexedDatasetBuilder:
    """Append documents to a `.bin` as they come, then `finalize` writes the `.idx`."""

    def __init__(self, bin_file: str | os.PathLike, dtype: type | np.dtype = np.int32) -> None:
        self.bin_file = os.fspath(bin_file)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._out = open(self.bin_file, "wb")
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._length_chunks: list[np.ndarray] = []
        self._doc_chunks: list[np.ndarray] = []
        self._num_sequences = 0

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (a document is one or more sequences, closed by `end_document`)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._out.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)
        self._num_sequences += 1

    def end_document(self) -> None:
        self._doc_indices.append(self._num_sequences)

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Optional[Iterable[int]] = None) -> None:
        """Append a document; `lengths` splits it into several sequences (default: one sequence)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            self.add_item(arr)
        else:
            start = 0
            for n in lengths:
                self.add_item(arr[start:start + n])
                start += n
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray,
                      sequences_per_document: Optional[np.ndarray] = None) -> None:
        """Append many documents at once: `tokens` concatenated, `lengths` per sequence, and how many
        sequences each document has (default: one each). A document of zero sequences is an empty
        document, stored as Megatron-LM's preprocessing stores one: a document boundary, no tokens."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != len(tokens):
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if sequences_per_document is None:
            ends = np.arange(1, len(lengths) + 1, dtype=np.int64)
        else:
            ends = np.cumsum(sequences_per_document, dtype=np.int64)
            if (ends[-1] if len(ends) else 0) != len(lengths):
                raise ValueError(f"documents hold {int(ends[-1]) if len(ends) else 0} sequences but "
                                 f"{len(lengths)} sequence lengths were given")
        self._out.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self._flush_lists()
        self._length_chunks.append(lengths)
        self._doc_chunks.append(self._num_sequences + ends)
        self._num_sequences += len(lengths)

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (same dtype) after what was written so far: merging."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DatasetError(f"{other.idx_file}: dtype {other.dtype} differs from the builder's {self.dtype}; "
                               "cannot merge datasets of different dtypes")
        self._flush_lists()
        self._length_chunks.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._doc_chunks.append(np.array(other.document_indices[1:], dtype=np.int64) + self._num_sequences)
        self._num_sequences += len(other)
        with open(other.bin_file, "rb") as src:
            shutil.copyfileobj(src, self._out, length=16 << 20)

    def _flush_lists(self) -> None:
        self._length_chunks.append(np.array(self._lengths, dtype=np.int32))
        self._doc_chunks.append(np.array(self._doc_indices, dtype=np.int64))
        self._lengths, self._doc_indices = [], []

    def finalize(self, idx_file: str | os.PathLike) -> None:
        """Close the `.bin` and write the `.idx`."""
        self._flush_lists()
        self._out.close()
        write_index(idx_file, self.dtype, np.concatenate(self._length_chunks), np.concatenate(self._doc_chunks))

    def close(self) -> None:
        """Close the `.bin` without writing an index (used when a run is abandoned)."""
        self._out.close()


def merge_datasets(prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike) -> None:
    """Concatenate datasets (same dtype) into `{output_prefix}.bin/.idx`, documents in the given order."""
    if not prefixes:
        raise DatasetError("merge_datasets: no input prefixes given")
    dtype = IndexedDataset(prefixes[0]).dtype
    Path(bin_path(output_prefix)).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(bin_path(output_prefix), dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
    except BaseException:
        builder.close()
        raise
    builder.finalize(idx_path(output_prefix))
