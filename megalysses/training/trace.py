"""One training step of a run traced on fake tensors: its peak device memory, and the pinned host memory it
allocates, at the real shape, on a machine without the GPUs (`pretrain.py --dry-run --gpus N --trace-memory`,
`tools/plan.py ... --trace`).

    traced = trace_step(cfg, Machine.described("H100"), world=8)         # rank 0 (the first stage)
    traced.device.bytes, traced.device.moment, traced.device.largest    # the peak, where, what is alive
    traced.pinned.bytes                                                  # pinned host memory, high-water mark

Rank `rank` of a world of `world` ranks runs the run's own start-up path and one step of the run's own train
step, in this one process: the config checked at that world size, the plan resolved on the machine, the
process groups created on torch's fake backend (whose collectives move nothing), the model and optimizer
built as a run builds them, the optimizer's state made as a resume makes it, then train_step on one global
batch of this rank's micro-batches at the padded sequence length, every option of the plan in force (of many
micro-batches, those that take the step's memory through every state it has: traced_micro_batches). Every
tensor is a fake tensor (torch's FakeTensorMode: shapes, dtypes and devices, no data): the meta device stands
for the GPU, the CPU for host memory. megalysses.tracker.LiveBytes counts the live bytes of each after every
op (the peak over the step, over the weights and state made before it).

What a GPU has and a fake tensor has not, the trace gives a form of, each through the interface the run's code
already asks, so that nothing it runs asks whether it is traced: megalysses.accelerator's Host (`FakeGPU`: the
GPU is the meta device, its streams and events do nothing, its pinned buffers are host tensors counted as
pinned, no tensor holds values to initialise); the collectives through a backend of the fake process group for
the meta device (megalysses.comm takes the devices a group's backend has); our Triton kernels' launches go
nowhere (triton_support.launches_to), their outputs allocated as on a GPU; the attention kernels run as their
GPU forms in kernels/gpu_forms.py (the kernel SDPA picks on CUDA, flash-attn, FlexAttention, with the
workspaces they allocate inside). FSDP2 runs on the meta device through training/fsdp_meta.py: its device
module, and the three private internals it patches, on the torch releases they were checked on. Every op is
also timed by megalysses.training.roofline on the streams these forms and FSDP2's device module hand out
(StepTrace.roofline: seconds per optimizer step by category, launches, host syncs, mask evaluations).
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megalysses import accelerator
from megalysses.config import Config, ConfigError
from megalysses.config.checks import validate_config
from megalysses.grid import ParallelGrid
from megalysses.plan import Machine, RunPlan, resolve
from megalysses.plan.memory import documents_per_sequence
from megalysses.memory import GIB
from megalysses.memory.types import torch_pinned
from megalysses.plan.step_time import Hardware
from megalysses.tracker import DEVICE, HOST, PINNED, LiveBytes, Moment, Peak
from megalysses.training.fsdp_meta import fsdp_internals, meta_device_module
from megalysses.training.roofline import Roofline, Tally

GPU_SMS = {"H100": 132, "H200": 132, "A100": 108}
ChangeForms = Callable[[Any, Roofline], Any]
"""A change of the attention kernels' forms a trace runs: given gpu_forms' (kernels/attention.py's GPUKernels)
and the trace's roofline, the GPUKernels to run instead (another code path's, for a comparison: benchmarks/)."""


@dataclass
class StepTrace:
    """What one traced step of one rank reached: the peak of each memory, with its moment and the largest
    tensors alive then."""

    plan: RunPlan
    rank: int
    stage: int                    # the pipeline stage of `rank`
    device: Peak
    pinned: Peak                  # pinned host memory: its high-water mark
    host: Peak                    # all host memory, pinned or not (the CPU optimizer's state and temporaries)
    seconds: float
    before: int = 0               # device bytes the step starts with: weights, optimizer state, its batch
    largest_allocation: int = 0   # the largest single device allocation of the step
    roofline: Tally = field(default_factory=Tally)     # the step's seconds and counts (training/roofline.py),
                                                       # per optimizer step

    def summary(self) -> dict:
        def peak(p: Peak) -> dict:
            return {"gib": p.bytes / 2 ** 30, "moment": str(p.moment),
                    "largest": [{"gib": a.bytes / 2 ** 30, "shape": list(a.shape), "dtype": a.dtype, "made": a.made}
                                for a in p.largest]}
        return {"rank": self.rank, "stage": self.stage, "seconds": round(self.seconds, 1),
                "device": peak(self.device), "pinned": peak(self.pinned), "host": peak(self.host),
                "before_step_gib": self.before / 2 ** 30, "largest_allocation_gib": self.largest_allocation / 2 ** 30}


    def lines(self) -> list[str]:
        """The peaks in words: each memory's peak and moment, and its largest tensors alive then."""
        out = [f"rank {self.rank} (stage {self.stage}), traced in {self.seconds:.1f} s"]
        for name, p in (("device", self.device), ("pinned host", self.pinned), ("host", self.host)):
            out.append(f"  {name}: peak {p.bytes / 2 ** 30:.3f} GiB at {p.moment}")
            for a in p.largest:
                out.append(f"    {a.bytes / 2 ** 30:9.4f} GiB  {a.dtype:<9} {str(list(a.shape)):<24} {a.made}")
        return out


class FakeGPU(accelerator.Host):
    """megalysses.accelerator's Host in a trace: the GPU is the meta device, its streams and events do nothing,
    its pinned buffers (megalysses' arenas and requests: registered host memory, exactly the bytes asked) are
    host tensors the tracker counts as pinned; no tensor holds values."""

    def __init__(self, live: LiveBytes, roof: Roofline) -> None:
        self.live, self.roof = live, roof

    def is_gpu(self, device: torch.device) -> bool:
        return torch.device(device).type == "meta"

    def holds_values(self, device: torch.device) -> bool:
        return False                        # fake tensors hold none

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self.is_gpu(device):
            return torch.empty(shape, dtype=dtype, device="cpu")
        with self.live.pinned():
            return torch.empty(shape, dtype=dtype, device="cpu")

    def stream(self, device: torch.device) -> Any:
        return self.roof.stream() if self.is_gpu(device) else None

    def current_stream(self, device: torch.device) -> Any:
        return self.roof.current if self.is_gpu(device) else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.roof.on(stream)

    def event(self, stream: Any) -> Any:
        return None if stream is None else stream.record_event()

    def record_stream(self, x: torch.Tensor, stream: Any) -> None:
        pass


def stage_rank(plan: RunPlan, stage: int) -> int:
    """World rank of the first rank (dp, sp, tp all 0) of pipeline stage `stage`."""
    return stage * plan.degrees.dp * plan.degrees.sp * plan.degrees.tp


def trace_step(cfg: Config, machine: Machine, world: int, stage: int = 0, keep: int = 12,
               hw: Optional[Hardware] = None, forms: Optional[ChangeForms] = None) -> StepTrace:
    """One step of the first rank of pipeline stage `stage` of a run of `cfg` on `world` ranks of `machine`,
    traced (see the module docstring); each peak lists the `keep` largest tensors alive then, and its
    roofline is timed at `hw`'s figures (default: Hardware()). `forms`, when given, changes the attention
    kernels' forms the step runs (ChangeForms)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise ConfigError(f"a memory trace needs torch's fake tensors and fake process-group backend, which torch "
                          f"{torch.__version__} lacks") from None
    if dist.is_initialized():
        raise RuntimeError("a memory trace creates its own process group: call it outside one")
    cfg = replace(cfg, data=replace(cfg.data, mock=True))
    validate_config(cfg, world_size=world)
    plan = resolve(cfg, machine, world)
    if not 0 <= stage < plan.degrees.pp:
        raise ValueError(f"the run has {plan.degrees.pp} pipeline stages: no stage {stage}")
    rank = stage_rank(plan, stage)
    # the meta device stands for the GPU: give it a backend of its own on the fake process group
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    # a group of backends per device has no default backend, and torch warns of it as the group is destroyed
    # ("No backend of type 0 found"): the fake one is its default
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    start = time.perf_counter()
    roof = Roofline(hw or Hardware())
    fsdp = fsdp_internals() if plan.fsdp else contextlib.nullcontext()     # FSDP2 on the meta device
    try:
        with warnings.catch_warnings(), meta_device_module(roof), fsdp:
            # the fake backend takes no group timeouts, and says so per group
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            grid = ParallelGrid.for_plan(plan, cfg.parallel.timeout_seconds)
            mesh = grid.device_mesh(torch.device("meta"))     # made of real tensors, before the fakes
            pinned = functools.partial(torch_pinned, exact=machine.pinned_exact)    # FSDP2's, rounded as torch does
            with FakeTensorMode(allow_non_fake_inputs=True), LiveBytes(keep, torch_pinned=pinned) as live, \
                    _gpu_forms(live, roof, machine, plan.micro_batch_size, forms), roof:
                traced = _step(cfg, grid, plan, mesh, live, roof)
    finally:
        dist.destroy_process_group()
    return StepTrace(plan, rank, stage, live.peaks[DEVICE], live.peaks[PINNED], live.peaks[HOST],
                     time.perf_counter() - start, live.before, live.largest_allocation,
                     roof.result(plan.micro_batches, traced))


@contextlib.contextmanager
def _gpu_forms(live: LiveBytes, roof: Roofline, machine: Machine, sequences: int,
               forms: Optional[ChangeForms]) -> Iterator[None]:
    from megalysses.kernels.gpu_forms import gpu_kernels
    from megalysses.kernels.triton_support import LaunchHook, launches_to

    with accelerator.use(FakeGPU(live, roof)), gpu_kernels(live, machine.packages, roof, sequences), \
            _changed_forms(forms, roof), \
            launches_to(LaunchHook(GPU_SMS.get(machine.gpu or "", 132), roof.triton)), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*|.*all_gather_into_tensor.*")
        yield


@contextlib.contextmanager
def _changed_forms(forms: Optional[ChangeForms], roof: Roofline) -> Iterator[None]:
    """The GPU kernels' forms in use (gpu_forms') changed by `forms` inside, or left as they are."""
    if forms is None:
        yield
        return
    from megalysses.kernels import attention

    with attention.use_kernels(forms(attention.kernels(), roof)):
        yield


def _step(cfg: Config, grid: ParallelGrid, plan: RunPlan, mesh: Any, live: LiveBytes, roof: Roofline) -> int:
    """Build the model and optimizer, make the optimizer's state, then one train_step, its peaks counted and
    its ops timed (each micro-batch a part of the roofline from its forward on, without a pipeline; with one,
    the schedule one part). Returns how many micro-batches it ran."""
    from megalysses.training.build import build_run
    from megalysses.training.step import train_step

    device = torch.device("meta")
    built = build_run(cfg, plan, grid, device, mesh=mesh)
    model, opt = built.model, built.opt
    live.name_modules(model)
    for _ in opt.checkpoint_slots():            # the AdamW state a resumed run has
        pass
    batch = fake_batch(cfg, grid, plan, device)
    traced = batch[:traced_micro_batches(len(batch), plan)]       # the others stay allocated, as a loaded step's
    step = opt.step

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        roof.mark("optimizer")
        with live.part("optimizer"), roof.optimizer():
            return step(*args, **kwargs)

    opt.step = optimizer_step
    live.reset_peaks()
    roof.mark("before the micro-batches")
    if plan.degrees.pp == 1:
        hook = model.register_forward_pre_hook(lambda *args: roof.mark("micro-batch"))
    else:
        roof.mark("micro-batches")
    train_step(model, opt, traced, grid, lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip,
               dtype=plan.torch_dtype, nan_policy=cfg.training.nan_policy)
    roof.finish()
    if plan.degrees.pp == 1:
        hook.remove()
    del batch
    return len(traced)


def traced_micro_batches(micro_batches: int, plan: RunPlan) -> int:
    """How many of a step's micro-batches the trace runs: enough for every state the step's memory goes
    through, the rest repeating one of them. Without a pipeline, the first (no gradients yet), one in the middle
    (the gradients of those before) and the last (the buckets reduced during its backward); with one, as many
    as fill the schedule's warm-up and reach its steady state twice (1F1B: pp; interleaved: 2 pp per model
    chunk), and the last."""
    needed = 3 if plan.degrees.pp == 1 else 2 * plan.degrees.pp * plan.degrees.virtual_stages + 2
    return min(micro_batches, needed)


def fake_batch(cfg: Config, grid: ParallelGrid, plan: RunPlan, device: torch.device) -> list[dict]:
    """This rank's micro-batches of one global batch at the run's longest (padded) length, as the data loader
    hands them over: token ids, labels and positions of its S/sp tokens, and with packed-document masks the
    document ids of the whole sequence, with the boundaries of as many documents a sequence as the plan counts
    (plan/memory.py documents_per_sequence: their cumulative lengths on the device, whose length the varlen
    kernels' workspaces follow, and each row's longest in host memory)."""
    B, S = plan.micro_batch_size, plan.padded_seq_len
    local = S // grid.sp_size
    out = []
    for _ in range(plan.micro_batches):
        mb = {k: torch.zeros(B, local, dtype=torch.long, device=device)
              for k in ("input_ids", "labels", "position_ids")}
        if cfg.data.document_mask:
            mb["doc_ids"] = torch.zeros(B, S, dtype=torch.long, device=device)
            mb["cu_seqlens"] = torch.zeros(B * documents_per_sequence(cfg, S) + 1, dtype=torch.int32, device=device)
            mb["longest_document"] = torch.full((B,), S, dtype=torch.int32)
        out.append(mb)
    return out


def trace_run(cfg: Config, machine: Machine, world: int, keep: int = 12,
              hw: Optional[Hardware] = None, forms: Optional[ChangeForms] = None) -> list[StepTrace]:
    """The traced step of the first stage and, with a pipeline, of the last (the run's peak is the larger)."""
    first = trace_step(cfg, machine, world, 0, keep, hw, forms)
    pp = first.plan.degrees.pp
    return [first] + ([trace_step(cfg, machine, world, pp - 1, keep, hw, forms)] if pp > 1 else [])


def traced_peak(traces: list[StepTrace]) -> StepTrace:
    """The stage whose device peak is the run's."""
    return max(traces, key=lambda t: t.device.bytes)


def model_part(moment: Moment) -> str:
    """The memory model's name (megalysses.memory Estimate.part) of the moment a trace peaked at: optimizer,
    loss (the LM head + loss forward), final norm (its backward), backward, or forward (elsewhere in a
    forward, which the model has no part for)."""
    if moment.part == "optimizer":
        return "optimizer"
    if moment.part == "forward":
        return "loss" if "linear_cross_entropy" in moment.where else "forward"
    return "final norm" if moment.module.endswith("final_norm") else "backward"


def trace_fields(traces: list[StepTrace], ranks_per_node: int) -> dict:
    """What tools/plan.py --trace adds to a layout: the traced device peak per GPU (the larger stage's), its
    moment and the model's name for it, host memory per node (all of it, and its pinned part) at their
    high-water marks (each rank of a node as the traced one of its stage), and the traced roofline
    (roofline_fields)."""
    top = traced_peak(traces)
    host = max(t.host.bytes for t in traces) * ranks_per_node
    pinned = max(t.pinned.bytes for t in traces) * ranks_per_node
    return {"traced_peak_gib": round(top.device.bytes / GIB, 3), "traced_moment": str(top.device.moment),
            "traced_part": model_part(top.device.moment), "traced_stage": top.stage,
            "traced_host_gib": round(host / GIB, 2), "traced_pinned_gib": round(pinned / GIB, 2),
            "traced_seconds": round(sum(t.seconds for t in traces), 1), **roofline_fields(traces)}


def roofline_fields(traces: list[StepTrace]) -> dict:
    """The traced roofline of the slowest stage, per optimizer step: its seconds (traced_step_s) and their
    breakdown by category, the host syncs, kernel launches and block-mask evaluations, device, host and
    collective bytes (GB), and FLOPs by class."""
    r = max(traces, key=lambda t: t.roofline.total).roofline
    return {"traced_step_s": float(f"{r.total:.7g}"),
            "traced_step_breakdown": {k: float(f"{v:.7g}") for k, v in r.seconds.items()},
            "traced_host_syncs": r.host_syncs, "traced_launches": r.launches,
            "traced_mask_evaluations": r.mask_evaluations,
            "traced_flops": {k: v for k, v in r.flops.items()},
            "traced_device_gb": round(r.device_bytes / 1e9, 3), "traced_host_copies_gb": round(r.host_bytes / 1e9, 3),
            "traced_collective_gb": {k: round(v / 1e9, 4) for k, v in r.collective_bytes.items()}}


