"""Runs megalysses.tools.config_doc from a checkout (`make docs`); --help lists its options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megalysses.tools.config_doc import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
