"""RMSNorm: the pure-PyTorch reference and a fused Triton kernel behind one dispatch point.

    y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight        (statistics in fp32)

This is Hugging Face Llama's LlamaRMSNorm, so converted weights give the same numbers.
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


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, impl: str = "auto") -> Tensor:
    """RMSNorm over the last dim. x (..., N), weight (N,) -> (..., N) in the promoted dtype of x and weight.

    impl: "torch" (reference), "triton" (fused forward + backward; CUDA, or CPU under TRITON_INTERPRET=1),
    or "auto" (the torch reference; Triton is opt-in)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if choose_impl(impl, x, "rms_norm") == "torch":
        return rms_norm_torch(x, weight, eps)
    from megalysses.kernels.rms_norm_triton import RMSNormTriton
    return RMSNormTriton.apply(x, weight, eps)
