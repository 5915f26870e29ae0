"""Train / valid / test datasets from (optionally weighted) dataset prefixes: the trainer's entry point.

    train, valid, test = build_gpt_datasets(["0.7", "data/a_text_document", "0.3", "data/b_text_document"],
                                            split="969,30,1", seq_len=4096, seed=1234,
                                            num_samples=(steps * gbs, evals * eval_steps * gbs, None))

Each prefix is split over its documents by the ratio string; each split of each prefix is a
GPTDataset, or, for a dataset with a loss mask beside it (`{prefix}_loss_mask`, tools/preprocess_data.py
--chat), PackedConversations (packing.py); several prefixes are blended with BlendedDataset. Indices are
cached in `options.cache_dir`, by default `index_cache/` beside each dataset.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Callable, Optional, Sequence

from megalysses.data.blend import BlendedDataset, is_weighted, parse_blend, required_samples
from megalysses.data.gpt_dataset import GPTDataset, split_ranges
from megalysses.data.indexed import DatasetError, IndexedDataset, bin_path, idx_path, loss_mask_prefix
from megalysses.data.packing import MaskedDataset, Packing, PackedConversations, open_loss_mask

log = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index_cache")


def epoch_samples(ds: IndexedDataset, documents: tuple[int, int], seq_len: int) -> int:
    """Samples of seq_len + 1 tokens that one epoch of documents [start, end) holds (consecutive samples share a
    token), as GPTDataset and Megatron-LM count them."""
    start, end = documents
    tokens = int(ds.sequence_lengths[start:end].sum(dtype="int64")) if end > start else 0
    return max(0, (tokens - 1) // seq_len)


def loss_mask_of(ds: IndexedDataset) -> Optional[IndexedDataset]:
    """The loss mask beside a dataset, checked against it, or None when it has none (every token trains)."""
    prefix = loss_mask_prefix(ds.prefix)
    if not (os.path.exists(idx_path(prefix)) or os.path.exists(bin_path(prefix))):
        return None
    return open_loss_mask(ds, prefix)


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """How build_gpt_datasets reads its datasets, the same for every split it is asked for."""

    cache_dir: Optional[str] = None      # where the indices are cached (default: index_cache/ beside each dataset)
    # called as validate(indexed, cache_dir) on every dataset once it is open (the trainer checks the token ids
    # against the vocabulary there)
    validate: Optional[Callable[[IndexedDataset, str], None]] = None
    # an unweighted list of several prefixes blended as Megatron-LM blends an unweighted --data-path: each
    # dataset weighs the samples one epoch of its share of the split holds (else equal weights)
    by_size: bool = False
    # packs the conversations of datasets with a loss mask; its lengths (a curriculum's) apply to the train
    # split, the others read at seq_len
    packing: Packing = Packing()


def build_gpt_datasets(paths: Sequence[str], split: str, seq_len: int, seed: int,
                       num_samples: Sequence[Optional[int]], options: DatasetOptions = DatasetOptions(),
                       need_train: bool = True) -> list[GPTDataset | PackedConversations | BlendedDataset | None]:
    """[train, valid, test]; num_samples[i] is the samples that split must provide (None = one epoch).

    An unweighted list of several prefixes is blended with equal weights, or as `options.by_size` says.
    An empty dataset, or a split that gives the train set no documents, raises DatasetError. A valid/test
    split with no documents is None; one too small for one sample is None (logged); a train split too small
    raises ValueError. need_train=False: the datasets are read for another split alone (a validation set of
    its own).
    """
    cache_dir, validate, packing = options.cache_dir, options.validate, options.packing
    prefixes, weights = parse_blend(paths)
    indexed = [IndexedDataset(p) for p in prefixes]
    masks = [loss_mask_of(ds) for ds in indexed]
    for ds in indexed:
        if ds.num_tokens == 0:
            raise DatasetError(f"{ds.prefix}: the dataset is empty ({len(ds)} sequences, 0 tokens), nothing to "
                               f"train on: re-run tools/preprocess_data.py on a corpus that yields tokens")
        if validate is not None:
            validate(ds, cache_dir or default_cache_dir(ds.prefix))
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    if need_train and not any(w > 0 and rng[0][1] > rng[0][0] for rng, w in zip(ranges, weights)):
        counts = ", ".join(f"{len(ds)} in {ds.prefix}" for ds in indexed)
        raise DatasetError(f"split '{split}' gives the training set no sequences ({counts}): give the first "
                           f"(train) ratio a share large enough for at least one sequence, e.g. '969,30,1'")
    out: list[GPTDataset | BlendedDataset | None] = []
    sized = options.by_size and not is_weighted(paths) and len(indexed) > 1
    for s, name in enumerate(SPLIT_NAMES):
        split_weights = [epoch_samples(ds, rng[s], seq_len) for ds, rng in zip(indexed, ranges)] if sized else weights
        members = [(ds, rng[s], w, mask) for ds, rng, w, mask in zip(indexed, ranges, split_weights, masks)
                   if w > 0 and rng[s][1] > rng[s][0]]
        split_packing = packing if name == "train" else dataclasses.replace(packing, lengths=())
        n = num_samples[s]
        total = sum(m[2] for m in members)
        need = [n] * len(members) if n is None or len(members) == 1 else required_samples(
            [m[2] for m in members], n)
        datasets, member_weights = [], []
        for (ds, docs, w, mask), k in zip(members, need):
            cache = cache_dir or default_cache_dir(ds.prefix)
            try:
                datasets.append(GPTDataset(ds, docs, seq_len, seed, k, cache, name) if mask is None else
                                PackedConversations(MaskedDataset(ds, mask), docs, seq_len, seed, k, cache, name,
                                                    split_packing))
                member_weights.append(w / total)
            except DatasetError:
                raise
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
