"""Indexed dataset: round trip, the Megatron byte layout (golden .idx), merging, corrupt files."""
import os
import struct

import numpy as np
import pytest

from megalysses.data.indexed import (DatasetError, IndexedDataset, IndexedDatasetBuilder, merge_datasets,
                                     optimal_dtype)
from megalysses.data.tokenizer import ByteTokenizer


def build(prefix, documents, dtype=np.uint16):
    """documents: list of documents, each a list of sequences."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in documents:
        builder.add_document(np.concatenate(doc), lengths=[len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(rng, n_docs, max_seqs=3, max_len=50, vocab=60000):
    return [[rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(rng.integers(1, max_seqs + 1))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 40, vocab=250)
    ds = IndexedDataset(build(tmp_path / "ds", docs, dtype))
    seqs = [s for doc in docs for s in doc]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(seqs) and ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(s) for s in seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    expected_docs = np.cumsum([0] + [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, expected_docs)
    i = max(range(len(seqs)), key=lambda k: len(seqs[k]))
    np.testing.assert_array_equal(ds.get(i, offset=2, length=3), seqs[i][2:5])
    with pytest.raises(IndexError):
        ds.get(i, offset=len(seqs[i]), length=1)


def test_golden_idx_layout(tmp_path):
    """3 sequences in 2 documents = 94 bytes, every field at its documented offset."""
    prefix = build(tmp_path / "golden", [[[1, 2, 3], [4, 5]], [[6]]], np.uint16)
    raw = open(f"{prefix}.idx", "rb").read()
    assert len(raw) == 94
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert struct.unpack_from("<B", raw, 17) == (8,)  # uint16
    assert struct.unpack_from("<QQ", raw, 18) == (3, 3)
    assert struct.unpack_from("<3i", raw, 34) == (3, 2, 1)
    assert struct.unpack_from("<3q", raw, 46) == (0, 6, 10)  # byte offsets
    assert struct.unpack_from("<3q", raw, 70) == (0, 2, 3)
    assert open(f"{prefix}.bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_reads_bytes_written_by_megatron_layout(tmp_path):
    """A pair written field by field with struct (as Megatron's _IndexWriter does) reads back."""
    lengths, docs = [2, 0, 3], [0, 1, 3]
    pointers = [0, 8, 8]
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<Q", 3) + struct.pack("<Q", 3))
        f.write(struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers) + struct.pack("<3q", *docs))
    (tmp_path / "m.bin").write_bytes(struct.pack("<5i", 7, -1, 70000, 3, 9))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and ds.num_documents == 2
    assert ds[0].tolist() == [7, -1] and ds[1].tolist() == [] and ds[2].tolist() == [70000, 3, 9]


def test_optimal_dtype():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(ByteTokenizer.vocab_size) is np.uint16
    assert optimal_dtype(128256) is np.int32


def test_add_documents_matches_add_document(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1000, size=rng.integers(0, 20)) for _ in range(30)]
    build(tmp_path / "a", [[d] for d in docs])
    builder = IndexedDatasetBuilder(tmp_path / "b.bin", np.uint16)
    builder.add_documents(np.concatenate(docs[:10]), [len(d) for d in docs[:10]])
    for d in docs[10:20]:
        builder.add_document(d)
    builder.add_documents(np.concatenate(docs[20:]), [len(d) for d in docs[20:]])
    builder.finalize(tmp_path / "b.idx")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()


def test_merge(tmp_path):
    rng = np.random.default_rng(2)
    parts = [random_documents(rng, n) for n in (5, 7, 1)]
    prefixes = [build(tmp_path / f"p{i}", docs) for i, docs in enumerate(parts)]
    merge_datasets(prefixes, tmp_path / "merged")
    build(tmp_path / "direct", [d for docs in parts for d in docs])
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"direct.{ext}").read_bytes()
    build(tmp_path / "wide", [[np.arange(3)]], np.int32)
    with pytest.raises(DatasetError, match="dtype"):
        merge_datasets([prefixes[0], str(tmp_path / "wide")], tmp_path / "bad")


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


CORRUPTIONS = {
    "bad magic": ("idx", lambda p: _patch(p, 0, b"XXIDIDX\x00\x00"), "bad magic"),
    "bad version": ("idx", lambda p: _patch(p, 9, struct.pack("<Q", 2)), "unsupported index version 2"),
    "unknown dtype": ("idx", lambda p: _patch(p, 17, bytes([9])), "unknown dtype code 9"),
    "truncated header": ("idx", lambda p: _truncate(p, 20), "truncated index"),
    "truncated arrays": ("idx", lambda p: _truncate(p, 80), "truncated index"),
    "extra idx bytes": ("idx", lambda p: open(p, "ab").write(b"\x00" * 7), "header does not match"),
    "bad document index": ("idx", lambda p: _patch(p, 70 + 16, struct.pack("<q", 5)), "corrupt document index"),
    "short bin": ("bin", lambda p: _truncate(p, 8), ".bin is 8 bytes"),
    "long bin": ("bin", lambda p: open(p, "ab").write(b"\x00\x00"), "belongs to another .bin"),
    "missing idx": ("idx", os.remove, "file not found"),
    "missing bin": ("bin", os.remove, "file not found"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_files_name_the_file_and_problem(tmp_path, case):
    ext, corrupt, message = CORRUPTIONS[case]
    prefix = build(tmp_path / "ds", [[[1, 2, 3], [4, 5]], [[6]]])
    corrupt(f"{prefix}.{ext}")
    with pytest.raises(DatasetError) as err:
        IndexedDataset(prefix)
    assert f"ds.{ext}" in str(err.value), str(err.value)
    assert message in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)
