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
    """The D/2 rotation frequencies theta^(-2i/D), in fp32 as Hugging Face computes them, with a `scaling`
    (config.RopeScalingConfig) as Hugging Face's rope_type of that name: llama3 (Llama 3.1: wavelengths longer
    than original_max_position_embeddings / low_freq_factor divided by `factor`, shorter than original /
    high_freq_factor kept, those between interpolated smoothly), linear (all divided by `factor`) or yarn
    (_yarn_inv_freq)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                 # (D/2,)
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    if kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {kind!r}")
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old / scaling.high_freq_factor) & ~(wavelen > old / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Any, device: Optional[torch.device]) -> Tensor:
    """YaRN's frequencies (arXiv 2309.00071), as Hugging Face's rope_type "yarn": dimension pair i keeps its
    frequency when it turns more than beta_fast times over the original context, is divided by `factor` when
    it turns fewer than beta_slow times, and mixes the two along a linear ramp between (its ends rounded
    out to whole dimensions with `truncate`)."""
    def dim_of(rotations: float) -> float:      # the dimension whose wavelength fits `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                                     # as Hugging Face: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


def rope_attention_factor(scaling: Optional[Any]) -> float:
    """The factor cos and sin are scaled by (1 but for yarn): YaRN's attention_factor, or from its factor as
    Hugging Face derives it: 1 + 0.1 ln(factor), or with mscale and mscale_all_dim (both non-zero) the ratio
    (1 + 0.1 mscale ln factor) / (1 + 0.1 mscale_all_dim ln factor)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
                 scaling: Optional[Any] = None) -> tuple[Tensor, Tensor]:
    """cos and sin (B, S, D) for integer positions (B, S): angle[..., i] = pos * inv_freq[i] for
    i < D/2 (rope_inv_freq, with optional scaling), repeated for the second half (HF's cat(freqs,
    freqs)); computed in fp32 and multiplied by the scaling's attention factor (YaRN's; 1 otherwise), then
    cast. Every RoPE kernel reads these, so each applies the factor."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq                    # (B, S, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)                            # (B, S, D)
    factor = rope_attention_factor(scaling)
    if factor == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


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
