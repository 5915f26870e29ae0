"""Blending: weight parsing, the within-one-sample bound at every prefix, determinism, speed."""
import time

import numpy as np
import pytest

from megalysses.data.blend import (BlendedDataset, _heap_sweep, _sorted_candidate, blend_indices, parse_blend,
                                   required_samples)


def max_deviation(dataset_index, weights):
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[dataset_index], axis=0)
    n = np.arange(1, len(dataset_index) + 1)[:, None]
    return np.abs(counts - n * w).max()


def test_parse_blend():
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    paths, weights = parse_blend(["2", "a", "6", "b"])
    assert paths == ["a", "b"] and weights == [0.25, 0.75]
    assert parse_blend(["a", "b", "c"]) == (["a", "b", "c"], [1 / 3] * 3)
    assert parse_blend(["only"]) == (["only"], [1.0])
    for bad in (["0.7", "a", "0.3"], ["a", "0.3"], ["0.5", "a", "b", "c"], [], ["-1", "a", "2", "b"]):
        with pytest.raises(ValueError):
            parse_blend(bad)


WEIGHTS = [
    [0.7, 0.3], [0.5, 0.5], [0.999, 0.001], [1, 1, 1], [0.6, 0.3, 0.1],
    [0.5, 0.2, 0.15, 0.1, 0.05], [0.01, 0.02, 0.03, 0.04, 0.4, 0.5], [3, 1, 0, 2],
]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_within_one_sample_at_every_prefix(weights):
    dataset_index, sample_index = blend_indices(weights, 20_000)
    active = sum(w > 0 for w in weights)
    bound = 1 - 1 / (2 * active - 2)
    assert max_deviation(dataset_index, weights) <= bound + 1e-9 < 1
    for d in range(len(weights)):  # the per-dataset sample index is the running count
        np.testing.assert_array_equal(sample_index[dataset_index == d], np.arange((dataset_index == d).sum()))
    again = blend_indices(weights, 20_000)
    np.testing.assert_array_equal(again[0], dataset_index)


def test_random_weights_stay_within_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.random(rng.integers(2, 9)) ** 3
        assert max_deviation(blend_indices(w, 5000)[0], w) < 1


def test_two_datasets_pick_the_most_lagging():
    """With two datasets every pick is one whose count lags its share the most (exact ties aside)."""
    for w in ([0.7, 0.3], [0.9, 0.1], [0.5, 0.5]):
        picks = blend_indices(w, 3000)[0]
        counts = [0, 0]
        for n, d in enumerate(picks):
            lag = [(n + 1) * w[k] - counts[k] for k in range(2)]
            assert lag[d] >= max(lag) - 1e-9, (n, lag, d)
            counts[d] += 1


def test_fast_path_equals_sweep_when_accepted():
    for w in ([0.7, 0.3], [0.123, 0.877]):
        w = np.asarray(w)
        fast = _sorted_candidate(w, 10_000, 0.5)
        assert fast is not None
        np.testing.assert_array_equal(fast, _heap_sweep(w.tolist(), 10_000, 0.5))


def test_millions_of_samples_fast():
    start = time.time()
    blend_indices([0.6, 0.4], 2_000_000)
    blend_indices([0.5, 0.2, 0.15, 0.1, 0.05], 1_000_000)
    assert time.time() - start < 8


def test_blended_dataset(tmp_path):
    a = [np.full(5, i) for i in range(100)]
    b = [np.full(5, 1000 + i) for i in range(100)]
    blend = BlendedDataset([a, b], [0.75, 0.25], size=120, cache_dir=str(tmp_path))
    first = [int(blend[i][0]) for i in range(8)]
    assert first == [0, 1, 1000, 2, 3, 4, 1001, 5]
    again = BlendedDataset([a, b], [0.75, 0.25], size=120, cache_dir=str(tmp_path))
    assert isinstance(again.dataset_index, np.memmap)
    assert [int(again[i][0]) for i in range(120)] == [int(blend[i][0]) for i in range(120)]
    assert required_samples([0.75, 0.25], 120) == [91, 31]
    with pytest.raises(ValueError, match="takes"):
        BlendedDataset([a[:10], b], [0.75, 0.25], size=120)


def test_unweighted_blend_by_size(tmp_path):
    """data.blend_by_size: an unweighted list weighs each dataset by the samples one epoch of its split holds, as
    Megatron-LM blends an unweighted --data-path; without it, equal weights; a weighted list keeps its weights."""
    from megalysses.data.build import DatasetOptions, build_gpt_datasets, epoch_samples
    from megalysses.data.gpt_dataset import split_ranges
    from test_data_gpt import make_dataset

    small = make_dataset(tmp_path / "small", [50] * 40)       # 2000 tokens
    large = make_dataset(tmp_path / "large", [70] * 90)       # 6300 tokens
    paths, seq = [str(tmp_path / "small"), str(tmp_path / "large")], 16
    sizes = [epoch_samples(ds, split_ranges("90,10,0", len(ds))[0], seq) for ds in (small, large)]
    assert sizes == [(36 * 50 - 1) // seq, (81 * 70 - 1) // seq]

    def shares(spec, by_size):
        train = build_gpt_datasets(spec, "90,10,0", seq, 1, (300, None, None),
                                   DatasetOptions(str(tmp_path / "cache"), by_size=by_size))[0]
        return np.bincount(train.dataset_index, minlength=2) / 300

    assert shares(paths, True) == pytest.approx(np.array(sizes) / sum(sizes), abs=1 / 300)
    assert shares(paths, False) == pytest.approx([0.5, 0.5], abs=1 / 300)
    assert shares(["0.2", paths[0], "0.8", paths[1]], True) == pytest.approx([0.2, 0.8], abs=1 / 300)
