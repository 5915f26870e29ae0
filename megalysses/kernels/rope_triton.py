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

from megalysses.kernels.triton_support import launch, num_programs

LAUNCHED = ("_rope_kernel", "_rope_qkv_kernel")   # the kernels launched from Python (tools/triton_build.py)


@triton.jit
def _cos_sin(COS, SIN, t64, head_dim, half, dims, in_dims, dtype: tl.constexpr):
    """Token t64's cos and sin halves, rounded to the input dtype (as Hugging Face does), in fp32."""
    cs = COS + t64 * head_dim + dims
    sn = SIN + t64 * head_dim + dims
    c1 = tl.load(cs, mask=in_dims, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cs + half, mask=in_dims, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sn, mask=in_dims, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sn + half, mask=in_dims, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


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
        c1, c2, s1, s2 = _cos_sin(COS, SIN, t64, head_dim, half, dims, in_dims, X.dtype.element_ty)
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


def _num_warps(tile: int) -> int:
    """Warps for a (heads or slots) x half-head-dim tile of `tile` elements: one per 128 elements, 4 to 16.
    At Triton's default of 4 the fused qkv kernel takes 165-189 registers a thread at the Llama-3-8B shape
    (two 4-warp programs resident per SM); at 16, 64-78 (one 16-warp program: twice the warps in flight).
    benchmarks/kernel_build.py shows registers per shape; the speed of either is unmeasured."""
    return min(16, max(4, tile // 128))


def _rope(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    B, S, H, D = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    grid = (num_programs(B * S, x.device),)
    block_h, block_half = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    launch(_rope_kernel, grid, x, cos, sin, y, B * S, H, D, BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half,
           num_warps=_num_warps(block_h * block_half))
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


@triton.jit
def _rope_qkv_kernel(QKV, COS, SIN, Q, K, V, n_tokens, n_groups, rep, head_dim,
                     BACKWARD: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Forward: slots of a token's qkv row (group g: rep query heads, then k_g, then v_g) -> rotated q,
    rotated k, copied v. Backward: the same index map read the other way, dq, dk, dv -> dqkv."""
    pid = tl.program_id(0)
    half = head_dim // 2
    per_group = rep + 2
    n_slots = n_groups * per_group
    slot = tl.arange(0, BLOCK_SLOTS)[:, None]                             # (BLOCK_SLOTS, 1)
    dims = tl.arange(0, BLOCK_HALF)[None, :]                              # (1, BLOCK_HALF)
    in_dims = dims < half
    live = (slot < n_slots) & in_dims
    g = slot // per_group
    j = slot % per_group
    is_q = live & (j < rep)
    is_k = live & (j == rep)
    is_v = live & (j == rep + 1)
    q_off = (g * rep + j) * head_dim + dims                               # within the token's q row
    kv_off = g * head_dim + dims
    for tok in range(pid, n_tokens, tl.num_programs(0)):
        t64 = tl.cast(tok, tl.int64)
        c1, c2, s1, s2 = _cos_sin(COS, SIN, t64, head_dim, half, dims, in_dims, QKV.dtype.element_ty)
        row = QKV + t64 * n_slots * head_dim + slot * head_dim + dims
        q_row = Q + t64 * n_groups * rep * head_dim + q_off
        k_row = K + t64 * n_groups * head_dim + kv_off
        v_row = V + t64 * n_groups * head_dim + kv_off
        rotate = is_q | is_k
        if BACKWARD:
            x1 = (tl.load(q_row, mask=is_q, other=0.0).to(tl.float32) + tl.load(k_row, mask=is_k, other=0.0)
                  .to(tl.float32) + tl.load(v_row, mask=is_v, other=0.0).to(tl.float32))
            x2 = (tl.load(q_row + half, mask=is_q, other=0.0).to(tl.float32)
                  + tl.load(k_row + half, mask=is_k, other=0.0).to(tl.float32)
                  + tl.load(v_row + half, mask=is_v, other=0.0).to(tl.float32))
            y1 = tl.where(rotate, x1 * c1 + x2 * s2, x1)
            y2 = tl.where(rotate, x2 * c2 - x1 * s1, x2)
            tl.store(row, y1.to(QKV.dtype.element_ty), mask=live)
            tl.store(row + half, y2.to(QKV.dtype.element_ty), mask=live)
        else:
            x1 = tl.load(row, mask=live, other=0.0).to(tl.float32)
            x2 = tl.load(row + half, mask=live, other=0.0).to(tl.float32)
            y1 = tl.where(rotate, x1 * c1 - x2 * s1, x1).to(Q.dtype.element_ty)
            y2 = tl.where(rotate, x2 * c2 + x1 * s2, x2).to(Q.dtype.element_ty)
            tl.store(q_row, y1, mask=is_q)
            tl.store(q_row + half, y2, mask=is_q)
            tl.store(k_row, y1, mask=is_k)
            tl.store(k_row + half, y2, mask=is_k)
            tl.store(v_row, y1, mask=is_v)
            tl.store(v_row + half, y2, mask=is_v)


def _launch_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, q: Tensor, k: Tensor, v: Tensor, backward: bool) -> None:
    B, S, hk, c, D = qkv.shape
    grid = (num_programs(B * S, qkv.device),)
    block_slots, block_half = triton.next_power_of_2(hk * c), triton.next_power_of_2(D // 2)
    launch(_rope_qkv_kernel, grid, qkv, cos, sin, q, k, v, B * S, hk, c - 2, D, BACKWARD=backward,
           BLOCK_SLOTS=block_slots, BLOCK_HALF=block_half, num_warps=_num_warps(block_slots * block_half))


class RoPEQKVTriton(torch.autograd.Function):
    """rope_qkv: qkv (B, S, Hkv, rep + 2, D) -> rotated q (B, S, Hkv*rep, D), rotated k, v (B, S, Hkv, D),
    contiguous, in one kernel; the backward writes dqkv in one kernel too."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, S, hk, c, D = qkv.shape
        if D % 2:
            raise ValueError(f"RoPE needs an even head dim, got {D}")
        qkv = qkv.contiguous()
        cos = cos.expand(B, S, D).contiguous()
        sin = sin.expand(B, S, D).contiguous()
        q = qkv.new_empty(B, S, hk * (c - 2), D)
        k, v = qkv.new_empty(B, S, hk, D), qkv.new_empty(B, S, hk, D)
        _launch_qkv(qkv, cos, sin, q, k, v, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.shape = qkv.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        cos, sin = ctx.saved_tensors
        dqkv = dq.new_empty(ctx.shape)
        _launch_qkv(dqkv, cos, sin, dq.contiguous(), dk.contiguous(), dv.contiguous(), backward=True)
        return dqkv, None, None
