"""Reading raw corpora for the tools: JSON Lines files (plain or gzip / bz2 / xz / zstd, recognised by
their bytes, not their name), Parquet and Arrow files and Hugging Face `datasets` folders (read by
megalysses.data.columnar), folders of text files, and glob patterns.

    files, folder = input_files("data/*.jsonl.gz")      # sorted; a folder gives its files recursively
    for path, kind in corpus_inputs("data/fineweb/"):   # kind: jsonl, parquet, arrow or text
    for line in read_lines(files[0]): ...               # raw bytes of each line

zstd needs the `zstandard` package (an optional extra). A zstd stream can end silently when its file
is cut short, so every frame is checked for its end. Problems a user can fix (a missing or empty file,
a JSON array instead of JSON Lines, corrupt or truncated compressed data) raise InputError naming the
file and the fix.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import io
import json
import lzma
import os
import re
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_SUFFIX = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
# Parquet files start with PAR1, Arrow IPC files with ARROW1, Arrow IPC streams (what `datasets` writes)
# with the continuation marker 0xFFFFFFFF
_COLUMNAR_MAGIC = ((b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\xff\xff\xff\xff", "arrow"))
ZSTD_READ = 1 << 20     # compressed bytes read at a time
_JSONL_NAME = re.compile(r"\.jsonl(\.(gz|bz2|xz|zst))?$", re.IGNORECASE)


class InputError(ValueError):
    """An input corpus the tools cannot read; the message names the file and the fix."""


def _zstandard(path: str):
    try:
        import zstandard
    except ImportError:
        raise InputError(f"{path}: zstd-compressed data needs the zstandard package: pip install zstandard (or "
                         f"pip install 'megalysses[zstd]')") from None
    return zstandard


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a zstd file (any number of frames). A file that ends inside a frame
    raises EOFError, as gzip does: zstandard's own stream reader would end there without a word."""

    def __init__(self, raw: BinaryIO, zstandard: Any) -> None:
        self.raw, self.zstd = raw, zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.in_frame = False                  # the current frame has had input but not its end
        self.out, self.at = b"", 0             # decompressed bytes not yet read, from self.at

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.at == len(self.out):
            chunk = self.raw.read(ZSTD_READ)
            if not chunk:
                if self.in_frame:
                    raise EOFError("compressed file ended before the end of its last zstd frame")
                return 0
            out = []
            while chunk:
                self.in_frame = True
                try:
                    out.append(self.frame.decompress(chunk))
                except self.zstd.ZstdError as err:
                    raise OSError(str(err)) from None
                if not self.frame.eof:
                    break
                chunk = self.frame.unused_data       # the next frame starts here
                self.frame = self.zstd.ZstdDecompressor().decompressobj()
                self.in_frame = False
            self.out, self.at = b"".join(out), 0
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n


_OPENERS: dict[str, Callable[[BinaryIO, str], BinaryIO]] = {
    "gzip": lambda raw, path: gzip.GzipFile(fileobj=raw), "bz2": lambda raw, path: bz2.BZ2File(raw),
    "xz": lambda raw, path: lzma.LZMAFile(raw),
    "zstd": lambda raw, path: io.BufferedReader(_ZstdReader(raw, _zstandard(path)), 1 << 20),
}
_CORRUPT = (EOFError, OSError, zlib.error, lzma.LZMAError)


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
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise InputError(f"--input {spec}: no file matches the pattern")
        return files, False
    raise InputError(f"--input {spec}: no such file or directory")


def check_readable(path: str) -> None:
    """Refuse a compression suffix on data that is not compressed so, and zstd data without zstandard."""
    if compression(path) == "zstd":
        _zstandard(path)


def columnar_format(path: str) -> Optional[str]:
    """'parquet' or 'arrow' (an Arrow IPC file or stream) from the file's first bytes, else None."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name in _COLUMNAR_MAGIC if head.startswith(magic)), None)


def _datasets_files(folder: Path) -> Optional[list[str]]:
    """The Arrow files of a Hugging Face `datasets` folder (Dataset.save_to_disk), in order; None for
    another folder. A DatasetDict (several splits) is refused: it is one split that is tokenized."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = ", ".join(json.loads((folder / "dataset_dict.json").read_text())["splits"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            splits = "see dataset_dict.json"
        raise InputError(f"--input {folder}: a `datasets` DatasetDict (splits: {splits}): pass the folder of one "
                         f"split, e.g. --input {folder / 'train'}")
    state = folder / "state.json"
    if not (state.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise InputError(f"{state}: not the state.json of a `datasets` folder ({err!r}): save the dataset again "
                         f"with save_to_disk") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing or not names:
        raise InputError(f"--input {folder}: the `datasets` folder lacks its Arrow files "
                         f"({', '.join(missing) or 'none listed in state.json'}): copy the whole folder")
    return [str(folder / n) for n in names]


def corpus_inputs(spec: str) -> tuple[list[tuple[str, str]], bool]:
    """([(file, kind)], is_text_folder) for --input: a file, a glob pattern or a folder. kind is 'parquet'
    or 'arrow' (by the file's bytes), 'jsonl' or 'text' (a whole file is one document). Files and glob
    matches are JSON Lines unless Parquet or Arrow. A `datasets` folder gives its Arrow files; a folder
    of Parquet, Arrow or .jsonl files (hidden ones ignored) gives those; any other folder is a folder of
    text documents, and a folder mixing the two is refused."""
    files, folder = input_files(spec)
    if not folder:
        return [(f, columnar_format(f) or "jsonl") for f in files], False
    arrow = _datasets_files(Path(spec))
    if arrow is not None:
        return [(f, "arrow") for f in arrow], False
    kinds = [(f, columnar_format(f) or ("jsonl" if _JSONL_NAME.search(f) else "text")) for f in files
             if not any(part.startswith(".") for part in Path(f).relative_to(spec).parts)]
    data = [fk for fk in kinds if fk[1] != "text"]
    if not data:
        return [(f, "text") for f in files], True
    others = [f for f, kind in kinds if kind == "text"]
    if others:
        kind = data[0][1]
        pattern = os.path.join(spec, "**", "*." + ("jsonl*" if kind == "jsonl" else kind))
        raise InputError(f"--input {spec}: the folder mixes {kind} data ({len(data)} files) with {len(others)} other "
                         f"files (e.g. {others[0]}): pass a glob of the data files, e.g. --input '{pattern}'")
    return data, False


def check_jsonl(path: str) -> None:
    """Refuse an empty file, zstd data without zstandard, and a file whose data is a JSON array or one
    pretty-printed object (JSON Lines hold one object per line)."""
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
        stream = _OPENERS[kind](raw, path) if kind in _OPENERS else raw
        try:
            for line in stream:
                count += 1
                if position:
                    position.done = base + raw.tell()
                yield line
        except _CORRUPT as err:
            after = f" after {count} lines" if count else ""
            raise InputError(f"{path}: corrupt or truncated {kind or 'file'} data{after} ({err}): re-download or "
                             f"re-create the file") from None


def read_file(path: str, position: Optional[Position] = None) -> bytes:
    """A whole file's bytes (decompressed when it is gzip, bz2 or xz data)."""
    kind = compression(path)
    with open(path, "rb") as raw:
        try:
            data = _OPENERS[kind](raw, path).read() if kind in _OPENERS else raw.read()
        except _CORRUPT as err:
            raise InputError(f"{path}: corrupt or truncated {kind} data ({err}): re-download or re-create "
                             f"the file") from None
    if position:
        position.done += os.path.getsize(path)
    return data
