"""The torch profiler over a window of training steps on chosen ranks (the config section `profile`).

    profiler = StepProfiler(cfg.profile, rank, run_dir, device, watchdog)
    with profiler.step(n):          # around training step n (counted from 1, as the log lines count)
        train_step(...)
    profiler.close()                # a run that stops inside the window writes what was recorded

A profiled rank records steps profile.start_step to profile.end_step, each under a "step N" range; the step
before them runs under the profiler unrecorded (Megatron-LM's warm-up step), so the profiler's own start-up
is not in the trace. After the last one it writes one Chrome trace,
<run_dir>/profile/rank<R>.steps<first>-<last>.pt.trace.json, whose `traceEvents` hold the CPU operators and,
on a GPU, the CUDA kernels and copies: Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's
profiler plugin (`tensorboard --logdir <run_dir>/profile`) open it.

Profiled ranks run slower, the other ranks wait for them in collectives, and the trace is written while
they wait; so every rank, profiled or not, gives the watchdog PROFILE_ALLOWANCE times
parallel.timeout_seconds from the warm-up step until the step after the window starts.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from megalysses.config import ProfileConfig
from megalysses.training.watchdog import Watchdog

PROFILE_ALLOWANCE = 3.0


class StepProfiler:
    """torch.profiler over the steps of `cfg` on this rank when it is one of cfg.ranks; the watchdog's
    allowance on every rank."""

    def __init__(self, cfg: ProfileConfig, rank: int, run_dir: Path, device: torch.device,
                 watchdog: Optional[Watchdog] = None) -> None:
        self.window = None if cfg.start_step is None else (cfg.start_step, cfg.end_step)
        self.rank, self.out_dir, self.device, self.watchdog = rank, Path(run_dir) / "profile", device, watchdog
        self.profiled = self.window is not None and rank in cfg.ranks
        self.prof: Optional[torch.profiler.profile] = None
        self.first = self.last = None         # the steps recorded so far
        self.done = False
        self.written: Optional[Path] = None

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        if self.window is None:
            yield
            return
        start, end = self.window
        if self.watchdog is not None:
            self.watchdog.allow(PROFILE_ALLOWANCE if start - 1 <= n <= end else 1.0)
        if self.profiled and self.prof is None and not self.done and start - 1 <= n <= end:
            self._start(n)
        if self.prof is None or n < start:
            yield
        else:
            with torch.profiler.record_function(f"step {n}"):
                yield
            self.first, self.last = self.first or n, n
        if self.prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)      # the step's kernels end inside the trace
            self.prof.step()                             # after the last recorded step: writes the trace
            if n >= end:
                self.close()

    def _start(self, n: int) -> None:
        """Profile from step n: a warm-up step when n is before the window, then the window's steps."""
        start, end = self.window
        first = max(n, start)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities, on_trace_ready=self._write,
            schedule=torch.profiler.schedule(wait=0, warmup=int(n < start), active=end - first + 1, repeat=1))
        self.prof.start()

    def _write(self, prof: torch.profiler.profile) -> None:
        if self.first is None:
            return
        name = f"rank{self.rank}.steps{self.first}-{self.last}.pt.trace.json"
        if self.watchdog is not None:
            self.watchdog.doing(f"writing the profiler trace of steps {self.first}-{self.last} ({name})")
        t0 = time.monotonic()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".{name}.tmp-{os.getpid()}"
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, self.out_dir / name)
        self.written = self.out_dir / name
        print(f"profile: rank {self.rank} wrote {self.written} (steps {self.first}-{self.last}, "
              f"{self.written.stat().st_size / 1e6:.1f} MB, {time.monotonic() - t0:.1f} s)", flush=True)

    def close(self) -> None:
        """Stop profiling; the steps recorded so far are written (a run that stopped inside the window)."""
        prof, self.prof = self.prof, None
        if prof is not None:
            self.done = True
            prof.stop()
