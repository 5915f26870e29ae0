"""Write the config reference, docs/CONFIG.md, from the schema (megalysses/config/__init__.py) and Megatron-LM's names
(megalysses/config/megatron_names.py).

    python tools/config_doc.py --output docs/CONFIG.md      # or: make docs
    python tools/config_doc.py --check                      # exit 1 when docs/CONFIG.md is out of date

Run it after adding or changing a config key; the test suite fails while the checked-in file is out of date.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megalysses.config.doc import REGENERATE, reference_markdown

DEFAULT = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=DEFAULT, help="where to write it (default: docs/CONFIG.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if --output differs from the schema")
    args = p.parse_args(argv)
    text = reference_markdown()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else None
        if current != text:
            print(f"{args.output} is out of date with megalysses/config/__init__.py: regenerate it with {REGENERATE}",
                  file=sys.stderr)
            return 1
        print(f"{args.output} is current")
        return 0
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
