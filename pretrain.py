"""Runs megalysses.tools.pretrain (installed as `megalysses-pretrain`) from a checkout; --help lists its options."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from megalysses.tools.pretrain import cli  # noqa: E402
except KeyboardInterrupt:     # Ctrl-C while Python loads torch: nothing has started yet
    if os.environ.get("RANK", "0") == "0":
        print("interrupted (Ctrl-C) while starting up: nothing was trained", flush=True)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(cli())
