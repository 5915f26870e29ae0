"""A config's predicted memory and step time on a machine, the layouts that fit, and the check that a
run's activities fit its watchdog: the cost models (megalysses.memory, plan.step_time) read off RunPlans.

    prediction = evaluate(cfg, gpus=8, gpu_memory_gib=None, host_memory_gib=None, hw=Hardware())   # an H100's 79.6
    fitting, considered = plan(cfg, gpus=64, seq_len=1 << 20, gpu_memory_gib=None)

A config is planned on a described machine (Machine.described: `hw.gpus_per_node` ranks to a node, with
the optional `packages` given, a plain CUDA torch install by default, and the memory the GPU exposes unless
`gpu_memory_gib` is given), resolved as the run resolves it. A layout fits where its predicted peak is at
most the usable memory: the device's less Hardware's reserve, the layout's communicators (plan/communicators.py)
and its fragmentation allowance, at least the layout's largest single block (Hardware.usable_bytes); between
layouts otherwise equal, the one with fewer communicators comes first.
"""
from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from megalysses.config import Config, ConfigError, ModelConfig
from megalysses.config.checks import check_heads, check_world_size, head_chunk_counts, validate_config
from megalysses.memory import GIB, Estimate
from megalysses.plan.memory import (estimate_plan, options_of, precision_of, shared_estimates,
                                    workload_of)
from megalysses.plan.flops import flops_per_token
from megalysses.plan.machine import PLAIN_TORCH, Machine
from megalysses.plan.run_plan import resolve
from megalysses.plan.tiles import could_fit
from megalysses.plan.types import RunPlan
from megalysses.plan.communicators import communicator_bytes, run_communicators
from megalysses.plan.step_time import Hardware, Overlap, StepTime, step_time


def heads_allow(m: ModelConfig, tp: int, sp: int, sp_ring: int) -> bool:
    """The head rule of a (tp, sp = ulysses x sp_ring) layout: the one function to swap when the layout rules
    change."""
    try:
        check_heads(m.num_heads, m.kv_heads, tp, sp, sp_ring)
    except ConfigError:
        return False
    return True


def ring_degrees(m: ModelConfig, tp: int, sp: int) -> list[int]:
    """Every ring degree of sp = ulysses x ring that the heads allow at tp, the ring growing (the Ulysses degree
    falling): those whose Ulysses degree gives each rank whole query heads and whole (or replicated) KV heads."""
    return [r for r in divisors(sp) if heads_allow(m, tp, sp, r)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_configs(cfg: Config, gpus: int, offload: bool, gpus_per_node: int = 8) -> Iterator[Config]:
    """Every layout and memory-option combination of `cfg` on `gpus` ranks that its rules allow: tp (inside a
    node), sp split into ulysses x ring every way the heads allow (ring_degrees; a Ulysses group that spans
    nodes too, its all-to-all timed on the links between them; parallel.sp_ring is set to the ring, so the
    config runs the split it was planned with, where sp_ring=0 would take the largest Ulysses degree), pp,
    virtual stages, checkpointing (with attention outputs kept or recomputed), MLP tiles (none, or auto:
    plan/tiles.py searches the tile sizes for the largest that keeps the peak at its least), LM head + loss
    tiles (auto; for any tile the step-time model counts the same time), attention head chunks (1 and every
    count the split's Ulysses degree allows, not with kept attention outputs), TP sequence sharding, FSDP or
    ZeRO-1, and with host memory (`offload`) activation offload (of every block's input, or of every 2nd or
    4th block's: training.checkpoint_stride), optimizer offload (ZeRO-1) and parameter offload (FSDP).
    Candidates whose tiles resolve alike are one run: plan() keeps the first. Generated lazily, layout by
    layout (layouts(), then layout_options())."""
    for layout in layouts(cfg, gpus, gpus_per_node):
        yield from layout_options(layout, offload)


def layouts(cfg: Config, gpus: int, gpus_per_node: int = 8) -> Iterator[Config]:
    """`cfg` at every (tp, sp = ulysses x ring, pp, virtual stages) of candidate_configs, in its order, the
    memory options as in `cfg`: what check_world_size judges, once for all of a layout's options."""
    m = cfg.model
    for tp in divisors(gpus):
        if tp > gpus_per_node:
            continue
        for sp in divisors(gpus // tp):
            for ring, pp in itertools.product(ring_degrees(m, tp, sp), divisors(gpus // (tp * sp))):
                for v in [1] + [x for x in (2, 4) if pp > 1]:
                    yield replace(cfg, parallel=replace(cfg.parallel, tp=tp, sp=sp, sp_ring=ring, pp=pp,
                                                        virtual_stages=v))


def layout_options(layout: Config, offload: bool) -> Iterator[Config]:
    """Every memory-option combination of candidate_configs at the layout of `layout` (from layouts())."""
    m, t, par = layout.model, layout.training, layout.parallel
    tp, sp, ring = par.tp, par.sp, par.sp_ring
    mlp_tiles, loss_tiles = [0, "auto"], ["auto"]
    # checkpointing, activation offload, attention outputs kept, checkpoint stride (host memory binding: 1/k of
    # the block inputs offloaded)
    activations = ((False, False, False, 1), (True, False, False, 1), (True, False, True, 1)) + \
        (((True, True, False, 1), (True, True, False, 2), (True, True, False, 4)) if offload else ())
    # FSDP, optimizer offload, parameter offload
    states = ((False, False, False), (True, False, False)) + \
        (((False, True, False), (True, False, True)) if offload else ())
    chunk_counts = head_chunk_counts(m.num_heads, m.kv_heads, tp, sp // ring)
    tiles = [x for x in mlp_tiles if x == "auto" or x < layout.data.seq_len // sp or x == 0]
    options = itertools.product(activations, itertools.product(tiles, loss_tiles),
                                (False, True) if tp > 1 else (False,), states, chunk_counts)
    for (ckpt, offl, keep, stride), (tile, loss_tile), tsp, (fsdp, opt_off, par_off), chunks in options:
        if keep and chunks > 1:
            continue
        yield replace(
            layout, parallel=replace(par, tp_sequence_parallel=tsp, fsdp=fsdp),
            training=replace(t, activation_checkpointing=ckpt, activation_offload=offl, recompute_attention=not keep,
                             optimizer_offload=opt_off, param_offload=par_off, checkpoint_stride=stride,
                             mlp_chunk_tokens=tile, loss_chunk_tokens=loss_tile, attention_head_chunks=chunks))


RING_MIN_TOKENS = 256
"""The fewest tokens of a sequence a ring rank is planned with: a ring degree is at most data.seq_len / 256."""


def most_gpus(cfg: Config) -> tuple[int, dict[str, tuple[int, str]]]:
    """The most GPUs any layout of `cfg` can use, and its factors ({name: (most, why)}): dp at most the
    global batch over the micro-batch (a micro-batch to each dp rank), tp x Ulysses at most the query heads
    (each such rank holds whole heads; tp within a node besides), pp at most the layers, the ring at most
    data.seq_len / RING_MIN_TOKENS. A --gpus above it plans nothing that can run."""
    m, t, S = cfg.model, cfg.training, cfg.data.seq_len
    factors = {"dp": (max(1, t.global_batch_size // t.micro_batch_size),
                      f"training.global_batch_size {t.global_batch_size} / micro_batch_size {t.micro_batch_size}"),
               "tp x ulysses": (m.num_heads, f"model.num_heads {m.num_heads}"),
               "pp": (m.num_layers, f"model.num_layers {m.num_layers}"),
               "ring": (max(1, S // RING_MIN_TOKENS), f"data.seq_len {S} / {RING_MIN_TOKENS}")}
    most = 1
    for n, _ in factors.values():
        most *= n
    return most, factors


@dataclass
class Prediction:
    """A config's resolved plan, its memory estimate and step time, and whether it fits."""

    cfg: Config
    plan: RunPlan
    estimate: Estimate
    step: StepTime
    fits: bool
    host_per_node: float
    hw: Hardware
    usable: float                   # the device budget of this layout (Hardware.usable_bytes with its largest block)
    why_not: str = ""

    def row(self) -> dict:
        c, layout, s = self.cfg, self.estimate.layout, self.step
        tok_s = c.training.global_batch_size * c.data.seq_len / s.total
        mfu = flops_per_token(c.model, c.data.seq_len) * tok_s / (layout.world * self.hw.peak_tflops * 1e12)
        return {"tp": layout.tp, "sp": layout.sp, "ring": layout.ring, "pp": layout.pp, "dp": layout.dp,
                "virtual_stages": layout.virtual_stages, "micro_batches": workload_of(c, self.plan).micro_batches,
                "attention": self.plan.attention, "kernels": self.plan.kernels, "dtype": self.plan.dtype,
                "activation_checkpointing": c.training.activation_checkpointing,
                "recompute_attention": c.training.recompute_attention,
                "activation_offload": c.training.activation_offload, "optimizer_offload": c.training.optimizer_offload,
                "param_offload": c.training.param_offload, "checkpoint_stride": c.training.checkpoint_stride,
                # the tiles the run takes (`auto` resolved; a loss tile of 0: the kernel's default)
                "mlp_chunk_tokens": self.plan.activation.mlp_chunk_tokens,
                "loss_chunk_tokens": self.plan.activation.loss_chunk_tokens,
                "attention_head_chunks": self.plan.activation.head_chunks,
                "tp_sequence_parallel": c.parallel.tp_sequence_parallel, "fsdp": c.parallel.fsdp,
                "peak_gib": round(self.estimate.peak / GIB, 2), "peak_part": self.estimate.part,
                "usable_gib": round(self.usable / GIB, 2), "communicators": len(run_communicators(self.plan)),
                "communicators_gib": round(communicator_bytes(self.plan) / GIB, 2),
                "largest_block_gib": round(self.estimate.largest.bytes / GIB, 2),
                "host_gib_per_node": round(self.host_per_node / GIB, 1),
                "all_to_all_gb": round(s.bytes["all_to_all"] / 1e9, 2),
                "all_reduce_gb": round(s.bytes["all_reduce"] / 1e9, 2),
                "p2p_gb": round(s.bytes["p2p"] / 1e9, 2), "ring_p2p_gb": round(s.bytes["ring_p2p"] / 1e9, 2),
                "step_s": round(s.total, 4), "tokens_per_s": round(tok_s, 1),
                "mfu": round(mfu, 4), "fits": self.fits}


def estimate_config(cfg: Config, world_size: int, machine: Machine) -> Estimate:
    """The predicted peak per rank of a run of `cfg` on `world_size` ranks of `machine`."""
    return estimate_plan(cfg, resolve(cfg, machine, world_size))


def described_machine(gpus: int, gpu_memory_gib: Optional[float], hw: Hardware,
                      packages: tuple[str, ...] = PLAIN_TORCH, gpu: str = "H100") -> Machine:
    """The machine the planner plans for: nodes of hw.gpus_per_node `gpu`s (fewer when `gpus` is less), of
    `gpu_memory_gib` each (None: what the GPU exposes, plan/machine.py DEVICE_MEMORY_GIB)."""
    return Machine.described(gpu, ranks_per_node=min(gpus, hw.gpus_per_node), memory_gib=gpu_memory_gib,
                             packages=packages)


def evaluate(cfg: Config, gpus: int, gpu_memory_gib: Optional[float], host_memory_gib: Optional[float],
             hw: Hardware, packages: tuple[str, ...] = PLAIN_TORCH, machine: Optional[Machine] = None) -> Prediction:
    """Memory, fit and step time of `cfg` at its own layout, options and kernels on `gpus` GPUs of `machine`
    (default: described_machine with `packages`; `gpu_memory_gib` None: the machine's), resolved as the run
    resolves it. ConfigError for what the run itself would refuse there (kept attention outputs without SDPA,
    say)."""
    machine = machine or described_machine(gpus, gpu_memory_gib, hw, packages)
    return predict(cfg, resolve(cfg, machine, gpus), gpu_memory_gib, host_memory_gib, hw)


def predict(cfg: Config, plan: RunPlan, gpu_memory_gib: Optional[float], host_memory_gib: Optional[float],
            hw: Hardware) -> Prediction:
    """Memory, fit and step time of the run `plan` resolved `cfg` into (`gpu_memory_gib` None: its machine's)."""
    gpu_memory_gib = plan.machine.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    est = estimate_plan(cfg, plan)
    offloaded = sum(t.bytes for t in est.terms if t.host and t.name.startswith("offloaded"))
    step = step_time(cfg.model, plan.degrees, options_of(cfg, plan), precision_of(plan), workload_of(cfg, plan), hw,
                     Overlap(grad_reduce=cfg.parallel.overlap_grad_reduce), retained=offloaded)
    per_node = est.host * min(plan.degrees.world, hw.gpus_per_node)
    why, usable = [], hw.usable_bytes(gpu_memory_gib, est.largest.bytes, communicator_bytes(plan))
    if est.peak > usable:
        why.append(f"peak {est.peak / GIB:.2f} GiB > usable {usable / GIB:.2f} GiB")
    if per_node > 0 and (host_memory_gib is None or per_node > host_memory_gib * GIB):
        why.append(f"host {per_node / GIB:.0f} GiB per node > --host-memory-gib {host_memory_gib}")
    return Prediction(cfg, plan, est, step, not why, per_node, hw, usable, "; ".join(why))


def predicted_step_seconds(cfg: Config, gpus: int, hw: Hardware, machine: Optional[Machine] = None) -> Optional[float]:
    """The step time of `cfg` at its own layout and options on `gpus` GPUs (of `machine`, default the described
    H100s; at data.seq_len, the longest length of a curriculum), or None for a config the model does not cover."""
    try:
        return run_step_seconds(cfg, resolve(cfg, machine or described_machine(gpus, None, hw), gpus), hw)
    except (ConfigError, ValueError):
        return None


def run_step_seconds(cfg: Config, plan: RunPlan, hw: Hardware) -> Optional[float]:
    """The step time of the run `plan` resolved `cfg` into (at data.seq_len, the longest length of a curriculum),
    or None for a run the model does not cover."""
    try:
        memory = 80.0 if plan.machine.memory_gib is None else None       # no device: time only
        return predict(cfg, plan, memory, None, hw).step.total
    except (ConfigError, ValueError):
        return None


def ranking(p: Prediction) -> tuple[float, float, int]:
    """How the search orders the layouts that fit: the fastest step first, then the lower peak, then, between
    otherwise equal layouts, the one with fewer communicators."""
    return p.step.total, p.estimate.peak, len(run_communicators(p.plan))


@dataclass
class Search:
    """How plan() searches, and what it did. `progress(searched, layouts_searched, layouts, fitting)` is told
    before every candidate and once at the end (`fitting`: those found so far). With `top`, only the `top`
    fastest layouts that fit are wanted, with every one whose step is at most `within` seconds besides (a
    layout to rank among them):
    where `prune`, a candidate whose step cannot be that quick (step_floor: its step time before the tiles and
    the offloaded bytes, which only add to it, are known) is not evaluated. plan() counts `evaluated`: the
    candidates whose memory and step time it weighed (tiles and all), the others skipped as unable to fit
    (could_fit) or to rank."""

    progress: Optional[Callable[[int, int, int, int], None]] = None
    top: Optional[int] = None
    within: float = 0.0
    prune: bool = True
    evaluated: int = 0


def plan(cfg: Config, gpus: int, seq_len: int, gpu_memory_gib: Optional[float] = None,
         host_memory_gib: Optional[float] = None, hw: Optional[Hardware] = None,
         packages: tuple[str, ...] = PLAIN_TORCH, search: Optional[Search] = None) -> tuple[list[Prediction], int]:
    """(the layouts that fit, best first, each run once; how many candidates were considered: those that
    validate), on H100s (`hw`, default Hardware()). A layout's batch arithmetic (config.checks.check_world_size)
    is checked once for all its memory options, and a candidate whose peak no tiles can bring within the
    device's usable memory (plan/tiles.py could_fit) is not searched further: it fits at none of them. With
    search.top (Search), the list holds the search.top fastest, exactly those the whole list starts with, and
    any that fit within search.within seconds; the candidates are enumerated as they are searched."""
    hw, search = hw or Hardware(), search or Search()
    cfg = replace(cfg, data=replace(cfg.data, seq_len=seq_len))
    machine = described_machine(gpus, gpu_memory_gib, hw, packages)
    found = _Found(search, hw.usable_bytes(machine.memory_gib))  # at least each layout's own (less its communicators
                                                                 # and its largest block)
    every = list(layouts(cfg, gpus, hw.gpus_per_node))
    for done, layout in enumerate(every):
        try:
            check_world_size(layout, gpus)
        except ConfigError:
            continue
        with shared_estimates():            # what one layout's candidates weigh alike, weighed once
            for cand in layout_options(layout, host_memory_gib is not None):
                if search.progress is not None:
                    search.progress(found.searched, done, len(every), len(found.fitting))
                found.searched += 1
                try:
                    validate_config(cand, world_size=gpus)
                except ConfigError:
                    continue
                found.considered += 1
                try:
                    p = found.weigh(cand, machine, gpus, host_memory_gib, hw)
                except ValueError:    # one the memory model does not cover, or the run refuses (it says which)
                    continue
                if p is not None:
                    found.add(p)
    if search.progress is not None:
        search.progress(found.searched, len(every), len(every), len(found.fitting))
    fitting = sorted(found.fitting, key=ranking)
    return fitting if search.top is None else found.best(fitting), found.considered


def step_floor(cand: Config, plan: RunPlan, hw: Hardware) -> float:
    """The least step time `cand` can have, from `plan`, resolved without tiles or the mask block
    (resolve(tiles=False, mask_block=False), which the step time does not read), its head chunks concrete:
    the step-time model's, at the MLP untiled or in tiles (an `auto` tile may resolve to either; any tile costs
    the same), with no offloaded bytes (which add host copies)."""
    opts = options_of(cand, plan)
    tiles = [opts.mlp_chunk_tokens] if cand.training.mlp_chunk_tokens != "auto" else [0, cand.model.hidden_size]
    return min(step_time(cand.model, plan.degrees, replace(opts, mlp_chunk_tokens=tile), precision_of(plan),
                         workload_of(cand, plan), hw, Overlap(grad_reduce=cand.parallel.overlap_grad_reduce)).total
               for tile in tiles)


class _Found:
    """plan()'s search so far: the runs weighed, the layouts found to fit, and the step time a candidate must
    not exceed to rank (with Search.top and prune)."""

    def __init__(self, search: Search, budget: float) -> None:
        self.search, self.budget = search, budget
        self.fitting: list[Prediction] = []
        self.plans: set = set()
        self.steps: list[float] = []          # the fitting ones' step times, ascending (with Search.top)
        self.searched = self.considered = 0

    def bar(self) -> float:
        """The step time above which a candidate cannot rank: the top-th fastest found so far (or within)."""
        s = self.search
        if s.top is None or not s.prune or len(self.steps) < s.top:
            return float("inf")
        return max(self.steps[s.top - 1], s.within)

    def weigh(self, cand: Config, machine: Machine, gpus: int, host_memory_gib: Optional[float],
              hw: Hardware) -> Optional[Prediction]:
        """`cand`'s prediction, or None where it cannot fit or (pruning) cannot rank, or its run was weighed."""
        bar = self.bar()
        if bar < float("inf") and step_floor(cand, resolve(cand, machine, gpus, tiles=False, mask_block=False),
                                             hw) > bar * (1 + 1e-9):
            return None
        untiled = resolve(cand, machine, gpus, tiles=False)
        if not could_fit(cand, untiled, self.budget - communicator_bytes(untiled)):
            return None
        self.search.evaluated += 1
        p = evaluate(cand, gpus, machine.memory_gib, host_memory_gib, hw, machine=machine)
        if p.plan in self.plans:              # tiles that resolve to another candidate's
            return None
        self.plans.add(p.plan)
        return p if p.fits else None

    def add(self, p: Prediction) -> None:
        self.fitting.append(p)
        if self.search.top is not None:
            bisect.insort(self.steps, p.step.total)

    def best(self, fitting: list[Prediction]) -> list[Prediction]:
        """The top fastest of the sorted `fitting`, and those within Search.within seconds."""
        s = self.search
        return [p for i, p in enumerate(fitting) if i < s.top or p.step.total <= s.within]


@dataclass(frozen=True)
class LongestActivity:
    """The longest activity of the loop a run spends without a heartbeat's pause: a training step or a validation,
    as the planner predicts it, and the parallel.timeout_seconds it needs (twice it: room for the prediction's
    error)."""

    what: str               # "a training step (global batch B x S tokens)" or "a validation (N x ...)"
    seconds: float

    @property
    def timeout_needed(self) -> float:
        return 2 * self.seconds

    @property
    def timeout_suggested(self) -> float:
        """Four times the activity, in whole ten minutes."""
        return 600 * -(-4 * self.seconds // 600)


def longest_activity(cfg: Config, plan: RunPlan, peak_tflops: Optional[float]) -> Optional[LongestActivity]:
    """A training step, or a validation, at the planner's predicted speed on a GPU of `peak_tflops`, whichever is
    longer; None on an unknown GPU (no peak) or outside what the planner covers.

    The step judged is the run's own longest: its global batch (training.global_batch_size, where a batch
    ramp ends), each sample at the longest length of its curriculum (data.seq_len), as `plan`, the run's own,
    lays it out (its machine, attention backend, kernels and ranks per node); a validation is training.eval_steps
    such batches, forward only."""
    if not peak_tflops:
        return None
    nodes = plan.machine.ranks_per_node
    hw = Hardware(peak_tflops=peak_tflops, **({"gpus_per_node": nodes} if nodes else {}))
    step = run_step_seconds(cfg, plan, hw)
    if step is None:
        return None
    t = cfg.training
    validation = step / 3 * t.eval_steps if t.eval_interval else 0.0     # forward passes only
    batch = f"global batch {t.global_batch_size} x {plan.padded_seq_len} tokens"
    if validation > step:
        return LongestActivity(f"a validation ({t.eval_steps} x {batch})", validation)
    return LongestActivity(f"a training step ({batch})", step)


def check_activity_time(cfg: Config, plan: RunPlan, peak_tflops: Optional[float]) -> None:
    """ConfigError when a training step, or a validation (longest_activity), takes more than half of
    parallel.timeout_seconds, the longest the watchdog lets a rank spend on one activity of the loop: it would end
    the run as stuck. The message names the batch and length it judged."""
    longest = longest_activity(cfg, plan, peak_tflops)
    timeout = cfg.parallel.timeout_seconds
    if longest is not None and longest.timeout_needed > timeout:
        raise ConfigError(f"parallel.timeout_seconds={timeout:g} is less than twice the time of {longest.what} "
                          f"predicted for this layout on this GPU (~{longest.seconds:.0f} s at {peak_tflops:g} "
                          f"TFLOP/s; tools/plan.py --explain shows the arithmetic): the watchdog would end it as "
                          f"stuck. Raise it, e.g. --set parallel.timeout_seconds={longest.timeout_suggested:.0f}")


def node_memory_bytes() -> Optional[float]:
    """This node's physical memory (None where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: Config, plan: RunPlan, node_bytes: Optional[float] = None) -> None:
    """ConfigError when what the memory model allocates in host memory per node (offloaded block inputs,
    optimizer or parameter state: memory.Estimate.host per rank, times the ranks of a node) exceeds the node's
    physical memory (`node_bytes`, default this node's), pinned memory cannot be swapped out. A run the
    memory model does not cover is not checked."""
    node_bytes = node_memory_bytes() if node_bytes is None else node_bytes
    try:
        host = estimate_plan(cfg, plan).host
    except ValueError:
        return
    ranks = plan.machine.ranks_per_node or 1
    if node_bytes and host * ranks > node_bytes:
        staging = " or save synchronously (checkpoint.async_save=false)" if plan.async_save else ""
        raise ConfigError(f"this run needs {host * ranks / GIB:.1f} GiB of host memory per node ({ranks} ranks x "
                          f"{host / GIB:.1f} GiB: offloaded activations and optimizer state, checkpoint staging, "
                          f"tools/plan.py --explain itemises them) but the node has {node_bytes / GIB:.1f} GiB: "
                          f"offload less (training.checkpoint_stride, training.activation_offload=false){staging}, "
                          f"or use more nodes")
