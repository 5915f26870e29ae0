"""The long-context figures as a user reads them: long_eval.json, a Markdown table and PNG pictures.

    write_results(out_dir, results, trained_length, extra={"settings": ..., "layout": ..., "seconds": ...})
    print(markdown(results, trained_length))
    paths = draw(results, out_dir, trained_length)      # needs matplotlib (the `plot` extra)

`results` holds one entry per task, length and depth ({"task", "length", "depth", "accuracy", "samples"}) or,
for loss by position, per length and position bucket ({"task", "length", "positions": [lo, hi], "loss",
"tokens"}), and nothing else; the JSON keeps what describes the run beside it. Lengths past the one the model
trained at are marked as extrapolation. The pictures: a depth x length heatmap per needle task, passkey
accuracy against length (one line per depth and their mean), loss against position within the document.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from megalysses.evaluation.tasks import ACCURACY_TASKS

JSON_NAME, MARKDOWN_NAME = "long_eval.json", "long_eval.md"


def write_results(out_dir: Path, results: list[dict], trained_length: Optional[int], extra: dict) -> Path:
    """<out_dir>/long_eval.json: {"results": results, "trained_length", "extrapolated": [lengths], **extra},
    written whole or not at all."""
    lengths = sorted({r["length"] for r in results})
    record = {"results": results, "trained_length": trained_length,
              "extrapolated": [n for n in lengths if trained_length is not None and n > trained_length], **extra}
    path = out_dir / JSON_NAME
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _length_label(n: int, trained: Optional[int]) -> str:
    return f"{n} (extrapolation)" if trained is not None and n > trained else str(n)


def markdown(results: list[dict], trained_length: Optional[int]) -> str:
    """Per accuracy task, a table of accuracy by length (rows) and depth (columns) with each length's mean;
    for loss by position, the loss by position bucket (rows) and length (columns)."""
    out = []
    for task in ACCURACY_TASKS:
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        depths = sorted({r["depth"] for r in rows})
        lines = [f"| {task}: length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |",
                 "|---" * (len(depths) + 2) + "|"]
        for n in sorted({r["length"] for r in rows}):
            cell = {r["depth"]: r for r in rows if r["length"] == n}
            mean = sum(c["accuracy"] * c["samples"] for c in cell.values()) / sum(c["samples"] for c in cell.values())
            lines.append(f"| {_length_label(n, trained_length)} | "
                         + " | ".join(f"{cell[d]['accuracy']:.0%}" if d in cell else "-" for d in depths)
                         + f" | {mean:.0%} |")
        samples = sorted({r["samples"] for r in rows})
        out.append("\n".join(lines) + f"\n\n{'/'.join(map(str, samples))} samples per cell; correct when every "
                   f"answer token is the model's greedy choice.")
    rows = [r for r in results if r["task"] == "position-loss"]
    if rows:
        lengths = sorted({r["length"] for r in rows})
        buckets = sorted({tuple(r["positions"]) for r in rows})
        lines = ["| position in document | " + " | ".join(_length_label(n, trained_length) for n in lengths) + " |",
                 "|---" * (len(lengths) + 1) + "|"]
        for lo, hi in buckets:
            cell = {r["length"]: r["loss"] for r in rows if tuple(r["positions"]) == (lo, hi)}
            lines.append(f"| {lo}" + (f"-{hi - 1}" if hi - 1 > lo else "") + " | "
                         + " | ".join(f"{cell[n]:.3f}" if n in cell else "-" for n in lengths) + " |")
        out.append("\n".join(lines) + "\n\nmean loss of the tokens predicted at each position within their document.")
    return "\n\n".join(out) + "\n"


def draw(results: list[dict], out_dir: Path, trained_length: Optional[int]) -> list[Path]:
    """The pictures of `results` in out_dir (PNG): ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in ("niah", "niah-multikey"):
        rows = [r for r in results if r["task"] == task]
        if rows:
            paths.append(_heatmap(plt, rows, out_dir / f"long_eval_{task}.png", task, trained_length))
    rows = [r for r in results if r["task"] == "passkey"]
    if rows:
        paths.append(_passkey(plt, rows, out_dir / "long_eval_passkey.png", trained_length))
    rows = [r for r in results if r["task"] == "position-loss"]
    if rows:
        paths.append(_position(plt, rows, out_dir / "long_eval_position_loss.png", trained_length))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def _heatmap(plt, rows: list[dict], path: Path, task: str, trained: Optional[int]) -> Path:
    lengths, depths = sorted({r["length"] for r in rows}), sorted({r["depth"] for r in rows})
    grid = [[next((r["accuracy"] for r in rows if r["length"] == n and r["depth"] == d), float("nan"))
             for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.5 + 0.45 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n}*" if trained and n > trained else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    note = f" (* past the trained {trained})" if trained and any(n > trained for n in lengths) else ""
    ax.set(xlabel=f"length (tokens){note}", ylabel="needle depth", title=f"{task}: accuracy")
    fig.colorbar(image, ax=ax)
    return _save(plt, fig, path)


def _passkey(plt, rows: list[dict], path: Path, trained: Optional[int]) -> Path:
    lengths = sorted({r["length"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({r["depth"] for r in rows}):
        pts = sorted((r["length"], r["accuracy"]) for r in rows if r["depth"] == d)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", alpha=0.4, lw=1, label=f"depth {d:g}")
    mean = [sum(r["accuracy"] * r["samples"] for r in rows if r["length"] == n)
            / sum(r["samples"] for r in rows if r["length"] == n) for n in lengths]
    ax.plot(lengths, mean, "o-", color="black", lw=2, label="mean")
    if trained is not None and lengths[-1] > trained:
        ax.axvline(trained, color="gray", ls="--", lw=1, label=f"trained length {trained}")
    ax.set(xlabel="length (tokens)", ylabel="accuracy", title="passkey retrieval", ylim=(-0.03, 1.03))
    if len(lengths) > 1 and lengths[-1] / lengths[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _position(plt, rows: list[dict], path: Path, trained: Optional[int]) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["length"] for r in rows}):
        pts = sorted((max(r["positions"][0], 0.5), r["loss"]) for r in rows if r["length"] == n)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=_length_label(n, trained))
    ax.set_xscale("log", base=2)
    ax.set(xlabel="position within the document (bucket start; 0 drawn at 0.5)", ylabel="loss",
           title="loss by position")
    ax.legend(title="length", fontsize=7)
    return _save(plt, fig, path)
