"""The memory model's inputs read off a Config: precision, attention backend, layout, options and
workload of a run, and its estimate."""
from __future__ import annotations

from typing import Optional

from megalysses.config import Config
from megalysses.config_checks import ulysses_ring
from megalysses.memory.estimate import estimate
from megalysses.memory.types import PRECISIONS, Estimate, Layout, Options, Precision, Workload
from megalysses.parallel.sequence_layout import SequenceLayout


def precision_for(cfg: Config, device: str = "cuda") -> Precision:
    """The compute dtype of a run of `cfg` on `device`: training.dtype, auto = bf16 on CUDA, fp32 elsewhere."""
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return PRECISIONS["bf16" if dtype == "bfloat16" else "fp32"]


def attention_for(cfg: Config, device: str = "cuda", ring: int = 1) -> tuple[str, bool, bool]:
    """(concrete backend, native grouped-query attention, fp32 dq accumulator) that `cfg` runs on
    `device` with a ring of `ring` ranks (kernels/attention.py; auto assumes flash-attn is installed on
    GPUs). With a ring the blocks run on torch's SDPA flash kernel (K/V expanded to the query heads), or
    FlexAttention for documents on CUDA (kernels/block_attention.py)."""
    backend = cfg.model.attention_backend
    ring = ring > 1
    cuda = device == "cuda"
    if backend == "auto":
        if ring:
            backend = "flex" if cfg.data.document_mask and cuda else "sdpa"
        else:
            backend = ("flex" if cfg.data.document_mask else "flash") if cuda else "sdpa"
    if ring:
        return backend, backend == "flex", backend == "sdpa" and cuda
    bf16 = precision_for(cfg, device).act == 2
    cuda_sdpa = backend == "sdpa" and cuda
    native = backend in ("flash", "flex") or (cuda_sdpa and bf16 and not cfg.data.document_mask)
    return backend, native, backend == "flash" or cuda_sdpa


def layout_of(cfg: Config, world_size: int, ranks_per_node: Optional[int] = None) -> Layout:
    """The layout of a run of `cfg` on `world_size` ranks, sp split into ulysses x ring as the run splits
    it on nodes of `ranks_per_node` (config_checks.ulysses_ring; None: the launcher's, as a launched run sees it)."""
    p = cfg.parallel
    return Layout(tp=p.tp, sp=p.sp, pp=p.pp, dp=max(world_size // (p.tp * p.sp * p.pp), 1),
                  virtual_stages=p.virtual_stages, ring=ulysses_ring(cfg, ranks_per_node)[1])


def options_of(cfg: Config, device: str = "cuda", ring: int = 1) -> Options:
    t, p = cfg.training, cfg.parallel
    backend, native, accumulator = attention_for(cfg, device, ring)
    return Options(activation_checkpointing=t.activation_checkpointing, activation_offload=t.activation_offload,
                   keep_attention=t.activation_checkpointing and not t.recompute_attention,
                   mlp_chunk_tokens=t.mlp_chunk_tokens, loss_chunk_tokens=t.loss_chunk_tokens,
                   tp_sequence_parallel=p.tp_sequence_parallel, fsdp=p.fsdp,
                   optimizer_offload=t.optimizer_offload, kernels=cfg.model.kernels, attention=backend,
                   native_gqa=native, dq_accumulator=accumulator, documents=cfg.data.document_mask,
                   bucket_bytes=0 if p.fsdp else p.grad_bucket_elements * 4, overlap_grad_reduce=p.overlap_grad_reduce)


def workload_of(cfg: Config, layout: Layout) -> Workload:
    """The longest micro-batch of a run of `cfg` (data.seq_len, the last length of a curriculum), padded to
    the layout's multiple as the data loader pads it (parallel/sequence_layout.py)."""
    t = cfg.training
    shard = SequenceLayout(layout.sp, layout.ring, layout.tp if cfg.parallel.tp_sequence_parallel else 1)
    return Workload(seq_len=shard.padded_len(cfg.data.seq_len), micro_batch_size=t.micro_batch_size,
                    micro_batches=max(t.global_batch_size // (t.micro_batch_size * layout.dp), 1))


def estimate_config(cfg: Config, world_size: int, device: str = "cuda",
                    ranks_per_node: Optional[int] = None) -> Estimate:
    """The predicted peak per rank of a run of `cfg` on `world_size` ranks of `device` (cuda or cpu), on
    nodes of `ranks_per_node` (None: the launcher's)."""
    layout = layout_of(cfg, world_size, ranks_per_node)
    return estimate(cfg.model, layout, options_of(cfg, device, layout.ring), precision_for(cfg, device),
                    workload_of(cfg, layout))
