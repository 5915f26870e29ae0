"""Data pipeline: Megatron-format indexed datasets, tokenizers, GPT samples, blending, the DP/SP loader.

The loader (which imports torch) is loaded on first use, so the numpy-only tools start fast.
"""
from typing import Any

from megalysses.data.blend import BlendedDataset, blend_indices, parse_blend
from megalysses.data.build import DatasetOptions, build_gpt_datasets
from megalysses.data.gpt_dataset import GPTDataset, MockGPTDataset, build_gpt_indices, split_ranges
from megalysses.data.indexed import (DatasetError, IndexedDataset, IndexedDatasetBuilder, merge_datasets,
                                     optimal_dtype)
from megalysses.data.tokenizer import (ByteTokenizer, GPT2BPETokenizer, HFTokenizer, NullTokenizer,
                                       SentencePieceTokenizer, Tokenizer, TokenizerError, build_tokenizer,
                                       tokenizer_from_config)
from megalysses.data.validate import check_token_ids

_LOADER_NAMES = ("IGNORE_INDEX", "BatchFormat", "LoaderRank", "build_micro_batch", "iterate_micro_batches")


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        from megalysses.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'megalysses.data' has no attribute {name!r}")


__all__ = [
    "BatchFormat", "BlendedDataset", "ByteTokenizer", "DatasetError", "DatasetOptions", "GPT2BPETokenizer",
    "GPTDataset", "HFTokenizer", "IGNORE_INDEX", "IndexedDataset", "IndexedDatasetBuilder", "LoaderRank",
    "MockGPTDataset", "NullTokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerError", "blend_indices",
    "build_gpt_datasets", "build_gpt_indices", "build_micro_batch", "build_tokenizer", "check_token_ids",
    "iterate_micro_batches", "merge_datasets", "optimal_dtype", "parse_blend", "split_ranges",
    "tokenizer_from_config",
]
