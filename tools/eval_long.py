"""Runs megalysses.tools.eval_long (installed as `megalysses-eval-long`) from a checkout; --help lists its
options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megalysses.tools.eval_long import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
