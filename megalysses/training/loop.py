"""The training loop: build, resume, step, validate, checkpoint, stop cleanly.

Stops at training.train_steps, at training.max_wall_minutes (with a checkpoint), or on SIGTERM /
SIGUSR1 (preemption: checkpoint, then exit 0). An ordinary step reads nothing back to the host; a logging
step (every logging.log_interval steps, and the last) reads its figures back once: the loss, token count and
gradient norm, the steps since the last one whose loss or norm was not finite (skipped, or with
training.nan_policy=abort the run stopped naming the first), and the stop flags, which every rank agrees on
through one small all-reduce there, so no rank is left waiting in a collective; the same all-reduce brings every
rank's busy time to rank 0, which names a straggler (training/step.py BusyClock). A signal or the wall-clock
limit therefore stops the run at the next logging step. A save reads the figures back too (counted apart).
With a watchdog, the loop tells it what it is doing, so that a stuck rank is named with what it was doing.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megalysses import accelerator
from megalysses.checkpoint.background import BackgroundSaver
from megalysses.checkpoint.dcp_io import save_checkpoint
from megalysses.checkpoint.initial import is_weights_only
from megalysses.checkpoint.manifest import CheckpointError, choose_checkpoint
from megalysses.config import Config
from megalysses.config.checks import check_logging_backends
from megalysses.config.io import save_config
from megalysses.config.batch_schedule import batch_line
from megalysses.distributed import on_rank0, print0
from megalysses.grid import ParallelGrid
from megalysses.kernels.attention import reserve_compiles
from megalysses.memory import GIB
from megalysses.memory.host import STAGING, arena_bytes
from megalysses.plan.memory import pinned_requests_of
from megalysses.model.gpt import architecture
from megalysses.plan import RunPlan
from megalysses.plan.flops import peak_tflops
from megalysses.plan.search import check_host_memory, check_activity_time
from megalysses.training.build import Parts, Run, build_run
from megalysses.training.long_eval import TrainingLongEval, scalars
from megalysses.training.metrics import MetricsLogger, ReadBack, StepTally, rank_hosts
from megalysses.training.profiler import StepProfiler
from megalysses.training.rundir import check_writable, mark_start
from megalysses.training.runtime import flex_compile_budget, startup_line, write_runtime
from megalysses.training.schedule import lr_at, lr_progress
from megalysses.training.signals import StopSignals
from megalysses.training.step import BusyClock, NonFiniteLossError, evaluate, train_step
from megalysses.training.watchdog import Watchdog


def phase_line(cfg: Config, step: int) -> str:
    """The curriculum's phase that the step after `step` completed steps trains in, in words."""
    d = cfg.data
    phase = max(i for i, (from_step, _) in enumerate(d.seq_len_schedule) if from_step <= step)
    length = d.seq_len_schedule[phase][1]
    pieces = (f"each sample of {d.seq_len} tokens cut into {d.seq_len // length} sequences"
              if length < d.seq_len else "whole samples")
    return (f"seq_len {length} from step {step + 1} (phase {phase + 1} of {len(d.seq_len_schedule)} of "
            f"data.seq_len_schedule: {pieces})")


def _prepare_dirs(cfg: Config, run_dir: Path, ckpt_dir: Path) -> None:
    """Rank 0: both directories writable before anything is trained."""
    check_writable(run_dir, "logging.run_dir")
    check_writable(ckpt_dir, "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint.dir (<run_dir>/checkpoints)")
    if cfg.logging.tensorboard and cfg.logging.tensorboard_dir:
        check_writable(Path(cfg.logging.tensorboard_dir), "logging.tensorboard_dir")


def train(cfg: Config, plan: RunPlan, grid: ParallelGrid, device: torch.device, signals: Optional[StopSignals] = None,
          watchdog: Optional[Watchdog] = None, dry_run: bool = False) -> dict:
    """Run training to the end (or a stop); returns a summary {step, loss, stopped_by}.

    `plan` is the plan of this run on this machine, resolved where the process started; `grid` lays it out.
    `signals` carries signals received before training started (the entry point creates it first thing);
    `watchdog` is told what the loop does. `dry_run`: the start-up path only, up to step 1: the model and
    optimizer are built (on the meta device for a described machine) and checked against the plan,
    runtime.json is written, and nothing is read or trained."""
    run_dir = Path(cfg.logging.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    doing = watchdog.doing if watchdog is not None else (lambda what: None)
    _start_up(cfg, plan, grid, device, ckpt_dir, watchdog is not None or dry_run, doing)
    path, initial = (None, None) if dry_run else _checkpoint_to_load(cfg, ckpt_dir, doing)
    if path is None and initial is None and not dry_run:      # the others say it as they load
        print0(f"initial weights: random (seed {cfg.training.seed})")
    doing("checking the long-context evaluation")
    long_eval = TrainingLongEval(cfg, grid, device, plan) if cfg.long_eval.interval and not dry_run else None
    run = build_run(cfg, plan, grid, device, Parts(initial=initial, data=not dry_run, resume=path), doing,
                    grid.device_mesh(device))
    if dry_run:
        on_rank0(lambda: write_runtime(run_dir, cfg, grid, plan))
        return {"step": 0, "loss": float("nan"), "stopped_by": "dry_run"}
    progress = run.progress
    if progress.step >= cfg.training.train_steps:
        return {"step": progress.step, "loss": progress.loss, "stopped_by": "already_finished"}

    # the run's config (what tools/generate.py and the converter read) only once this one has passed every
    # check, loaded its checkpoint and made the saver's process group: a launch that fails leaves the run as it was
    def start_run() -> None:
        save_config(cfg, run_dir / "config.yaml")
        write_runtime(run_dir, cfg, grid, plan)
        mark_start(run_dir, progress.step, path, progress.consumed * cfg.data.seq_len,
                   grid.degrees.summary())

    loop = TrainingLoop(run, long_eval, ckpt_dir, doing)
    on_rank0(start_run)
    return loop(signals, watchdog)


def _start_up(cfg: Config, plan: RunPlan, grid: ParallelGrid, device: torch.device, ckpt_dir: Path,
              check_time: bool, doing: Callable[[str], None]) -> None:
    """The checks before anything is built: the directories writable (rank 0), the logging backends, the
    longest activity's time against the watchdog (`check_time`), this node's host memory; then the start-up line.
    (That the grid splits sp as the plan does is checked with the built model: build_run's check_built.)"""
    doing("checking the run directory")
    on_rank0(lambda: _prepare_dirs(cfg, Path(cfg.logging.run_dir), ckpt_dir))
    check_logging_backends(cfg)
    if check_time:                           # the machine's GPU's peak, or logging.peak_tflops
        check_activity_time(cfg, plan, peak_tflops(cfg.logging.peak_tflops, plan.machine.gpu, plan.dtype))
    if plan.machine.host_memory_gib is not None:    # the node's, where the machine knows it (a described one not)
        check_host_memory(cfg, plan, plan.machine.host_memory_gib * GIB)
    if plan.attention == "flex" and device.type == "cuda":
        reserve_compiles(flex_compile_budget(plan))
    print0(startup_line(cfg, grid, plan))


def _checkpoint_to_load(cfg: Config, ckpt_dir: Path, doing: Callable[[str], None]
                        ) -> tuple[Optional[Path], Optional[str | Path]]:
    """(the checkpoint to resume, the weights to start from): weights without optimizer state (a converted
    model) start the run; so does checkpoint.init_from when there is no checkpoint of this run to resume."""
    source = ckpt_dir if cfg.checkpoint.load == "auto" else cfg.checkpoint.load
    path = None
    if source is not None:
        doing(f"verifying the checkpoints in {source}")
        path = choose_checkpoint(source, explicit=cfg.checkpoint.load != "auto", fallback=cfg.checkpoint.fallback)
    if path is not None and is_weights_only(path):
        return None, path
    return path, None if path else cfg.checkpoint.init_from


def background_saver(cfg: Config, plan: RunPlan, grid: ParallelGrid, device: torch.device) -> BackgroundSaver:
    """What writes this rank's checkpoints in the background (checkpoint.async_save): its staging arena as the plan
    sizes it, and its process group, made while the launcher's store is there (a stop signal from a launcher that
    died still gets its checkpoint)."""
    staging = [r for r in pinned_requests_of(cfg, plan, grid.pp_rank) if r.owner == STAGING]
    return BackgroundSaver(arena_bytes(staging), device, cfg.parallel.timeout_seconds,
                           f"checkpoint staging: {sum(r.count for r in staging)} tensors")


class TrainingLoop:
    """The steps of a built run, from `progress` to training.train_steps or a stop: each step's batch, its
    validation, long-context evaluation and checkpoint when due, and the stop every rank agrees on."""

    def __init__(self, run: Run, long_eval: Optional[TrainingLongEval], ckpt_dir: Path,
                 doing: Callable[[str], None]) -> None:
        self.cfg, self.grid, self.device, self.plan = run.cfg, run.grid, run.device, run.plan
        self.model, self.opt, self.mesh, self.data, self.long_eval = run.model, run.opt, run.mesh, run.data, long_eval
        self.progress, self.ckpt_dir, self.doing = run.progress, ckpt_dir, doing
        self.saver = background_saver(run.cfg, run.plan, run.grid, run.device) if run.plan.async_save else None

    def __call__(self, signals: Optional[StopSignals], watchdog: Optional[Watchdog]) -> dict:
        cfg, p, doing = self.cfg, self.progress, self.doing
        run_dir, total = Path(cfg.logging.run_dir), cfg.training.train_steps
        self.logger = MetricsLogger(cfg, run_dir, self.grid.world, self.device, total, self.plan.torch_dtype)
        self.logger.hosts, self.busy = rank_hosts(), BusyClock(self.device)
        self.logger.stage_ranks = self.grid.world // self.grid.pp_size
        profiler = StepProfiler(cfg.profile, self.grid.rank, run_dir, self.device, watchdog)
        flags = signals or StopSignals()
        start = time.monotonic()
        self.tally, self.read_at, self.wall = StepTally(self.device), p.step, (flags, start)
        stopped_by = "train_steps"
        batches = self.data.train_batches(p.consumed)
        first_step, saved_at, first_updates = p.step, p.step, p.updates
        seq_len, samples = 0, 0
        try:
            while p.step < total:
                lr = lr_at(p.step, cfg.optimizer, total, lr_progress(cfg.training, p.step, p.consumed))
                phase_len = self.plan.train_phase(p.step).seq_len
                if phase_len != seq_len:
                    seq_len = phase_len
                    if cfg.data.seq_len_schedule:
                        print0(phase_line(cfg, p.step))
                doing(f"reading the batch of step {p.step + 1}")
                batch = next(batches)
                if len(batch) * self.plan.samples_per_micro_batch != samples:   # a ramp grows the global batch
                    samples = len(batch) * self.plan.samples_per_micro_batch
                    if self.data.batch_sizes.ramped:
                        print0(batch_line(p.step, samples, self.data.batch_sizes, self.plan.samples_per_micro_batch))
                doing(f"training step {p.step + 1}")
                with profiler.step(p.step + 1), self.busy.measuring():
                    result = train_step(self.model, self.opt, batch, self.grid, lr=lr,
                                        grad_clip=cfg.optimizer.grad_clip, dtype=self.plan.torch_dtype,
                                        nan_policy=cfg.training.nan_policy)
                    self.busy.start()            # its last collective left, with every rank
                p.step += 1
                p.consumed += samples
                self.tally.add(result.figures, p.step)
                back = self._read_back() if self.logger.due(p.step) else None
                # throughput counts every token processed (masked labels included), as the FLOPs do
                self.logger.step(p.step, back and back.loss, lr, back and back.grad_norm, samples * cfg.data.seq_len,
                                 seq_len, tokens_seen=p.consumed * cfg.data.seq_len)
                if self._after_step():
                    saved_at = p.step
                stopped_by = self._stop(back)
                if stopped_by != "train_steps":
                    break
            self._settle("save")
            if p.updates == first_updates and p.step > first_step and stopped_by != "signal":
                raise NonFiniteLossError(f"every step of this run (steps {first_step + 1} to {p.step}) was skipped: "
                                         f"the loss or the gradient norm was never finite, so nothing was learned; "
                                         f"lower optimizer.lr or check the data")
            if p.step > first_step and saved_at != p.step:
                with accelerator.host_wait("save"):
                    self.save()
            with accelerator.host_wait("save"):
                self.finish_saves()
            if stopped_by != "train_steps":
                print0(f"stopped at step {p.step} ({stopped_by}); checkpoint saved to {self.ckpt_dir}")
        finally:
            self.finish_saves(quiet=True)
            profiler.close()
            if signals is None:
                flags.restore()
            self.logger.close()
        return {"step": p.step, "loss": p.loss, "stopped_by": stopped_by}

    def _after_step(self) -> bool:
        """Validation, long-context evaluation and a checkpoint where due (their time kept out of tokens/s);
        whether a checkpoint was saved."""
        cfg, step = self.cfg, self.progress.step
        t0 = time.perf_counter()
        evaluated = bool(cfg.training.eval_interval) and step % cfg.training.eval_interval == 0
        with accelerator.host_wait("evaluation"):
            if evaluated:
                self.doing(f"validating at step {step}")
                loss = evaluate(self.model, self.data.valid_batches(), self.grid, self.plan.torch_dtype)
                self.logger.eval(step, loss)
            if self.long_eval is not None and self.long_eval.due(step):
                evaluated = True
                self.logger.long_eval(step, scalars(self.long_eval(self.model, step, self.doing)))
        saved = bool(cfg.checkpoint.save_interval) and step % cfg.checkpoint.save_interval == 0
        if saved:
            self._settle("save")            # the checkpoint's loss and optimizer steps
            with accelerator.host_wait("save"):
                self.save()
        self.logger.exclude(time.perf_counter() - t0)   # tokens/s measures training steps only
        if evaluated or saved:
            self.busy.start()               # nor is it a rank's busy time (BusyClock)
        return saved

    def _read_back(self) -> ReadBack:
        """The one read-back of a logging step (StepTally.read), with this rank's stop flags: the run's progress
        (optimizer updates, the last finite loss) brought up to date, and a step whose loss or gradient norm was
        not finite reported (training.nan_policy=abort). AdamW's step count needs nothing: a skipped step left it
        as it was, on the device (parallel/optimizer.py)."""
        t, p = self.cfg.training, self.progress
        flags, start = self.wall
        over_time = t.max_wall_minutes > 0 and time.monotonic() - start > 60 * t.max_wall_minutes
        self.doing(f"waiting for every rank to finish step {p.step}")
        back = self.tally.read((flags.signalled, over_time), self.busy.take(p.step - self.read_at))
        self.busy.start()                   # the read-back's all-reduce is left with every rank too
        self.logger.note_busy(back.busy)
        p.updates += p.step - self.read_at - back.not_finite
        self.read_at = p.step
        p.loss = back.last_finite_loss if math.isfinite(back.last_finite_loss) else p.loss   # the last finite loss
        skipped = self.logger.extra.get("skipped_steps", 0) + back.not_finite      # since the last logged step
        self.logger.note(skipped_steps=skipped, updates=p.updates)
        if back.not_finite and t.nan_policy == "abort":
            raise NonFiniteLossError(f"the loss or the gradient norm was not finite at step {back.first_not_finite} "
                                     f"(found at step {p.step}; loss now {back.loss:.4f}, gradient norm "
                                     f"{back.grad_norm:.4f}): aborting (set training.nan_policy=skip to skip such "
                                     f"steps)")
        return back

    def _settle(self, reason: str) -> None:
        """Read the steps back now (for `reason`: a save needs the run's progress) unless this step did."""
        if self.read_at != self.progress.step:
            with accelerator.host_wait(reason):
                self._read_back()

    def _stop(self, back: Optional[ReadBack]) -> str:
        """Why the loop stops after this step ("train_steps": it goes on, or has trained them all): a signal or
        training.max_wall_minutes as every rank agreed in this step's read-back (logging steps only),
        training.exit_at_step or exit_interval."""
        t, step = self.cfg.training, self.progress.step
        signal, over_time = back.stop if back is not None else (False, False)
        interval = t.exit_interval and step % t.exit_interval == 0
        if (signal or over_time or step == t.exit_at_step or interval) and step < t.train_steps:
            return ("signal" if signal else "max_wall_minutes" if over_time else
                    "exit_at_step" if step == t.exit_at_step else "exit_interval")
        return "train_steps"

    def save(self) -> None:
        """The checkpoint of this step: written before it returns, or with checkpoint.async_save (as the plan
        resolved it; the loop then has a saver) staged, then written in the background after the previous one is
        complete."""
        cfg, p, grid = self.cfg, self.progress, self.grid
        meta = {"consumed_samples": p.consumed, "optimizer_steps": p.updates,
                "loss": p.loss if math.isfinite(p.loss) else None,
                "model_shape": architecture(cfg.model, grid.tp_size),
                "layout": grid.degrees.summary()}
        if self.saver is None:
            self.doing(f"saving the checkpoint of step {p.step}")
            save_checkpoint(self.ckpt_dir, p.step, self.model, self.opt, grid, self.mesh, meta,
                            keep_last=cfg.checkpoint.keep_last)
            return
        if self.saver.pending_step is not None:
            self.doing(f"waiting for the checkpoint of step {self.saver.pending_step} before saving step {p.step}")
            self.saver.wait()
        self.doing(f"staging the checkpoint of step {p.step}")
        self.saver.save(self.ckpt_dir, p.step, self.model, self.opt, grid, self.mesh, meta, cfg.checkpoint.keep_last)

    def finish_saves(self, quiet: bool = False) -> None:
        """The end of training, a stop: wait until the checkpoint being written in the background is complete on
        every rank, and let the saver go. `quiet` (on the way out of an error): its own failure is not raised."""
        saver, self.saver = self.saver, None
        if saver is None:
            return
        self.doing(f"waiting for the checkpoint of step {saver.pending_step} to be written")
        try:
            saver.close()
        except CheckpointError:
            if not quiet:
                raise
