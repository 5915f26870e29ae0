"""Tokenizers behind one interface: a sentencepiece model, or raw UTF-8 bytes (no model file).

    tok = build_tokenizer("byte")                       # ids 0..255 bytes, 256 BOS, 257 EOS=EOD, 258 PAD
    tok = build_tokenizer("sentencepiece", "tok.model")
    ids = tok.encode("hello"); tok.decode(ids) == "hello"

Every tokenizer exposes vocab_size, bos_id, eos_id, eod_id (= eos_id, the document separator
the data pipeline appends), pad_id, encode and decode.
"""
from __future__ import annotations

import os
from typing import Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    eod_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=EOD=257, PAD=258 (vocab_size 259)."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    eod_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The ids as a bytes object (each byte is its own id): the fast path for preprocessing."""
        return text.encode("utf-8")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A trained sentencepiece model (see tools/train_tokenizer.py). PAD falls back to EOS when the
    model has no pad piece; a model without an EOS piece is refused (documents need a separator)."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm

        path = os.fspath(model_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: sentencepiece model file not found")
        self.model_path = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = int(self.sp.vocab_size())
        self.bos_id = int(self.sp.bos_id())
        self.eos_id = int(self.sp.eos_id())
        if self.eos_id < 0:
            raise ValueError(f"{path}: the sentencepiece model has no EOS piece (eos_id=-1); "
                             "retrain it with an eos id so documents can be separated")
        self.eod_id = self.eos_id
        pad = int(self.sp.pad_id())
        self.pad_id = pad if pad >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in one call, on this thread only (parallelism is the caller's choice)."""
        return self.sp.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


def build_tokenizer(kind: str, model_path: Optional[str] = None) -> ByteTokenizer | SentencePieceTokenizer:
    """`kind` is "byte" (no file) or "sentencepiece" (needs `model_path`)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "sentencepiece":
        if not model_path:
            raise ValueError("tokenizer kind 'sentencepiece' needs a model path (--tokenizer-model)")
        return SentencePieceTokenizer(model_path)
    raise ValueError(f"unknown tokenizer kind {kind!r}: expected 'sentencepiece' or 'byte'")
