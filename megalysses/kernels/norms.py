"""RMSNorm, and the residual add fused with it: pure-PyTorch references and fused Triton kernels
behind one dispatch point each.

    y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight        (statistics in fp32)
    r, y = x + delta, rms_norm(x + delta)                             (add_rms_norm: one kernel)

This is Hugging Face Llama's LlamaRMSNorm, so converted weights give the same numbers. The sum r is
rounded to x's dtype (it is the residual stream) and the norm is taken of the rounded sum, as in an
unfused model.

The torch path runs every norm (RMSNorm, and LayerNorm, which has no other) over tiles of rows (TiledNorm):
the forward writes one output tile by tile, keeping only the input; the backward recomputes each tile under
autograd and takes its gradients there. So the reference's fp32 copies (the input's, x^2, the normalised x,
their gradients: several times the (tokens x hidden) activation in fp32) exist for one tile of
NORM_TILE_ELEMENTS at a time. Per row it is the untiled reference's arithmetic; the weight's (and bias's)
gradient is summed over tiles in fp32.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megalysses.kernels.triton_support import choose_impl

NORM_TILE_ELEMENTS = 1 << 24
"""Elements per tile of the torch norms (4096 tokens at hidden 4096): the tile's fp32 temporaries in the
backward are a few hundred MiB at most (megalysses.memory counts them), against several GiB for the
whole activation at long context."""


def norm_tile_rows(n_cols: int) -> int:
    """Rows per tile of a norm over rows of `n_cols` elements."""
    return max(1, NORM_TILE_ELEMENTS // n_cols)


class TiledNorm(torch.autograd.Function):
    """y = fn(x, *params) for a norm `fn` over the last dim (each row on its own), over tiles of `rows` rows.
    Keeps x and the parameters; the backward recomputes each tile under autograd. Parameters' gradients are
    accumulated in fp32 over the tiles and returned in their own dtype; None parameters are allowed."""

    @staticmethod
    def forward(ctx, fn: Callable[..., Tensor], rows: int, x: Tensor, *params: Optional[Tensor]) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])                                      # (M, N)
        if x2.shape[0] <= rows:
            out = fn(x2, *params)                                             # one tile
        else:
            out = None
            for lo in range(0, x2.shape[0], rows):
                y = fn(x2[lo:lo + rows], *params)
                if out is None:
                    out = torch.empty(x2.shape, dtype=y.dtype, device=y.device)
                out[lo:lo + rows] = y
        ctx.fn, ctx.rows, ctx.x_shape = fn, rows, x.shape
        ctx.save_for_backward(x, *params)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, *params = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        want_x = ctx.needs_input_grad[2]
        want = [p is not None and ctx.needs_input_grad[3 + i] for i, p in enumerate(params)]
        ps = [p.detach().requires_grad_(w) if p is not None else None for p, w in zip(params, want)]
        dx = torch.empty_like(x2) if want_x else None
        sums = iter(tiled_backward(lambda xt: ctx.fn(xt, *ps), ctx.rows, x2, dy2,
                                   [p for p, w in zip(ps, want) if w], dx))
        out = [dx.view(ctx.x_shape) if want_x else None]
        out += [next(sums).to(p.dtype) if w else None for p, w in zip(params, want)]
        return (None, None, *out)


def tiled_backward(fn: Callable[[Tensor], Tensor], rows: int, x2: Tensor, dy2: Tensor, leaves: list[Tensor],
                   dx2: Optional[Tensor]) -> list[Tensor]:
    """The backward of a row-wise `fn` over tiles of `rows` rows of x2 (M, N), its output's gradient dy2 (M, N):
    each tile recomputed under autograd, x2's gradient written into dx2's rows (None: not wanted; dx2 may be
    dy2 itself, each tile read before it is written) and the gradients of `leaves` (tensors fn reads) summed
    over the tiles in fp32, returned in fp32."""
    sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in leaves]
    for lo in range(0, x2.shape[0], rows):
        with torch.enable_grad():
            xt = x2[lo:lo + rows].detach().requires_grad_(dx2 is not None)
            grads = list(torch.autograd.grad(fn(xt), ([xt] if dx2 is not None else []) + leaves, dy2[lo:lo + rows]))
        if dx2 is not None:
            dx2[lo:lo + rows] = grads.pop(0)
        for total, g in zip(sums, grads):
            total += g
    return sums


def tiled_norm(fn: Callable[..., Tensor], x: Tensor, *params: Optional[Tensor]) -> Tensor:
    """fn(x, *params) over tiles of norm_tile_rows(x.shape[-1]) rows (TiledNorm)."""
    return TiledNorm.apply(fn, norm_tile_rows(x.shape[-1]), x, *params)


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Reference RMSNorm over the last dim. x (..., N), weight (N,) -> (..., N). Statistics in fp32
    (fp64 for fp64 inputs)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x_hat.to(x.dtype) * weight


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, impl: str = "torch") -> Tensor:
    """RMSNorm over the last dim. x (..., N), weight (N,) -> (..., N) in the promoted dtype of x and weight.

    impl: "torch" (the reference over row tiles, TiledNorm), "triton" (fused forward + backward; CUDA, or CPU
    under TRITON_INTERPRET=1), "liger" or "apex" (their fused RMSNorm, CUDA); the run plan chooses
    (model.kernels)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    impl = choose_impl(impl, x, "rms_norm")
    if impl == "torch":
        return tiled_norm(lambda x_, w_: rms_norm_torch(x_, w_, eps), x, weight)
    if impl in ("liger", "apex"):
        from megalysses.kernels import external
        return external.rms_norm(impl, x, weight, eps)
    from megalysses.kernels.rms_norm_triton import RMSNormTriton
    return RMSNormTriton.apply(x, weight, eps)


def add_rms_norm_torch(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Reference: r = x + delta (in x's dtype), then rms_norm_torch(r). Returns (r, normed r)."""
    r = x + delta
    return r, rms_norm_torch(r, weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float = 1e-6,
                 impl: str = "torch") -> tuple[Tensor, Tensor]:
    """The residual add and the RMSNorm of its result: (x + delta, rms_norm(x + delta)), x and delta
    (..., N) of one dtype, weight (N,). impl as for rms_norm; the Triton kernel reads x and delta once
    and writes both outputs (gradients flow to x, delta and weight)."""
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and delta {tuple(delta.shape)} {delta.dtype} "
                         f"must have one shape and dtype")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    impl = choose_impl(impl, x, "add_rms_norm")
    if impl == "torch":
        r = x + delta
        return r, rms_norm(r, weight, eps, impl="torch")
    if impl in ("liger", "apex"):
        from megalysses.kernels import external
        return external.add_rms_norm(impl, x, delta, weight, eps)
    from megalysses.kernels.rms_norm_triton import AddRMSNormTriton
    return AddRMSNormTriton.apply(x, delta, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    """LayerNorm over the last dim (F.layer_norm), over row tiles as the torch RMSNorm: it keeps its input
    alone, and its backward's temporaries (the recomputed tile's output and statistics, the weight's and
    bias's partial sums) are one tile's."""
    return tiled_norm(lambda x_, w_, b_: F.layer_norm(x_, (x_.shape[-1],), w_, b_, eps), x, weight, bias)
