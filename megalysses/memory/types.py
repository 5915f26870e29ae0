"""The memory model's vocabulary: the precision and kernel tables (what the code keeps, the places to
update when it changes), the options and workload it is asked about (beside the layout, the run's
megalysses.degrees.Degrees), and the estimate it gives."""
from __future__ import annotations

from dataclasses import dataclass, field

from megalysses.degrees import Degrees

GIB = 1024 ** 3


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the compute dtype (weights and activations) and of the optimizer state."""

    name: str
    weight: int        # the model's parameters: the compute dtype (no autocast anywhere)
    act: int           # activations, in the compute dtype
    master: int = 4    # the optimizer's fp32 master copy (ZeRO-1: sharded over dp x sp; FSDP: the sharded parameter)
    moments: int = 8   # AdamW exp_avg + exp_avg_sq, fp32

    def grad(self, micro_batches: int) -> int:
        """Bytes per parameter of a step's accumulated gradient: the compute dtype's .grad with one
        micro-batch; fp32 with more (ZeRO-1's main_grad; fp32 weights accumulate in .grad)."""
        return self.weight if micro_batches == 1 else 4


PRECISIONS: dict[str, Precision] = {"fp32": Precision("fp32", weight=4, act=4),
                                    "bf16": Precision("bf16", weight=2, act=2)}


@dataclass(frozen=True)
class Kernels:
    """What model.kernels keeps for the backward (kernels/norms.py, rope.py, swiglu.py, external.py)."""

    name: str
    norm_tiled: bool           # the torch path: norms over row tiles (kernels/norms.py TiledNorm) keep their
                               # input alone and recompute a tile in the backward; else input and 1/rms
    rope_casts: int            # cos/sin copies in the compute dtype kept per layer (bf16 only)
    rope_saves_cos_sin: bool   # the kernel keeps the stage's fp32 cos, sin themselves
    fresh_qkv: bool            # q, k, v come out as new tensors (else v is a view of the QKV output)
    swiglu_silu: bool          # SwiGLU keeps silu(gate) besides the gate-up output
    qkv_grad_buffers: int      # full-width QKV gradients alive while they are assembled in the backward


# torch and triton are measured (tests/test_memory_model.py; triton through its CPU interpreter); liger
# and apex are read off their sources: liger's RMSNorm and add+RMSNorm keep the input and 1/rms, its
# RoPE one bf16 cos and sin, its SwiGLU contiguous gate and up halves (the same 2 x ffn); apex's RMSNorm
# keeps input and 1/rms, with our Triton kernels for the rest.
KERNELS: dict[str, Kernels] = {
    "torch": Kernels("torch", norm_tiled=True, rope_casts=4, rope_saves_cos_sin=False, fresh_qkv=False,
                     swiglu_silu=True, qkv_grad_buffers=2),
    "triton": Kernels("triton", norm_tiled=False, rope_casts=0, rope_saves_cos_sin=True, fresh_qkv=True,
                      swiglu_silu=False, qkv_grad_buffers=1),
    "liger": Kernels("liger", norm_tiled=False, rope_casts=2, rope_saves_cos_sin=False, fresh_qkv=False,
                     swiglu_silu=False, qkv_grad_buffers=2),
    "apex": Kernels("apex", norm_tiled=False, rope_casts=0, rope_saves_cos_sin=True, fresh_qkv=True,
                    swiglu_silu=False, qkv_grad_buffers=1),
}


@dataclass(frozen=True)
class Options:
    """Memory options: the training.* and parallel.* switches as the RunPlan resolves them, under its names (those
    of its ActivationPolicy, RunPlan.fsdp, kernels, attention, async_save), the kernels, and parameter offload
    (FSDP, other systems' only)."""

    checkpointing: bool = False
    offload: bool = False              # checkpointed block inputs live in pinned host memory
    checkpoint_stride: int = 1         # checkpointing keeps every k-th block input (training.checkpoint_stride)
    keep_attention: bool = False       # checkpointing keeps attention outputs (training.recompute_attention=false)
    mlp_chunk_tokens: int = 0
    loss_chunk_tokens: int = 0         # LM head + loss tile (0: automatic, <= 512 MiB of fp32 logits)
    head_chunks: int = 1               # attention runs over this many groups of heads, each recomputed
    tp_sequence_parallel: bool = False
    fsdp: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    kernels: str = "torch"             # model.kernels
    attention: str = "flash"           # the concrete backend: flash, sdpa, flex, reference
    native_gqa: bool = True            # the kernel reads grouped KV heads as they are (no repeat to Hq)
    dq_accumulator: bool = True        # the backward accumulates dq in fp32 (flash-attn, SDPA's CUDA kernels)
    documents: bool = False            # packed-document masks (sdpa then builds a dense S x S mask)
    varlen_sequences: int = 0          # sequences per row in a variable-length kernel's cumulative lengths (its
                                       # documents; flash-attn's varlen backward keeps 128 rows more for each)
    offload_prefetch: int = 1          # offloaded layers copied back ahead of the one in backward
    bucket_bytes: float = 32_000_000 * 4       # one gradient bucket (ZeRO-1: parallel.grad_bucket_elements fp32)
    overlap_grad_reduce: bool = True   # ZeRO-1 reduces buckets during the backward (parallel.overlap_grad_reduce)
    mask_block: int = 128              # FlexAttention's block-mask block size (ActivationPolicy.mask_block)
    async_save: bool = False           # checkpoints staged in pinned host memory, written in the background
                                       # (checkpoint.async_save as the plan resolved it; memory/host.py)
    guard_elements: int = 0            # training.nan_policy=skip: AdamW steps runs of up to this many elements, each
                                       # kept aside to be put back (parallel/optimizer.py GUARD_ELEMENTS); 0: unguarded
    pinned_rounding: bool = False      # torch rounds each pinned request of its own (FSDP2's) up to a power of two
                                       # (a torch that cannot stop it: Machine.pinned_exact False); megalysses'
                                       # own are exact (memory/host.py)


@dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch_size: int = 1
    micro_batches: int = 1             # per optimizer step per dp rank


@dataclass(frozen=True)
class Term:
    """One named contribution: `bytes` on the device (or the host), and how it was computed."""

    name: str
    bytes: float
    formula: str = ""
    host: bool = False


@dataclass
class Estimate:
    peak: float                        # bytes on the device at the peak (the largest stage)
    stage: int                         # the pipeline stage holding the peak
    part: str                          # backward, loss or optimizer
    terms: list[Term]                  # the breakdown: device terms add up to `peak`; host terms follow
    host: float = 0.0                  # host bytes per rank (offloaded activations and optimizer state)
    layer_bytes_per_token: float = 0.0  # retained bytes per layer per token of S/sp
    largest: Term = field(default_factory=lambda: Term("largest block", 0.0))   # the largest single allocation
    # the device bytes at each part of each stage considered, {(stage, part): bytes}: the peak is their largest
    parts: dict = field(default_factory=dict)
    layout: Degrees = field(default_factory=Degrees)
    options: Options = field(default_factory=Options)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


def fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


TORCH_EXACT_ABOVE = 1 << 20
"""torch's caching host allocator, told to stop rounding (accelerator.PINNED_EXACT_ABOVE_MB), still rounds a
request of at most 1 MiB up to a power of two."""


def torch_pinned(nbytes: float, exact: bool) -> float:
    """What a pinned request through torch's caching host allocator (FSDP2's) takes: as asked above 1 MiB where
    torch can be told so (`exact`), else rounded up to a power of two."""
    if exact and nbytes > TORCH_EXACT_ABOVE:
        return nbytes
    return float(1 << max(int(nbytes) - 1, 0).bit_length()) if nbytes > 0 else 0.0
