"""Draw the loss (train and validation) and throughput curves of a run to a PNG.

    python tools/plot_metrics.py runs/quickstart                 # -> runs/quickstart/metrics.png
    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --output curves.png

Needs matplotlib (`pip install megalysses[plot]`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: {path}:{i} is not JSON; skipped", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path, help="a run directory or its metrics.jsonl")
    p.add_argument("--output", type=Path, default=None, help="PNG path (default: beside the metrics file)")
    args = p.parse_args(argv)
    if args.metrics.is_dir():
        args.metrics = args.metrics / "metrics.jsonl"
    if not args.metrics.is_file():
        print(f"error: {args.metrics} does not exist: pass a run directory (logging.run_dir) or its metrics.jsonl",
              file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(args.metrics)
    train = [r for r in rows if "loss" in r]
    if not train:
        print(f"error: {args.metrics} has no training steps logged yet", file=sys.stderr)
        return 1
    val = [r for r in rows if "val_loss" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train])
    ax2.set(xlabel="step", ylabel="tokens/s (all devices)", title="throughput")
    fig.tight_layout()
    out = args.output or args.metrics.with_suffix(".png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
