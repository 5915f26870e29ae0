"""Runs megalysses.tools.train_tokenizer (installed as `megalysses-train-tokenizer`) from a checkout;
--help lists its options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megalysses.tools.train_tokenizer import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
