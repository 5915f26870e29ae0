"""Train / valid / test datasets from (optionally weighted) dataset prefixes: the trainer's entry point.

    train, valid, test = build_gpt_datasets(["0.7", "data/a_text_document", "0.3", "data/b_text_document"],
                                            split="969,30,1", seq_len=4096, seed=1234,
                                            num_samples=(steps * gbs, evals * eval_steps * gbs, None))

Each prefix is split over its documents by the ratio string; each split of each prefix is a
GPTDataset; several prefixes are blended with BlendedDataset. Indices are cached in `cache_dir`,
by default `index_cache/` beside each dataset.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Optional, Sequence

from megalysses.data.blend import BlendedDataset, parse_blend, required_samples
from megalysses.data.gpt_dataset import GPTDataset, split_ranges
from megalysses.data.indexed import IndexedDataset

log = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index_cache")


def build_gpt_datasets(paths: Sequence[str], split: str, seq_len: int, seed: int,
                       num_samples: Sequence[Optional[int]], cache_dir: Optional[str] = None,
                       ) -> list[GPTDataset | BlendedDataset | None]:
    """[train, valid, test]; num_samples[i] is the samples that split must provide (None = one epoch).

    A split with no documents is None; a valid/test split too small for one sample is None (logged);
    a train split too small raises ValueError.
    """
    prefixes, weights = parse_blend(paths)
    indexed = [IndexedDataset(p) for p in prefixes]
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    out: list[GPTDataset | BlendedDataset | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        members = [(ds, rng[s], w) for ds, rng, w in zip(indexed, ranges, weights) if w > 0 and rng[s][1] > rng[s][0]]
        n = num_samples[s]
        total = sum(w for _, _, w in members)
        need = [n] * len(members) if n is None or len(members) == 1 else required_samples(
            [w for _, _, w in members], n)
        datasets, member_weights = [], []
        for (ds, docs, w), k in zip(members, need):
            try:
                datasets.append(GPTDataset(ds, docs, seq_len, seed, k, cache_dir or default_cache_dir(ds.prefix),
                                           name))
                member_weights.append(w / total)
            except ValueError as err:
                if name == "train":
                    raise
                log.warning("skipping the %s split of %s: %s", name, ds.prefix, err)
        if not datasets:
            out.append(None)
        elif len(datasets) == 1:
            out.append(datasets[0])
        else:
            size = n if n is not None else int(math.floor(min(len(d) / w for d, w in zip(datasets, member_weights))))
            blend_cache = cache_dir or default_cache_dir(prefixes[0])
            out.append(BlendedDataset(datasets, member_weights, size, blend_cache, f"blend-{name}"))
    return out
