"""SwiGLU on the interleaved gate-up output in Triton (forward and backward); imported only when triton is.

x (M, 2f) holds gate_i at column 2i and up_i at 2i + 1; y (M, f) = silu(gate) * up, in fp32 arithmetic,
rounded once. The backward, from dy and the saved input alone (no saved intermediates):
    s = sigmoid(gate)   d up = dy * gate * s   d gate = dy * up * s * (1 + gate * (1 - s))
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megalysses.kernels.triton_support import gpu_sms, launch

LAUNCHED = ("_swiglu_fwd", "_swiglu_bwd")      # the kernels launched from Python (tools/triton_build.py)


@triton.jit
def _swiglu_fwd(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)    # output elements
    live = offs < n
    gate = tl.load(X + 2 * offs, mask=live, other=0.0).to(tl.float32)
    up = tl.load(X + 2 * offs + 1, mask=live, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    tl.store(Y + offs, (gate * sig * up).to(Y.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_bwd(X, DY, DX, n, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    gate = tl.load(X + 2 * offs, mask=live, other=0.0).to(tl.float32)
    up = tl.load(X + 2 * offs + 1, mask=live, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=live, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_up = dy * gate * sig
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(DX + 2 * offs, d_gate.to(DX.dtype.element_ty), mask=live)
    tl.store(DX + 2 * offs + 1, d_up.to(DX.dtype.element_ty), mask=live)


def _block(n: int, device: torch.device) -> int:
    # few, large programs under the CPU interpreter (each program costs ~1 ms there)
    return 1024 if gpu_sms(device) is not None else max(1024, triton.next_power_of_2(triton.cdiv(n, 64)))


class SwiGLUTriton(torch.autograd.Function):
    """silu(gate) * up from x (..., 2f) interleaved -> (..., f); saves only x."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        n = y.numel()
        block = _block(n, x.device)
        launch(_swiglu_fwd, (triton.cdiv(n, block),), x, y, n, BLOCK=block)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        n = dy.numel()
        block = _block(n, x.device)
        launch(_swiglu_bwd, (triton.cdiv(n, block),), x, dy, dx, n, BLOCK=block)
        return dx
