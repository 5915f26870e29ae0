"""Rotary position embedding in the Hugging Face Llama convention (rotate_half: the head dim is split
into a first and a second half, not interleaved pairs), so that converted Llama weights give the same
logits. A pure-PyTorch reference and a Triton kernel behind one dispatch point.

    cos, sin = rope_cos_sin(position_ids, head_dim, theta)   # (B, S, D), once per step
    q = apply_rope(q, cos, sin)                               # (B, S, H, D)
    q, k, v = rope_qkv(qkv, cos, sin)                         # split a fused QKV output, rotate q and k
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from megalysses.kernels.qkv_layout import split_qkv
from megalysses.kernels.triton_support import choose_impl


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Any] = None,
                  device: Optional[torch.device] = None) -> Tensor:
    """The D/2 rotation frequencies theta^(-2i/D), in fp32 as Hugging Face computes them; with a
    `scaling` of type llama3 (config.RopeScalingConfig), Llama 3.1's: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    original / high_freq_factor kept, and those between interpolated smoothly."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                 # (D/2,)
    if scaling is None or scaling.type == "none":
        return inv_freq
    if scaling.type != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling.type!r}")
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old / scaling.high_freq_factor) & ~(wavelen > old / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
                 scaling: Optional[Any] = None) -> tuple[Tensor, Tensor]:
    """cos and sin (B, S, D) for integer positions (B, S): angle[..., i] = pos * inv_freq[i] for
    i < D/2 (rope_inv_freq, with optional scaling), repeated for the second half (HF's cat(freqs,
    freqs)); computed in fp32, then cast."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq                    # (B, S, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)                            # (B, S, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Reference: x * cos + rotate_half(x) * sin in x's dtype, exactly HF's apply_rotary_pos_emb.
    x (B, S, H, D), cos, sin (B, S, D) -> (B, S, H, D)."""
    cos = cos.unsqueeze(2).to(x.dtype)                                    # (B, S, 1, D)
    sin = sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, impl: str = "torch") -> Tensor:
    """Rotate x (B, S, H, D) by the angles in cos, sin (B, S, D) (from rope_cos_sin) -> (B, S, H, D).

    impl: "torch" (reference, bit-identical to HF), "triton" (fused forward + backward in fp32; CUDA,
    or CPU under TRITON_INTERPRET=1); the run plan chooses (model.kernels).
    Gradients flow to x only."""
    if cos.shape != sin.shape or cos.shape[-1] != x.shape[-1] or cos.dim() != 3:
        raise ValueError(f"cos, sin must be (B, S, D) for x {tuple(x.shape)}; "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if choose_impl(impl, x, "apply_rope") == "torch":
        return apply_rope_torch(x, cos, sin)
    from megalysses.kernels.rope_triton import RoPETriton
    return RoPETriton.apply(x, cos, sin)


def rope_qkv_torch(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: split_qkv, then apply_rope_torch to q and k."""
    q, k, v = split_qkv(qkv)
    return apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin), v


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, impl: str = "torch") -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused QKV projection output (B, S, Hkv, rep + 2, D) into q (B, S, Hkv*rep, D), k, v
    (B, S, Hkv, D), with q and k rotated by cos, sin (B, S, D). impl as for apply_rope; the Triton kernel
    reads qkv once and writes contiguous q, k and v (and the reverse in the backward)."""
    if qkv.dim() != 5 or qkv.shape[3] < 3:
        raise ValueError(f"qkv must be (B, S, Hkv, rep + 2, D) with rep >= 1, got {tuple(qkv.shape)}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != qkv.shape[-1]:
        raise ValueError(f"cos, sin must be (B, S, D) for qkv {tuple(qkv.shape)}; got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    impl = choose_impl(impl, qkv, "rope_qkv")
    if impl == "torch":
        return rope_qkv_torch(qkv, cos, sin)
    if impl == "liger":
        from megalysses.kernels import external
        return external.rope_qkv(qkv, cos, sin)
    from megalysses.kernels.rope_triton import RoPEQKVTriton
    return RoPEQKVTriton.apply(qkv, cos, sin)
