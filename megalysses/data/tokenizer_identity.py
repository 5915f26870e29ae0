"""Which tokenizer wrote a dataset: a small JSON file beside its .bin/.idx, `PREFIX.tokenizer.json` (Megatron-LM's
format itself is untouched), written by tools/preprocess_data.py and tools/merge_datasets.py and compared with the
run's tokenizer when training opens the dataset: ids of another tokenizer that fall inside the vocabulary would
otherwise train silently.

    record = tokenizer_identity(tokenizer)   # {"type", "vocab_size", "eod", "bos", "files": [{"name", "sha256"}]}
    write_identity("data/my_text_document", record)
    recorded = read_identity("data/my_text_document")        # None: no sidecar (older or Megatron-LM's datasets)
    line = identity_mismatch(recorded, record)                # None when they agree, else a line naming both

Two tokenizers agree when they are of one type and, but for the null tokenizer (whose vocabulary is the model's),
their files have the same contents (sha256), the same number of ids and the same EOD.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

SUFFIX = ".tokenizer.json"
VERSION = 1


def sidecar_path(prefix: str | os.PathLike) -> str:
    """The identity file of the dataset `prefix`."""
    return f"{os.fspath(prefix)}{SUFFIX}"


def _sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _kind_and_files(tokenizer: Any) -> tuple[str, list[str]]:
    """The tokenizer's type (config.values.KINDS) and the files that define it."""
    from megalysses.data.tokenizer import GPT2BPETokenizer, HFTokenizer, NullTokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, GPT2BPETokenizer):
        return "gpt2bpe", [tokenizer.path, tokenizer.merge_file]
    if isinstance(tokenizer, HFTokenizer):
        return "huggingface", [tokenizer.path]
    if isinstance(tokenizer, SentencePieceTokenizer):
        return "sentencepiece", [tokenizer.model_path]
    return ("null" if isinstance(tokenizer, NullTokenizer) else "byte"), []


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What identifies `tokenizer`: its type, ids, EOD and BOS, and each of its files' name and sha256 (a Hugging
    Face tokenizer: its folder's name too)."""
    kind, files = _kind_and_files(tokenizer)
    record: dict[str, Any] = {"version": VERSION, "type": kind, "vocab_size": int(tokenizer.vocab_size),
                              "eod": tokenizer.eod_id, "bos": tokenizer.bos_id,
                              "files": [{"name": os.path.basename(f), "sha256": _sha256(f)} for f in files]}
    if kind == "huggingface":
        record["folder"] = Path(tokenizer.path).resolve().parent.name
    return record


def write_identity(prefix: str | os.PathLike, record: dict[str, Any]) -> str:
    """`record` into the identity file of `prefix`, written whole (a temporary file renamed); its path."""
    path = sidecar_path(prefix)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_identity(prefix: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The identity recorded beside `prefix`, or None when there is none. ValueError when it cannot be read."""
    path = sidecar_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise ValueError(f"{path}: not a tokenizer identity (no 'type')")
    return record


def describe(record: dict[str, Any]) -> str:
    """A tokenizer's identity in words: `sentencepiece my.model (sha256 1a2b3c4d5e6f, 4096 ids, EOD 2)`."""
    files = record.get("files") or []
    names = " + ".join(f"{f.get('name')}" for f in files)
    where = f" {record['folder']}/{names}" if record.get("folder") else f" {names}" if names else ""
    digest = f"sha256 {files[0].get('sha256', '')[:12]}, " if files else ""
    return f"{record['type']}{where} ({digest}{record.get('vocab_size')} ids, EOD {record.get('eod')})"


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two identities name one tokenizer (see the module's docstring)."""
    if a.get("type") != b.get("type"):
        return False
    if a["type"] == "null":
        return True
    hashes = [[f.get("sha256") for f in r.get("files") or []] for r in (a, b)]
    return hashes[0] == hashes[1] and a.get("vocab_size") == b.get("vocab_size") and a.get("eod") == b.get("eod")


def identity_mismatch(recorded: Optional[dict[str, Any]], current: dict[str, Any], what: str = "the data"
                      ) -> Optional[str]:
    """None when `recorded` (None: nothing recorded) and `current` name one tokenizer, else one line naming both."""
    if recorded is None or same_tokenizer(recorded, current):
        return None
    return (f"{what} was tokenized with {describe(recorded)}, but this run's tokenizer is {describe(current)}: "
            f"set data.tokenizer (and data.tokenizer_model, data.eod) to the one that wrote it, or re-tokenize it")
