"""liger-kernel and apex behind our fused ops' dispatch points (model.kernels: liger | apex), for CUDA.

Each adapter takes and returns what our op does (see norms.py, swiglu.py, rope.py) and is compared with
the torch reference by the kernel tests on a GPU:
    liger  RMSNorm (Llama casting), the residual add fused with it (LigerFusedAddRMSNormFunction, or an
           add then its RMSNorm on releases without it), SwiGLU (LigerSiLUMulFunction on the gate and up
           halves of our interleaved projection), RoPE on q and k (LigerRopeFunction, Hugging Face layout)
    apex   RMSNorm (fused_rms_norm_affine), and the add before it; the other ops use our Triton kernels
"""
from __future__ import annotations

from torch import Tensor

from megalysses.kernels.qkv_layout import split_qkv


def rms_norm(impl: str, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if impl == "liger":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    return fused_rms_norm_affine(x, weight, weight.shape, eps)


def add_rms_norm(impl: str, x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if impl == "liger":
        try:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        except ImportError:
            LigerFusedAddRMSNormFunction = None
        if LigerFusedAddRMSNormFunction is not None:
            normed, residual = LigerFusedAddRMSNormFunction.apply(x, delta, weight, eps, 0.0, "llama", False)
            return residual, normed
    r = x + delta
    return r, rms_norm(impl, r, weight, eps)


def swiglu(gate_up: Tensor) -> Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return LigerSiLUMulFunction.apply(gate.contiguous(), up.contiguous())


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    from liger_kernel.ops.rope import LigerRopeFunction

    # liger's backward rotates the incoming dq, dk in place: safe here, where they come fresh from attention's
    # backward (or from the all-to-all's), and used by nothing after
    q, k, v = split_qkv(qkv)                                          # (B, S, H, D)
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
    q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)   # (B, H, S, D) in and out
    return q.transpose(1, 2), k.transpose(1, 2), v
