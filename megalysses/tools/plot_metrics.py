"""Draw the loss (train and validation) and throughput curves of a run to a PNG, and its long-context figures
(long_eval: accuracy by task and length over the steps, the latest loss by position) when it logged any.

    python tools/plot_metrics.py runs/quickstart                 # -> runs/quickstart/metrics.png
    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --output curves.png

Needs matplotlib (`pip install megalysses[plot]`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The rows of a metrics.jsonl that are JSON objects with a numeric step, and how many lines were
    skipped (not JSON, not UTF-8, cut short by a crash, or without a step)."""
    rows, skipped = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict) and _number(row.get("step")):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path, help="a run directory or its metrics.jsonl")
    p.add_argument("--output", type=Path, default=None, help="image path, .png/.pdf/.svg (default: beside the metrics)")
    args = p.parse_args(argv)
    if args.metrics.is_dir():
        args.metrics = args.metrics / "metrics.jsonl"
    if not args.metrics.is_file():
        print(f"error: {args.metrics} does not exist: pass a run directory (logging.run_dir) or its metrics.jsonl",
              file=sys.stderr)
        return 1
    out = args.output or args.metrics.with_suffix(".png")
    if out.suffix.lower() not in FORMATS:
        print(f"error: --output {out}: unsupported image type {out.suffix or '(none)'!r}: use one of "
              f"{', '.join(FORMATS)}", file=sys.stderr)
        return 1
    if not out.parent.is_dir() or out.is_dir():
        where = f"{out} is a directory" if out.is_dir() else f"the directory {out.parent} does not exist"
        print(f"error: --output {out}: {where}: give a file path in an existing directory", file=sys.stderr)
        return 1
    rows, skipped = read_metrics(args.metrics)
    if skipped:
        print(f"warning: {args.metrics}: skipped {skipped} lines that are not metric rows (not JSON, or cut "
              f"short)", file=sys.stderr)
    train = [r for r in rows if _number(r.get("loss"))]
    if not train:
        print(f"error: {args.metrics} has no training steps logged (no lines with a step and a loss): is it the "
              f"metrics.jsonl of a run that has trained?", file=sys.stderr)
        return 1
    try:
        import matplotlib
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'megalysses[plot]'", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = [r for r in rows if _number(r.get("val_loss"))]
    accuracy = sorted({k for r in rows for k in r if k.startswith("long_eval/") and "position-loss" not in k})
    position = [r for r in rows if any(k.startswith("long_eval/position-loss/") for k in r)]
    panels = 2 + bool(accuracy) + bool(position)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in train], [r["tokens_per_s"] if _number(r.get("tokens_per_s")) else float("nan")
                                          for r in train])
    ax2.set(xlabel="step", ylabel="tokens/s (all devices)", title="throughput")
    if accuracy:
        _accuracy_panel(axes[2], rows, accuracy)
    if position:
        _position_panel(axes[-1], position[-1])
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        print(f"error: --output {out}: cannot write it ({e.strerror or e})", file=sys.stderr)
        return 1
    finally:
        plt.close(fig)
    print(f"wrote {out}")
    return 0


def _accuracy_panel(ax, rows: list[dict], keys: list[str]) -> None:
    """long_eval/<task>/<length> over the steps, one line each."""
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=key.removeprefix("long_eval/"))
    ax.set(xlabel="step", ylabel="accuracy", title="long context", ylim=(-0.03, 1.03))
    ax.legend(fontsize=7)


def _position_panel(ax, row: dict) -> None:
    """The latest loss by position: long_eval/position-loss/<length>/<lo>-<hi>, one line per length."""
    curves: dict[int, list[tuple[float, float]]] = {}
    for key, value in row.items():
        if key.startswith("long_eval/position-loss/") and _number(value):
            length, bucket = key.split("/")[2:4]
            curves.setdefault(int(length), []).append((max(float(bucket.split("-")[0]), 0.5), value))
    for length, pts in sorted(curves.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{length} tokens")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="position in the document", ylabel="loss", title=f"loss by position (step {row['step']})")
    ax.legend(fontsize=7)


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
