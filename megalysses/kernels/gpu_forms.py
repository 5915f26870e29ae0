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
A fused backward allocates workspaces inside its kernel, which the tracker counts at the kernel's op
(WORKSPACES, LiveBytes.workspaces): the flash kernels' fp32 dq accumulator and rowsum(dO * O), and with
fewer KV heads than query heads dK and dV at the query heads' width before they are summed per group.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from megalysses.kernels import attention

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _rounded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def flash_backward_workspace(q: Tensor, k: Tensor, heads_first: bool = False) -> int:
    """Bytes a flash backward allocates inside (FlashAttention-2's mha_bwd, torch's flash kernels, varlen):
    the fp32 dq accumulator (B, S rounded to 128, Hq, D rounded to 8) and rowsum(dO * O) (B, Hq, S rounded
    to 128); with fewer KV heads, dK and dV at the query heads' width. q, k: (B, S, H, D), (T, H, D) for
    packed sequences, or (B, H, S, D) with `heads_first`."""
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if heads_first:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    B, S, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    sr = _rounded(S, 128)
    nbytes = 4 * B * sr * H * _rounded(D, 8) + 4 * B * H * sr
    if Hk != H:
        nbytes += 2 * B * Sk * H * D * q.element_size()
    return nbytes


WORKSPACES = {
    aten._scaled_dot_product_flash_attention_backward.default:
        lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k, heads_first=True),
    aten._scaled_dot_product_efficient_attention_backward.default:
        lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k, heads_first=True),
    aten._flash_attention_backward.default: lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k),
}
if attention.varlen_available():
    import torch.nn.attention.varlen     # noqa: F401 (registers torch_attn's ops)

    WORKSPACES[torch.ops.torch_attn._varlen_attn_backward.default] = \
        lambda dout, q, k, *args, **kwargs: flash_backward_workspace(q, k)


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
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _Forms.live.transient(flash_backward_workspace(q, k), "flash-attn backward's workspace")
        return dq, dk, dv


def _flash_attn_func(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float = None, causal: bool = True) -> Tensor:
    return _FlashAttn.apply(q, k, v)


def _flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                            softmax_scale: float = None, causal: bool = True) -> Tensor:
    return _FlashAttn.apply(q, k, v)


# ----------------------------------------------------------------------------- FlexAttention

class _Flex(torch.autograd.Function):
    """Compiled FlexAttention on q (B, Hq, S, D), k, v (B, Hk, Sk, D): the output and its fp32 log-sum-exp
    (always computed, kept for the backward); the backward takes the gradients of both, and allocates the
    fp32 rowsum(dO * O) beside dq, dk, dv."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv


class _Aux:
    def __init__(self, lse: Tensor) -> None:
        self.lse = lse


def _compiled_flex() -> Any:
    def flex(q_: Tensor, k_: Tensor, v_: Tensor, block_mask: Any = None, scale: float = None,
             enable_gqa: bool = False, **lse_request: Any) -> Any:
        out, lse = _Flex.apply(q_, k_, v_)
        return (out, _Aux(lse)) if lse_request else out
    return flex


# ----------------------------------------------------------------------------- installing them

class _Forms:
    live: Any = None


@contextlib.contextmanager
def gpu_kernels(live: Any, packages: frozenset) -> Iterator[None]:
    """Inside, attention runs in the forms above, its kernels' workspaces counted by `live` (the trace's
    LiveBytes), and the device checks see a CUDA GPU with `packages` (a described machine's optional
    packages)."""
    replaced = [(attention._BACKEND_FNS, "sdpa", functools.partial(attention._sdpa, sdpa=cuda_sdpa))]
    attributes = [
        (attention, "flash_attn_func", _flash_attn_func),
        (attention, "flash_attn_varlen_func", _flash_attn_varlen_func),
        (attention, "compiled_flex", _compiled_flex),
        (attention, "causal_block_mask", attention.causal_block_mask.__wrapped__),     # built for each trace
        (attention, "_installed", lambda: frozenset(packages)),
    ]
    saved = [(table, key, table[key]) for table, key, _ in replaced]
    kept = [(module, name, getattr(module, name)) for module, name, _ in attributes]
    _Forms.live = live
    live.workspaces.update(WORKSPACES)
    try:
        for table, key, form in replaced:
            table[key] = form
        for module, name, form in attributes:
            setattr(module, name, form)
        yield
    finally:
        _Forms.live = None
        for table, key, original in saved:
            table[key] = original
        for module, name, original in kept:
            setattr(module, name, original)
