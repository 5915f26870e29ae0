"""The step-time model: predicted seconds per optimizer step on the busiest rank of a layout.

Step time = the compute at stated sustained FLOP/s (with head chunks, each chunk's attention, projections
and all-to-alls once more: its recomputation in the backward) + the communication megalysses does not overlap
(tp collectives, Ulysses all-to-alls, pipeline p2p, ZeRO-1's parameter all-gather; the ring's K/V and
dK/dV hops beyond the attention they travel under; the gradient reduce-scatter beyond the last
backward; FSDP beyond its micro-batch) at stated bandwidths + the pipeline bubble + host copies beyond
the compute (activation offload; with optimizer offload the gradients streamed out in every micro-batch;
with parameter offload every block's fp32 shard copied in for its forward and its backward and its
gradient shard copied out) + the optimizer step (on the host's cores with either offload). The
figures are `Hardware`'s (H100 SXM nodes of 8 by default); the layout, options, precision and workload
are the memory model's (megalysses.memory), read off a RunPlan by megalysses.plan.search.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from megalysses.config import ModelConfig
from megalysses.degrees import Degrees
from megalysses.memory import GIB, Options, Precision, Workload, head_norm_params, kv_replication, \
    layer_params, stage_layers, stage_params, tiled
from megalysses.plan.flops import attended_keys


@dataclass(frozen=True)
class Hardware:
    """Stated figures (H100 SXM defaults); each is a command-line flag."""

    peak_tflops: float = 989.0            # dense bf16 peak of one H100 SXM (datasheet)
    matmul_efficiency: float = 0.6        # sustained fraction of the peak over a training step's matmuls,
                                          # with the memory-bound kernels between them (one value that
                                          # reproduces Megatron-Core's nine published H100 MFU points)
    attention_efficiency: float = 0.35    # FlashAttention-2 class kernels, forward + backward
    intra_node_gbs: float = 360.0         # NVLink bus bandwidth per GPU (80% of 450 GB/s per direction)
    inter_node_gbs: float = 40.0          # network per GPU (80% of 400 Gb/s)
    host_gbs: float = 50.0                # host <-> device copies per GPU (PCIe Gen5 x16)
    host_adam_gparams: float = 0.25       # billions of parameters per second that one GPU's share of the
                                          # host's cores updates with torch's foreach AdamW (optimizer offload)
    hbm_gbs: float = 2680.0               # device memory bandwidth (80% of 3.35 TB/s): the optimizer step
    kernel_matmul_efficiency: float = 0.75    # sustained fraction of the peak of a matmul kernel alone (the
                                              # traced roofline's: it times the memory-bound kernels apart)
    launch_us: float = 4.0                # microseconds between two kernels queued back to back (the traced
                                          # roofline's launch overhead per kernel)
    gpus_per_node: int = 8
    reserve_gib: float = 1.0              # what no allocator trace sees besides the communicators (estimates, not
                                          # measured here): the CUDA context, about 0.5 GiB on an H100 under CUDA
                                          # 12's lazy module loading; cuBLAS and cuBLASLt workspaces, tens of MiB per
                                          # stream; the rest, slack. NCCL's buffers are counted per communicator
                                          # of the layout (plan/communicators.py), beside this
    fragmentation: float = 0.05           # the least share of the device held back for the caching allocator's
                                          # fragmentation; the allowance is at least the largest single block

    def __post_init__(self) -> None:
        bad = hardware_problems(asdict(self))
        if bad:
            raise ValueError("Hardware: " + "; ".join(f"{name} {why}" for name, why in bad.items()))

    def allowance_bytes(self, gpu_memory_gib: float, largest_block: float = 0.0) -> float:
        """What the caching allocator's fragmentation may cost: `fragmentation` of the device, and at least the
        largest single block (a free range split among smaller blocks cannot take it; expandable segments,
        set at start-up, keep the rest small)."""
        return max(self.fragmentation * gpu_memory_gib * GIB, largest_block)

    def usable_bytes(self, gpu_memory_gib: float, largest_block: float = 0.0, communicators: float = 0.0) -> float:
        """The device budget: its memory less the reserve, the layout's communicators (`communicators` bytes:
        plan/communicators.py communicator_bytes; 0, an upper bound, where no layout is given) and the fragmentation
        allowance (`largest_block`: the largest single allocation, memory.Estimate.largest)."""
        return (gpu_memory_gib * GIB - self.reserve_gib * GIB - communicators
                - self.allowance_bytes(gpu_memory_gib, largest_block))

    def link(self, span: int) -> float:
        """Bandwidth (bytes/s) of a group whose ranks span `span` consecutive world ranks."""
        return (self.intra_node_gbs if span <= self.gpus_per_node else self.inter_node_gbs) * 1e9


# what each figure must be: efficiencies are fractions of the peak, rates and bandwidths are divided by
_FRACTION = ("matmul_efficiency", "attention_efficiency", "kernel_matmul_efficiency")
_POSITIVE = ("peak_tflops", "intra_node_gbs", "inter_node_gbs", "host_gbs", "host_adam_gparams", "hbm_gbs")


def hardware_problems(values: Mapping[str, Any]) -> dict[str, str]:
    """{field: what it must be, and what it is} for each of Hardware's figures in `values` that is out of
    range: efficiencies in (0, 1], the peak, bandwidths and rates positive and finite, at least one GPU per
    node, a reserve of zero or more GiB, a fragmentation in [0, 1)."""
    out = {}
    for name, v in values.items():
        if name in _FRACTION and not 0 < v <= 1:
            out[name] = f"must be in (0, 1] (a fraction of the peak), got {v:g}"
        elif name in _POSITIVE and not (v > 0 and math.isfinite(v)):
            out[name] = f"must be positive and finite, got {v:g}"
        elif name == "gpus_per_node" and not v >= 1:
            out[name] = f"must be at least 1, got {v}"
        elif name in ("reserve_gib", "launch_us") and not (v >= 0 and math.isfinite(v)):
            out[name] = f"must be zero or more, got {v:g}"
        elif name == "fragmentation" and not 0 <= v < 1:
            out[name] = f"must be in [0, 1) (a share of the device), got {v:g}"
    return out


@dataclass(frozen=True)
class Overlap:
    """Which communication hides behind compute (megalysses: only the gradient reduction)."""

    tp: bool = False
    ulysses: bool = False
    p2p: bool = False
    grad_reduce: bool = True
    param_gather: bool = False


@dataclass
class StepTime:
    compute: float            # seconds of compute per step on one rank (micro-batches x stage)
    exposed: dict[str, float]  # seconds of communication / copies that compute does not hide, by kind
    bubble: float
    optimizer: float
    bytes: dict[str, float]   # bytes per step per rank: all_to_all, all_reduce (tp + gradients), p2p, host
    flops: dict[str, float]   # FLOPs per step per rank: matmul, attention (recompute included)

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.bubble + self.optimizer

    def terms(self) -> dict[str, float]:
        """The seconds that add up to `total`, by name."""
        return {"compute": self.compute, **{f"exposed {k}": v for k, v in self.exposed.items()},
                "pipeline bubble": self.bubble, "optimizer": self.optimizer}

    def breakdown(self, hw: "Hardware") -> dict[str, float]:
        """The seconds of `total` in the traced roofline's categories (megalysses.training.roofline.CATEGORIES),
        and the pipeline bubble (which a trace of one rank cannot see): compute (the matmuls, and the ring's
        merges, memory-bound passes), attention, masks and launches (the model has no term for either),
        communication not overlapped, host copies, optimizer."""
        merges = "ring merges (fp32, device memory)"
        copies = "host copies (offload)"
        attention = self.flops["attention"] / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
        return {"compute": self.compute - attention + self.exposed.get(merges, 0.0), "attention": attention,
                "masks": 0.0,
                "communication": sum(v for k, v in self.exposed.items() if k not in (merges, copies)),
                "host copies": self.exposed.get(copies, 0.0), "optimizer": self.optimizer, "launches": 0.0,
                "pipeline bubble": self.bubble}


@dataclass
class _Compute:
    """A step's arithmetic on the busiest rank, and what the collectives' counts need of it."""

    tokens: float           # per micro-batch per rank
    layers: int             # on the stage
    q: float                # query (and output) width per rank
    kv: float               # K/V width per rank after replication to the Ulysses degree
    recomputes: int         # forwards recomputed in the backward
    forwards: int           # of attention, per layer
    mm: float               # matmul FLOPs per step
    attn: float             # attention FLOPs per step
    seconds: float          # both at the hardware's efficiencies


def _compute(m: ModelConfig, layout: Degrees, opts: Options, work: Workload, hw: Hardware) -> _Compute:
    t, P, M = layout.tp, layout.sp, work.micro_batches
    tokens = work.micro_batch_size * work.seq_len / P                 # per micro-batch per rank
    L = stage_layers(m, layout)
    dense = layer_params(m, t) - 2 * m.hidden_size - head_norm_params(m)
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden_size * m.ffn_size / t
    # with head chunks each chunk replicates its own KV heads to the Ulysses degree when it has fewer
    N = opts.head_chunks
    hk = m.kv_heads // t // N
    q, kv = m.num_heads * m.head_size / t, N * hk * kv_replication(hk, layout.ulysses) * m.head_size
    fwd_mm = L * 2 * dense * tokens
    # causal: 4 S q FLOPs per key a query attends, S/2 of them on average (flops.attended_keys); a sliding window
    # spares work where the kernel skips masked blocks (flash-attn, FlexAttention), not with dense masks
    window = m.sliding_window if opts.attention in ("flash", "flex") else 0
    fwd_attn = L * 4 * work.micro_batch_size * work.seq_len * attended_keys(work.seq_len, window) * q / P
    head = 2 * m.padded_vocab_size(t) / t * m.hidden_size * tokens
    # forwards recomputed in the backward: one under checkpointing, two with a stride (the group's, the block's)
    recomputes = (2 if opts.checkpoint_stride > 1 else 1) if opts.checkpointing else 0
    # the block's recomputation runs its attention projections again, and its MLP: in tiles, each tile's forward
    # once more in its own backward besides (the tiles keep nothing); untiled, up to the last tensor the backward
    # saved (torch.utils.checkpoint's early stop): the down projection, whose output nothing saves, does not run
    mlp_mm, down = L * 2 * mlp * tokens, L * 2 * m.hidden_size * m.ffn_size / t * tokens
    redo_mm = (fwd_mm - mlp_mm) * recomputes
    if tiled(opts.mlp_chunk_tokens, layout, opts, work.seq_len):
        redo_mm += mlp_mm * (1 + recomputes)
    else:
        redo_mm += (mlp_mm - down) * recomputes
    if N > 1:       # each head chunk's forward runs again in its backward: QKV and output projections
        redo_mm += L * 2 * (m.hidden_size * (q + 2 * m.kv_heads * m.head_size / t) + q * m.hidden_size) * tokens
    mm = M * (3 * (fwd_mm + head) + redo_mm)
    # forward, backward (twice the forward), and under checkpointing the recomputations, unless their output is
    # kept; head chunks recompute attention once more (per chunk, in the backward); a ring's FlexAttention blocks
    # run their forward again in their backward (kernels/block_attention.py: the block's own output and LSE)
    forwards = 1 + (0 if opts.keep_attention else recomputes) + (N > 1)     # of attention, per layer
    again = layout.ring > 1 and opts.attention == "flex"
    attn = M * fwd_attn * (forwards + again + 2)
    seconds = (mm / (hw.peak_tflops * 1e12 * hw.matmul_efficiency)
               + attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency))
    return _Compute(tokens, L, q, kv, recomputes, forwards, mm, attn, seconds)


@dataclass(frozen=True)
class _Step:
    """What step_time is asked about, handed as one to the terms it adds up."""

    m: ModelConfig
    layout: Degrees
    opts: Options
    prec: Precision
    work: Workload
    hw: Hardware
    overlap: Overlap


def _model_parallel_comm(s: _Step, c: _Compute, nbytes: dict, exposed: dict) -> None:
    """The Ulysses all-to-alls, the ring's hops and merges, the tensor-parallel collectives and the pipeline's
    p2p: their bytes into `nbytes`, their seconds not hidden under compute into `exposed`."""
    m, layout, opts, prec, work, hw, overlap = s.m, s.layout, s.opts, s.prec, s.work, s.hw, s.overlap
    t, P, M, u, ring = layout.tp, layout.sp, work.micro_batches, layout.ulysses, layout.ring
    tokens, L, q, kv, a = c.tokens, c.layers, c.q, c.kv, prec.act
    passes = 2 + c.recomputes                                            # forward, backward (+ recomputes)
    attn_passes = passes + (opts.head_chunks > 1)  # head chunks: the all-to-alls and the ring's hops once more
    if u > 1:
        a2a = (u - 1) / u * tokens * (2 * q + 2 * kv) * a * L * attn_passes * M
        nbytes["all_to_all"] = a2a
        exposed["Ulysses all-to-all"] = 0.0 if overlap.ulysses else a2a / hw.link(t * u)
    if ring > 1:
        # K/V blocks go around the ring in each forward (and the recomputation) and again in the backward,
        # r - 1 hops each; the fp32 dK/dV accumulators r hops (parallel/ring.py). Each hop is posted before
        # the block's attention, so only what the attention does not cover shows
        block = tokens * 2 * kv                                            # elements of one K/V block
        nbytes["ring_p2p"] = ((ring - 1) * attn_passes * block * a + ring * block * 4) * L * M
        attention = c.attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
        exposed["ring p2p"] = max(0.0, nbytes["ring_p2p"] / hw.link(t * P) - attention)
        # what one fused kernel over the whole sequence does not do: at each of the r steps the block's output is
        # merged into the fp32 output and LSE (every forward), and the backward adds the block's dq and dK/dV into
        # fp32 accumulators (parallel/ring.py); each a memory-bound pass of about (a + 8) bytes an element
        merges = ring * L * M * tokens * (q * c.forwards + q + 2 * kv) * (a + 8)
        exposed["ring merges (fp32, device memory)"] = merges / (hw.hbm_gbs * 1e9)
    if t > 1:
        per = (t - 1) / t * tokens * m.hidden_size * a
        if opts.tp_sequence_parallel:
            tp = per * (2 + 2) * L * passes * M                            # QKV, gate-up gathers; 2 reduce-scatters
        else:
            tp = 2 * per * 2 * L * passes * M                              # 2 all-reduces, ring 2(t-1)/t
        nbytes["all_reduce"] += tp
        exposed["tensor-parallel collectives"] = 0.0 if overlap.tp else tp / hw.link(t)
    if layout.pp > 1:
        r = t if opts.tp_sequence_parallel else 1
        p2p = 2 * tokens / r * m.hidden_size * 4 * M * layout.virtual_stages
        nbytes["p2p"] = p2p
        exposed["pipeline p2p"] = 0.0 if overlap.p2p else p2p / hw.link(layout.world)


def _data_parallel_comm(s: _Step, n: float, compute: float, nbytes: dict, exposed: dict) -> None:
    """FSDP's gathers and reduce-scatters, or ZeRO-1's gradient reduce-scatter and parameter all-gather, over the
    dp x sp ranks that hold the same weights (`n` parameters, `compute` seconds to hide under): bytes into
    `nbytes`, what compute does not hide into `exposed`."""
    layout, opts, prec, M, hw, overlap = s.layout, s.opts, s.prec, s.work.micro_batches, s.hw, s.overlap
    G = layout.dp * layout.sp
    if G <= 1:
        return
    span_grad, a, per_mb = layout.tp * layout.sp * layout.dp, prec.act, compute / M
    share = (G - 1) / G * n
    if opts.fsdp:
        fsdp = M * share * (2 * a + 4)                                # gathers forward + backward, fp32 reduce
        nbytes["all_reduce"] += fsdp
        exposed["FSDP gathers and reduce-scatters"] = max(0.0, fsdp / hw.link(span_grad) - compute)
    elif opts.optimizer_offload:     # every micro-batch's buckets reduced during its own backward
        reduce, gather = share * 4, share * prec.weight
        nbytes["all_reduce"] += M * reduce + gather
        rs = reduce / hw.link(span_grad)
        exposed["gradient reduce-scatter"] = M * max(0.0, rs - 2 / 3 * per_mb)
        exposed["parameter all-gather"] = 0.0 if overlap.param_gather else gather / hw.link(span_grad)
    else:
        reduce, gather = share * 4, share * prec.weight
        nbytes["all_reduce"] += reduce + gather
        rs = reduce / hw.link(span_grad)
        exposed["gradient reduce-scatter"] = max(0.0, rs - 2 / 3 * per_mb) if overlap.grad_reduce else rs
        exposed["parameter all-gather"] = 0.0 if overlap.param_gather else gather / hw.link(span_grad)


def _host_and_optimizer(s: _Step, n: float, compute: float, retained: float, nbytes: dict, exposed: dict) -> float:
    """The host copies of the offloads (bytes into `nbytes`, what compute does not hide into `exposed`), and
    the optimizer step's seconds: on the device, or on the host's cores with the optimizer or the parameters
    offloaded."""
    layout, opts, prec, M, hw = s.layout, s.opts, s.prec, s.work.micro_batches, s.hw
    G = layout.dp * layout.sp
    copies = 0.0                     # host <-> device bytes per step beyond the optimizer's own
    if opts.offload:
        copies += 2 * retained
    if opts.optimizer_offload and not opts.fsdp:
        copies += M * n / G * 4                                          # reduced fp32 chunks out
    if opts.param_offload and opts.fsdp:
        copies += M * n / G * (2 * 4 + 4)                                # fp32 shards in twice, gradients out
    if copies:
        nbytes["host"] = copies
        exposed["host copies (offload)"] = max(0.0, copies / (hw.host_gbs * 1e9) - compute)
    if opts.optimizer_offload and not opts.fsdp:   # weights back up, the update on the host's cores
        moved = n * prec.weight / G
        nbytes["host"] += moved
        return moved / (hw.host_gbs * 1e9) + n / G / (hw.host_adam_gparams * 1e9)
    if opts.param_offload and opts.fsdp:          # the update on the host's cores, in place
        return n / G / (hw.host_adam_gparams * 1e9)
    return n / G * (prec.master + prec.moments + 4) * 3 / (hw.hbm_gbs * 1e9)


def step_time(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload, hw: Hardware,
              overlap: Overlap = Overlap(), retained: float = 0.0) -> StepTime:
    """Predicted seconds per optimizer step on the busiest rank. `retained`: activation bytes per step
    that activation offload copies out and back."""
    M = work.micro_batches
    c = _compute(m, layout, opts, work, hw)
    nbytes: dict[str, float] = {"all_to_all": 0.0, "all_reduce": 0.0, "p2p": 0.0, "ring_p2p": 0.0, "host": 0.0}
    exposed: dict[str, float] = {}
    step = _Step(m, layout, opts, prec, work, hw, overlap)
    _model_parallel_comm(step, c, nbytes, exposed)
    n = max(sum(stage_params(m, layout, s == 0, s == layout.pp - 1)) for s in (0, layout.pp - 1))
    _data_parallel_comm(step, n, c.seconds, nbytes, exposed)
    optimizer = _host_and_optimizer(step, n, c.seconds, retained, nbytes, exposed)
    comm_mb = sum(exposed.get(k, 0.0) for k in ("Ulysses all-to-all", "ring p2p", "tensor-parallel collectives",
                                                 "pipeline p2p")) / M
    bubble = (layout.pp - 1) / layout.virtual_stages * (c.seconds / M + comm_mb)
    return StepTime(compute=c.seconds, exposed=exposed, bubble=bubble, optimizer=optimizer, bytes=nbytes,
                    flops={"matmul": c.mm, "attention": c.attn})
