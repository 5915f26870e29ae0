"""The one way a run is assembled: the model, the optimizer, the training data, the pinned arenas and the
checkpoint state of a run of `cfg` under its plan, on its grid and device.

    plan = resolve(cfg, machine, world)                      # once, where the process starts (tools/)
    grid = ParallelGrid.for_plan(plan, cfg.parallel.timeout_seconds)
    run = build_run(cfg, plan, grid, device, Parts(data=True, resume=path))
    TrainingLoop(run, ...)()                                 # training runs a Run (training/loop.py)

Training (and its dry run), the long-context evaluation, generation, the memory and step traces, the
benchmarks and the tests all build here, in this order: the pinned arenas the plan sizes, the fp32 model (with
FSDP sharded over the grid's mesh) where its weights live, the initial weights (or the caller's own: Parts)
loaded into it where there are any, the optimizer's fp32 masters from it, the compute weights in the plan's
dtype (FSDP casts as it gathers), the check that the built model is the planned one, the training data, and the
checkpoint resumed. Nothing here resolves a plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from megalysses import accelerator
from megalysses.checkpoint.dcp_io import load_checkpoint
from megalysses.checkpoint.initial import load_initial_weights
from megalysses.config import Config, ConfigError
from megalysses.distributed import print0
from megalysses.grid import ParallelGrid
from megalysses.memory import arenas
from megalysses.memory.host import STAGING
from megalysses.model.gpt import GPTStage, architecture, init_weights, stage_layers
from megalysses.model.layers import ParallelGroups
from megalysses.model.policies import apply_activation_policy
from megalysses.parallel.fsdp import FSDPAdamW, shard_model
from megalysses.parallel.interleaved import VirtualStages
from megalysses.parallel.optimizer import AdamWSettings, Optimizer
from megalysses.parallel.zero import ReduceSettings, ShardedAdamW
from megalysses.pinned_arena import PinnedArena, PinnedMemory
from megalysses.plan import RunPlan
from megalysses.plan.memory import pinned_requests_of
from megalysses.training.data import TrainingData
from megalysses.training.runtime import check_built, model_config


def pinned_arenas(cfg: Config, plan: RunPlan, grid: ParallelGrid, device: torch.device) -> dict[str, PinnedArena]:
    """This rank's pinned host memory: what the memory model counts for its pipeline stage, an arena for each
    owner (each model chunk's activation offloader, the optimizer; memory/host.py); empty where nothing is
    pinned."""
    reqs = [r for r in pinned_requests_of(cfg, plan, grid.pp_rank) if r.owner != STAGING]   # the saver's (save)

    def what(owner: str) -> str:
        mine = [r for r in reqs if r.owner == owner and r.count]
        return "; ".join(f"{name}: {sum(r.count for r in mine if r.name == name)} requests"
                         for name in dict.fromkeys(r.name for r in mine)) or f"nothing ({owner})"
    return {owner: PinnedArena(nbytes, device, what(owner)) for owner, nbytes in arenas(reqs).items()}


def build_model(cfg: Config, grid: ParallelGrid, device: torch.device, mesh: DeviceMesh,
                plan: RunPlan, pinned: Optional[dict[str, PinnedArena]] = None) -> GPTStage | VirtualStages:
    """This rank's pipeline stage (or its virtual stages) with its tp shards in fp32, initialised
    identically at every layout (then, with parallel.fsdp, sharded over the grad group to gather in the
    compute dtype); each chunk's activation offload takes its host buffers from its arena in `pinned`
    (pinned_arenas), or without them from pinned requests of its own."""
    model_cfg = model_config(cfg, plan)
    groups = ParallelGroups(tp=grid.tp_group, ulysses=grid.ulysses_group, ring=grid.ring_group,
                            sequence_parallel=plan.activation.tp_sequence_parallel)
    v = plan.degrees.virtual_stages
    V = grid.pp_size * v
    chunks = []
    # allocated where the weights live: where they run, never staged through host memory, or (parameter
    # offload) in host memory, where FSDP keeps their shards
    where = torch.device("cpu") if plan.weights == "host" else device
    for k in range(v):   # chunk k of this rank is virtual stage k * pp + pp_rank
        vs = k * grid.pp_size + grid.pp_rank
        with torch.device(where):
            chunk = GPTStage(model_cfg, groups, stage_layers(cfg.model.num_layers, V, vs), first=vs == 0,
                             last=vs == V - 1)
        apply_activation_policy(chunk, plan.activation, (pinned or {}).get(f"model chunk {k}"))
        if accelerator.current().holds_values(device):     # not a dry run's shapes, a trace's fake tensors
            init_weights(chunk, cfg.training.seed, grid.tp_rank, grid.tp_size)
        if plan.fsdp:
            shard_model(chunk, mesh["grad"], plan.torch_dtype, getattr(torch, plan.grad_dtype),
                        offload=plan.weights == "host")
        chunks.append(chunk)
    return chunks[0] if v == 1 else VirtualStages(chunks)


def build_optimizer(cfg: Config, model: GPTStage, grid: ParallelGrid, plan: RunPlan,
                    device: Optional[torch.device] = None, pinned: Optional[PinnedMemory] = None) -> Optimizer:
    """The optimizer the plan places: FSDP2's AdamW over the sharded model, or ZeRO-1's over the grad group (its
    state in host memory where the plan puts it there)."""
    o = cfg.optimizer
    # the two copies of a tied embedding (first and last stage) sum their gradients; a middle stage has neither
    tied_across_stages = cfg.model.tie_embeddings and grid.pp_size > 1 and (grid.is_first_stage or grid.is_last_stage)
    settings = AdamWSettings(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                             tp_rank=grid.tp_rank, embed_group=grid.embed_group if tied_across_stages else None,
                             tied_head_copy=tied_across_stages and not grid.is_first_stage)
    if plan.fsdp:
        return FSDPAdamW(model, settings, device=device)
    reduce = ReduceSettings(bucket_elements=cfg.parallel.grad_bucket_elements, overlap=cfg.parallel.overlap_grad_reduce,
                            offload=plan.optimizer == "zero1-host", grad_dtype=getattr(torch, plan.grad_dtype))
    return ShardedAdamW(model.named_parameters(), grid.grad_group, settings, reduce, pinned)


@dataclass
class Progress:
    """Where a run stands: steps done, samples consumed, optimizer steps taken (skipped steps excluded) and
    the last finite loss."""

    step: int = 0
    consumed: int = 0
    updates: int = 0
    loss: float = float("nan")


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


WeightsLoader = Callable[[GPTStage | VirtualStages, ParallelGrid, Optional[DeviceMesh]], None]
"""Reads a caller's own weights into the built fp32 model (its stages, the grid, the grid's device mesh)."""


@dataclass(frozen=True)
class Parts:
    """What a build holds beside the model. `optimizer`: the optimizer and the arenas it pins (a run that only
    evaluates or generates has neither, and its model's offloaders take pinned memory of their own); `initial`:
    weights to start from (a converted model, checkpoint.init_from); `weights`: instead, weights the caller reads
    in itself (generation: a run's compute weights, a Hugging Face model's tensors), quietly, at the same point;
    `data`: the training data; `resume`: a checkpoint of this run to load (needs the optimizer)."""

    optimizer: bool = True
    initial: Optional[str | Path] = None
    weights: Optional[WeightsLoader] = None
    data: bool = False
    resume: Optional[Path] = None


@dataclass
class Run:
    """A built run: what training, evaluation, generation and the traces run."""

    cfg: Config
    plan: RunPlan
    grid: ParallelGrid
    device: torch.device
    mesh: Optional[DeviceMesh]
    model: GPTStage | VirtualStages
    opt: Optional[Optimizer] = None
    data: Optional[TrainingData] = None
    pinned: dict[str, PinnedArena] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)


def build_run(cfg: Config, plan: RunPlan, grid: ParallelGrid, device: torch.device, parts: Parts = Parts(),
              doing: Callable[[str], None] = lambda what: None, mesh: Optional[DeviceMesh] = None) -> Run:
    """The run of `cfg` under `plan` on `grid` and `device`, built in the module docstring's order; `doing` is told
    each phase; `mesh`: the grid's device mesh where the caller has made it (a trace makes its own; made here where
    FSDP or the weights loaded need it)."""
    if parts.resume is not None and not parts.optimizer:
        raise ValueError("resuming a checkpoint loads the optimizer's state: build the optimizer too")
    if parts.initial is not None and parts.weights is not None:
        raise ValueError("the initial weights and the caller's weights both fill the model: give one of them")
    loads = parts.initial is not None or parts.weights is not None or parts.resume is not None
    if mesh is None and (plan.fsdp or loads):
        mesh = grid.device_mesh(device)
    pinned = pinned_arenas(cfg, plan, grid, device) if parts.optimizer else {}
    doing("building the model")
    model = build_model(cfg, grid, device, mesh, plan, pinned)
    if parts.initial is not None:
        doing(f"loading the initial weights {parts.initial}")
        print0(load_initial_weights(parts.initial, model, cfg, grid, mesh))
    if parts.weights is not None:
        doing("reading the weights in")
        parts.weights(model, grid, mesh)
    opt = None
    if parts.optimizer:
        doing("building the optimizer")
        opt = build_optimizer(cfg, model, grid, plan, device, pinned.get("optimizer"))
    if not plan.fsdp:
        with torch.no_grad():       # each parameter's data, in place: the Parameter objects stay the ones the
            for p in model.parameters():    # optimizer holds, whatever tensors they hold (nn.Module.to tries
                p.data = p.data.to(plan.torch_dtype)    # to swap the objects where it cannot assign in place)
    check_built(model, grid, plan)
    run = Run(cfg, plan, grid, device, mesh, model, opt, pinned=pinned)
    if parts.data:
        doing("opening the datasets")
        run.data = TrainingData(cfg, grid, plan, device)
    if parts.resume is not None:
        doing(f"loading the checkpoint {parts.resume}")
        run.progress = _resume(cfg, parts.resume, model, opt, grid, mesh)
    return run
