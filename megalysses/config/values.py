"""The grammar of config values that the config's checks and the data pipeline read alike: a dataset list
(bare prefixes, or weight and prefix pairs), a train/valid/test split, and the tokenizer kinds (ours and
Megatron-LM's --tokenizer-type names).

    parse_blend(["0.7", "data/a_text_document", "0.3", "data/b"])  # (["data/a_text_document", "data/b"], [0.7, 0.3])
    parse_split("969,30,1")                                          # [0.969, 0.03, 0.001]
    canonical_kind("HuggingFaceTokenizer")                           # "huggingface"
"""
from __future__ import annotations

import math
import re
from typing import Sequence

KINDS = ("byte", "sentencepiece", "huggingface", "gpt2bpe", "null")
_MEGATRON_KINDS = {
    "huggingfacetokenizer": "huggingface", "sentencepiecetokenizer": "sentencepiece",
    "gptsentencepiecetokenizer": "sentencepiece", "llama2tokenizer": "sentencepiece",
    "gpt2bpetokenizer": "gpt2bpe", "nulltokenizer": "null", "hf": "huggingface", "tokenizers": "huggingface",
}
_UNSUPPORTED_KINDS = {
    "tiktokenizer": "tiktoken vocabularies are not supported: use the model's tokenizer.json with HuggingFaceTokenizer",
    "bertwordpiecelowercase": "BERT word-piece tokenizers are for BERT data, not GPT pretraining",
    "bertwordpiececase": "BERT word-piece tokenizers are for BERT data, not GPT pretraining",
    "multimodaltokenizer": "multimodal tokenizers are not supported (text GPT pretraining only)",
    "nullmultimodaltokenizer": "multimodal tokenizers are not supported (text GPT pretraining only)",
    "sfttokenizer": "the SFT tokenizer is for fine-tuning conversations, not pretraining",
}


class TokenizerError(ValueError):
    """A missing, unreadable or unsuitable tokenizer; the message names the file and the fix."""


def canonical_kind(kind: str) -> str:
    """One of KINDS for our names and Megatron-LM's --tokenizer-type names (case-insensitive)."""
    key = str(kind).strip().lower()
    if key in KINDS:
        return key
    if key in _MEGATRON_KINDS:
        return _MEGATRON_KINDS[key]
    if key in _UNSUPPORTED_KINDS:
        raise TokenizerError(f"tokenizer type {kind!r}: {_UNSUPPORTED_KINDS[key]}")
    raise TokenizerError(f"unknown tokenizer kind {kind!r}: expected one of {', '.join(KINDS[:-1])} or Megatron-LM's "
                         f"NullTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                         f"Llama2Tokenizer, GPT2BPETokenizer")


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def is_weighted(spec: Sequence[str]) -> bool:
    """Whether a dataset list gives weights (["0.7", "a", "0.3", "b"]) rather than bare prefixes."""
    return bool(spec) and _is_number(str(spec[0]))


def parse_blend(spec: Sequence[str]) -> tuple[list[str], list[float]]:
    """["0.7", "pathA", "0.3", "pathB"] or ["pathA", "pathB"] (equal weights) -> (paths, normalised weights)."""
    items = [str(s) for s in spec]
    if not items:
        raise ValueError("empty dataset list: give dataset prefixes, optionally weighted ['0.7', 'a', '0.3', 'b']")
    is_number = _is_number
    if not is_number(items[0]):
        if any(is_number(s) for s in items):
            raise ValueError(f"dataset list {items}: mixes weights and unweighted paths")
        return items, [1.0 / len(items)] * len(items)
    if len(items) % 2 or not all(is_number(w) and not is_number(p) for w, p in zip(items[::2], items[1::2])):
        raise ValueError(f"dataset list {items}: expected weight, path pairs like ['0.7', 'a', '0.3', 'b']")
    weights = [float(w) for w in items[::2]]
    for w, path in zip(items[::2], items[1::2]):
        if not math.isfinite(float(w)) or float(w) < 0:
            raise ValueError(f"dataset list {items}: the weight {w} of {path} is not a finite non-negative number")
    if sum(weights) <= 0:
        raise ValueError(f"dataset list {items}: the weights sum to 0; give at least one dataset a positive weight")
    total = sum(weights)
    return items[1::2], [w / total for w in weights]


def parse_split(split: str) -> list[float]:
    """"969,30,1" (or "969/30/1") -> normalised [train, valid, test] weights (missing entries are 0)."""
    text = str(split).strip()
    usage = "give up to three non-negative ratios for train,valid,test like '969,30,1'"
    items = [x.strip() for x in re.split(r"[,/]", text)] if text else []
    if not 1 <= len(items) <= 3:
        raise ValueError(f"split {split!r}: {len(items)} ratios; {usage}")
    parts = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"split {split!r}: {item!r} is not a number; {usage}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"split {split!r}: ratio {item} is {'negative' if value < 0 else 'not finite'}; {usage}")
        parts.append(value)
    if sum(parts) <= 0:
        raise ValueError(f"split {split!r}: the ratios sum to 0; {usage}")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]
