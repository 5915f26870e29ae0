"""Draw the loss (train and validation) and throughput curves of one run, or of several to compare, to an image.

    python tools/plot_metrics.py runs/quickstart                      # -> runs/quickstart/metrics.png
    python tools/plot_metrics.py runs/a runs/b --x tokens --output compare.png
    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --output curves.svg

Each run is a run directory (logging.run_dir) or its metrics.jsonl; the x axis counts optimizer steps
(`--x step`) or tokens trained on (`--x tokens`, what compares runs of different batch sizes). Every
restart of a run is marked with a dotted line where it resumed, a change of layout (tp, sp, pp, dp) with
a dashed one and its label; steps that a restart from an earlier checkpoint trained again are drawn as
the later run trained them. Needs matplotlib (`pip install megalysses[plot]`).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl that are JSON objects with a numeric step, in order, and how many lines
    were skipped (not JSON, not UTF-8, cut short by a crash, or without a step)."""
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


@dataclass
class Run:
    """One run's curves and the events to mark on them."""

    name: str
    train: list[dict] = field(default_factory=list)        # logged steps, each step once (the latest record)
    val: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)       # {"step", "tokens", "label", "layout_change"}


def layout_words(layout: Optional[dict]) -> str:
    if not isinstance(layout, dict):
        return "?"
    return "·".join(f"{k}{layout[k]}" for k in ("tp", "sp", "pp", "dp") if k in layout)


def timeline(name: str, records: list[dict]) -> Run:
    """The run as it trained: a start mark at step s supersedes the earlier records of the steps after s (a
    restart from an older checkpoint trains them again); every start after the first is an event, a layout
    change when its layout differs from the previous start's."""
    run, layout = Run(name), None
    for rec in records:
        if rec.get("event") == "start":
            s = rec["step"]
            run.train = [r for r in run.train if r["step"] <= s]
            run.val = [r for r in run.val if r["step"] <= s]
            new = rec.get("layout")
            if rec.get("run", 1) > 1 or layout is not None:
                changed = layout is not None and new is not None and new != layout
                label = f"{layout_words(layout)} -> {layout_words(new)}" if changed else f"resumed at step {s}"
                run.events.append({"step": s, "tokens": rec.get("tokens"), "label": label, "layout_change": changed})
            layout = new if new is not None else layout
        elif _number(rec.get("loss")):
            run.train.append(rec)
        elif _number(rec.get("val_loss")):
            run.val.append(rec)
    return run


def _metrics_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def _names(paths: list[Path]) -> list[str]:
    """Short labels: the run directories' names, or their whole paths where names repeat."""
    dirs = [p.parent if p.name == "metrics.jsonl" else p for p in paths]
    names = [d.name or str(d) for d in dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dirs]


def _check_output(out: Path) -> Optional[str]:
    if out.suffix.lower() not in FORMATS:
        return f"unsupported image type {out.suffix or '(none)'!r}: use one of {', '.join(FORMATS)}"
    if not out.parent.is_dir() or out.is_dir():
        where = f"{out} is a directory" if out.is_dir() else f"the directory {out.parent} does not exist"
        return f"{where}: give a file path in an existing directory"
    return None


def load_runs(paths: list[Path], x: str) -> list[Run]:
    """Every run's timeline; SystemExit with one error line for a run without a metrics file, without trained
    steps, or without token counts when x is tokens."""
    runs = []
    for path, name in zip(paths, _names(paths)):
        if not path.is_file():
            raise SystemExit(f"error: {path} does not exist: pass a run directory (logging.run_dir) or its "
                             f"metrics.jsonl")
        records, skipped = read_metrics(path)
        if skipped:
            print(f"warning: {path}: skipped {skipped} lines that are not metric rows (not JSON, or cut short)",
                  file=sys.stderr)
        run = timeline(name, records)
        if not run.train:
            raise SystemExit(f"error: {path} has no training steps logged (no lines with a step and a loss): is it "
                             f"the metrics.jsonl of a run that has trained?")
        if x == "tokens" and not all(_number(r.get("tokens")) for r in run.train):
            raise SystemExit(f"error: {path} does not count the tokens of every logged step (a run logged before "
                             f"they were counted): plot it against --x step")
        runs.append(run)
    return runs


def draw(runs: list[Run], x: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def at(rec: dict) -> float:
        value = rec["step"] if x == "step" else rec.get("tokens")
        return value if _number(value) else float("nan")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax1.plot([at(r) for r in run.train], [r["loss"] for r in run.train], color=color, label=f"{run.name} train")
        val = [r for r in run.val if x == "step" or _number(r.get("tokens"))]
        if val:
            ax1.plot([at(r) for r in val], [r["val_loss"] for r in val], "o--", color=color,
                     label=f"{run.name} validation")
        ax2.plot([at(r) for r in run.train], [r["tokens_per_s"] if _number(r.get("tokens_per_s")) else float("nan")
                                              for r in run.train], color=color, label=run.name)
        for e in run.events:
            where = at(e)
            if where != where:      # a start mark that does not count tokens
                continue
            for ax in (ax1, ax2):
                ax.axvline(where, color=color, linestyle="--" if e["layout_change"] else ":", linewidth=1)
            ax1.annotate(e["label"], (where, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                         ha="right", fontsize=7, color=color)
    label = "step" if x == "step" else "tokens trained on"
    ax1.set(xlabel=label, ylabel="loss", title="loss")
    ax1.legend(fontsize=8)
    ax2.set(xlabel=label, ylabel="tokens/s (all devices)", title="throughput")
    if len(runs) > 1:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path, nargs="+", help="run directories (logging.run_dir) or their metrics.jsonl")
    p.add_argument("--x", choices=("step", "tokens"), default="step",
                   help="the x axis: optimizer steps, or tokens trained on (default step)")
    p.add_argument("--output", type=Path, default=None,
                   help="image path, .png/.pdf/.svg (default: beside the metrics of a single run)")
    args = p.parse_args(argv)
    paths = [_metrics_file(m) for m in args.metrics]
    if args.output is None and len(paths) > 1:
        print(f"error: {len(paths)} runs to compare: give the image's path with --output", file=sys.stderr)
        return 1
    out = args.output or paths[0].with_suffix(".png")
    problem = _check_output(out)
    if problem:
        print(f"error: --output {out}: {problem}", file=sys.stderr)
        return 1
    try:
        runs = load_runs(paths, args.x)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'megalysses[plot]'", file=sys.stderr)
        return 1
    try:
        draw(runs, args.x, out)
    except OSError as e:
        print(f"error: --output {out}: cannot write it ({e.strerror or e})", file=sys.stderr)
        return 1
    marks = sum(len(r.events) for r in runs)
    print(f"wrote {out}" + (f" ({marks} restarts marked)" if marks else ""))
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
