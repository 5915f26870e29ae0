"""The run directory at start-up: the run and checkpoint directories are checked writable before any
step is trained, and each start of a run leaves a mark in metrics.jsonl.

metrics.jsonl holds one JSON object per line: logged steps ({"step", "tokens", "loss", ...}; tokens: those
trained on so far), validations ({"step", "val_loss"}) and, first thing each time the run starts or resumes,
    {"event": "start", "run": 3, "step": 40, "tokens": 163840, "resumed_from": ".../step_0000040",
     "layout": {"tp": 2, "sp": 2, "pp": 1, "dp": 1}, "time": "..."}
The records after a start mark belong to that run. A run that resumed from a checkpoint older than
the last logged step logs those steps again: the later records (after the later mark) supersede the
earlier ones for every step from the mark's `step` on.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Optional

from megalysses.config import ConfigError


def check_writable(path: Path, what: str) -> None:
    """Create directory `path` if needed and write a file in it; ConfigError naming `what` otherwise."""
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{what}={path} is a symbolic link to {os.readlink(path)}, which does not exist: "
                          f"create its target or choose another directory")
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                where = "is not a directory" if parent == path else f"lies below {parent}, which is not a directory"
                raise ConfigError(f"{what}={path} {where}: give a directory")
            break
    probe = path / f".write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what}={path} is not writable ({e.strerror or e}): choose a directory this user "
                          f"can write to") from None


def mark_start(run_dir: Path, step: int, resumed_from: Optional[Path], tokens: int = 0,
               layout: Optional[dict] = None) -> None:
    """Append the start mark of this run to <run_dir>/metrics.jsonl (rank 0): the step and tokens trained
    before it, the checkpoint it resumed from, its layout."""
    path = run_dir / "metrics.jsonl"
    runs = 0
    if path.is_file():
        with open(path, "rb") as f:
            runs = sum(b'"event": "start"' in line for line in f)
    rec = {"event": "start", "run": runs + 1, "step": step, "tokens": tokens,
           "resumed_from": None if resumed_from is None else str(resumed_from), "layout": layout,
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
