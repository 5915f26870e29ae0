"""Reading raw corpora for the tools: JSON Lines files (plain or gzip / bz2 / xz, recognised by their
bytes, not their name), folders of text files, and glob patterns.

    files, folder = input_files("data/*.jsonl.gz")      # sorted; a folder gives its files recursively
    for line in read_lines(files[0]): ...               # raw bytes of each line

Problems a user can fix (a missing or empty file, a JSON array instead of JSON Lines, corrupt or
truncated compressed data, zstd) raise InputError naming the file and the fix.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import os
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_SUFFIX = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
_OPENERS: dict[str, Callable[[BinaryIO], BinaryIO]] = {
    "gzip": lambda raw: gzip.GzipFile(fileobj=raw), "bz2": lambda raw: bz2.BZ2File(raw),
    "xz": lambda raw: lzma.LZMAFile(raw),
}
_CORRUPT = (EOFError, OSError, zlib.error, lzma.LZMAError)


class InputError(ValueError):
    """An input corpus the tools cannot read; the message names the file and the fix."""


def compression(path: str) -> Optional[str]:
    """gzip, bz2, xz, zstd or None, from the file's first bytes; a compression suffix on a file that
    does not start with its magic bytes is an error."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    suffix = Path(path).suffix.lower()
    if suffix in _SUFFIX and head:
        raise InputError(f"{path}: named {suffix} but it is not {_SUFFIX[suffix]} data (it starts with {head!r}): "
                         f"rename it without {suffix}, or compress it properly")
    return None


def input_files(spec: str) -> tuple[list[str], bool]:
    """(files, is_folder) for a file, a folder (every file below it, sorted) or a glob pattern (sorted)."""
    if os.path.isdir(spec):
        files = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file())
        if not files:
            raise InputError(f"--input {spec}: the folder holds no files")
        return files, True
    if os.path.isfile(spec):
        return [spec], False
    if glob.has_magic(spec):
        files = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        if not files:
            raise InputError(f"--input {spec}: no file matches the pattern")
        return files, False
    raise InputError(f"--input {spec}: no such file or directory")


def check_readable(path: str) -> None:
    """Refuse zstd data and a compression suffix on data that is not compressed so."""
    if compression(path) == "zstd":
        raise InputError(f"{path}: zstd-compressed data is not read here: decompress it first (zstd -d), or "
                         f"recompress it with gzip")


def check_jsonl(path: str) -> None:
    """Refuse an empty file, zstd, and a file whose data is a JSON array or one pretty-printed object
    (JSON Lines hold one object per line)."""
    check_readable(path)
    if os.path.getsize(path) == 0:
        raise InputError(f"{path}: the file is empty: nothing to read")
    first = b""
    for line in read_lines(path):
        if line.startswith((b"\xff\xfe", b"\xfe\xff")) and not first:
            raise InputError(f"{path}: the text is UTF-16 (or UTF-32), not UTF-8: convert it, e.g. "
                             f"iconv -f utf-16 -t utf-8 {path} > {Path(path).stem}.utf8.jsonl")
        first = line.strip()
        if first:
            break
    if first.startswith(b"["):
        raise InputError(f"{path}: the data is a JSON array, not JSON Lines (one object per line): convert it, "
                         f"e.g. jq -c '.[]' {path} > {Path(path).stem}.jsonl")
    if first == b"{":
        raise InputError(f"{path}: the data is one pretty-printed JSON object, not JSON Lines (one object per "
                         f"line): convert it, e.g. jq -c . {path} > {Path(path).stem}.jsonl")


class Position:
    """Bytes of the input read so far (compressed bytes for compressed files), for progress and ETA."""

    def __init__(self) -> None:
        self.done = 0


def read_lines(path: str, position: Optional[Position] = None) -> Iterator[bytes]:
    """The raw lines of a (possibly compressed) text file."""
    kind = compression(path)
    base = position.done if position else 0
    count = 0
    with open(path, "rb") as raw:
        stream = _OPENERS[kind](raw) if kind in _OPENERS else raw
        try:
            for line in stream:
                count += 1
                if position:
                    position.done = base + raw.tell()
                yield line
        except _CORRUPT as err:
            raise InputError(f"{path}: corrupt or truncated {kind or 'file'} data after {count} lines ({err}): "
                             f"re-download or re-create the file") from None


def read_file(path: str, position: Optional[Position] = None) -> bytes:
    """A whole file's bytes (decompressed when it is gzip, bz2 or xz data)."""
    kind = compression(path)
    with open(path, "rb") as raw:
        try:
            data = _OPENERS[kind](raw).read() if kind in _OPENERS else raw.read()
        except _CORRUPT as err:
            raise InputError(f"{path}: corrupt or truncated {kind} data ({err}): re-download or re-create "
                             f"the file") from None
    if position:
        position.done += os.path.getsize(path)
    return data
