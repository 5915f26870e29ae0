"""RMSNorm, and the residual add fused with it: pure-PyTorch references and fused Triton kernels
behind one dispatch point each.

    y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight        (statistics in fp32)
    r, y = x + delta, rms_norm(x + delta)                             (add_rms_norm: one kernel)

This is Hugging Face Llama's LlamaRMSNorm, so converted weights give the same numbers. The sum r is
rounded to x's dtype (it is the residual stream) and the norm is taken of the rounded sum, as in an
unfused model.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megalysses.kernels.triton_support import choose_impl


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Reference RMSNorm over the last dim. x (..., N), weight (N,) -> (..., N). Statistics in fp32
    (fp64 for fp64 inputs)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x_hat.to(x.dtype) * weight


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, impl: str = "torch") -> Tensor:
    """RMSNorm over the last dim. x (..., N), weight (N,) -> (..., N) in the promoted dtype of x and weight.

    impl: "torch" (reference), "triton" (fused forward + backward; CUDA, or CPU under TRITON_INTERPRET=1),
    "liger" or "apex" (their fused RMSNorm, CUDA); the run plan chooses (model.kernels)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    impl = choose_impl(impl, x, "rms_norm")
    if impl == "torch":
        return rms_norm_torch(x, weight, eps)
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
        return add_rms_norm_torch(x, delta, weight, eps)
    if impl in ("liger", "apex"):
        from megalysses.kernels import external
        return external.add_rms_norm(impl, x, delta, weight, eps)
    from megalysses.kernels.rms_norm_triton import AddRMSNormTriton
    return AddRMSNormTriton.apply(x, delta, weight, eps)
