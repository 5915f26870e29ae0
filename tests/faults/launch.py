"""Helpers for the fault tests that run pretrain under torchrun: the command, its worker processes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1", "logging.log_interval=1",
        "optimizer.warmup_steps=1"]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_cmd(nproc: int, overrides: list[str], *torchrun_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *torchrun_args, str(ROOT / "pretrain.py")] + sets(overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_steps(run: Path, proc: subprocess.Popen, n: int = 1, timeout: float = 120) -> None:
    """Until metrics.jsonl has `n` logged steps (the workers are training)."""
    deadline = time.monotonic() + timeout
    path = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count('"loss"') >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before training: {proc.communicate()[0]}")
        time.sleep(0.1)
    raise AssertionError(f"no training step logged in {timeout} s")


def processes_of(run: Path) -> dict[int, dict]:
    """Live processes whose command line names `run` (unique to one test): {pid: environ subset}."""
    out = {}
    needle = str(run).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle not in (d / "cmdline").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            env = dict(e.split("=", 1) for e in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in e)
            out[int(d.name)] = {"RANK": env.get("RANK"), "is_worker": "RANK" in env}
        except OSError:
            continue
    return out


def workers_of(run: Path) -> dict[int, int]:
    """{rank: pid} of the training processes of `run`."""
    return {int(info["RANK"]): pid for pid, info in processes_of(run).items() if info["is_worker"]}


def gone(run: Path, timeout: float = 20) -> bool:
    """Whether every process of `run` has ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not processes_of(run)


def kill_all(run: Path) -> None:
    """Clean-up after a failed test: SIGKILL whatever of `run` is left."""
    for pid in processes_of(run):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]
