"""Rotary embedding in Triton (forward and backward, one kernel); imported only when triton is.

With x = [x1, x2] (first half, second half of the head dim) and cos = [c1, c2], sin = [s1, s2]:
    forward   y1 = x1 c1 - x2 s1        y2 = x2 c2 + x1 s2
    backward  dx1 = dy1 c1 + dy2 s2     dx2 = dy2 c2 - dy1 s1
cos and sin are rounded to x's dtype first (as Hugging Face does); the arithmetic is fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megalysses.kernels.triton_support import num_programs


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_tokens, n_heads, head_dim,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0)
    half = head_dim // 2
    heads = tl.arange(0, BLOCK_H)[:, None]                                # (BLOCK_H, 1)
    dims = tl.arange(0, BLOCK_HALF)[None, :]                              # (1, BLOCK_HALF)
    in_dims = dims < half
    in_x = (heads < n_heads) & in_dims
    for tok in range(pid, n_tokens, tl.num_programs(0)):
        t64 = tl.cast(tok, tl.int64)
        cs = COS + t64 * head_dim + dims
        sn = SIN + t64 * head_dim + dims
        c1 = tl.load(cs, mask=in_dims, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        c2 = tl.load(cs + half, mask=in_dims, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        s1 = tl.load(sn, mask=in_dims, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        s2 = tl.load(sn + half, mask=in_dims, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        offs = t64 * n_heads * head_dim + heads * head_dim + dims
        x1 = tl.load(X + offs, mask=in_x, other=0.0).to(tl.float32)
        x2 = tl.load(X + offs + half, mask=in_x, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(Y + offs, y1.to(Y.dtype.element_ty), mask=in_x)
        tl.store(Y + offs + half, y2.to(Y.dtype.element_ty), mask=in_x)


def _rope(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    B, S, H, D = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    grid = (num_programs(B * S, x.device),)
    _rope_kernel[grid](x, cos, sin, y, B * S, H, D, BACKWARD=backward,
                       BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(D // 2))
    return y


class RoPETriton(torch.autograd.Function):
    """apply_rope for x (B, S, H, D) and cos, sin (B, S, D); gradient for x only (cos, sin are constants)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, H, D = x.shape
        if D % 2:
            raise ValueError(f"RoPE needs an even head dim, got {D}")
        cos = cos.expand(B, S, D).contiguous()
        sin = sin.expand(B, S, D).contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: Tensor):
        cos, sin = ctx.saved_tensors
        return _rope(dy, cos, sin, backward=True), None, None
