"""Build a corpus from files already on this machine (no download, ever).

    python tools/build_corpus.py --stdlib --output data/stdlib.jsonl [--exclude-tests]
    python tools/build_corpus.py --passkey --seq-len 512 --documents 20000 --output data/passkey512.jsonl
    python tools/build_corpus.py --passkey --loss-on answer --seq-len 512 --output data/passkey512a.jsonl

--stdlib takes every .py file of the running interpreter's standard library (sysconfig's "stdlib"
path; site-packages and dist-packages are always left out), sorted by relative path, one jsonl
document {"text": ..., "path": ...} each. Each file is decoded with its declared source encoding
(PEP 263, UTF-8 by default); the rare file that cannot be decoded is skipped and counted, and so are the
files with no text but whitespace (empty `__init__.py` files: empty documents to preprocessing).

--passkey writes a synthetic retrieval corpus (megalysses/evaluation/corpus.py): --documents passkey
documents, each the passkey prompt of tools/eval_long.py with its filler a passage of the standard library's
docstrings repeated (ASCII, digits removed) and the key at a random depth, exactly --seq-len - 1 bytes long. Tokenized
with the byte tokenizer and --append-eod, each document is one sample of data.seq_len = --seq-len, so no
document is cut at a sample boundary (a key never loses its question):

    python tools/preprocess_data.py --input data/passkey512.jsonl --output-prefix data/passkey512 \
        --json-keys text --append-eod --tokenizer-type byte

With --loss-on answer (default: all) only the answer (its space, its digits) and the EOD after it carry the
loss: the records are {"prompt": ..., "completion": " 12345"}, which tools/preprocess_data.py --chat writes with
their loss mask (and the EOD), each document a sequence of its own:

    python tools/preprocess_data.py --chat --input data/passkey512a.jsonl --output-prefix data/passkey512a \
        --tokenizer-type byte

The output is written to a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sys
import sysconfig
import tokenize
from pathlib import Path
from typing import Iterator, Optional

from megalysses.evaluation.corpus import LOSS_ON, passkey_documents, passkey_records

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_files(root: str, exclude_tests: bool) -> list[Path]:
    """Every .py file under root, sorted by relative path."""
    skip = EXCLUDED_DIRS | (TEST_DIRS if exclude_tests else set())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> str:
    """A .py file's text in its declared encoding (raises SyntaxError / UnicodeDecodeError if unreadable)."""
    data = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def docstrings(root: str) -> Iterator[str]:
    """The docstrings of every module, class and function of the .py files under root (prose for filler)."""
    for path in stdlib_files(root, exclude_tests=True):
        try:
            tree = ast.parse(read_source(path))
        except (SyntaxError, UnicodeDecodeError, LookupError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text:
                    yield text


def main(argv: Optional[list[str]] = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--stdlib", action="store_true", help="use the Python standard library's source files")
    source.add_argument("--passkey", action="store_true",
                        help="a synthetic passkey-retrieval corpus, filler from the standard library's docstrings")
    p.add_argument("--output", required=True, help="output .jsonl path")
    p.add_argument("--exclude-tests", action="store_true", help="leave out test/, tests/ and idle_test/ folders")
    p.add_argument("--seq-len", type=int, default=512, help="--passkey: tokens per document with its EOD (byte "
                   "tokenizer), the data.seq_len to train with (default 512)")
    p.add_argument("--documents", type=int, default=20000, help="--passkey: how many documents (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="--passkey: seed of the keys, depths and filler (default 0)")
    p.add_argument("--loss-on", choices=LOSS_ON, default=None,
                   help="--passkey: which tokens carry the loss: all of them (default), or the answer's alone "
                        "(prompt/completion records for tools/preprocess_data.py --chat)")
    args = p.parse_args(argv)
    if args.loss_on is not None and not args.passkey:
        p.error("--loss-on only applies with --passkey")
    if args.passkey and (args.seq_len < 2 or args.documents < 1):
        p.error(f"--seq-len {args.seq_len} / --documents {args.documents}: give a length of at least 2 tokens and "
                f"at least one document")

    root = sysconfig.get_paths()["stdlib"]
    out = Path(args.output)
    if out.is_dir() or args.output.endswith(os.sep):
        p.error(f"--output {args.output} is a directory: give a file path, e.g. {out / 'stdlib.jsonl'}")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        p.error(f"--output {args.output}: {parent} is a file, not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            counts = _write_passkey(f, root, args) if args.passkey else _write_stdlib(f, root, args.exclude_tests)
        os.replace(tmp, out)
    except ValueError as e:
        p.error(f"--passkey: {e}")
    finally:
        if tmp.exists():
            tmp.unlink()
    what = (f"passkey documents of {args.seq_len - 1} bytes, filler from the docstrings under" if args.passkey else
            f"documents ({counts['characters'] / 1e6:.1f} MB of text) from")
    print(f"wrote {counts['documents']} {what} {root} to {out}; skipped {counts['empty']} files with no text and "
          f"{counts['skipped']} that cannot be decoded", file=sys.stderr)
    return counts


def _write_stdlib(f, root: str, exclude_tests: bool) -> dict[str, int]:
    written = skipped = empty = nbytes = 0
    for path in stdlib_files(root, exclude_tests):
        try:
            text = read_source(path)
        except (SyntaxError, UnicodeDecodeError, LookupError):
            skipped += 1
            continue
        if not text.strip():
            empty += 1
            continue
        f.write(json.dumps({"text": text, "path": path.relative_to(root).as_posix()}) + "\n")
        written += 1
        nbytes += len(text)
    return {"documents": written, "skipped": skipped, "empty": empty, "characters": nbytes}


def _write_passkey(f, root: str, args: argparse.Namespace) -> dict[str, int]:
    written = nbytes = 0
    documents = passkey_documents(docstrings(root), args.seq_len, args.documents, args.seed)
    for record in passkey_records(documents, args.loss_on or "all"):
        f.write(json.dumps(record) + "\n")
        written += 1
        nbytes += sum(map(len, record.values()))
    return {"documents": written, "skipped": 0, "empty": 0, "characters": nbytes}


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
