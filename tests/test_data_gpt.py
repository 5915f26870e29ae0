"""GPT samples: split ranges, windows that reconstruct the token stream, epochs, the cache, mock data."""
import multiprocessing as mp
import os

import numpy as np
import pytest

from megalysses.data.build import build_gpt_datasets
from megalysses.data.gpt_dataset import (GPTDataset, MockGPTDataset, build_gpt_indices, num_epochs_needed,
                                         split_ranges, stable_order)
from megalysses.data.indexed import IndexedDataset, IndexedDatasetBuilder


def make_dataset(path, lengths):
    """Documents whose tokens are their global stream positions mod 60000 (so windows are checkable)."""
    builder = IndexedDatasetBuilder(f"{path}.bin", np.int32)
    start = 0
    for n in lengths:
        builder.add_document(np.arange(start, start + n))
        start += n
    builder.finalize(f"{path}.idx")
    return IndexedDataset(path)


def megatron_sample_index(lengths_in_stream, seq_len, num_samples):
    """Megatron's build_sample_idx loop (helpers.cpp), transcribed as a reference."""
    rows, pos, off = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_len + 1
        while remaining:
            doc_len = lengths_in_stream[pos] - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                pos, off = pos + 1, 0
        rows.append((pos, off))
    return np.array(rows)


def test_split_ranges():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1,1,1", 10) == [(0, 4), (4, 7), (7, 10)]
    assert split_ranges("100", 7) == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(ValueError):
        split_ranges("0,0,0", 5)


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_sample_index_matches_megatron(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(1, 40, size=200)
    ix = build_gpt_indices(lengths, 0, seq_len, seed=3, num_epochs=2)
    n = len(ix["sample"]) - 1
    assert n == (2 * lengths.sum() - 1) // seq_len
    np.testing.assert_array_equal(ix["sample"], megatron_sample_index(lengths[ix["doc"]], seq_len, n))


@pytest.mark.parametrize("seq_len,epochs", [(16, 1), (50, 3), (7, 2)])
def test_windows_reconstruct_the_stream(tmp_path, seq_len, epochs):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(0, 60, size=120)
    lengths[:3] = 0  # empty documents are legal
    ds = make_dataset(tmp_path / "ds", lengths)
    tokens_per_epoch = int(lengths.sum())
    num_samples = (epochs * tokens_per_epoch - 1) // seq_len - 3
    gpt = GPTDataset(ds, (0, len(ds)), seq_len, seed=5, num_samples=num_samples)
    assert gpt.num_epochs == epochs and len(gpt) >= num_samples

    doc = np.asarray(gpt.document_index).reshape(epochs, len(ds))
    for e in range(epochs):  # every document exactly once per epoch, epochs shuffled differently
        assert sorted(doc[e]) == list(range(len(ds)))
    assert epochs == 1 or not np.array_equal(doc[0], doc[1])
    stream = np.concatenate([ds[int(d)] for d in gpt.document_index])
    windows = [gpt.unshuffled(i) for i in range(len(gpt))]
    assert all(len(w) == seq_len + 1 for w in windows)
    for a, b in zip(windows, windows[1:]):
        assert a[-1] == b[0]  # consecutive samples overlap by exactly one token
    rebuilt = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])
    np.testing.assert_array_equal(rebuilt, stream[:len(rebuilt)])
    assert len(stream) - len(rebuilt) < seq_len
    counts = np.bincount(rebuilt[:tokens_per_epoch], minlength=tokens_per_epoch)
    assert counts.max() == 1 and counts.sum() == tokens_per_epoch  # each token once in the first epoch

    shuffle = np.asarray(gpt.shuffle_index)
    assert sorted(shuffle) == list(range(len(gpt)))
    starts = shuffle * seq_len // tokens_per_epoch  # epoch of each shuffled sample: non-decreasing
    assert np.all(np.diff(starts) >= 0)
    for i in (0, len(gpt) // 2, len(gpt) - 1):
        np.testing.assert_array_equal(gpt[i], windows[shuffle[i]])


def test_num_epochs():
    assert num_epochs_needed(100, 10, None) == 1
    assert num_epochs_needed(100, 10, 9) == 1
    assert num_epochs_needed(100, 10, 10) == 2  # 10 * 10 + 1 tokens
    assert num_epochs_needed(100, 10, 1000) == 101


def _build_in_process(args):
    path, cache, seed = args
    gpt = GPTDataset(IndexedDataset(path), (0, 50), 32, seed, num_samples=200, cache_dir=cache)
    return [np.asarray(gpt[i]).tolist() for i in range(0, len(gpt), 7)]


def test_cache_is_reused_and_safe_under_concurrent_builders(tmp_path):
    ds = make_dataset(tmp_path / "ds", np.random.default_rng(0).integers(1, 100, size=60))
    cache = str(tmp_path / "cache")
    with mp.get_context("fork").Pool(4) as pool:  # four "ranks" start at once on an empty cache
        results = pool.map(_build_in_process, [(str(tmp_path / "ds"), cache, 9)] * 4)
    assert all(r == results[0] for r in results)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)  # doc, sample, shuffle, description
    cached = GPTDataset(ds, (0, 50), 32, 9, num_samples=200, cache_dir=cache)
    assert isinstance(cached.sample_index, np.memmap)
    fresh = GPTDataset(ds, (0, 50), 32, 9, num_samples=200, cache_dir=None)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(cached, name), getattr(fresh, name))
    GPTDataset(ds, (0, 50), 32, 10, num_samples=200, cache_dir=cache)  # another seed: other files
    GPTDataset(ds, (0, 50), 16, 9, num_samples=200, cache_dir=cache)  # another seq_len: other files
    assert len(os.listdir(cache)) == 12


def test_unwritable_cache_dir_still_works(tmp_path):
    ds = make_dataset(tmp_path / "ds", [40] * 10)
    (tmp_path / "a_file").write_text("")
    gpt = GPTDataset(ds, (0, 10), 16, 1, cache_dir=str(tmp_path / "a_file" / "cache"))  # mkdir fails, even as root
    assert len(gpt) == (400 - 1) // 16


def test_too_small_split_is_refused(tmp_path):
    ds = make_dataset(tmp_path / "ds", [3, 4])
    with pytest.raises(ValueError, match="cannot fill one sample"):
        GPTDataset(ds, (0, 2), 16, 1)


def test_build_gpt_datasets_single_and_blended(tmp_path):
    rng = np.random.default_rng(1)
    make_dataset(tmp_path / "a", rng.integers(10, 200, size=300))
    make_dataset(tmp_path / "b", rng.integers(10, 200, size=100))
    train, valid, test = build_gpt_datasets([str(tmp_path / "a")], "90,8,2", 64, 7, (500, None, None))
    assert len(train) >= 500 and train.name == "train" and valid.name == "valid" and test is not None
    assert os.path.isdir(tmp_path / "index_cache")
    blend = build_gpt_datasets(["0.75", str(tmp_path / "a"), "0.25", str(tmp_path / "b")], "90,8,2", 64, 7,
                               (400, 20, None))
    assert len(blend[0]) == 400 and len(blend[1]) == 20
    assert np.bincount(np.asarray(blend[0].dataset_index)).tolist() == [300, 100]
    assert len(blend[0][399]) == 65


def test_mock_dataset_is_deterministic():
    a = MockGPTDataset(100, 256, vocab_size=1000, eod_id=999, seed=3)
    b = MockGPTDataset(100, 256, vocab_size=1000, eod_id=999, seed=3)
    c = MockGPTDataset(100, 256, vocab_size=1000, eod_id=999, seed=4)
    for i in (0, 17, 99):
        assert a[i].shape == (257,) and a[i].dtype == np.int64
        np.testing.assert_array_equal(a[i], b[i])
        assert 0 <= a[i].min() and a[i].max() < 1000
        assert (a[i] == 999).sum() >= 1
    assert not np.array_equal(a[0], c[0])
    with pytest.raises(IndexError):
        a[100]


def reference_indices(lengths, first, seq_len, seed, epochs):
    """The indices by their definition: ids shuffled per epoch (Generator.permuted), Megatron's sample
    loop, samples ordered inside their epoch by one uniform draw each (lexsort, stable on ties)."""
    rng = np.random.default_rng(seed)
    doc = np.tile(np.arange(first, first + len(lengths)), (epochs, 1))
    rng.permuted(doc, axis=1, out=doc)
    doc = doc.reshape(-1)
    n = (epochs * int(np.sum(lengths)) - 1) // seq_len
    sample = megatron_sample_index(np.asarray(lengths)[doc - first], seq_len, n)
    epoch = np.arange(n) * seq_len // int(np.sum(lengths))
    return doc, sample, np.lexsort((rng.random(n), epoch))


class TiedDraws:
    """A generator whose uniform draws keep only 7 bits (still multiples of 2**-53 in [0, 1)): many ties."""

    make = np.random.default_rng

    def __init__(self, seed):
        self.rng = TiedDraws.make(seed)

    def permuted(self, *args, **kwargs):
        return self.rng.permuted(*args, **kwargs)

    def random(self, n):
        return np.floor(self.rng.random(n) * 128) / 128


@pytest.mark.parametrize("ties", [False, True])
def test_indices_equal_their_definition(monkeypatch, ties):
    if ties:
        monkeypatch.setattr(np.random, "default_rng", TiedDraws)
    rng = np.random.RandomState(7)
    for _ in range(25):
        lengths = rng.randint(0, 50, size=rng.randint(2, 300))
        lengths[0] += 2
        first, seq_len, seed, epochs = rng.randint(0, 1000), rng.randint(1, 70), rng.randint(0, 99), rng.randint(1, 5)
        ix = build_gpt_indices(lengths, first, seq_len, seed, epochs)
        doc, sample, shuffle = reference_indices(lengths, first, seq_len, seed, epochs)
        np.testing.assert_array_equal(ix["doc"], doc)
        np.testing.assert_array_equal(ix["sample"], sample)
        np.testing.assert_array_equal(ix["shuffle"], shuffle)
        assert ix["doc"].dtype == np.int32 and ix["sample"].dtype == np.int32 and ix["shuffle"].dtype == np.uint32


def test_split_parsing_is_strict():
    assert split_ranges("8/1/1", 10) == [(0, 8), (8, 9), (9, 10)]
    assert split_ranges(" 98, 2 ", 100) == [(0, 98), (98, 100), (100, 100)]
    for bad, message in (("-1,2,0", "negative"), ("1,1,1,1", "4 ratios"), ("a,b", "not a number"),
                         ("nan,1", "not finite"), ("0,0", "sum to 0"), ("", "0 ratios")):
        with pytest.raises(ValueError, match=message):
            split_ranges(bad, 10)


def test_stable_order_is_a_stable_argsort():
    rng = np.random.default_rng(3)
    for n in (1, 2, 4096, 5000, 70000):
        units = (rng.random(n) * 2.0**53).astype(np.uint64)
        if n > 2:   # leading bits shared, low bits different; and exact ties
            i, j = rng.integers(0, n, size=(2, n // 10))
            units[j] = units[i] ^ rng.integers(0, 64, size=len(i)).astype(np.uint64)
            units[rng.integers(0, n, size=5)] = units[0]
        draws = units.astype(np.float64) / 2.0**53
        np.testing.assert_array_equal(stable_order(draws), np.argsort(draws, kind="stable"))
