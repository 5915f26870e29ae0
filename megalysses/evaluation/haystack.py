"""Real text for the long-context tasks: the documents of a run's validation data, or of given datasets, as one
stream to cut windows from.

    stream = DocumentStream.validation(cfg.data)              # data.valid_paths, or the valid split of data.paths
    stream = DocumentStream.whole(["data/essays_text_document"])          # --haystack
    tokens = stream.window(4097, rng)                          # from a random document's start, documents in order
    text = stream.window(4000, rng, drop={eod, bos}, separator=[10, 10])   # one text, a separator before each document

A window starts at the start of a random document and goes on through the next ones (from the first again
after the last); it never holds a document twice. The needle tasks read text without document boundaries (the
tokens in `drop` left out, `separator` between documents); loss by position reads documents as training
packs them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megalysses.data.blend import parse_blend
from megalysses.data.build import default_cache_dir
from megalysses.data.gpt_dataset import split_ranges
from megalysses.data.indexed import IndexedDataset
from megalysses.data.validate import check_token_ids


class HaystackError(ValueError):
    """No documents to read, or too few tokens for a window; the message names the data and the fix."""


class DocumentStream:
    """Documents [start, end) of each of some indexed datasets, one after the other."""

    def __init__(self, parts: Sequence[tuple[IndexedDataset, int, int]], name: str) -> None:
        self.parts = [(ds, start, end) for ds, start, end in parts if end > start]
        self.name = name
        if not self.parts:
            raise HaystackError(f"{name} holds no documents: give a dataset with some (--haystack, or "
                                f"long_eval.haystack)")
        self.first = np.cumsum([0] + [end - start for _, start, end in self.parts])
        self.num_tokens = sum(int(ds.sequence_lengths[start:end].sum(dtype=np.int64)) for ds, start, end in self.parts)

    @classmethod
    def whole(cls, paths: Sequence[str]) -> "DocumentStream":
        """Every document of the datasets `paths` names (prefixes; a blend's weights are ignored)."""
        prefixes, _ = parse_blend(list(paths))
        return cls([(ds, 0, len(ds)) for ds in map(IndexedDataset, prefixes)], f"the haystack {' '.join(prefixes)}")

    @classmethod
    def validation(cls, data) -> "DocumentStream":
        """The run's validation documents: data.valid_paths whole, else the valid split of data.paths."""
        if data.valid_paths:
            stream = cls.whole(data.valid_paths)
            stream.name = f"the validation data {' '.join(parse_blend(list(data.valid_paths))[0])} (data.valid_paths)"
            return stream
        prefixes, _ = parse_blend(list(data.paths))
        sets = [IndexedDataset(p) for p in prefixes]
        parts = [(ds, *split_ranges(data.split, len(ds))[1]) for ds in sets]
        name = f"the valid split '{data.split}' of {' '.join(prefixes)} (data.paths)"
        if not any(end > start for _, start, end in parts):
            raise HaystackError(f"{name} holds no documents: give data.split a valid share or data.valid_paths, or "
                                f"name a haystack (--haystack, or long_eval.haystack)")
        return cls(parts, name)

    def check_ids(self, vocab_size: int) -> None:
        """DatasetError unless every token id of the datasets is below `vocab_size` (the tokenizer's): text made
        with another tokenizer would read as nonsense, or past the model's vocabulary (cached as training's)."""
        fix = ("it was tokenized with another tokenizer than the run's: give a haystack made with the run's "
               "(tools/preprocess_data.py)")
        for ds in {id(ds): ds for ds, _, _ in self.parts}.values():
            check_token_ids(ds, vocab_size, default_cache_dir(ds.prefix), "the tokenizer's vocabulary", fix)

    @property
    def num_documents(self) -> int:
        return int(self.first[-1])

    def document(self, i: int) -> np.ndarray:
        part = int(np.searchsorted(self.first, i, side="right")) - 1
        ds, start, _ = self.parts[part]
        return ds.get(start + i - int(self.first[part]))

    def text_tokens(self, limit: int, drop: Optional[set[int]] = None) -> int:
        """The stream's tokens not in `drop`, counted up to `limit` (documents read until it is reached)."""
        have = 0
        for i in range(self.num_documents):
            doc = self.document(i)
            have += len(doc) - (int(np.isin(doc, list(drop)).sum()) if drop else 0)
            if have >= limit:
                return have
        return have

    def window(self, n: int, rng: np.random.Generator, drop: Optional[set[int]] = None,
               separator: Sequence[int] = ()) -> np.ndarray:
        """n tokens from the start of a random document on, through the following documents; HaystackError when
        the stream holds fewer."""
        if n > self.num_tokens:
            raise self._short(n, self.num_tokens)
        first = int(rng.integers(self.num_documents))
        pieces, have = [], 0
        for k in range(self.num_documents):
            doc = np.asarray(self.document((first + k) % self.num_documents), dtype=np.int64)
            if drop:
                doc = doc[~np.isin(doc, list(drop))]
            if separator and len(doc):
                doc = np.concatenate([np.asarray(separator, dtype=np.int64), doc])
            pieces.append(doc)
            have += len(doc)
            if have >= n:
                return np.concatenate(pieces)[:n]
        raise self._short(n, have)

    def _short(self, n: int, have: int) -> HaystackError:
        return HaystackError(f"{self.name} holds {have} tokens of text, fewer than the {n} a sample needs: give a "
                             f"larger haystack (--haystack, or long_eval.haystack) or shorter lengths")
