"""The memory model's inputs read off a RunPlan (megalysses.plan): the precision, options and workload of a
run as it was resolved (its layout is the plan's own Degrees), and its estimate.

    plan = resolve(cfg, machine, world_size)
    est = estimate_plan(cfg, plan)
    reqs = pinned_requests_of(cfg, plan, stage)      # what pipeline rank `stage` pins: its arena's contents
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

from megalysses.config import Config
from megalysses.kernels.attention import varlen_native_gqa
from megalysses.memory.estimate import estimate
from megalysses.memory.host import PinnedRequest, pinned_requests
from megalysses.memory.types import PRECISIONS, Estimate, Options, Precision, Workload
from megalysses.parallel.optimizer import GUARD_ELEMENTS
from megalysses.plan.types import RunPlan


def precision_of(plan: RunPlan) -> Precision:
    return PRECISIONS["bf16" if plan.dtype == "bfloat16" else "fp32"]


def attention_buffers(plan: RunPlan, documents: bool) -> tuple[bool, bool]:
    """(native grouped-query attention, fp32 dq accumulator) of the plan's attention kernel: whether it reads
    the grouped KV heads as they are (no repeat to the query heads) and accumulates dq in fp32 in its
    backward (flash-attn, SDPA's CUDA kernels). With a ring, the blocks run on torch's SDPA flash kernel
    (K/V expanded to the query heads) or FlexAttention (kernels/block_attention.py)."""
    backend, cuda = plan.attention, plan.machine.cuda
    cuda_sdpa = backend == "sdpa" and cuda
    if plan.degrees.ring > 1:
        return backend == "flex", cuda_sdpa
    masked = documents or plan.attention_window > 0       # SDPA with a mask: no native grouped-query attention
    native = backend in ("flash", "flex") or (backend == "varlen" and varlen_native_gqa()) or \
        (cuda_sdpa and plan.dtype == "bfloat16" and not masked)
    return native, backend in ("flash", "varlen") or cuda_sdpa


def documents_per_sequence(cfg: Config, seq_len: int) -> int:
    """The packed documents the plan counts in a sequence of `seq_len` tokens: 1 + seq_len x
    data.documents_per_million / 10^6, rounded up (with data.document_mask; else the sequence is one)."""
    if not cfg.data.document_mask:
        return 1
    return 1 + math.ceil(seq_len * cfg.data.documents_per_million / 1e6)


def varlen_sequences(cfg: Config, plan: RunPlan) -> int:
    """The sequences per row of a micro-batch in the cumulative lengths of the plan's variable-length attention
    kernel (flash-attn's varlen backward keeps 128 fp32 rows more of its dq accumulator and rowsum(dO * O) for
    each): a sequence's documents with packed-document masks; each row one sequence for varlen without them
    (flash then runs its fixed-length kernel); none with a ring, whose blocks run other kernels."""
    if plan.degrees.ring > 1 or plan.attention not in ("flash", "varlen"):
        return 0
    if cfg.data.document_mask:
        return documents_per_sequence(cfg, plan.padded_seq_len)
    return 1 if plan.attention == "varlen" else 0


def options_of(cfg: Config, plan: RunPlan) -> Options:
    a, p = plan.activation, cfg.parallel
    native, accumulator = attention_buffers(plan, cfg.data.document_mask)
    return Options(checkpointing=a.checkpointing, offload=a.offload,
                   checkpoint_stride=a.checkpoint_stride, head_chunks=a.head_chunks,
                   keep_attention=a.keep_attention, mlp_chunk_tokens=a.mlp_chunk_tokens,
                   loss_chunk_tokens=a.loss_chunk_tokens, tp_sequence_parallel=a.tp_sequence_parallel,
                   fsdp=plan.fsdp, optimizer_offload=plan.optimizer == "zero1-host",
                   param_offload=plan.weights == "host",
                   kernels=plan.kernels, attention=plan.attention, native_gqa=native, dq_accumulator=accumulator,
                   documents=cfg.data.document_mask, varlen_sequences=varlen_sequences(cfg, plan),
                   bucket_bytes=0 if plan.fsdp else p.grad_bucket_elements * 4,
                   overlap_grad_reduce=p.overlap_grad_reduce, pinned_rounding=not plan.machine.pinned_exact,
                   async_save=plan.async_save,
                   guard_elements=GUARD_ELEMENTS if cfg.training.nan_policy == "skip" else 0,
                   mask_block=a.mask_block)


def workload_of(cfg: Config, plan: RunPlan) -> Workload:
    """The longest micro-batch of the run (data.seq_len, the last length of a curriculum), padded to the
    layout's multiple as the data loader pads it."""
    return Workload(seq_len=plan.padded_seq_len, micro_batch_size=plan.micro_batch_size,
                    micro_batches=plan.micro_batches)


_SHARED: Optional[dict] = None       # the estimates shared_estimates() keeps, by their inputs


@contextmanager
def shared_estimates() -> Iterator[None]:
    """Within it, estimate_plan computes each estimate once for its inputs (the model, layout, options, precision
    and workload) and hands the same Estimate back to every later call with equal inputs: the planner's search,
    whose tile bounds, tile searches and final estimate of a candidate weigh many of the same runs. Read the
    estimates it gives, do not change them."""
    global _SHARED
    outer, _SHARED = _SHARED, {} if _SHARED is None else _SHARED
    try:
        yield
    finally:
        _SHARED = outer


def estimate_plan(cfg: Config, plan: RunPlan) -> Estimate:
    """The predicted peak per rank of the run `plan` resolved `cfg` into (within shared_estimates(), once for
    equal inputs)."""
    inputs = (plan.degrees, options_of(cfg, plan), precision_of(plan), workload_of(cfg, plan))
    if _SHARED is None:
        return estimate(cfg.model, *inputs)
    model, est = _SHARED.get(inputs, (None, None))
    if model is not cfg.model and model != cfg.model:
        est = estimate(cfg.model, *inputs)
        _SHARED[inputs] = (cfg.model, est)
    return est


def pinned_requests_of(cfg: Config, plan: RunPlan, stage: int) -> list[PinnedRequest]:
    """The pinned host requests megalysses makes on pipeline rank `stage` of the run `plan` resolved `cfg` into."""
    return pinned_requests(cfg.model, plan.degrees, options_of(cfg, plan), precision_of(plan),
                           workload_of(cfg, plan), stage)
