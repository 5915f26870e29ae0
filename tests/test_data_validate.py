"""Token-id validation at open time (vectorised, chunked, cached by file identity), the index checks,
and the per-batch guard of the loader."""
import os

import numpy as np
import pytest

from megalysses.data import validate
from megalysses.data.indexed import DatasetError, IndexedDataset, IndexedDatasetBuilder
from megalysses.data.loader import BatchFormat, LoaderRank, iterate_micro_batches
from megalysses.data.validate import check_token_ids, token_range


def make(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in docs:
        builder.add_document(np.asarray(d))
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


def test_range_over_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "CHUNK_TOKENS", 7)   # many chunks, the extremes in different ones
    docs = [[5, 6, 7], [8] * 10, [3, 900, 4], [], [1, 2]]
    ds = make(tmp_path / "u", docs)
    assert token_range(ds) == (0, 900) and validate.scan_token_range(ds).tolist() == [0, 900]
    signed = make(tmp_path / "s", [[5, 6], [7] * 9, [-3, 2]], np.int32)
    assert token_range(signed) == (-3, 7)
    assert token_range(make(tmp_path / "e", [[], []])) == (0, -1)
    with pytest.raises(DatasetError, match=r"token id 900 \(document 2, sequence 2; largest id 900\)"):
        check_token_ids(ds, 900)
    check_token_ids(ds, 901)
    with pytest.raises(DatasetError, match=r"negative token id -3 \(document 2"):
        check_token_ids(signed, 1000)


def test_result_is_cached_by_file_identity(tmp_path, monkeypatch):
    ds = make(tmp_path / "c", [[1, 2, 3], [4, 5]])
    cache = str(tmp_path / "cache")
    check_token_ids(ds, 10, cache)
    assert any(name.endswith("-range.npy") for name in os.listdir(cache))

    def no_scan(ds):
        raise AssertionError("scanned again")
    monkeypatch.setattr(validate, "scan_token_range", no_scan)
    check_token_ids(IndexedDataset(tmp_path / "c"), 10, cache)           # from the cache
    with pytest.raises(DatasetError, match="token id 4"):
        check_token_ids(IndexedDataset(tmp_path / "c"), 4, cache)        # the verdict is not cached, the range is
    monkeypatch.undo()
    make(tmp_path / "c", [[1, 2, 3], [4, 50]])                            # same sizes, new contents
    stat = os.stat(tmp_path / "c.bin")
    os.utime(tmp_path / "c.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match="token id 50"):
        check_token_ids(IndexedDataset(tmp_path / "c"), 10, cache)


def test_float_dtypes_refused(tmp_path):
    ds = make(tmp_path / "f", [[1.0, 2.0]], np.float64)
    with pytest.raises(DatasetError, match="stored as float64"):
        check_token_ids(ds, 100)


def test_loader_guard_stops_out_of_range_samples():
    class Stream:
        seq_len = 8

        def __len__(self):
            return 4

        def __getitem__(self, g):
            return np.full(9, 1000 if g == 2 else 7)

    fmt = BatchFormat(eod_id=7, reset_position_ids=True, document_mask=True)
    batches = iterate_micro_batches(Stream(), 1, LoaderRank(), 0, fmt, vocab_size=1000)
    assert next(batches)["input_ids"].max() == 7
    next(batches)
    with pytest.raises(DatasetError, match="sample 2 of the stream holds token id 1000"):
        next(batches)
    assert len(list(iterate_micro_batches(Stream(), 1, LoaderRank(), 0, fmt))) == 4   # no guard asked


def test_index_checks_find_the_first_bad_entry(tmp_path):
    make(tmp_path / "i", [[1, 2], [3, 4, 5], [6]])
    raw = bytearray(open(tmp_path / "i.idx", "rb").read())
    raw[34 + 4:34 + 8] = (-3).to_bytes(4, "little", signed=True)
    open(tmp_path / "i.idx", "wb").write(raw)
    with pytest.raises(DatasetError, match="sequence 1 has a negative length -3"):
        IndexedDataset(tmp_path / "i")


def test_index_checks_across_chunks(tmp_path, monkeypatch):
    import struct

    from megalysses.data import indexed
    monkeypatch.setattr(indexed, "CHECK_CHUNK", 3)
    ds = make(tmp_path / "k", [list(range(n)) for n in (2, 0, 5, 1, 3, 4, 0, 2)])
    assert len(ds) == 8 and IndexedDataset(tmp_path / "k").num_tokens == 17
    raw = bytearray(open(tmp_path / "k.idx", "rb").read())
    raw[34 + 8 * 4 + 4 * 8:34 + 8 * 4 + 5 * 8] = struct.pack("<q", 999)    # pointer of sequence 4
    open(tmp_path / "k.idx", "wb").write(raw)
    with pytest.raises(DatasetError, match="sequence 4 points at byte 999 .* end at byte 16"):
        IndexedDataset(tmp_path / "k")
