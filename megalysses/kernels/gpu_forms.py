"""The attention kernels as a GPU runs them, in forms that run on fake tensors: what a memory trace
(megalysses/training/trace.py) runs in their place, allocating what each kernel allocates.

    with gpu_kernels(live, packages):      # live: the trace's megalysses.tracker.LiveBytes
        ... core_attention(q, k, v, mask=mask, backend=...) on meta tensors, with a backward ...

Fake tensors run the aten ops that have meta implementations, and torch's variable-length attention (a
custom op with fake implementations); what they cannot run, or run otherwise than CUDA does, has a form here:
    sdpa       F.scaled_dot_product_attention picks its kernel from the device: on meta tensors the math
               kernel (S x S scores). cuda_sdpa picks as CUDA does (flash for half precision without a
               mask, else the memory-efficient kernel with the mask as an additive bias in the input's dtype,
               made from the boolean mask first) and calls that kernel's aten op, whose backward autograd runs.
    flash      flash-attn (flash_attn_func, flash_attn_varlen_func): the outputs and the fp32 log-sum-exp.
    flex       FlexAttention: compiled on CUDA, refused on meta tensors; its form allocates the output and the
               fp32 log-sum-exp, and in the backward (against the output and the log-sum-exp) the gradients
               and the fp32 rowsum(dO * O). Block masks are built as on CUDA (kernels/block_mask.py: from
               the documents' boundaries per block), the plain causal one for each trace (not cached).
Each form carries its kernel's cost beside it (KernelCost: FLOPs by the (query, key) pairs its mask allows,
bytes read and written, launches; a block mask's build in the category "masks"), handed to the traced
roofline (megalysses/training/roofline.py) where torch has no formula of its own: COSTS for the aten ops
(torch's varlen attention), the `roof` of gpu_kernels for the forms. A trace's document ids hold no data, so
a mask allows the pairs causality leaves, as for one document (a ring step's diagonal block causal, the others
whole): the most its documents can allow.
A fused backward allocates workspaces inside its kernel, which the tracker counts at the kernel's op
(WORKSPACES, LiveBytes.workspaces): the flash kernels' fp32 dq accumulator and rowsum(dO * O), and with
fewer KV heads than query heads dK and dV at the query heads' width before they are summed per group. A
variable-length kernel's have 128 rows more per sequence of its cumulative lengths (flash_backward_workspace),
whose length a trace's batch gives: the documents the plan counts (training/trace.py fake_batch).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from megalysses.kernels import attention
from megalysses.kernels import block_mask as block_masks

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _rounded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def flash_head_size(d: int) -> int:
    """The head size of a flash kernel's fp32 dq accumulator: `d` padded to a multiple of 8 (the kernel's
    head_size), then rounded up to 32 up to 128 and to 64 above (FlashAttention-2's mha_bwd and mha_varlen_bwd:
    round_multiple(head_size, head_size <= 128 ? 32 : 64), in flash-attn's build and torch's alike)."""
    d = _rounded(d, 8)
    return _rounded(d, 32 if d <= 128 else 64)


def flash_backward_workspace(q: Tensor, k: Tensor, heads_first: bool = False, sequences: int = 1,
                             flash: bool = True) -> int:
    """Bytes a flash backward allocates inside (FlashAttention-2's mha_bwd and mha_varlen_bwd, torch's flash
    kernels, varlen): the fp32 dq accumulator and rowsum(dO * O) (softmax_d), and with fewer KV heads, dK and dV
    at the query heads' width. q, k: (B, S, H, D), (B, H, S, D) with `heads_first`, or (T, H, D) packed over
    `sequences` sequences (the cumulative lengths' count). Rows of the accumulators: each sequence's S rounded
    up to 128 (mha_bwd), or T + 128 x sequences packed (mha_varlen_bwd places each sequence 128 rows after the
    last, so that the atomic adds of a 128-row block past its end stay clear of the next). Bytes:
    4 x rows x Hq x (flash_head_size(D) + 1), + 2 x Sk x Hq x D in q's dtype with grouped KV heads; not a
    flash kernel (`flash` false: SDPA's memory-efficient one, counted alike) D rounded to 8."""
    if heads_first:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if q.dim() == 3:
        rows, (H, D), kv_rows, Hk = q.shape[0] + 128 * sequences, q.shape[1:], k.shape[0], k.shape[1]
    else:
        B, S, H, D = q.shape
        rows, kv_rows, Hk = B * _rounded(S, 128), B * k.shape[1], k.shape[2]
    nbytes = 4 * rows * H * (flash_head_size(D) if flash else _rounded(D, 8)) + 4 * H * rows
    if Hk != H:
        nbytes += 2 * kv_rows * H * D * q.element_size()
    return nbytes


class KernelCost(NamedTuple):
    """What one kernel costs: `flops` of class `kind` (attention, matmul, memory), `bytes` of device memory read
    and written, its launches, and the mask_mod evaluations of a block mask's build."""

    kind: str
    flops: float
    bytes: float
    launches: int = 1
    mask_evaluations: float = 0.0
    name: str = ""


def causal_pairs(s: int, window: int = 0) -> int:
    """(query, key) pairs of a causal mask over `s` positions (with a sliding window of `window`: the keys less
    than `window` before each query)."""
    if not window or window >= s:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * window


def attention_cost(heads: int, head_size: int, pairs: float, tensors: tuple, backward: bool) -> KernelCost:
    """A fused attention kernel over `pairs` (query, key) pairs of each of `heads` query heads (the batch's
    pairs, all its elements): 4 head_size FLOPs a pair forward (Q K^T, P V), 2.5 times that backward (the
    scores again, dP, dS, dQ, dK, dV), as torch.utils.flop_counter counts SDPA; the bytes of `tensors`, read
    or written once; one launch forward, three backward (the rowsum(dO * O), the kernel, dq's conversion)."""
    flops = 4 * head_size * pairs * heads * (2.5 if backward else 1.0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
    name = "attention backward" if backward else "attention forward"
    return KernelCost("attention", flops, nbytes, 3 if backward else 1, name=name)


def _packed_pairs(tokens: int, causal: bool) -> int:
    """Pairs of `tokens` packed tokens of a trace: its micro-batch's sequences (_Forms.sequences), each counted
    as one document, causal or whole: the most pairs its documents can allow (the fake batch's cumulative
    lengths give the count of its documents, whose workspaces the backward allocates, not their lengths)."""
    n = _Forms.sequences
    length = tokens // n
    return n * (causal_pairs(length) if causal else length * length)


def _varlen_cost(backward: bool) -> Any:
    def cost(*args: Any, **kwargs: Any) -> KernelCost:
        names = [a.name for a in (_VARLEN_BWD if backward else _VARLEN_FWD)._schema.arguments]
        call = {**dict(zip(names, args)), **kwargs}
        q = call["query"]
        pairs = _packed_pairs(q.shape[0], bool(call.get("is_causal", False)))
        return attention_cost(q.shape[1], q.shape[2], pairs, tuple(call.values()), backward)
    return cost


WORKSPACES = {
    aten._scaled_dot_product_flash_attention_backward.default:
        lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k, heads_first=True),
    aten._scaled_dot_product_efficient_attention_backward.default:
        lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k, heads_first=True, flash=False),
    aten._flash_attention_backward.default: lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k),
}
if attention.varlen_available():
    import torch.nn.attention.varlen     # noqa: F401 (registers torch_attn's ops)

    WORKSPACES[torch.ops.torch_attn._varlen_attn_backward.default] = \
        lambda dout, q, k, v, out, lse, cu_q, *args, **kwargs: flash_backward_workspace(
            q, k, sequences=cu_q.numel() - 1)
    _VARLEN_FWD = torch.ops.torch_attn._varlen_attn.default
    _VARLEN_BWD = torch.ops.torch_attn._varlen_attn_backward.default
    COSTS = {_VARLEN_FWD: _varlen_cost(False), _VARLEN_BWD: _varlen_cost(True)}
else:
    COSTS = {}


# ----------------------------------------------------------------------------- sdpa, as CUDA picks it

def cuda_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention as it runs on CUDA (dropout 0): the flash kernel for fp16/bf16 without a
    mask (grouped KV heads included), else the memory-efficient kernel, a boolean mask turned into an additive
    bias in q's dtype first (its last dim padded to a multiple of 16)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    D = q.shape[-1]
    if attn_mask is None and q.dtype in _HALF and D % 8 == 0 and D <= 256:
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]
    if enable_gqa:
        raise RuntimeError("cuda_sdpa: grouped KV heads with a mask or in fp32 run SDPA's math kernel, which "
                           "megalysses never asks for (it expands the KV heads)")
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.where(bias.logical_not(), float("-inf"), 0.0).to(q.dtype)
    if bias is not None and bias.shape[-1] % 16:
        pad = 16 - bias.shape[-1] % 16
        bias = torch.nn.functional.pad(bias, (0, pad))[..., :bias.shape[-1]]
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal, scale=scale)[0]


# ----------------------------------------------------------------------------- flash-attn

class _FlashAttn(torch.autograd.Function):
    """flash-attn's flash_attn_func (q (B, S, Hq, D), k, v (B, S, Hk, D)) or its varlen form over the packed
    tokens (q (T, Hq, D)): the output and the fp32 log-sum-exp it keeps for the backward; the backward's
    gradients and workspace."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, pairs: int, sequences: int) -> Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs, ctx.sequences = pairs, sequences
        _Forms.charge(attention_cost(q.shape[-2], q.shape[-1], pairs, (q, k, v, out, lse), backward=False))
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        workspace = flash_backward_workspace(q, k, sequences=ctx.sequences)
        _Forms.live.transient(workspace, "flash-attn backward's workspace")
        _Forms.charge(attention_cost(q.shape[-2], q.shape[-1], ctx.pairs, (q, k, v, out, lse, dout, dq, dk, dv),
                                     backward=True))
        return dq, dk, dv, None, None


def _flash_attn_func(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float = None, causal: bool = True) -> Tensor:
    pairs = q.shape[0] * (causal_pairs(q.shape[1]) if causal else q.shape[1] * k.shape[1])
    return _FlashAttn.apply(q, k, v, pairs, 1)


def _flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                            **options: Any) -> Tensor:
    """flash_attn_varlen_func over the packed sequences of cu_q (its softmax_scale and window_size change no
    allocation; causal as flash-attn's default, off unless given)."""
    pairs = _packed_pairs(q.shape[0], bool(options.get("causal", False)))
    return _FlashAttn.apply(q, k, v, pairs, cu_q.numel() - 1)


# ----------------------------------------------------------------------------- FlexAttention

class _Flex(torch.autograd.Function):
    """Compiled FlexAttention on q (B, Hq, S, D), k, v (B, Hk, Sk, D): the output and its fp32 log-sum-exp
    (always computed, kept for the backward); the backward takes the gradients of both, and allocates the
    fp32 rowsum(dO * O) beside dq, dk, dv."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, pairs: int) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs = pairs
        _Forms.charge(attention_cost(q.shape[1], q.shape[-1], pairs, (q, k, v, out, lse), backward=False))
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _Forms.charge(attention_cost(q.shape[1], q.shape[-1], ctx.pairs, (q, k, v, out, lse, dout, delta, dq, dk, dv),
                                     backward=True))
        del delta
        return dq, dk, dv, None


class _Aux:
    def __init__(self, lse: Tensor) -> None:
        self.lse = lse


def _compiled_flex() -> Any:
    def flex(q_: Tensor, k_: Tensor, v_: Tensor, block_mask: Any = None, scale: float = None,
             enable_gqa: bool = False, **lse_request: Any) -> Any:
        S, Sk = q_.shape[-2], k_.shape[-2]
        pairs = S * Sk if block_mask is None else _allowed_pairs(block_mask.mask_mod, S, Sk)
        out, lse = _Flex.apply(q_, k_, v_, q_.shape[0] * pairs)
        return (out, _Aux(lse)) if lse_request else out
    return flex


def _build_block_mask(*args: Any, **kwargs: Any) -> Any:
    """kernels/block_mask.py's build_block_mask, as on CUDA (from the documents' boundaries per block, never a
    mask_mod evaluation per pair), its ops in the roofline's category "masks"."""
    with _Forms.category("masks"):
        return block_masks.build_block_mask(*args, **kwargs)


def _allowed_pairs(mask_mod: Any, S: int, kv_len: int) -> int:
    """The pairs a block mask of `mask_mod` (MaskPattern.mask_mod) allows per batch element, a trace's batch being
    one document: causal (with its window) when it closes over a true `causal` (a diagonal block, or the whole
    sequence), else all of them. Read from the function, as the fake document ids cannot be evaluated."""
    free = inspect.getclosurevars(mask_mod).nonlocals
    if free.get("causal", False) is True:
        return causal_pairs(S, int(free.get("window", 0) or 0))
    return S * kv_len


# ----------------------------------------------------------------------------- installing them

class _Forms:
    live: Any = None
    roof: Any = None
    sequences: int = 1          # sequences of a micro-batch, one document each (the trace's batch)

    @classmethod
    def charge(cls, cost: KernelCost) -> None:
        if cls.roof is not None:
            cls.roof.cost(cost)

    @classmethod
    def category(cls, name: str) -> contextlib.AbstractContextManager:
        return cls.roof.category(name) if cls.roof is not None else contextlib.nullcontext()


@contextlib.contextmanager
def gpu_kernels(live: Any, packages: frozenset, roof: Any = None, sequences: int = 1) -> Iterator[None]:
    """Inside, attention runs in the forms above (kernels/attention.py's GPUKernels, put in place with its
    use_kernels), its kernels' workspaces counted by `live` (the trace's LiveBytes), and the device checks see a
    CUDA GPU with `packages` (a described machine's optional packages). `roof` (the trace's
    megalysses.training.roofline.Roofline, or None) is handed each form's KernelCost (its `cost`), and the ops of a
    block mask's build in its category "masks" (its `category`), and its `costs` are given COSTS; packed attention
    counts `sequences` sequences of one document each."""
    forms = attention.GPUKernels(
        sdpa=cuda_sdpa, flash_attn_func=_flash_attn_func, flash_attn_varlen_func=_flash_attn_varlen_func,
        compiled_flex=_compiled_flex, build_block_mask=_build_block_mask, installed=lambda: frozenset(packages),
        causal_block_mask=attention.causal_block_mask.__wrapped__)        # built for each trace (not cached)
    _Forms.live, _Forms.roof, _Forms.sequences = live, roof, sequences
    live.workspaces.update(WORKSPACES)
    if roof is not None:
        roof.costs.update(COSTS)
    try:
        with attention.use_kernels(forms):
            yield
    finally:
        _Forms.live = _Forms.roof = None
