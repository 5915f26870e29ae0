"""Pinned host memory of one rank, request by request, as the code makes it: what the run's pinned arenas are
sized from (megalysses/pinned_arena.py, at start-up) and what the memory model's pinned host terms count, so
the bytes the planner counts are the bytes allocated.

    reqs = pinned_requests(m, layout, opts, prec, work, stage)      # this pipeline rank's requests
    arena_bytes(reqs)                                               # what they take: each ALIGN-aligned
    arenas(reqs)                                                    # {owner: bytes}: an arena each

megalysses' own pinned tensors, each requested at its exact size:
    activation offload   one buffer per block input of each forward in flight (parallel/offload.py: every
                         model chunk's offloader keeps its buffers and reuses them; a chunk's first block
                         input is a received pipeline activation, kept on the device, except on the first
                         stage); per chunk, the most forwards in flight over the rank's pipeline schedule
    optimizer offload    (ZeRO-1) each parameter's fp32 master chunk and reduced-gradient chunk (the largest
                         rank's, ceil(rows / G) rows), and with more than one micro-batch per step the
                         staging buffers a later micro-batch's bucket waits in (parallel/host_gradients.py)
    checkpoint staging   (checkpoint.async_save) a copy of every tensor the rank saves, the background write's
                         source (checkpoint/background.py): each parameter as the rank holds it (its tp shard in
                         the compute dtype, or under FSDP its fp32 dim-0 chunk) and its fp32 master, exp_avg and
                         exp_avg_sq chunks (the largest rank's)
Each request names its owner (the optimizer, the offloader of one model chunk, the checkpoint stager), and each
owner takes an arena of its own: an offloader lets all its buffers go when the sequence grows (a curriculum's
next length) and takes them again at the new size, which its own arena always holds (shared with longer-lived
slices, the space freed could be split into ranges too small for them).
What torch pins for FSDP2's CPUOffloadPolicy (parameter offload) goes through torch's caching host allocator
instead, counted by memory.types.torch_pinned: rounded up to a power of two where torch rounds it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalysses.config import ModelConfig
from megalysses.memory.states import param_shapes, shard_elements
from megalysses.degrees import Degrees
from megalysses.memory.types import Options, Precision, Term, Workload, fmt_bytes
from megalysses.pinned_arena import ALIGN, aligned

STAGING = "checkpoint"
"""The owner of the checkpoint staging requests: the background saver, which takes its arena at the first save."""

STAGING_BUFFERS = 2
"""Optimizer offload's staging buffers (parallel/host_gradients.py): a later micro-batch's reduced gradients
wait in one of them for their addition on the host while the next bucket fills another."""


def staging_elements(bucket_elements: int, group: int, rank_elements: int) -> int:
    """Elements of one staging buffer: one rank's share of a bucket (`bucket_elements` over a grad group of
    `group` ranks), or all of its gradients (`rank_elements`) where that is less."""
    return min(-(-bucket_elements // group), rank_elements)


@dataclass(frozen=True)
class PinnedRequest:
    """`count` pinned requests of `nbytes` each, named as the memory model's host terms name them."""

    name: str
    nbytes: int
    count: int
    owner: str          # "optimizer", or "model chunk k": who takes them (an arena each)

    @property
    def total(self) -> int:
        """What they take in an arena (each slice aligned)."""
        return self.count * aligned(self.nbytes)


def offload_buffers(m: ModelConfig, layout: Degrees, opts: Options, work: Workload, stage: int) -> list[int]:
    """How many block-input buffers the activation offloader of each model chunk of pipeline rank `stage`
    makes: the block inputs one forward offloads times the most forwards of that chunk whose backward has not
    started, over the rank's schedule (one micro-batch at a time without a pipeline; P - stage with 1F1B;
    the interleaved order of parallel/interleaved.py)."""
    P, v, M = layout.pp, layout.virtual_stages, work.micro_batches
    stride = opts.checkpoint_stride if opts.checkpointing else 1
    groups = -(-(m.num_layers // (P * v)) // stride)                 # checkpointed groups of one chunk
    per_forward = [groups - (0 if stage == 0 and c == 0 else 1) for c in range(v)]
    if P == 1:
        most = [1] * v
    elif v == 1:
        most = [min(P - stage, M)]
    else:
        most = _interleaved_in_flight(P, v, M, stage)
    return [n * k for n, k in zip(most, per_forward)]


def _interleaved_in_flight(P: int, v: int, M: int, stage: int) -> list[int]:
    """Per local model chunk, the most of its forwards whose backward has not started, over rank `stage`'s
    interleaved order (parallel/interleaved.py rank_order: forwards in groups of P micro-batches, chunk after
    chunk; backwards likewise from the last chunk; Megatron's warm-up of forwards, then one of each)."""
    def chunk(i: int, backward: bool) -> int:
        k = i % (P * v) // P
        return v - 1 - k if backward else k

    total = M * v
    warmup = min((P - stage - 1) * 2 + (v - 1) * P, total)
    order = [(chunk(i, False), 1) for i in range(warmup)]
    for i in range(total - warmup):
        order += [(chunk(warmup + i, False), 1), (chunk(i, True), -1)]
    order += [(chunk(i, True), -1) for i in range(total - warmup, total)]
    most, now = [0] * v, [0] * v
    for c, step in order:
        now[c] += step
        most[c] = max(most[c], now[c])
    return most


def block_input_bytes(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload) -> int:
    """One block input on one rank: (B, S/sp, h) in the compute dtype (S/(sp tp) under TP sequence sharding)."""
    r = layout.tp if opts.tp_sequence_parallel else 1
    return work.micro_batch_size * (work.seq_len // (layout.sp * r)) * m.hidden_size * prec.act


def pinned_requests(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload,
                    stage: int) -> list[PinnedRequest]:
    """The pinned host requests megalysses makes itself on pipeline rank `stage` (the module docstring)."""
    reqs = []
    if opts.offload and opts.checkpointing:
        size = block_input_bytes(m, layout, opts, prec, work)
        reqs += [PinnedRequest("offloaded block inputs", size, n, f"model chunk {c}")
                 for c, n in enumerate(offload_buffers(m, layout, opts, work, stage))]
    if opts.optimizer_offload and not opts.fsdp:
        shards = shard_elements(m, layout, stage == 0, stage == layout.pp - 1)
        for name in ("fp32 masters", "reduced fp32 gradients"):
            reqs += [PinnedRequest(name, 4 * n, count, "optimizer") for n, count in shards]
        if work.micro_batches > 1:
            G = layout.dp * layout.sp
            elements = staging_elements(int(opts.bucket_bytes // 4), G, sum(n * c for n, c in shards))
            reqs.append(PinnedRequest("gradient staging buffers", elements * (4 if G > 1 else prec.weight),
                                      STAGING_BUFFERS, "optimizer"))
    if opts.async_save:
        reqs += staging_requests(m, layout, opts, prec, stage)
    return reqs


def staging_requests(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision,
                     stage: int) -> list[PinnedRequest]:
    """The copy of pipeline rank `stage`'s checkpoint state that a background save writes from: every parameter as
    the rank saves it (ZeRO-1: its tp shard in the compute dtype; FSDP: its fp32 dim-0 chunk) and its optimizer
    state (fp32 master, exp_avg, exp_avg_sq: dim-0 chunks over the grad group; the largest rank's)."""
    first, last = stage == 0, stage == layout.pp - 1
    if opts.fsdp:
        weights = [(4 * n, count) for n, count in shard_elements(m, layout, first, last)]
    else:
        weights = [(rows * row * prec.weight, count) for rows, row, count in param_shapes(m, layout, first, last)]
    chunks = shard_elements(m, layout, first, last)
    return ([PinnedRequest("checkpoint staging: weights", nbytes, count, STAGING) for nbytes, count in weights] +
            [PinnedRequest("checkpoint staging: master and moments", 4 * n, 3 * count, STAGING) for n, count in chunks])


def arena_bytes(reqs: list[PinnedRequest]) -> int:
    """What `reqs` take at once."""
    return sum(r.total for r in reqs)


def arenas(reqs: list[PinnedRequest]) -> dict[str, int]:
    """The bytes of each owner's arena (an offloader that offloads nothing gets an empty one, so that a
    buffer the plan did not count is an error, not an allocation beside the plan)."""
    return {owner: arena_bytes([r for r in reqs if r.owner == owner]) for owner in dict.fromkeys(r.owner for r in reqs)}


def pinned_terms(reqs: list[PinnedRequest]) -> list[Term]:
    """The memory model's host terms of `reqs`, one per name."""
    terms = []
    for name in dict.fromkeys(r.name for r in reqs if r.count and r.nbytes):
        mine = [r for r in reqs if r.name == name]
        count, sizes = sum(r.count for r in mine), {r.nbytes for r in mine if r.count}
        formula = (f"{count} x {fmt_bytes(sizes.pop())}" if len(sizes) == 1 else
                   f"{count} requests, {fmt_bytes(sum(r.count * r.nbytes for r in mine))} asked")
        terms.append(Term(name, sum(r.total for r in mine), formula + f", each {ALIGN}-byte aligned", host=True))
    return terms
