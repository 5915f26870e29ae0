"""Runs megalysses.tools.pretrain (installed as `megalysses-pretrain`) from a checkout; --help lists its options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megalysses.tools.pretrain import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
