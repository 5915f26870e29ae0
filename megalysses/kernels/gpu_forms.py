"""The attention kernels as a GPU runs them, in forms that run on fake tensors: what a memory trace
(megalysses/training/trace.py) runs in their place, allocating what each kernel allocates.

    with gpu_kernels(live, packages):      # live: the trace's megalysses.tracker.LiveBytes
        ... core_attention(q, k, v, mask=mask, backend=...) on meta tensors, with a backward ...

Fake tensors run the aten ops that have meta implementations; what they cannot run, or run otherwise than
CUDA does, has a form here:
    sdpa       F.scaled_dot_product_attention picks its kernel from the device: on meta tensors the math
               kernel (S x S scores). cuda_sdpa picks as CUDA does (flash for half precision without a
               mask, else the memory-efficient kernel with the mask as an additive bias in the input's dtype,
               made from the boolean mask first) and calls that kernel's aten ops.
    flash      flash-attn (flash_attn_func, flash_attn_varlen_func): the outputs and the fp32 log-sum-exp.
    flex       FlexAttention: compiled on CUDA, refused on meta tensors; its forms allocate the output and the
               fp32 log-sum-exp, and in the backward (against the output and the log-sum-exp) the gradients
               and the fp32 rowsum(dO * O). create_block_mask compiled on CUDA never makes the (S, S) mask:
               its form makes the block-level masks that the compiled part makes, then runs torch's own
               conversion of them into the BlockMask's index tensors (an int64 argsort of each).
The backward of a fused kernel allocates workspaces inside the kernel, which the tracker is told of
(LiveBytes.transient) at the kernel: flash's and the memory-efficient kernel's fp32 dq accumulator and
fp32 rowsum(dO * O), flash-attn's query-width dK and dV with grouped KV heads.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from megalysses.kernels import attention, block_attention

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _rounded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Workspaces:
    """Where the forms report the bytes a kernel allocates and frees inside itself (the trace's tracker)."""

    live: Any = None

    @classmethod
    def add(cls, nbytes: int, what: str) -> None:
        if cls.live is not None:
            cls.live.transient(int(nbytes), what)


def _flash_backward_workspace(q: Tensor, k: Tensor, heads_first: bool, what: str) -> None:
    """The fp32 dq accumulator (B, S rounded to 128, Hq, D rounded to 8) and the fp32 rowsum(dO * O)
    (B, Hq, S rounded to 128) of a flash backward; with fewer KV heads, dK and dV at the query heads' width
    before they are summed per group."""
    if heads_first:
        B, H, S, D = q.shape
        Hk, Sk = k.shape[1], k.shape[2]
    else:
        B, S, H, D = q.shape
        Sk, Hk = k.shape[1], k.shape[2]
    sr = _rounded(S, 128)
    nbytes = 4 * B * sr * H * _rounded(D, 8) + 4 * B * H * sr
    if Hk != H:
        nbytes += 2 * B * Sk * H * D * q.element_size()
    _Workspaces.add(nbytes, what)


# ----------------------------------------------------------------------------- sdpa, as CUDA picks it

class _FlashSDPA(torch.autograd.Function):
    """torch's flash kernel (aten._scaled_dot_product_flash_attention), q, k, v (B, H, S, D)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cq, ck, seed, offset)
        ctx.causal, ctx.scale, ctx.lens = causal, scale, (mq, mk)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, cq, ck, seed, offset = ctx.saved_tensors
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cq, ck, *ctx.lens, 0.0, ctx.causal, seed, offset, scale=ctx.scale)
        _flash_backward_workspace(q, k, True, "flash attention backward: fp32 dq accumulator, rowsum(dO * O)")
        return dq, dk, dv, None, None


class _EfficientSDPA(torch.autograd.Function):
    """The memory-efficient kernel (aten._scaled_dot_product_efficient_attention) with an additive bias."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], causal: bool, scale: float) -> Tensor:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                             scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False],
            ctx.causal, scale=ctx.scale)
        _flash_backward_workspace(q, k, True, "memory-efficient attention backward: fp32 dq accumulator, delta")
        return dq, dk, dv, None, None, None


def cuda_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention as it runs on CUDA (dropout 0): the flash kernel for fp16/bf16 without a
    mask (grouped KV heads included), else the memory-efficient kernel, a boolean mask turned into an additive
    bias in q's dtype first (and its last dim padded to a multiple of 16)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    D = q.shape[-1]
    if attn_mask is None and q.dtype in _HALF and D % 8 == 0 and D <= 256:
        return _FlashSDPA.apply(q, k, v, is_causal, scale)
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
    return _EfficientSDPA.apply(q, k, v, bias, is_causal, scale)


def _block_sdpa_backward(dout, q, k, v, out, lse, block, scale, aux):
    """The ring block's backward on CUDA (torch's flash kernel), with its workspace."""
    grads = block_attention._sdpa_backward(dout, q, k, v, out, lse, block, scale, aux)
    k_, _, _ = block_attention._expand_kv(q, k, v)
    _flash_backward_workspace(q, k_, False, "flash attention backward (ring block): fp32 dq accumulator, "
                                            "rowsum(dO * O)")
    return grads


# ----------------------------------------------------------------------------- flash-attn

class _FlashAttn(torch.autograd.Function):
    """flash-attn's flash_attn_func (q (B, S, Hq, D), k, v (B, S, Hk, D)) or, with `cu`, its varlen form over
    the flattened tokens (q (T, Hq, D)): the output, the fp32 log-sum-exp kept for the backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)       # (B, S, H): its bytes
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        shaped = q if q.dim() == 4 else q.unsqueeze(0)
        _flash_backward_workspace(shaped, k if k.dim() == 4 else k.unsqueeze(0), False,
                                  "flash-attn backward: fp32 dq accumulator, rowsum(dO * O)")
        return dq, dk, dv


def _flash_attn_func(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float = None, causal: bool = True) -> Tensor:
    return _FlashAttn.apply(q, k, v)


def _flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                            softmax_scale: float = None, causal: bool = True) -> Tensor:
    return _FlashAttn.apply(q, k, v)


# ----------------------------------------------------------------------------- FlexAttention

class _Flex(torch.autograd.Function):
    """Compiled FlexAttention on q (B, Hq, S, D), k, v (B, Hk, Sk, D): the output and its fp32 log-sum-exp
    (always computed, kept for the backward); the backward takes gradients of both."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask_tensors: tuple) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)     # rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv, None


def _compiled_flex() -> Any:
    def flex(q_: Tensor, k_: Tensor, v_: Tensor, block_mask: Any = None, scale: float = None,
             enable_gqa: bool = False, **lse_request: Any) -> Any:
        out, lse = _Flex.apply(q_, k_, v_, ())
        return (out, _Aux(lse)) if lse_request else out
    return flex


class _Aux:
    def __init__(self, lse: Tensor) -> None:
        self.lse = lse


def _create_block_mask(mask_mod: Any, B: Optional[int], S: int, device: Any, kv_len: Optional[int] = None) -> Any:
    """create_block_mask as compiled on CUDA: the partial and full block masks (B, 1, S/128, Sk/128) that its
    fused part makes from mask_mod (never the (S, Sk) mask), then torch's own conversion of them into the
    BlockMask's kv and q index tensors."""
    fm = attention.flex_module
    kv_len = S if kv_len is None else kv_len
    n_q, n_kv = -(-S // 128), -(-kv_len // 128)
    partial = torch.zeros(B or 1, 1, n_q, n_kv, dtype=torch.int8, device=device)
    full = torch.zeros(B or 1, 1, n_q, n_kv, dtype=torch.int8, device=device)
    return fm._create_sparse_block_from_block_mask((partial, full), mask_mod, (S, kv_len), 128, 128)


def _causal_block_mask(S: int, device: Any) -> Any:
    return _create_block_mask(lambda b, h, q, kv: kv <= q, None, S, device)


# ----------------------------------------------------------------------------- installing them

@contextlib.contextmanager
def gpu_kernels(live: Any, packages: frozenset) -> Iterator[None]:
    """Inside, attention runs in the forms above, reporting its kernels' workspaces to `live`, and the device
    checks see a CUDA GPU with `packages` (a described machine's optional packages)."""
    replaced = [
        (attention._BACKEND_FNS, "sdpa", functools.partial(attention._sdpa, sdpa=cuda_sdpa)),
        (block_attention._BACKWARD, "sdpa", _block_sdpa_backward),
    ]
    attributes = [
        (attention, "flash_attn_func", _flash_attn_func),
        (attention, "flash_attn_varlen_func", _flash_attn_varlen_func),
        (attention, "compiled_flex", _compiled_flex),
        (attention, "create_block_mask", _create_block_mask),
        (attention, "causal_block_mask", _causal_block_mask),
        (attention, "_installed", lambda: frozenset(packages) | {"flex"}),
    ]
    saved = [(table, key, table[key]) for table, key, _ in replaced]
    kept = [(module, name, getattr(module, name)) for module, name, _ in attributes]
    _Workspaces.live = live
    try:
        for table, key, form in replaced:
            table[key] = form
        for module, name, form in attributes:
            setattr(module, name, form)
        yield
    finally:
        _Workspaces.live = None
        for table, key, original in saved:
            table[key] = original
        for module, name, original in kept:
            setattr(module, name, original)
