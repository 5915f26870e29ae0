"""RMSNorm, and the residual add fused with it, forward and backward in Triton; imported only when
triton is (see triton_support.py).

Same numbers as norms.rms_norm_torch: y = (x * rstd).to(x.dtype) * w, rstd = rsqrt(mean(x^2) + eps),
computed in fp32. add_rms_norm: r = (x + delta) rounded to x's dtype, written out, and normalised as
above (one read of x and delta, one write of r and y). Each program loops over rows pid, pid + G, ...;
the backward writes one partial weight gradient per program, summed afterwards, and for the fused
form adds the gradient that reaches r directly (the residual path) to the norm's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megalysses.kernels.triton_support import launch, num_programs

MAX_COLS = 65536
LAUNCHED = ("_rms_norm_fwd", "_rms_norm_bwd")  # the kernels launched from Python (tools/triton_build.py)


@triton.jit
def _add(a, b):
    return a + b


# The kernels call only core builtins and functions defined here (tl.reduce with _add, not tl.sum, a
# @jit function of triton's standard library): Triton's interpreter can then run them on CPU even when
# triton was imported before TRITON_INTERPRET was set.


@triton.jit
def _rms_norm_fwd(X, D, W, R, Y, RSTD, n_rows, n_cols, eps, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    """y = rms_norm(x); with HAS_DELTA, first r = x + d rounded to x's dtype (stored to R), y = rms_norm(r)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * n_cols
        x = tl.load(X + base + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x = (x + tl.load(D + base + cols, mask=in_row, other=0.0).to(tl.float32)).to(R.dtype.element_ty)
            tl.store(R + base + cols, x, mask=in_row)                   # the residual stream, rounded
            x = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.reduce(x * x, 0, _add) / n_cols + eps)
        x_hat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)     # rounded like the reference
        tl.store(Y + base + cols, (x_hat * w).to(Y.dtype.element_ty), mask=in_row)
        tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, DRES, n_rows, n_cols, BLOCK: tl.constexpr,
                  HAS_DRES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * n_cols
        x = tl.load(X + base + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(DY + base + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w
        # d/dx of w * x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        dx = (g - x_hat * (tl.reduce(g * x_hat, 0, _add) / n_cols)) * rstd
        if HAS_DRES:   # the gradient that reached the residual output directly
            dx += tl.load(DRES + base + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=in_row)
    tl.store(DW_PARTIAL + tl.cast(pid, tl.int64) * n_cols + cols, dw, mask=in_row)      # 64-bit, as every offset


def _launch_config(n_cols: int, backward: bool = False) -> tuple[int, int]:
    """(block, warps): a warp per 256 columns in the forward, per 128 in the backward, which holds more per
    column (x, dy, dx, the weight's gradient); at 8 warps for 2048 columns it spilled a register on sm_80
    (benchmarks/kernel_build.py)."""
    block = triton.next_power_of_2(n_cols)
    return block, min(max(block // (128 if backward else 256), 1), 16)


class RMSNormTriton(torch.autograd.Function):
    """y = rms_norm(x, weight, eps) over the last dim; x (..., N), weight (N,) -> (..., N) in the
    promoted dtype of x and weight. Backward gives dx and dweight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        n_cols = x.shape[-1]
        if n_cols > MAX_COLS:
            raise ValueError(f"Triton RMSNorm handles rows up to {MAX_COLS} elements, got {n_cols}")
        x2 = x.reshape(-1, n_cols).contiguous()                          # (M, N)
        w = weight.contiguous()
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, warps = _launch_config(n_cols)
        grid = (num_programs(x2.shape[0], x.device),)
        launch(_rms_norm_fwd, grid, x2, x2, w, x2, y, rstd, x2.shape[0], n_cols, eps, BLOCK=block, HAS_DELTA=False,
               num_warps=warps)
        ctx.save_for_backward(x2, w, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, w, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2)
        block, warps = _launch_config(n_cols, backward=True)
        grid = (num_programs(n_rows, x2.device),)
        dw_partial = torch.empty(grid[0], n_cols, dtype=torch.float32, device=x2.device)
        launch(_rms_norm_bwd, grid, dy2, x2, w, rstd, dx, dw_partial, dx, n_rows, n_cols, BLOCK=block, HAS_DRES=False,
               num_warps=warps)
        return dx.view(ctx.x_shape), dw_partial.sum(0).to(w.dtype), None


class AddRMSNormTriton(torch.autograd.Function):
    """(r, y) = (x + delta, rms_norm(x + delta, weight, eps)) over the last dim; x, delta (..., N) of one
    dtype, weight (N,). Backward gives dx = ddelta (the same tensor) and dweight."""

    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        n_cols = x.shape[-1]
        if n_cols > MAX_COLS:
            raise ValueError(f"Triton RMSNorm handles rows up to {MAX_COLS} elements, got {n_cols}")
        x2, d2 = x.reshape(-1, n_cols).contiguous(), delta.reshape(-1, n_cols).contiguous()
        w = weight.contiguous()
        r = torch.empty_like(x2)
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, warps = _launch_config(n_cols)
        grid = (num_programs(x2.shape[0], x.device),)
        launch(_rms_norm_fwd, grid, x2, d2, w, r, y, rstd, x2.shape[0], n_cols, eps, BLOCK=block, HAS_DELTA=True,
               num_warps=warps)
        ctx.save_for_backward(r, w, rstd)
        ctx.x_shape = x.shape
        return r.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, dr: Tensor, dy: Tensor):
        r, w, rstd = ctx.saved_tensors
        n_rows, n_cols = r.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dr2 = dr.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(r)
        block, warps = _launch_config(n_cols, backward=True)
        grid = (num_programs(n_rows, r.device),)
        dw_partial = torch.empty(grid[0], n_cols, dtype=torch.float32, device=r.device)
        launch(_rms_norm_bwd, grid, dy2, r, w, rstd, dx, dw_partial, dr2, n_rows, n_cols, BLOCK=block, HAS_DRES=True,
               num_warps=warps)
        dx = dx.view(ctx.x_shape)
        return dx, dx, dw_partial.sum(0).to(w.dtype), None
