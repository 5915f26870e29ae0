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
from megalysses.kernels.block_mask import ROW_CHUNK
from megalysses.kernels.linear_cross_entropy import default_chunk_tokens
from megalysses.kernels.norms import NORM_TILE_ELEMENTS
from megalysses.memory import GIB, KERNELS, Options, Precision, Workload, head_norm_params, kv_replication, \
    layer_params, stage_layers, stage_params, tiled
from megalysses.plan.flops import attended_keys


@dataclass(frozen=True)
class Hardware:
    """Stated figures (H100 SXM defaults); each is a command-line flag."""

    peak_tflops: float = 989.0            # dense bf16 peak of one H100 SXM (datasheet)
    matmul_efficiency: float = 0.7        # sustained fraction of the peak of the matmul kernels alone, the
                                          # memory-bound kernels between them counted apart (at hbm_gbs, their
                                          # bytes: KERNEL_PASSES); with them, Megatron-Core's nine published
                                          # H100 MFU points (tests/test_plan.py)
    attention_efficiency: float = 0.35    # FlashAttention-2 class kernels, forward + backward (a backward
                                          # counted as 2.5 forwards, torch.utils.flop_counter's count)
    intra_node_gbs: float = 360.0         # NVLink bus bandwidth per GPU (80% of 450 GB/s per direction)
    inter_node_gbs: float = 40.0          # network per GPU (80% of 400 Gb/s)
    host_gbs: float = 50.0                # host <-> device copies per GPU (PCIe Gen5 x16)
    host_adam_gparams: float = 0.25       # billions of parameters per second that one GPU's share of the
                                          # host's cores updates with torch's foreach AdamW (optimizer offload)
    hbm_gbs: float = 2680.0               # device memory bandwidth (80% of 3.35 TB/s): the memory-bound kernels
    launch_us: float = 4.0                # microseconds between two kernels queued back to back (a launch
                                          # overhead per kernel)
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
_FRACTION = ("matmul_efficiency", "attention_efficiency")
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
    bytes: dict[str, float]   # bytes per step per rank: all_to_all, all_reduce (tp + gradients), p2p, host, memory
                              # (the memory-bound kernels')
    flops: dict[str, float]   # FLOPs per step per rank: matmul, attention (recompute included)
    launches: float = 0.0     # seconds of kernel launches (launch_us each)
    kernels: int = 0          # kernels launched per step

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.bubble + self.optimizer + self.launches

    def terms(self) -> dict[str, float]:
        """The seconds that add up to `total`, by name."""
        return {"compute": self.compute, **{f"exposed {k}": v for k, v in self.exposed.items()},
                "pipeline bubble": self.bubble, "optimizer": self.optimizer, "launches": self.launches}

    def breakdown(self, hw: "Hardware") -> dict[str, float]:
        """The seconds of `total` in the traced roofline's categories (megalysses.training.roofline.CATEGORIES),
        and the pipeline bubble (which a trace of one rank cannot see): compute (the matmuls and the memory-bound
        kernels, the ring's merges among them), attention, masks (FlexAttention's block-mask builds), communication
        not overlapped, host copies, optimizer, launches."""
        merges, copies = "ring merges (fp32, device memory)", COPIES
        attention = self.flops["attention"] / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
        return {"compute": self.compute - attention + self.exposed.get(merges, 0.0), "attention": attention,
                "masks": self.exposed.get(MASKS, 0.0),
                "communication": sum(v for k, v in self.exposed.items() if k not in (merges, copies, MASKS)),
                "host copies": self.exposed.get(copies, 0.0), "optimizer": self.optimizer, "launches": self.launches,
                "pipeline bubble": self.bubble}


@dataclass(frozen=True)
class KernelPasses:
    """What one kernel set's memory-bound kernels cost (norms, RoPE, SwiGLU, residual adds, casts, the copies
    around the projections and attention, gradient accumulation): bytes read and written in device memory, at
    bf16 activations, per token of the rank and element of a width (hidden h, which takes the query width with
    it, MLP ffn/tp, K/V kv per rank) or per parameter, and the kernels launched. Counted by the traced step at
    small shapes (tests/test_step_trace.py holds the two together), per kernel set: the torch references run a
    norm, RoPE and SwiGLU as several kernels each, fp32 in between; the fused Triton kernels one each."""

    layer: tuple[float, float, float]       # a layer's forward and backward: bytes/token per (h, f, kv) element
    recompute: tuple[float, float, float]   # the block's recomputed forward (activation checkpointing)
    head: float                     # bytes/token per h element outside the layers (embedding, final norm)
    chunks: tuple[float, float]     # head chunks: bytes/token per (q + kv) element; per h element and chunk
    tiles: tuple[float, float]      # MLP tiles: bytes/token per f element; per MLP parameter and tile (the
                                    # weight gradients each tile's backward adds)
    launches: tuple[int, int, int]  # kernels per layer: each micro-batch, each recomputation, each step
    chunk_launches: tuple[int, int]     # (a, b): a head-chunked layer launches a N - b more
    tile_launches: tuple[int, int]      # (a, b): a tiled MLP launches a K - b more (K tiles), without checkpointing
    tile_recompute_launches: tuple[int, int]    # and (a, b) more each recomputation (the block's tiles' forward
                                                # again: the norm, the up projections and the activation per tile)
    micro_batch_launches: int           # per micro-batch outside the layers (embedding, head, loss)
    fsdp_launches: int                  # FSDP2's kernels per layer and micro-batch on one rank (unsharded), in
                                        # place of ZeRO-1's gradient casts
    chunk_norm_tile_launches: int       # a head-chunked layer's norm backward over row tiles of NORM_TILE_ELEMENTS
                                        # (model/tiled.py norm_backward_into: the norm again, its backward, the
                                        # weight gradient's sum and cast, the tile's gradient copied): each tile
                                        # beyond the first, beyond the norm tiles' own (NORM_TILE_LAUNCHES)
    params: tuple[float, float] = (17.1, 18.0)  # bytes per parameter outside the optimizer: each micro-batch (its
                                                # gradients' casts and sums), each step (ZeRO-1's gradient buckets)
    loss: float = 70.5              # bytes/token per vocabulary element (per rank) of the LM head's memory-bound
                                    # kernels: the fp32 logits' casts, softmax and its gradient


# torch and triton are counted; liger and apex (fused norms and RoPE, Triton SwiGLU) as triton
_TRITON = KernelPasses(layer=(56.6, 16.7, 16.5), recompute=(21.0, 6.0, 8.0), head=28.6, chunks=(24.3, 4.0),
                       tiles=(31.3, 10.5), launches=(44, 8, 32), chunk_launches=(23, 9), tile_launches=(23, 6),
                       tile_recompute_launches=(6, 2), micro_batch_launches=74, fsdp_launches=69,
                       chunk_norm_tile_launches=6)
KERNEL_PASSES: dict[str, KernelPasses] = {
    "torch": KernelPasses(layer=(445.7, 36.7, 72.5), recompute=(107.2, 14.1, 34.8), head=185.6,
                          chunks=(83.0, 7.0), tiles=(39.3, 10.0), launches=(142, 38, 32), chunk_launches=(73, 25),
                          tile_launches=(67, 44), tile_recompute_launches=(14, 11), micro_batch_launches=106,
                          fsdp_launches=61, chunk_norm_tile_launches=22),
    "triton": _TRITON, "liger": _TRITON, "apex": _TRITON}
FSDP_BYTES = (69.6, 31.3)    # FSDP2's casts, copies and gradients per block parameter per micro-batch (in place of
                             # KernelPasses.params): one rank, sharded
FSDP_ROOT_BYTES = (288.0, 0.0)      # the same per parameter of the root unit (embedding, LM head)
FSDP_LAUNCHES = 45.5         # FSDP2's kernels per layer, sharded, each step (the norm's square and sum per
                             # parameter); one rank's by kernel set (KernelPasses.fsdp_launches)
FSDP_PARAM_OFFLOAD_LAUNCHES = -32    # one rank's FSDP2 with its shards in host memory: kernels per layer and
                                     # micro-batch beside fsdp_launches (counted at one micro-batch)
OFFLOAD_LAUNCHES = 3         # activation offload, per layer and micro-batch: the block input's copy to the host,
                             # its fetch back, the zeros its backward starts from (parallel/offload.py)
ZERO_LAUNCHES = 3            # ZeRO-1's kernels per layer and step over a group, beside KernelPasses.launches[2]
ZERO_RANK_LAUNCHES = 2       # and per parameter tensor and rank of the group: its chunk for that rank padded into
                             # the reduce-scatter's input, the rank's updated chunk copied back into the parameter
                             # (parallel/grad_reduce.py _rank_chunk, parallel/zero.py gather_params)
NORM_TILE_LAUNCHES = 44      # kernels of each torch norm tile beyond the first, forward and backward
LOSS_TILE_LAUNCHES = 36      # kernels of each LM head and loss tile beyond the first
LOSS_TILE_BYTES = 20.0       # and its bytes per head parameter (the fp32 weight gradient's sum)
ULYSSES_BYTES = (21.0, 17.0)     # bytes/token per element of q and kv (per rank) around Ulysses' all-to-alls
                                 # (the heads' stack and cat): each forward (recomputations and a head chunk's
                                 # again in its backward among them), the backward
ULYSSES_LAUNCHES = 16        # their kernels per layer and head chunk at a forward and its recomputation
ULYSSES_FORWARD_LAUNCHES = 5     # each forward more (a head chunk's again in its backward)
RING_BYTES = (34.0, 145.0)   # a ring's bytes/token per element of q and kv: per block, per layer (beside its merges)
RING_LAUNCHES = (50, 4)      # a ring's kernels per layer and head chunk at a forward and its recomputation: per
                             # block, once
RING_FORWARD_LAUNCHES = (14, 4)     # each forward of a ring more (a head chunk's again in its backward): per block
                                    # (the block's attention, its merge into the fp32 output and LSE), once
MASK_LAUNCHES = 90           # kernels of a ring block's block-mask build (per micro-batch)
MASK_ROW_LAUNCHES = (24, 10)  # and of each group of its rows beyond the first (kernels/block_mask.py: ROW_CHUNK
                              # block-matrix entries at a time): the block matrices', each of the 4 orderings'
STEP_LAUNCHES = 62           # per step: the norm, clipping and torch's foreach AdamW
MASKS, COPIES = "block-mask builds", "host copies (offload)"
MASK_QUERY_BYTES = 448.0     # a block mask's build: bytes per query (each query's interval of keys, its blocks)
MASK_PAIR_BYTES = 400.0      # and per pair of blocks (the block matrices, their orderings into FlexAttention's
                             # index tensors): counted by the trace up to 1.5M x 1.5M tokens, where the pairs dominate
HOST_NORM = 1.1             # the host's AdamW with the gradient norm and the clipping beside it: a pass of ten more
ADAM_BYTES = 84              # torch's foreach AdamW (decay, lerp, mul, addcmul, sqrt, div, add, addcdiv) per fp32
                             # element


def _tensors(m: ModelConfig, pp: int = 1) -> tuple[int, int]:
    """Parameter tensors of a block (the fused QKV, output, fused gate-up or first and down projections, two
    norms, and their biases, q and k head norms) and of the root (embedding, LM head unless tied or staged, the
    final norm)."""
    norm = 2 if m.norm == "layernorm" else 1
    block = 4 + 2 * norm + m.qkv_bias + m.attention_bias + 2 * m.mlp_bias + 2 * m.qk_layernorm
    return block, (1 if m.tie_embeddings or pp > 1 else 2) + norm


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
    memory: float = 0.0     # bytes the memory-bound kernels read and write per step
    launches: int = 0       # kernels launched per step
    seconds: float = 0.0    # the three at the hardware's efficiencies and bandwidth


def _compute(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload, hw: Hardware) -> _Compute:
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
    if N > 1:       # each head chunk's QKV projection runs again in its backward (its output projection's
        # gradients are taken by hand from the chunk's attention output: model/tiled.py chunks_backward)
        redo_mm += L * 2 * m.hidden_size * (q + 2 * m.kv_heads * m.head_size / t) * tokens
    mm = M * (3 * (fwd_mm + head) + redo_mm)
    # forward, backward (2.5 forwards: torch.utils.flop_counter's count, to which attention_efficiency is
    # fitted), and under checkpointing the recomputations, unless their output is kept; head chunks recompute
    # attention once more (per chunk, in the backward); a ring's FlexAttention blocks run their forward again in
    # their backward (kernels/block_attention.py: the block's own output and LSE)
    forwards = 1 + (0 if opts.keep_attention else recomputes) + (N > 1)     # of attention, per layer
    again = layout.ring > 1 and opts.attention == "flex"
    attn = M * fwd_attn * (forwards + again + 2.5)
    c = _Compute(tokens, L, q, kv, recomputes, forwards, mm, attn)
    c.memory, c.launches = _memory_passes(m, layout, opts, work, c, prec.weight < 4)
    c.memory *= prec.act / 2             # counted at bf16 activations
    c.seconds = (mm / (hw.peak_tflops * 1e12 * hw.matmul_efficiency)
                 + attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency) + c.memory / (hw.hbm_gbs * 1e9))
    return c


def _memory_passes(m: ModelConfig, layout: Degrees, opts: Options, work: Workload, c: _Compute,
                   narrow: bool) -> tuple[float, int]:
    """(bytes, kernels) of a step's memory-bound kernels and every kernel it launches, but the optimizer's
    bytes (KERNEL_PASSES: per layer and micro-batch by width and parameter, head chunks, MLP tiles, Ulysses'
    all-to-alls and the ring; the LM head by the vocabulary; FSDP2's and ZeRO-1's per parameter). `narrow`:
    weights narrower than fp32, which ZeRO-1 gathers cast (a kernel per gradient bucket)."""
    k, t, M, L, T = KERNEL_PASSES[opts.kernels], layout.tp, work.micro_batches, c.layers, c.tokens
    shard = t if opts.tp_sequence_parallel else 1          # TP sequence sharding splits the residual stream
    h = m.hidden_size / shard
    widths = (h, m.ffn_size / t, c.kv)
    per_token = sum(w * (a + c.recomputes * r) for w, a, r in zip(widths, k.layer, k.recompute))
    params = layer_params(m, t)
    per_mb = 0.0                                                    # bytes per layer and micro-batch, not by token
    launches = k.launches[0] + c.recomputes * k.launches[1]
    # the torch norms run over row tiles of NORM_TILE_ELEMENTS (kernels/norms.py), two a layer and the final one;
    # a head-chunked layer's norm backward over row tiles with every kernel set
    row_tiles = math.ceil(T / shard * m.hidden_size / NORM_TILE_ELEMENTS) - 1
    N = opts.head_chunks
    if N > 1:
        per_token += k.chunks[0] * (c.q + c.kv) + N * k.chunks[1] * h
        launches += k.chunk_launches[0] * N - k.chunk_launches[1] + k.chunk_norm_tile_launches * row_tiles
    if tiled(opts.mlp_chunk_tokens, layout, opts, work.seq_len):
        tiles = math.ceil(T / shard / opts.mlp_chunk_tokens)
        per_token += k.tiles[0] * widths[1] * (1.0 if c.recomputes else 0.75)
        per_mb += tiles * k.tiles[1] * (3 if m.mlp == "swiglu" else 2) * m.hidden_size * widths[1]
        redo = k.tile_recompute_launches
        launches += (k.tile_launches[0] + c.recomputes * redo[0]) * tiles - k.tile_launches[1] - c.recomputes * redo[1]
    norm_tiles = row_tiles * KERNELS[opts.kernels].norm_tiled
    launches += 2 * NORM_TILE_LAUNCHES * norm_tiles
    if layout.ulysses > 1:
        a2a_forwards = 1 + c.recomputes + (N > 1)
        per_token += (ULYSSES_BYTES[0] * a2a_forwards + ULYSSES_BYTES[1]) * (c.q + c.kv)
        launches += (ULYSSES_LAUNCHES + (c.forwards - 2) * ULYSSES_FORWARD_LAUNCHES) * N
    if layout.ring > 1:     # each of the r blocks, each head chunk: slices, fp32 accumulations, the K/V stack
        per_token += (RING_BYTES[0] * layout.ring + RING_BYTES[1]) * (c.q + c.kv)
        forwards = RING_FORWARD_LAUNCHES[0] * layout.ring + RING_FORWARD_LAUNCHES[1]
        launches += (RING_LAUNCHES[0] * layout.ring + RING_LAUNCHES[1] + (c.forwards - 2) * forwards) * N
    if opts.offload and opts.checkpointing:
        launches += OFFLOAD_LAUNCHES
    sharded, step_launches = layout.dp * layout.sp > 1, STEP_LAUNCHES
    vocab = m.padded_vocab_size(t) / t
    root = vocab * m.hidden_size * (1 if m.tie_embeddings or layout.pp > 1 else 2)   # embedding, LM head
    if opts.fsdp:
        per_layer = M * (FSDP_BYTES[sharded] * params + per_mb + T * per_token)
        one_rank = k.fsdp_launches + (FSDP_PARAM_OFFLOAD_LAUNCHES if opts.param_offload else 0)
        launches = M * (launches + (0 if sharded else one_rank)) + (FSDP_LAUNCHES if sharded else 0)
        outside = M * FSDP_ROOT_BYTES[sharded] * root
    else:
        per_layer = M * (k.params[0] * params + per_mb + T * per_token) + k.params[1] * params
        launches = M * launches + k.launches[2]
        if sharded:
            group = layout.dp * layout.sp
            launches += ZERO_LAUNCHES + ZERO_RANK_LAUNCHES * group * _tensors(m)[0]
            step_launches += ZERO_RANK_LAUNCHES * group * _tensors(m, layout.pp)[1]
            launches += narrow * 4 * params / opts.bucket_bytes     # about a bucket of fp32 gradient elements each
        outside = (M * k.params[0] + k.params[1]) * root
    outside += M * T * (k.head * h + k.loss * vocab)
    # the LM head and loss in tiles of tokens: each tile beyond the first its kernels and its head weight
    # gradient's sum
    more = math.ceil(T / (opts.loss_chunk_tokens or default_chunk_tokens(int(vocab)))) - 1
    outside += M * more * LOSS_TILE_BYTES * vocab * m.hidden_size
    ring_masks = M * _mask_launches(layout, opts, work) if layout.ring > 1 else 0
    return L * per_layer + outside, round(L * launches + M * (k.micro_batch_launches + LOSS_TILE_LAUNCHES * more
                                                              + NORM_TILE_LAUNCHES * norm_tiles)
                                          + step_launches + ring_masks)


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
        # the block's attention, so only what the attention does not cover shows, but the last: the dK/dV
        # accumulators' hop home after the last block's backward, waited for before the backward returns
        block = tokens * 2 * kv                                            # elements of one K/V block
        nbytes["ring_p2p"] = ((ring - 1) * attn_passes * block * a + ring * block * 4) * L * M
        home = block * 4 * L * M
        attention = c.attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
        exposed["ring p2p"] = (home / hw.link(t * P)
                               + max(0.0, (nbytes["ring_p2p"] - home) / hw.link(t * P) - attention))
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
        # each micro-batch: the root unit's gather before anything runs, and the last block's and the root's
        # fp32 reduce-scatters after the backward's last kernel (FSDP2's final callback waits for them)
        m = s.m
        root = m.padded_vocab_size(layout.tp) / layout.tp * m.hidden_size * (1 if m.tie_embeddings else 2)
        last = (G - 1) / G * (root * (a + 4) + layer_params(m, layout.tp) * 4)
        exposed["FSDP gathers and reduce-scatters"] = (M * last / hw.link(span_grad)
                                                        + max(0.0, (fsdp - M * last) / hw.link(span_grad) - compute))
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
        last = (G - 1) / G * _last_bucket(s.m, layout, stage_layers(s.m, layout), opts.bucket_bytes / 4) * 4
        exposed["gradient reduce-scatter"] = (max(last / hw.link(span_grad), rs - 2 / 3 * per_mb)
                                              if overlap.grad_reduce else rs)
        exposed["parameter all-gather"] = 0.0 if overlap.param_gather else gather / hw.link(span_grad)


def _last_bucket(m: ModelConfig, layout: Degrees, layers: int, bucket_elements: float) -> float:
    """Elements of ZeRO-1's last gradient bucket, reduced after the backward's last kernel with nothing left to
    hide it: the buckets fill in the order the backward makes the gradients (the parameters' reversed) and close
    once they carry bucket_elements, the last one the embedding's and what the one before it left."""
    t, h, D = layout.tp, m.hidden_size, m.head_size
    norm = [h] * (2 if m.norm == "layernorm" else 1)
    fc = (2 if m.mlp == "swiglu" else 1) * m.ffn_size / t
    block = (norm + [h * D * (m.num_heads + 2 * m.kv_heads) / t] + [(m.num_heads + 2 * m.kv_heads) * D / t] * m.qkv_bias
             + [h * m.num_heads * D / t] + [h] * m.attention_bias + norm + [h * fc] + [fc] * m.mlp_bias
             + [h * m.ffn_size / t] + [h] * m.mlp_bias)
    vocab = m.padded_vocab_size(t) / t * h
    order = [vocab] + block * layers + norm + ([] if m.tie_embeddings or layout.pp > 1 else [vocab])
    size = last = 0.0
    for n in reversed(order):
        size += n
        if size >= bucket_elements:
            size, last = 0.0, size
    return size or last


def _mask_launches(layout: Degrees, opts: Options, work: Workload) -> int:
    """Kernels of a micro-batch's block-mask builds on ring rank 0 (its own block whole, every other block with the
    second half of its queries), each over groups of rows of ROW_CHUNK block-matrix entries at most."""
    def groups(rows: int, cols: int) -> int:
        return math.ceil(rows / max(1, ROW_CHUNK // max(work.micro_batch_size * cols, 1)))

    r, nk = layout.ring, math.ceil(work.seq_len / layout.ring / opts.mask_block)
    total = 0
    for nq, builds in ((nk, 1), (math.ceil(nk / 2), r - 1)):
        rows = groups(nq, nk + 1) - 1
        orderings = 2 * (groups(nq, nk) - 1) + 2 * (groups(nk, nq) - 1)
        total += builds * (MASK_LAUNCHES + MASK_ROW_LAUNCHES[0] * rows + MASK_ROW_LAUNCHES[1] * orderings)
    return total


def _ring_masks(s: _Step, exposed: dict) -> None:
    """A ring's per-block work outside its kernels, each micro-batch: FlexAttention's block masks built from the
    documents' boundaries (kernels/block_mask.py: per query and per pair of blocks; the masks), and
    with documents the ring blocks' positions copied to the device to pick their document ids (two a block: the
    host copies), for ring rank 0 (its own block whole, every other one's second half of its queries)."""
    layout, opts, work, hw = s.layout, s.opts, s.work, s.hw
    r = layout.ring
    if r == 1:
        return
    block, half = work.seq_len / r, work.seq_len / (2 * r)
    queries = block + (r - 1) * half
    pairs = (block / opts.mask_block) ** 2 + (r - 1) * (half / opts.mask_block) * (block / opts.mask_block)
    if opts.attention == "flex":
        built = MASK_QUERY_BYTES * queries + MASK_PAIR_BYTES * pairs
        exposed[MASKS] = work.micro_batches * built / (hw.hbm_gbs * 1e9)
    if opts.documents:
        exposed[COPIES] = exposed.get(COPIES, 0.0) + work.micro_batches * r * 2 * block * 8 / (hw.host_gbs * 1e9)


def _host_and_optimizer(s: _Step, n: float, compute: float, retained: float, nbytes: dict, exposed: dict) -> float:
    """The host copies of the offloads (bytes into `nbytes`, what compute does not hide into `exposed`), and
    the optimizer step's seconds: on the device, or on the host's cores with the optimizer or the parameters
    offloaded."""
    layout, opts, prec, M, hw = s.layout, s.opts, s.prec, s.work.micro_batches, s.hw
    G = layout.dp * layout.sp
    copies, blocking = 0.0, 0.0      # host <-> device bytes per step beyond the optimizer's own; those no compute hides
    if opts.offload:                 # `retained`: a micro-batch's offloaded block inputs, out and back in each
        copies += 2 * retained * M
        # the first copied back in each backward, the last block's input: nothing runs ahead of it to hide it
        blocking += M * retained / math.ceil(stage_layers(s.m, layout) / opts.checkpoint_stride)
    if opts.optimizer_offload and not opts.fsdp:
        copies += M * n / G * 4                                          # reduced fp32 chunks out
    if opts.param_offload and opts.fsdp:
        copies += M * n / G * (2 * 4 + 4)                                # fp32 shards in twice, gradients out
        # FSDP2 copies each unit's shards in on the default stream, inside its all-gather (forward and backward),
        # and waits for the last micro-batch's gradients out at the end of the backward
        blocking += (2 * M + 1) * n / G * 4
    if copies:
        nbytes["host"] = copies
        exposed[COPIES] = exposed.get(COPIES, 0.0) + (blocking / (hw.host_gbs * 1e9)
                                                      + max(0.0, (copies - blocking) / (hw.host_gbs * 1e9) - compute))
    if opts.optimizer_offload and not opts.fsdp:   # weights back up, the update on the host's cores
        moved = n * prec.weight / G
        nbytes["host"] += moved
        return moved / (hw.host_gbs * 1e9) + HOST_NORM * n / G / (hw.host_adam_gparams * 1e9)
    if opts.param_offload and opts.fsdp:          # the update on the host's cores, in place
        return HOST_NORM * n / G / (hw.host_adam_gparams * 1e9)
    # the norm (FSDP2: a square and a sum; ZeRO-1: torch's foreach norm), the clipping, foreach AdamW in fp32, and
    # ZeRO-1's updated chunks back into the parameters (padded, joined and, over a group, cast to the weights'
    # dtype when narrower, gathered and copied out: each copy reads its source and its destination and writes it)
    w = prec.weight
    finish = 8 + 4 if opts.fsdp else 4 + (8 if G == 1 else 16 + (4 + w if w < 4 else 0) + 3 * w * G)
    return n / G * (finish + 8 + ADAM_BYTES) / (hw.hbm_gbs * 1e9)


def step_time(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload, hw: Hardware,
              overlap: Overlap = Overlap(), retained: float = 0.0) -> StepTime:
    """Predicted seconds per optimizer step on the busiest rank. `retained`: activation bytes per step
    that activation offload copies out and back."""
    M = work.micro_batches
    c = _compute(m, layout, opts, prec, work, hw)
    nbytes: dict[str, float] = {"all_to_all": 0.0, "all_reduce": 0.0, "p2p": 0.0, "ring_p2p": 0.0, "host": 0.0,
                                "memory": c.memory}
    exposed: dict[str, float] = {}
    step = _Step(m, layout, opts, prec, work, hw, overlap)
    _model_parallel_comm(step, c, nbytes, exposed)
    n = max(sum(stage_params(m, layout, s == 0, s == layout.pp - 1)) for s in (0, layout.pp - 1))
    _data_parallel_comm(step, n, c.seconds, nbytes, exposed)
    _ring_masks(step, exposed)
    optimizer = _host_and_optimizer(step, n, c.seconds, retained, nbytes, exposed)
    comm_mb = sum(exposed.get(k, 0.0) for k in ("Ulysses all-to-all", "ring p2p", "tensor-parallel collectives",
                                                 "pipeline p2p")) / M
    bubble = (layout.pp - 1) / layout.virtual_stages * (c.seconds / M + comm_mb)
    return StepTime(compute=c.seconds, exposed=exposed, bubble=bubble, optimizer=optimizer, bytes=nbytes,
                    flops={"matmul": c.mm, "attention": c.attn}, launches=c.launches * hw.launch_us * 1e-6,
                    kernels=c.launches)
