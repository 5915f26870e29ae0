"""The training loop: build, resume, step, validate, checkpoint, stop cleanly.

Stops at training.train_steps, at training.max_wall_minutes (with a checkpoint), or on SIGTERM /
SIGUSR1 (preemption: checkpoint, then exit 0). An ordinary step reads nothing back to the host; a logging
step (every logging.log_interval steps, and the last) reads its figures back once: the loss, token count and
gradient norm, the steps since the last one whose loss or norm was not finite (skipped, or with
training.nan_policy=abort the run stopped naming the first), and the stop flags, which every rank agrees on
through one small all-reduce there, so no rank is left waiting in a collective. A signal or the wall-clock
limit therefore stops the run at the next logging step. A save reads the figures back too (counted apart).
With a watchdog, the loop tells it what it is doing, so that a stuck rank is named with its phase.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from megalysses import accelerator
from megalysses.checkpoint.background import BackgroundSaver
from megalysses.checkpoint.dcp_io import load_checkpoint, save_checkpoint
from megalysses.checkpoint.initial import is_weights_only, load_initial_weights
from megalysses.checkpoint.manifest import CheckpointError, choose_checkpoint
from megalysses.config import Config, ConfigError
from megalysses.config.checks import check_logging_backends
from megalysses.config.io import save_config
from megalysses.config.batch_schedule import batch_line
from megalysses.distributed import on_rank0, print0
from megalysses.grid import ParallelGrid
from megalysses.kernels.attention import reserve_compiles
from megalysses.memory import GIB, arenas
from megalysses.memory.host import STAGING, arena_bytes
from megalysses.plan.memory import pinned_requests_of
from megalysses.model.gpt import GPTStage, architecture, init_weights, stage_layers
from megalysses.model.layers import ParallelGroups
from megalysses.model.policies import apply_activation_policy
from megalysses.parallel.interleaved import VirtualStages
from megalysses.pinned_arena import PinnedArena, PinnedMemory
from megalysses.plan import RunPlan
from megalysses.plan.flops import peak_tflops
from megalysses.plan.search import check_host_memory, check_phase_time
from megalysses.training.data import TrainingData
from megalysses.parallel.fsdp import FSDPAdamW, shard_model
from megalysses.training.long_eval import TrainingLongEval, scalars
from megalysses.training.metrics import MetricsLogger, ReadBack, StepTally
from megalysses.parallel.optimizer import AdamWSettings, Optimizer
from megalysses.parallel.zero import ReduceSettings, ShardedAdamW
from megalysses.training.profiler import StepProfiler
from megalysses.training.rundir import check_writable, mark_start
from megalysses.training.runtime import (check_built, flex_compile_budget, model_config, resolve_run, startup_line,
                                         write_runtime)
from megalysses.training.schedule import lr_at, lr_progress
from megalysses.training.signals import StopSignals
from megalysses.training.step import NonFiniteLossError, evaluate, train_step
from megalysses.training.watchdog import Watchdog

def pinned_arenas(cfg: Config, run: RunPlan, grid: ParallelGrid, device: torch.device) -> dict[str, PinnedArena]:
    """This rank's pinned host memory: what the memory model counts for its pipeline stage, an arena for each
    owner (each model chunk's activation offloader, the optimizer; memory/host.py); empty where nothing is
    pinned."""
    reqs = [r for r in pinned_requests_of(cfg, run, grid.pp_rank) if r.owner != STAGING]   # the saver's (save)

    def what(owner: str) -> str:
        mine = [r for r in reqs if r.owner == owner and r.count]
        return "; ".join(f"{name}: {sum(r.count for r in mine if r.name == name)} requests"
                         for name in dict.fromkeys(r.name for r in mine)) or f"nothing ({owner})"
    return {owner: PinnedArena(nbytes, device, what(owner)) for owner, nbytes in arenas(reqs).items()}


def build_model(cfg: Config, grid: ParallelGrid, device: torch.device, mesh: DeviceMesh,
                run: RunPlan, pinned: Optional[dict[str, PinnedArena]] = None) -> GPTStage | VirtualStages:
    """This rank's pipeline stage (or its virtual stages) with its tp shards in fp32, initialised
    identically at every layout (then, with parallel.fsdp, sharded over the grad group to gather in the
    compute dtype); each chunk's activation offload takes its host buffers from its arena in `pinned`
    (pinned_arenas), or without them from pinned requests of its own."""
    model_cfg = model_config(cfg, run)
    groups = ParallelGroups(tp=grid.tp_group, ulysses=grid.ulysses_group, ring=grid.ring_group,
                            sequence_parallel=run.activation.tp_sequence_parallel)
    v = run.virtual_stages
    V = grid.pp_size * v
    chunks = []
    # allocated where the weights live: where they run, never staged through host memory, or (parameter
    # offload) in host memory, where FSDP keeps their shards
    where = torch.device("cpu") if run.weights == "host" else device
    for k in range(v):   # chunk k of this rank is virtual stage k * pp + pp_rank
        vs = k * grid.pp_size + grid.pp_rank
        with torch.device(where):
            chunk = GPTStage(model_cfg, groups, stage_layers(cfg.model.num_layers, V, vs), first=vs == 0,
                             last=vs == V - 1)
        apply_activation_policy(chunk, run.activation, (pinned or {}).get(f"model chunk {k}"))
        if accelerator.current().holds_values(device):     # not a dry run's shapes, a trace's fake tensors
            init_weights(chunk, cfg.training.seed, grid.tp_rank, grid.tp_size)
        if run.fsdp:
            shard_model(chunk, mesh["grad"], run.torch_dtype, getattr(torch, run.grad_dtype),
                        offload=run.weights == "host")
        chunks.append(chunk)
    return chunks[0] if v == 1 else VirtualStages(chunks)


def build_optimizer(cfg: Config, model: GPTStage, grid: ParallelGrid, run: RunPlan,
                    device: Optional[torch.device] = None, pinned: Optional[PinnedMemory] = None) -> Optimizer:
    """The optimizer the plan places: FSDP2's AdamW over the sharded model, or ZeRO-1's over the grad group (its
    state in host memory where the plan puts it there)."""
    o = cfg.optimizer
    # the two copies of a tied embedding (first and last stage) sum their gradients; a middle stage has neither
    tied_across_stages = cfg.model.tie_embeddings and grid.pp_size > 1 and (grid.is_first_stage or grid.is_last_stage)
    settings = AdamWSettings(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                             tp_rank=grid.tp_rank, embed_group=grid.embed_group if tied_across_stages else None,
                             tied_head_copy=tied_across_stages and not grid.is_first_stage)
    if run.fsdp:
        return FSDPAdamW(model, settings, device=device)
    reduce = ReduceSettings(bucket_elements=cfg.parallel.grad_bucket_elements, overlap=cfg.parallel.overlap_grad_reduce,
                            offload=run.optimizer == "zero1-host", grad_dtype=getattr(torch, run.grad_dtype))
    return ShardedAdamW(model.named_parameters(), grid.grad_group, settings, reduce, pinned)


def build_model_and_optimizer(cfg: Config, grid: ParallelGrid, device: torch.device, run: RunPlan,
                              mesh: Optional[DeviceMesh] = None, initial: Optional[str | Path] = None,
                              doing: Callable[[str], None] = lambda what: None,
                              ) -> tuple[GPTStage | VirtualStages, Optimizer]:
    """The model and optimizer of a run, built the one way every caller builds them: the fp32 model
    (with parallel.fsdp, sharded over `mesh`, the grid's device mesh), the `initial` weights loaded into it
    where there are any (a converted model, checkpoint.init_from), the optimizer's fp32 masters from it,
    then the compute weights in the run's dtype (FSDP casts when it gathers); what both pin in host memory
    from arenas the plan sizes (pinned_arenas). `doing` is told each phase."""
    if mesh is None and run.fsdp:
        mesh = grid.device_mesh(device)
    pinned = pinned_arenas(cfg, run, grid, device)
    doing("building the model")
    model = build_model(cfg, grid, device, mesh, run, pinned)
    if initial is not None:
        doing(f"loading the initial weights {initial}")
        print0(load_initial_weights(initial, model, cfg, grid, mesh))
    doing("building the optimizer")
    opt = build_optimizer(cfg, model, grid, run, device, pinned.get("optimizer"))
    if not run.fsdp:
        with torch.no_grad():       # each parameter's data, in place: the Parameter objects stay the ones the
            for p in model.parameters():    # optimizer holds, whatever tensors they hold (nn.Module.to tries
                p.data = p.data.to(run.torch_dtype)     # to swap the objects where it cannot assign in place)
    return model, opt


def stage_line(cfg: Config, step: int) -> str:
    """The curriculum stage that the step after `step` completed steps trains in, in words."""
    d = cfg.data
    stage = max(i for i, (from_step, _) in enumerate(d.seq_len_schedule) if from_step <= step)
    length = d.seq_len_schedule[stage][1]
    pieces = (f"each sample of {d.seq_len} tokens cut into {d.seq_len // length} sequences"
              if length < d.seq_len else "whole samples")
    return (f"seq_len {length} from step {step + 1} (stage {stage + 1} of {len(d.seq_len_schedule)} of "
            f"data.seq_len_schedule: {pieces})")


def _prepare_dirs(cfg: Config, run_dir: Path, ckpt_dir: Path) -> None:
    """Rank 0: both directories writable before anything is trained."""
    check_writable(run_dir, "logging.run_dir")
    check_writable(ckpt_dir, "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint.dir (<run_dir>/checkpoints)")
    if cfg.logging.tensorboard and cfg.logging.tensorboard_dir:
        check_writable(Path(cfg.logging.tensorboard_dir), "logging.tensorboard_dir")


@dataclass
class Progress:
    """Where a run stands: steps done, samples consumed, optimizer steps taken (skipped steps excluded) and
    the last finite loss."""

    step: int = 0
    consumed: int = 0
    updates: int = 0
    loss: float = float("nan")


def train(cfg: Config, grid: ParallelGrid, device: torch.device, signals: Optional[StopSignals] = None,
          watchdog: Optional[Watchdog] = None, run: Optional[RunPlan] = None, dry_run: bool = False) -> dict:
    """Run training to the end (or a stop); returns a summary {step, loss, stopped_by}.

    `signals` carries signals received before training started (the entry point creates it first thing);
    `watchdog` is told what the loop does; `run` is the plan of this run on this machine (resolved here
    when not given). `dry_run`: the start-up path only, up to step 1: the model and optimizer are built
    (on the meta device for a described machine) and checked against the plan, runtime.json is written,
    and nothing is read or trained."""
    run_dir = Path(cfg.logging.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    doing = watchdog.doing if watchdog is not None else (lambda what: None)
    run = _start_up(cfg, grid, device, run, run_dir, ckpt_dir, watchdog is not None or dry_run, doing)
    path, initial = (None, None) if dry_run else _checkpoint_to_load(cfg, ckpt_dir, doing)
    if path is None and initial is None and not dry_run:      # the others say it as they load
        print0(f"initial weights: random (seed {cfg.training.seed})")
    doing("checking the long-context evaluation")
    long_eval = TrainingLongEval(cfg, grid, device, run) if cfg.long_eval.interval and not dry_run else None
    mesh = grid.device_mesh(device)
    model, opt = build_model_and_optimizer(cfg, grid, device, run, mesh, initial, doing)
    check_built(model, grid, run)
    if dry_run:
        on_rank0(lambda: write_runtime(run_dir, cfg, grid, run))
        return {"step": 0, "loss": float("nan"), "stopped_by": "dry_run"}
    doing("opening the datasets")
    data = TrainingData(cfg, grid, run, device)
    progress = Progress()
    if path is not None:
        doing(f"loading the checkpoint {path}")
        progress = _resume(cfg, path, model, opt, grid, mesh)
        if progress.step >= cfg.training.train_steps:
            return {"step": progress.step, "loss": progress.loss, "stopped_by": "already_finished"}

    # the run's config (what tools/generate.py and the converter read) only once this one has passed every
    # check, loaded its checkpoint and made the saver's process group: a launch that fails leaves the run as it was
    def start_run() -> None:
        save_config(cfg, run_dir / "config.yaml")
        write_runtime(run_dir, cfg, grid, run)
        mark_start(run_dir, progress.step, path, progress.consumed * cfg.data.seq_len,
                   {"tp": grid.tp_size, "sp": grid.sp_size, "pp": grid.pp_size, "dp": grid.dp_size})

    loop = TrainingLoop(cfg, grid, device, run, model, opt, mesh, data, long_eval, progress, ckpt_dir, doing)
    on_rank0(start_run)
    return loop(signals, watchdog)


def _start_up(cfg: Config, grid: ParallelGrid, device: torch.device, run: Optional[RunPlan], run_dir: Path,
              ckpt_dir: Path, check_time: bool, doing: Callable[[str], None]) -> RunPlan:
    """The checks before anything is built: the directories writable (rank 0), the plan (resolved here when not
    given), the logging backends, the phase times against the watchdog (`check_time`), this node's host memory;
    then the start-up line. Returns the plan."""
    doing("checking the run directory")
    on_rank0(lambda: _prepare_dirs(cfg, run_dir, ckpt_dir))
    run = run or resolve_run(cfg, device, grid)
    check_logging_backends(cfg)
    if check_time:                           # the machine's GPU's peak, or logging.peak_tflops
        check_phase_time(cfg, run, peak_tflops(cfg.logging.peak_tflops, run.machine.gpu, run.dtype))
    if run.machine.host_memory_gib is not None:    # the node's, where the plan's machine knows it (a described one not)
        check_host_memory(cfg, run, run.machine.host_memory_gib * GIB)
    if run.attention == "flex" and device.type == "cuda":
        reserve_compiles(flex_compile_budget(run))
    print0(startup_line(cfg, grid, run))
    return run


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


def _resume(cfg: Config, path: Path, model: GPTStage | VirtualStages, opt: Optimizer, grid: ParallelGrid,
            mesh: DeviceMesh) -> Progress:
    """The checkpoint `path` loaded into the model and optimizer; where it left the run."""
    meta = load_checkpoint(path, model, opt, grid, mesh, architecture(cfg.model, grid.tp_size))
    step = meta["step"]
    last = meta.get("loss")
    progress = Progress(step, meta["consumed_samples"], meta.get("optimizer_steps", step),
                        float("nan") if last is None else last)
    if step >= cfg.training.train_steps:
        return progress
    print0(f"resumed from {path} at step {step} ({progress.consumed} samples consumed)")
    if 0 < cfg.training.exit_at_step <= step:
        raise ConfigError(f"the checkpoint {path} is at step {step}, already at or past "
                          f"training.exit_at_step={cfg.training.exit_at_step}: raise exit_at_step "
                          f"(or set it to 0) to continue this run")
    return Progress(step, progress.consumed, progress.updates)


def background_saver(cfg: Config, run: RunPlan, grid: ParallelGrid, device: torch.device) -> BackgroundSaver:
    """What writes this rank's checkpoints in the background (checkpoint.async_save): its staging arena as the plan
    sizes it, and its process group, made while the launcher's store is there (a stop signal from a launcher that
    died still gets its checkpoint)."""
    staging = [r for r in pinned_requests_of(cfg, run, grid.pp_rank) if r.owner == STAGING]
    return BackgroundSaver(arena_bytes(staging), device, cfg.parallel.timeout_seconds,
                           f"checkpoint staging: {sum(r.count for r in staging)} tensors")


class TrainingLoop:
    """The steps of a built run, from `progress` to training.train_steps or a stop: each step's batch, its
    validation, long-context evaluation and checkpoint when due, and the stop every rank agrees on."""

    def __init__(self, cfg: Config, grid: ParallelGrid, device: torch.device, run: RunPlan,
                 model: GPTStage | VirtualStages, opt: Optimizer, mesh: DeviceMesh, data: TrainingData,
                 long_eval: Optional[TrainingLongEval], progress: Progress, ckpt_dir: Path,
                 doing: Callable[[str], None]) -> None:
        self.cfg, self.grid, self.device, self.run = cfg, grid, device, run
        self.model, self.opt, self.mesh, self.data, self.long_eval = model, opt, mesh, data, long_eval
        self.progress, self.ckpt_dir, self.doing = progress, ckpt_dir, doing
        self.saver = background_saver(cfg, run, grid, device) if run.async_save else None

    def __call__(self, signals: Optional[StopSignals], watchdog: Optional[Watchdog]) -> dict:
        cfg, p, doing = self.cfg, self.progress, self.doing
        run_dir, total = Path(cfg.logging.run_dir), cfg.training.train_steps
        self.logger = MetricsLogger(cfg, run_dir, self.grid.world, self.device, total, self.run.torch_dtype)
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
                phase_len = self.run.train_phase(p.step).seq_len
                if phase_len != seq_len:
                    seq_len = phase_len
                    if cfg.data.seq_len_schedule:
                        print0(stage_line(cfg, p.step))
                doing(f"reading the batch of step {p.step + 1}")
                batch = next(batches)
                if len(batch) * self.run.samples_per_micro_batch != samples:   # a ramp grows the global batch
                    samples = len(batch) * self.run.samples_per_micro_batch
                    if self.data.batch_sizes.ramped:
                        print0(batch_line(p.step, samples, self.data.batch_sizes, self.run.samples_per_micro_batch))
                doing(f"training step {p.step + 1}")
                with profiler.step(p.step + 1):
                    result = train_step(self.model, self.opt, batch, self.grid, lr=lr,
                                        grad_clip=cfg.optimizer.grad_clip, dtype=self.run.torch_dtype,
                                        nan_policy=cfg.training.nan_policy)
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
        with accelerator.host_wait("evaluation"):
            if cfg.training.eval_interval and step % cfg.training.eval_interval == 0:
                self.doing(f"validating at step {step}")
                self.logger.eval(step, evaluate(self.model, self.data.valid_batches(), self.grid, self.run.torch_dtype))
            if self.long_eval is not None and self.long_eval.due(step):
                self.logger.long_eval(step, scalars(self.long_eval(self.model, step, self.doing)))
        saved = bool(cfg.checkpoint.save_interval) and step % cfg.checkpoint.save_interval == 0
        if saved:
            self._settle("save")            # the checkpoint's loss and optimizer steps
            with accelerator.host_wait("save"):
                self.save()
        self.logger.exclude(time.perf_counter() - t0)   # tokens/s measures training steps only
        return saved

    def _read_back(self) -> ReadBack:
        """The one read-back of a logging step (StepTally.read), with this rank's stop flags: the run's progress
        (optimizer updates, the last finite loss) brought up to date, AdamW's step count set right where steps
        were skipped, and a step whose loss or gradient norm was not finite reported (training.nan_policy=abort)."""
        t, p = self.cfg.training, self.progress
        flags, start = self.wall
        over_time = t.max_wall_minutes > 0 and time.monotonic() - start > 60 * t.max_wall_minutes
        self.doing(f"waiting for every rank to finish step {p.step}")
        back = self.tally.read((flags.signalled, over_time))
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
        if back.not_finite:
            self.opt.set_step(p.updates)          # AdamW counted the skipped steps until now
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
                "layout": {"tp": grid.tp_size, "sp": grid.sp_size, "pp": grid.pp_size, "dp": grid.dp_size}}
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
