"""Whether a run has trained all its steps: exit status 0 when the newest checkpoint of the run that
`pretrain.py --config CONFIG [--set ...]` describes is at training.train_steps, 1 when it is not (no
checkpoint yet, or stopped before the end). torchrun_pod.sh asks it once torchrun has exited 0, to tell
a finished run from one that a signal stopped with a checkpoint.

    python examples/kubernetes/finished.py configs/llama3_8b_128k.yaml [--set section.key=value ...]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalysses.config import ConfigError  # noqa: E402
from megalysses.config.io import load_config  # noqa: E402
from megalysses.checkpoint.manifest import read_latest, step_of  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the run's YAML config, as given to pretrain.py --config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"not finished: {e}")
        return 1
    root = Path(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    latest, problem = read_latest(root)
    if latest is None:
        print(f"not finished: {problem}")
        return 1
    step, total = step_of(latest), cfg.training.train_steps
    print(f"{'finished' if step >= total else 'not finished'}: {latest} is at step {step} of training.train_steps="
          f"{total}")
    return 0 if step >= total else 1


if __name__ == "__main__":
    sys.exit(main())
