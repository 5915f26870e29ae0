"""What the scripts in benchmarks/ share: where their results go, and running work in a process of its own
within a time bound.

    add_output_args(parser)                   # --out-dir DIR | --record; neither: the script only prints
    folder = output_dir(parser, args)         # None (print only), the --out-dir, or benchmarks/results/
    write_text(folder, "x.json", text)        # atomically (a run stopped while writing keeps the old file)
    done = run_bounded(cmd, timeout=60.0)     # at the timeout the process and all it started are killed
    done.returncode, done.stdout, done.timed_out

A benchmark writes files only where it is told to: into an --out-dir it is given, or, with --record, into
benchmarks/results/, the results kept in git. By default it prints its tables and writes nothing.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def add_output_args(p: argparse.ArgumentParser, name: Optional[str] = None) -> None:
    """--out-dir DIR or --record (not both); with `name`, also --name STEM for the file name (default `name`)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out-dir", type=Path, default=None,
                       help="write the result files into this folder (default: print only, write nothing)")
    where.add_argument("--record", action="store_true",
                       help="write them into benchmarks/results/, the recorded results (commit them with the machine "
                            "they ran on)")
    if name is not None:
        p.add_argument("--name", default=None, help=f"the result file's name without extension (default {name})")


def output_dir(p: argparse.ArgumentParser, args: argparse.Namespace, smoke: bool = False) -> Optional[Path]:
    """Where this run writes: None (print only), its --out-dir, or benchmarks/results/ with --record. A smoke
    run (a tiny shape that checks the harness) is refused --record: its numbers are not results."""
    if args.record and smoke:
        p.error("--record keeps real measurements: a --smoke run writes into an --out-dir, or only prints")
    return RESULTS if args.record else args.out_dir


def write_text(folder: Path, name: str, text: str) -> Path:
    """Write `folder/name` in one step: a run stopped while writing leaves the previous file whole."""
    return write_bytes(folder, name, text.encode())


def write_bytes(folder: Path, name: str, data: bytes) -> Path:
    """write_text's binary twin (a benchmark's own inputs in its work folder, e.g. a checkpoint's metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / name
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


def child_env(**extra: str) -> dict:
    """The environment for a child process: this one, with the repository first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class Finished:
    returncode: Optional[int]          # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def last_line(self) -> str:
        """The last non-empty line of stderr, else of stdout: usually what went wrong."""
        for text in (self.stderr, self.stdout):
            lines = [x for x in text.strip().splitlines() if x.strip()]
            if lines:
                return lines[-1].strip()
        return "no output"


PIPE_GRACE_S = 10.0     # after the kill, how long the pipes may stay open (a process that left the group)


def run_bounded(cmd: Sequence[str], timeout: Optional[float], env: Optional[dict] = None,
                cwd: Optional[Path] = None) -> Finished:
    """Run `cmd` with its output captured; at `timeout` seconds (None: no limit) kill it and everything it
    started (it runs in a session of its own: pytest's ranks, compile workers), keeping the output it had
    written. A hang or a crash of the child never takes the caller down; Ctrl-C or SIGTERM in the caller (as
    an exception) kills the child too."""
    start = time.monotonic()
    p = subprocess.Popen(list(cmd), cwd=cwd or ROOT, env=env if env is not None else child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=None if timeout is None else max(timeout, 0.01))
        code: Optional[int] = p.returncode
    except subprocess.TimeoutExpired:
        _kill_group(p)
        try:
            out, err = p.communicate(timeout=PIPE_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = "", "its output pipes stayed open after the kill"
        code = None
    except BaseException:
        _kill_group(p)
        p.wait()
        raise
    return Finished(code, out or "", err or "", time.monotonic() - start)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def source_commit() -> str | None:
    """The short git commit of the megalysses checkout this runs from (benchmarks record it with their
    results); None outside a git checkout or without git."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out or None
