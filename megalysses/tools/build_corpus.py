"""Build the default corpus from files already on this machine (no download, ever).

    python tools/build_corpus.py --stdlib --output data/stdlib.jsonl [--exclude-tests]

--stdlib takes every .py file of the running interpreter's standard library (sysconfig's "stdlib"
path; site-packages and dist-packages are always left out), sorted by relative path, one jsonl
document {"text": ..., "path": ...} each. Each file is decoded with its declared source encoding
(PEP 263, UTF-8 by default); the rare file that cannot be decoded is skipped and counted, and so are the
files with no text but whitespace (empty `__init__.py` files: empty documents to preprocessing).
The output is written to a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import sysconfig
import tokenize
from pathlib import Path
from typing import Optional

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


def main(argv: Optional[list[str]] = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stdlib", action="store_true", required=True, help="use the Python standard library")
    p.add_argument("--output", required=True, help="output .jsonl path")
    p.add_argument("--exclude-tests", action="store_true", help="leave out test/, tests/ and idle_test/ folders")
    args = p.parse_args(argv)

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
    written = skipped = empty = nbytes = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for path in stdlib_files(root, args.exclude_tests):
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
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {written} documents ({nbytes / 1e6:.1f} MB of text) from {root} to {out}; "
          f"skipped {empty} files with no text and {skipped} that cannot be decoded", file=sys.stderr)
    return {"documents": written, "skipped": skipped, "empty": empty, "characters": nbytes}


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
