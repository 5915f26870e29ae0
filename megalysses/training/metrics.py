"""Throughput accounting (tokens/s, MFU by megalysses.plan.flops), the rank-0 log line, metrics.jsonl,
optional wandb and TensorBoard; the steps' figures kept on the device between logging steps (StepTally) and
read back once on each, with every rank's busy time (training/step.py BusyClock) to name a straggler."""
from __future__ import annotations

import json
import math
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megalysses import accelerator, comm
from megalysses.config import Config
from megalysses.distributed import is_rank0, print0
from megalysses.plan.flops import flops_per_token, peak_tflops

def peak_for(configured: float, device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The peak MFU is measured against on `device` (plan.flops.peak_tflops with the device's GPU name)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return peak_tflops(configured, gpu, str(dtype).removeprefix("torch."))


@dataclass
class ReadBack:
    """What a logging step reads back: the step's loss, token count and gradient norm, the steps since the
    previous read-back whose loss or norm was not finite (the first of them), the last finite loss among
    them (NaN if none), and the stop flags every rank agreed on (a signal, training.max_wall_minutes)."""

    loss: float
    tokens: float
    grad_norm: float
    not_finite: int
    first_not_finite: int
    last_finite_loss: float
    stop: tuple[bool, ...]
    busy: tuple[float, ...] = ()
    """Every rank's busy seconds a step since the previous read-back, by rank (training/step.py BusyClock; empty
    when nothing was measured)."""


def rank_hosts() -> list[str]:
    """Every rank's host name, by rank (one gather at the start of training: a straggler is named with its host)."""
    here = socket.gethostname()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [here]
    hosts: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, here)
    return [str(h) for h in hosts]


@dataclass
class Spread:
    """The ranks' busy seconds a step over a log interval (training/step.py BusyClock), by rank, and the rank that
    kept the others waiting longest: the one furthest above the median of the other ranks of its pipeline stage
    (`stage_ranks` consecutive ranks a stage; a pipeline's stages differ by their place in the schedule, not by
    speed)."""

    busy: tuple[float, ...]
    stage_ranks: int = 0
    median: float = field(init=False)
    slowest: int = field(init=False)
    late: float = field(init=False)
    lone: bool = field(init=False)

    def __post_init__(self) -> None:
        n = self.stage_ranks or len(self.busy)
        self.median, self.lone = statistics.median(self.busy), n < 2
        if self.lone:
            self.slowest, self.late = max(range(len(self.busy)), key=lambda r: self.busy[r]), 0.0
            return
        others = [statistics.median(self.busy[q] for q in range(r - r % n, r - r % n + n) if q != r)
                  for r in range(len(self.busy))]
        self.slowest = max(range(len(self.busy)), key=lambda r: self.busy[r] - others[r])
        self.late = self.busy[self.slowest] - others[self.slowest]

    def fields(self) -> dict[str, float]:
        """What metrics.jsonl carries of it."""
        return {"busy_s_min": min(self.busy), "busy_s_median": self.median, "busy_s_max": max(self.busy),
                "busy_slowest_rank": self.slowest}

    def warning(self, step_time: float, fraction: float, hosts: list[str]) -> Optional[str]:
        """The one line naming the slowest rank when the others waited for it more than `fraction` of a step
        (logging.straggler_warn_fraction; 0: never), else None."""
        if fraction <= 0 or self.lone or self.late <= fraction * step_time:
            return None
        r = self.slowest
        host = hosts[r] if r < len(hosts) else "?"
        return (f"warning: rank {r} (host {host}) is a straggler: busy {self.busy[r]:.3f} s a step between its "
                f"blocking collectives, the others' median {self.busy[r] - self.late:.3f} s; they waited "
                f"{self.late:.3f} s a step for it, {self.late / step_time:.0%} of the step time {step_time:.3f} s "
                f"(logging.straggler_warn_fraction={fraction})")


class StepTally:
    """The steps' figures on the device between two read-backs. `add` takes a step's (training/step.py
    StepResult.figures) without a host synchronisation; `read` all-reduces this rank's stop flags over every
    rank and reads everything back in one copy, the logging step's one synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.figures = torch.full((4,), math.nan, dtype=torch.float64, device=device)
        self._clear()

    def _clear(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.not_finite, self.first, self.last_finite = zero, zero.clone(), torch.full_like(zero, math.nan)

    def add(self, figures: Tensor, step: int) -> None:
        """Step `step`'s figures: [loss, tokens, gradient norm, not finite]."""
        bad = figures[3]
        self.first = torch.where((bad > 0) & (self.first == 0), float(step), self.first)
        self.not_finite = self.not_finite + bad
        self.last_finite = torch.where(torch.isfinite(figures[0]), figures[0], self.last_finite)
        self.figures = figures

    def read(self, flags: tuple[bool, ...], busy: Optional[float] = None) -> ReadBack:
        """Agree on the stop `flags` (any rank's) and gather every rank's `busy` seconds (BusyClock.take) in the
        same all-reduce (a maximum: this rank's slot holds 1 + its seconds, every other slot 0, so that a slot
        left at 0 means not measured), and read the tally back; it starts again from nothing."""
        group = comm.world()
        shared = torch.zeros(len(flags) + comm.group_size(group), dtype=torch.float64, device=self.device)
        for i, f in enumerate(flags):       # filled on the device (no copy that would wait for it)
            shared[i] = float(f)
        if busy is not None:
            shared[len(flags) + comm.group_rank(group)] = 1.0 + busy
        comm.all_reduce_(shared, group, op="max")
        tally = torch.stack([self.not_finite, self.first, self.last_finite])
        values = accelerator.read_back(torch.cat([self.figures, tally, shared]))
        self._clear()
        loss, tokens, norm, _, bad, first, last = values[:7]
        stop, slots = values[7:7 + len(flags)], values[7 + len(flags):]
        measured = tuple(v - 1.0 for v in slots) if all(v > 0 for v in slots) else ()
        return ReadBack(loss, tokens, norm, int(bad), int(first), last, tuple(v > 0 for v in stop), measured)


class MetricsLogger:
    """Rank 0 writes one JSON object per logged step to <run_dir>/metrics.jsonl, prints a line, and
    mirrors the same scalars, under the same names, to wandb and to TensorBoard event files in
    logging.tensorboard_dir (<run_dir>/tensorboard) when enabled."""

    def __init__(self, cfg: Config, run_dir: Path, world: int, device: torch.device, total_steps: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.cfg, self.world, self.device, self.total = cfg, world, device, total_steps
        self.peak = peak_for(cfg.logging.peak_tflops, device, dtype)
        self.path = run_dir / "metrics.jsonl"
        self.wandb = self.tensorboard = None
        self.tokens_seen: Optional[int] = None
        self.t_last, self.tokens_since, self.flops_since, self.steps_since = time.perf_counter(), 0, 0.0, 0
        self.extra: dict[str, float] = {}
        self.spread: Optional[Spread] = None
        self.hosts: list[str] = []          # by rank, to name a straggler's host (rank_hosts)
        self.stage_ranks = world            # the ranks of a pipeline stage (the loop sets it from its grid)
        self.warm = False                   # past the first logged step (warm-up: no straggler warning)
        if is_rank0():
            run_dir.mkdir(parents=True, exist_ok=True)
            if cfg.logging.wandb_mode != "disabled":
                import wandb  # the `wandb` extra

                self.wandb = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                                        dir=str(run_dir), config=_flatten(cfg))
            if cfg.logging.tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # the `tensorboard` extra

                self.tensorboard = SummaryWriter(log_dir=cfg.logging.tensorboard_dir or str(run_dir / "tensorboard"))

    def due(self, step: int) -> bool:
        """Whether step `step` is a logging step: every logging.log_interval steps, and the last."""
        return step % self.cfg.logging.log_interval == 0 or step == self.total

    def note(self, **scalars: float) -> None:
        """Scalars to log with the next logged step (skipped steps, optimizer updates)."""
        self.extra.update(scalars)

    def note_busy(self, busy: tuple[float, ...]) -> None:
        """Every rank's busy seconds a step over this log interval (ReadBack.busy; empty: none measured): their
        spread goes to the next logged step, with a warning naming the slowest rank when it kept the others
        waiting (Spread.warning; not on the run's first logged step: its warm-up, first allocations and lazy
        initialisation, varies from rank to rank)."""
        self.spread = Spread(busy, self.stage_ranks) if busy else None

    def step(self, step: int, loss: Optional[float], lr: float, grad_norm: Optional[float], tokens: int,
             seq_len: int, force: bool = False, tokens_seen: Optional[int] = None) -> None:
        """Account one optimizer step of `tokens` tokens in sequences of `seq_len`; log every log_interval
        (`loss` and `grad_norm` are read back on those steps only: None on the others).
        `tokens_seen`: the tokens trained on by the end of this step, since step 1."""
        self.tokens_since += tokens
        self.tokens_seen = tokens_seen
        self.flops_since += tokens * flops_per_token(self.cfg.model, seq_len)
        self.steps_since += 1
        if not (force or self.due(step)):
            return
        now = time.perf_counter()
        dt = max(now - self.t_last, 1e-9)
        tok_s = self.tokens_since / dt
        tflops = self.flops_since / dt / self.world / 1e12
        rec = {"step": step, **({"tokens": tokens_seen} if tokens_seen is not None else {}), "seq_len": seq_len,
               "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / self.world, "tflops_per_device": tflops,
               "mfu": tflops / self.peak if self.peak else None, "step_time_s": dt / self.steps_since,
               "peak_mem_gib": _peak_mem(self.device), **self.extra,
               **(self.spread.fields() if self.spread is not None else {})}
        spread, self.extra, self.spread = self.spread, {}, None
        eta = (self.total - step) * dt / self.steps_since
        self.t_last, self.tokens_since, self.flops_since, self.steps_since = now, 0, 0.0, 0
        self._emit(rec)
        mfu = f"{100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else "-"
        mem = f"{rec['peak_mem_gib']:.1f}GiB"
        print0(f"step {step:>6}/{self.total} | seq {seq_len} | loss {loss:.4f} | lr {lr:.2e} | "
               f"gnorm {grad_norm:.3f} | tok/s {tok_s:,.0f} ({tok_s / self.world:,.0f}/dev) | "
               f"{tflops:.2f} TFLOP/s/dev | MFU {mfu} | mem {mem} | ETA {_hms(eta)}")
        warning = spread and self.warm and spread.warning(rec["step_time_s"], self.cfg.logging.straggler_warn_fraction,
                                                          self.hosts)
        if warning:
            print0(warning)
        self.warm = True

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (validation, checkpointing) out of the next throughput measurement."""
        self.t_last += seconds

    def eval(self, step: int, loss: float) -> None:
        self._emit({"step": step, **({"tokens": self.tokens_seen} if self.tokens_seen is not None else {}),
                    "val_loss": loss})
        print0(f"step {step:>6}/{self.total} | validation loss {loss:.4f}")

    def long_eval(self, step: int, figures: dict[str, float]) -> None:
        """The long-context figures (training/long_eval.scalars: long_eval/<task>/<length>, ...)."""
        self._emit({"step": step, **figures})
        acc = [f"{k.removeprefix('long_eval/')} {v:.0%}" for k, v in figures.items() if "position-loss" not in k]
        pos = sorted({k.split("/")[2] for k in figures if "position-loss" in k}, key=int)
        for n in pos:
            losses = [v for k, v in figures.items() if k.startswith(f"long_eval/position-loss/{n}/")]
            acc.append(f"position-loss/{n} {losses[0]:.3f} -> {losses[-1]:.3f}")
        print0(f"step {step:>6}/{self.total} | long context: {', '.join(acc)}")

    def _emit(self, rec: dict) -> None:
        if not is_rank0():
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        scalars = {k: v for k, v in rec.items() if k != "step" and v is not None}
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, global_step=rec["step"])
            self.tensorboard.flush()   # a preempted or killed run keeps what it logged

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _peak_mem(device: torch.device) -> float:
    """Peak GPU memory allocated, or the peak resident memory of the process on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _flatten(cfg: Config) -> dict:
    import dataclasses

    return {f"{sec}.{k}": v for sec, d in dataclasses.asdict(cfg).items() for k, v in d.items()}
